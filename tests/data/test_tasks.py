"""Task transforms against independent references: counts, reconstructions, T5's own numbers."""

import numpy as np
import pytest

from tx_jax.data import tasks

SPECIAL = frozenset({0, 1, 2, 3})
REGULAR = np.arange(4, 260, dtype=np.int32)
MASK = 3


def test_mlm_fractions_over_many_samples():
  rng = np.random.default_rng(0)
  selected = masked = randomised = kept = eligible = 0
  for i in range(400):
    # [CLS] text [SEP] plus pads: specials and pads must never be selected.
    ids = np.concatenate([[1], rng.integers(4, 260, size=rng.integers(20, 120)), [2], [0] * 5])
    ex = tasks.mlm_example(
        ids,
        np.random.default_rng(i),
        mask_id=MASK,
        special_ids=SPECIAL,
        regular_ids=REGULAR,
        probability=0.15,
        mask_fraction=0.8,
        random_fraction=0.1,
    )
    sel = ex["weights"] > 0
    assert not sel[np.isin(ids, list(SPECIAL))].any()
    np.testing.assert_array_equal(ex["targets"], ids)
    np.testing.assert_array_equal(ex["inputs"][~sel], ids[~sel])  # unselected untouched
    n_eligible = int((~np.isin(ids, list(SPECIAL))).sum())
    assert sel.sum() == max(1, round(0.15 * n_eligible))  # BERT: exactly round(15%)
    eligible += n_eligible
    selected += sel.sum()
    masked += (ex["inputs"][sel] == MASK).sum()
    same = ex["inputs"][sel] == ids[sel]
    kept += same.sum()
    randomised += ((ex["inputs"][sel] != MASK) & ~same).sum()
    assert np.isin(ex["inputs"][sel & (ex["inputs"] != MASK)], REGULAR).all()
  assert abs(selected / eligible - 0.15) < 0.005
  assert abs(masked / selected - 0.8) < 0.02
  # A random replacement equal to the original (1/256) counts as kept: correct for it.
  assert abs(randomised / selected - 0.1 * 255 / 256) < 0.015
  assert abs(kept / selected - (0.1 + 0.1 / 256)) < 0.015


def test_t5_span_lengths_match_t5_numbers():
  # T5 paper / seqio: inputs_length 512 -> 568 raw tokens and 114 targets.
  assert tasks.span_corruption_lengths(512, 0.15, 3.0) == (568, 114)


def _reconstruct(inputs, targets, sentinels):
  """Independent inverse: replace the k-th sentinel in inputs by the k-th span of targets."""
  spans, current = {}, None
  for t in targets[:-1]:  # last is eos
    if t in sentinels:
      current = t
      spans[current] = []
    else:
      spans[current].append(t)
  out = []
  for t in inputs[:-1]:
    out.extend(spans[t] if t in sentinels else [t])
  return out


@pytest.mark.parametrize("length", [1, 2, 5, 37, 568])
def test_span_corruption_reconstructs_original(length):
  sentinels = [359 - i for i in range(100)]
  noise_total = total = spans = 0
  for seed in range(50):
    ids = np.random.default_rng(seed).integers(4, 260, size=length)
    ex = tasks.span_corruption_example(
        ids,
        np.random.default_rng(seed + 1000),
        noise_density=0.15,
        mean_noise_span_length=3.0,
        sentinel_ids=sentinels,
        eos_id=2,
        decoder_start_id=1,
    )
    inputs, targets = ex["encoder_inputs"], ex["targets"]
    assert inputs[-1] == 2 and targets[-1] == 2
    assert _reconstruct(list(inputs), list(targets), set(sentinels)) == list(ids)
    used = [t for t in inputs if t in sentinels]
    assert used == sentinels[: len(used)]  # <extra_id_0> first, counting down
    np.testing.assert_array_equal(ex["decoder_inputs"], np.concatenate([[1], targets[:-1]]))
    noise_total += len(targets) - 1 - len(used)
    total += length
    spans += len(used)
  if length == 568:
    assert noise_total / total == pytest.approx(0.15, abs=0.002)
    assert noise_total / spans == pytest.approx(3.0, abs=0.05)
    assert len(inputs) == 512 and len(targets) == 114


def test_lm_examples_cover_every_token_once():
  ids = np.arange(10, 10 + 23)
  exs = tasks.lm_examples(ids, seq_len=8)
  np.testing.assert_array_equal(np.concatenate([e["targets"] for e in exs]), ids[1:])
  np.testing.assert_array_equal(np.concatenate([e["inputs"] for e in exs]), ids[:-1])
  assert [len(e["inputs"]) for e in exs] == [8, 8, 6]
  assert tasks.lm_examples([5], seq_len=8) == []  # nothing to predict


def test_classification_pair_truncates_longer_first():
  ex = tasks.classification_example(list(range(10, 20)), [30, 31], 1, seq_len=9, cls_id=1, sep_id=2)
  np.testing.assert_array_equal(ex["inputs"], [1, 10, 11, 12, 13, 2, 30, 31, 2])
  np.testing.assert_array_equal(ex["token_type_ids"], [0] * 6 + [1] * 3)
  assert ex["labels"] == 1
