"""grain pipelines: packing invariants, determinism, exact restore, shards, eval padding, global batch."""

import json

import jax
import numpy as np
import pytest

from tx_jax import data
from tx_jax.data import tasks, tokenizers
from tests.data.helpers import make_config

DOCS = [" ".join(f"w{d}x{i}" for i in range(3 + 7 * d % 41)) for d in range(60)]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("text") / "docs.txt"
  path.write_text("\n".join(DOCS) + "\n", encoding="utf-8")
  return str(path)


def _take(it, n):
  return [next(it) for _ in range(n)]


def _lm_config(text_file, **kw):
  cfg = dict(
      source="text_files",
      task="lm",
      train_files=text_file,
      eval_files=text_file,
      seq_len=32,
      global_batch_size=4,
      lm_shuffle_window=1000,
      pack=True,
  )
  return make_config(**{**cfg, **kw})


def test_lm_packing_invariants(text_file):
  """One epoch: segments restart positions, never mix documents, and lose/duplicate no token."""
  config = _lm_config(text_file, num_epochs=1)
  tok = tokenizers.ByteTokenizer()
  batches = list(data.build_train_iterator(config, process_index=0, process_count=1))
  got = []
  for b in batches:
    assert b["inputs"].dtype == np.int32 and b["weights"].dtype == np.float32
    for r in range(b["inputs"].shape[0]):
      seg, pos = b["segment_ids"][r], b["positions"][r]
      pad = seg == 0
      assert (b["inputs"][r][pad] == 0).all() and (b["weights"][r][pad] == 0).all()
      for s in np.unique(seg[~pad]):
        where = np.flatnonzero(seg == s)
        assert (np.diff(where) == 1).all()  # a segment is contiguous...
        np.testing.assert_array_equal(pos[where], np.arange(len(where)))  # ...restarts at 0
        got.append((tuple(b["inputs"][r][where]), tuple(b["targets"][r][where])))
  # Independent reference: every window of every document, from numpy slicing.
  want = []
  for doc in DOCS:
    ids = np.array(tok.encode(doc) + [tok.eos_id])
    for start in range(0, len(ids) - 1, 32):
      piece = ids[start : start + 33]
      want.append((tuple(piece[:-1]), tuple(piece[1:])))
  # The batch tail that does not fill a batch is dropped (drop_remainder); all else is exact.
  assert len(set(got)) == len(got)
  assert set(got) <= set(want) and len(want) - len(got) < 4 * 4


def test_no_attention_across_documents(text_file):
  """The segment mask built from segment_ids keeps every token inside its own document."""
  b = next(data.build_train_iterator(_lm_config(text_file), process_index=0, process_count=1))
  seg = b["segment_ids"]
  mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  tok = tokenizers.ByteTokenizer()
  for r in range(seg.shape[0]):
    for t in np.flatnonzero(seg[r]):
      visible = b["inputs"][r][mask[r, t] & (np.arange(seg.shape[1]) <= t)]
      text = tok.decode(visible)  # a leak would splice two documents: in none of them
      assert any(text in doc for doc in DOCS), text


@pytest.mark.parametrize(
    "overrides,steps",
    [
        (dict(pack=True), 200),  # synthetic seq2seq, packed: the 200-batch acceptance check
        (dict(task="mlm", seq_len=24, synthetic_train_size=70, lm_shuffle_window=1000), 40),
        (
            dict(
                task="span_corruption",
                target_len=8,
                synthetic_train_size=70,
                lm_shuffle_window=1000,
                pack=True,
            ),
            40,
        ),
    ],
)
def test_restored_iterator_equals_continuous(overrides, steps):
  """Restore after `steps` batches (several epochs in); the next `steps` match bit for bit."""
  # grain's index_shuffle slows down as the range shrinks (~1 ms per index at 50 records),
  # so the epochs here are a few hundred records: 200 batches still cross several of them.
  cfg = dict(global_batch_size=4, synthetic_train_size=300, source_len=16, target_len=16)
  config = make_config(**{**cfg, **overrides})
  it = data.build_train_iterator(config, process_index=0, process_count=1)
  _take(it, steps)
  state = json.loads(json.dumps(it.get_state()))  # the trainer stores it as JSON
  continuous = _take(it, steps)
  restored_it = data.build_train_iterator(config, process_index=0, process_count=1)
  restored_it.set_state(state)
  for a, b in zip(continuous, _take(restored_it, steps)):
    assert a.keys() == b.keys()
    for k in a:
      np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_restore_lm_with_window_shuffle(text_file):
  config = _lm_config(text_file, seq_len=16, pack=True)
  it = data.build_train_iterator(config, process_index=0, process_count=1)
  _take(it, 90)  # past the first epoch of the 60 documents (~85 batches)
  state = it.get_state()
  continuous = _take(it, 30)
  again = data.build_train_iterator(config, process_index=0, process_count=1)
  again.set_state(state)
  for a, b in zip(continuous, _take(again, 30)):
    np.testing.assert_array_equal(a["inputs"], b["inputs"])
    np.testing.assert_array_equal(a["segment_ids"], b["segment_ids"])


def test_seed_determinism():
  def first(seed):
    config = make_config(shuffle_seed=seed, global_batch_size=4)
    return _take(data.build_train_iterator(config, process_index=0, process_count=1), 3)

  a, b, c = first(0), first(0), first(1)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x["encoder_inputs"], y["encoder_inputs"])
  assert not all(np.array_equal(x["encoder_inputs"], z["encoder_inputs"]) for x, z in zip(a, c))


def _sources(batches):
  tok = tokenizers.ByteTokenizer()
  return [
      tok.decode(row[seg > 0])
      for b in batches
      for row, seg in zip(b["encoder_inputs"], b["encoder_segment_ids"])
      if seg.any()
  ]


def test_process_shards_are_disjoint_and_cover_split():
  config = make_config(
      synthetic_train_size=30, num_epochs=1, global_batch_size=3, eval_global_batch_size=3
  )
  shards = [
      _sources(data.build_train_iterator(config, process_index=p, process_count=3))
      for p in range(3)
  ]
  assert [len(s) for s in shards] == [10, 10, 10]
  assert not set(shards[0]) & set(shards[1]) and not set(shards[1]) & set(shards[2])
  everything = data.eval_examples(make_config(synthetic_train_size=30), "train")
  assert sorted(sum(shards, [])) == sorted(s for s, _ in everything)


def test_fixed_input_shards_give_the_same_global_batches_on_any_process_count():
  """With data.num_shards fixed, process p's rows are block p of the one-process global batch."""
  config = make_config(synthetic_train_size=64, global_batch_size=8, num_shards=4)
  alone = data.build_train_iterator(config, process_index=0, process_count=1)
  pair = [data.build_train_iterator(config, process_index=p, process_count=2) for p in range(2)]
  for _ in range(20):  # past the end of an epoch: 64 records / 8 rows
    whole, halves = next(alone), [next(it) for it in pair]
    for key in whole:
      np.testing.assert_array_equal(whole[key], np.concatenate([h[key] for h in halves]))


def test_input_shards_must_divide_over_processes():
  config = make_config(global_batch_size=8, num_shards=3)
  with pytest.raises(ValueError, match="data.num_shards=3"):
    data.build_train_iterator(config, process_index=0, process_count=2)


def test_eval_batches_padded_exact_and_sharded():
  config = make_config(synthetic_eval_size=23, eval_global_batch_size=8)
  pairs = data.eval_examples(config, "validation")
  single = data.build_eval_batches(config, "validation", process_index=0, process_count=1)
  assert len(single) == 3 and single[-1]["weights"].sum(axis=1).tolist()[-1] == 0
  assert _sources(single) == [s for s, _ in pairs]  # source order, padding rows empty
  tok = tokenizers.ByteTokenizer()
  assert sum(b["weights"].sum() for b in single) == sum(len(tok.encode(t)) + 1 for _, t in pairs)
  per_process = [
      data.build_eval_batches(config, "validation", process_index=p, process_count=2)
      for p in range(2)
  ]
  assert len(per_process[0]) == len(per_process[1])  # every host runs the same eval steps
  assert sorted(_sources(per_process[0]) + _sources(per_process[1])) == sorted(s for s, _ in pairs)


def test_synthetic_heldout_disjoint_from_train():
  config = make_config(synthetic_train_size=3000, synthetic_eval_size=300)
  train = {s for s, _ in data.eval_examples(config, "train")}
  held = [s for s, _ in data.eval_examples(config, "validation")]
  assert not train & set(held)
  assert all(3 <= len(s) <= 12 for s in held)
  assert all(t == s[::-1] for s, t in data.eval_examples(config, "test"))


def test_make_global_batch_shards_leading_axis():
  mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
  local = {
      "inputs": np.arange(8 * 5, dtype=np.int32).reshape(8, 5),
      "weights": np.ones((8, 5), np.float32),
  }
  out = data.make_global_batch(local, mesh, ("data", "fsdp"))
  np.testing.assert_array_equal(np.asarray(out["inputs"]), local["inputs"])
  assert out["inputs"].sharding.spec[0] == ("data", "fsdp")
  assert {s.data.shape for s in out["inputs"].addressable_shards} == {(1, 5)}
  with pytest.raises(ValueError, match="does not divide"):
    data.make_global_batch({"inputs": np.zeros((6, 2))}, mesh, ("data", "fsdp"))


def test_span_corruption_pipeline_reconstructs(text_file):
  config = make_config(
      source="text_files",
      task="span_corruption",
      train_files=text_file,
      source_len=24,
      target_len=12,
      global_batch_size=2,
      pack=False,
  )
  b = next(data.build_train_iterator(config, process_index=0, process_count=1))
  tok = tokenizers.ByteTokenizer()
  sentinels = {tok.sentinel_id(i) for i in range(100)}
  for enc, tgt in zip(b["encoder_inputs"], b["targets"]):
    enc, tgt = enc[enc > 0].tolist(), tgt[tgt > 0].tolist()
    spans, cur = {}, None
    for t in tgt[:-1]:
      if t in sentinels:
        cur = spans.setdefault(t, [])
      else:
        cur.append(t)
    text = tok.decode([x for t in enc[:-1] for x in (spans[t] if t in sentinels else [t])])
    assert any(text in doc for doc in DOCS)


def test_pad_batch_pads_rows_and_marks_real_tokens():
  from tx_jax.data import pipeline

  examples = [
      {"inputs": np.array([5, 6, 7], np.int32), "label": 1},
      {"inputs": np.array([8], np.int32), "label": 0},
  ]
  out = pipeline.pad_batch(examples, {"inputs": 4})
  np.testing.assert_array_equal(out["inputs"], [[5, 6, 7, 0], [8, 0, 0, 0]])
  np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1, 0], [1, 0, 0, 0]])
  np.testing.assert_array_equal(out["positions"], [[0, 1, 2, 0], [0, 0, 0, 0]])
  np.testing.assert_array_equal(out["label"], [1, 0])
  assert out["inputs"].dtype == out["segment_ids"].dtype == np.int32
  row = pipeline.pad_example(examples[1], {"inputs": 4})
  np.testing.assert_array_equal(row["inputs"], [8, 0, 0, 0])
  assert row["label"] == 0


def test_unpacked_lm_batches_hold_each_chunk_once_with_its_padding_masked(text_file):
  config = _lm_config(text_file, pack=False, lm_shuffle_window=1)
  batch = next(data.build_train_iterator(config))
  assert set(batch) == {"inputs", "targets", "weights", "segment_ids", "positions"}
  assert batch["inputs"].shape == (4, 32)
  real = batch["weights"] > 0
  np.testing.assert_array_equal(batch["segment_ids"] > 0, real)
  np.testing.assert_array_equal(batch["inputs"][~real], 0)
  np.testing.assert_array_equal(batch["positions"][real], np.nonzero(real)[1])
