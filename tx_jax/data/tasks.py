"""Task transforms on token ids: pure numpy functions of (ids, rng), one example at a time.

Outputs are unpadded int32 / float32 arrays keyed as in ARCHITECTURE.md's
batch contract; `pipeline.py` packs or pads them into rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TASKS = ("lm", "mlm", "span_corruption", "seq2seq", "classification")


def _i32(x) -> np.ndarray:
  return np.asarray(x, dtype=np.int32)


def chunk(ids: Sequence[int], length: int, overlap: int = 0) -> list[np.ndarray]:
  """Splits ids into consecutive pieces of at most `length`, each starting `length - overlap` on."""
  if length <= overlap:
    raise ValueError(f"chunk length {length} must exceed overlap {overlap}")
  ids = _i32(ids)
  step = length - overlap
  n = max(1, -(-(len(ids) - overlap) // step))
  return [ids[i * step : i * step + length] for i in range(n)]


def lm_examples(ids: Sequence[int], seq_len: int) -> list[dict[str, np.ndarray]]:
  """Causal LM: a document's ids (eos-terminated) cut into windows of seq_len predictions.

  Windows overlap by one token so that every token after the first is a target
  exactly once; windows with nothing to predict are dropped. Rows are read-only views
  (one long document is ~16k rows per epoch; the batcher copies them).
  """
  ones = np.ones(seq_len, np.float32)
  ones.flags.writeable = False
  out = []
  for piece in chunk(ids, seq_len + 1, overlap=1):
    if len(piece) >= 2:
      piece.flags.writeable = False
      out.append({"inputs": piece[:-1], "targets": piece[1:], "weights": ones[: len(piece) - 1]})
  return out


def mlm_example(
    ids: Sequence[int],
    rng: np.random.Generator,
    *,
    mask_id: int,
    special_ids: frozenset[int],
    regular_ids: np.ndarray,
    probability: float,
    mask_fraction: float,
    random_fraction: float,
) -> dict[str, np.ndarray]:
  """BERT masking: round(p * n) non-special tokens are selected (at least one);

  of those, mask_fraction become [MASK], random_fraction a random regular token
  and the rest stay. `targets` hold the original ids, `weights` 1 on selected.
  """
  ids = _i32(ids)
  eligible = np.flatnonzero(~np.isin(ids, list(special_ids)))
  inputs, weights = ids.copy(), np.zeros(len(ids), np.float32)
  if len(eligible):
    n = min(len(eligible), max(1, int(round(probability * len(eligible)))))
    chosen = rng.choice(eligible, size=n, replace=False)
    u = rng.random(n)
    replace = rng.choice(regular_ids, size=n)
    inputs[chosen] = np.where(
        u < mask_fraction,
        mask_id,
        np.where(u < mask_fraction + random_fraction, replace, ids[chosen]),
    )
    weights[chosen] = 1.0
  return {
      "inputs": inputs,
      "targets": ids,
      "weights": weights,
      "token_type_ids": np.zeros(len(ids), np.int32),
  }


def _random_segmentation(num_items: int, num_segments: int, rng: np.random.Generator) -> np.ndarray:
  """T5: lengths of num_segments non-empty segments partitioning num_items, at random."""
  first_in_segment = np.arange(num_items - 1) < num_segments - 1
  rng.shuffle(first_in_segment)
  first_in_segment = np.concatenate([[False], first_in_segment])
  segment_id = np.cumsum(first_in_segment)
  return np.bincount(segment_id, minlength=num_segments)


def random_spans_noise_mask(
    length: int, noise_density: float, mean_noise_span_length: float, rng: np.random.Generator
) -> np.ndarray:
  """T5's random_spans_noise_mask: bool[length], noise spans alternate with kept spans."""
  orig_length = length
  length = max(length, 2)  # T5: a span needs one noise and one kept token
  num_noise_tokens = int(np.round(length * noise_density))
  num_noise_tokens = min(max(num_noise_tokens, 1), length - 1)
  num_noise_spans = max(int(np.round(num_noise_tokens / mean_noise_span_length)), 1)
  num_nonnoise_tokens = length - num_noise_tokens
  noise_span_lengths = _random_segmentation(num_noise_tokens, num_noise_spans, rng)
  nonnoise_span_lengths = _random_segmentation(num_nonnoise_tokens, num_noise_spans, rng)
  interleaved = np.stack([nonnoise_span_lengths, noise_span_lengths], axis=1).reshape(-1)
  span_starts = np.cumsum(interleaved)[:-1]
  span_start_indicator = np.zeros(length, np.int32)
  span_start_indicator[span_starts] = 1
  is_noise = np.cumsum(span_start_indicator) % 2 == 1
  return is_noise[:orig_length]


def span_corruption_lengths(
    source_len: int, noise_density: float, mean_noise_span_length: float
) -> tuple[int, int]:
  """T5's random_spans_helper: (raw tokens per example, target length) for `source_len` inputs."""

  def lengths(tokens_length: int) -> tuple[int, int]:
    num_noise = int(round(tokens_length * noise_density))
    num_spans = int(round(num_noise / mean_noise_span_length))
    return tokens_length - num_noise + num_spans + 1, num_noise + num_spans + 1

  tokens_length = source_len - 1
  while lengths(tokens_length + 1)[0] <= source_len:
    tokens_length += 1
  return tokens_length, lengths(tokens_length)[1]


def span_corruption_example(
    ids: Sequence[int],
    rng: np.random.Generator,
    *,
    noise_density: float,
    mean_noise_span_length: float,
    sentinel_ids: Sequence[int],
    eos_id: int,
    decoder_start_id: int,
) -> dict[str, np.ndarray]:
  """T5 span corruption: each noise span becomes one sentinel in the inputs; targets list

  sentinel + span for every span. Sentinel k is sentinel_ids[k] (top of vocabulary down).
  Both sides end with eos.
  """
  ids = _i32(ids)
  noise = random_spans_noise_mask(len(ids), noise_density, mean_noise_span_length, rng)
  first_noise = noise & ~np.concatenate([[False], noise[:-1]])
  span_index = np.cumsum(first_noise) - 1  # k for tokens of the k-th noise span
  if span_index.max(initial=-1) >= len(sentinel_ids):
    raise ValueError(
        f"span corruption needs {span_index.max() + 1} sentinels but "
        f"data.num_sentinels={len(sentinel_ids)}"
    )
  sentinels = _i32(sentinel_ids)
  # Inputs: kept tokens, and a sentinel in place of each noise span's first token.
  keep_in = ~noise | first_noise
  inputs = np.where(first_noise, sentinels[np.maximum(span_index, 0)], ids)[keep_in]
  # Targets: the complement: noise tokens, each span preceded by its sentinel.
  tgt_parts = []
  for k, start in enumerate(np.flatnonzero(first_noise)):
    end = start
    while end < len(ids) and noise[end]:
      end += 1
    tgt_parts.append([sentinels[k], *ids[start:end]])
  targets = _i32([t for part in tgt_parts for t in part] + [eos_id])
  return seq2seq_example(np.append(inputs, eos_id), targets, decoder_start_id)


def seq2seq_example(
    encoder_ids: Sequence[int], target_ids: Sequence[int], decoder_start_id: int
) -> dict[str, np.ndarray]:
  """Encoder ids and eos-terminated targets -> the seq2seq contract (decoder inputs shift right)."""
  targets = _i32(target_ids)
  return {
      "encoder_inputs": _i32(encoder_ids),
      "targets": targets,
      "decoder_inputs": np.concatenate([_i32([decoder_start_id]), targets[:-1]]),
      "weights": np.ones(len(targets), np.float32),
  }


def truncate_eos(ids: Sequence[int], max_len: int, eos_id: int) -> list[int]:
  """ids[:max_len - 1] + [eos]: length limits that keep the terminator."""
  return list(ids[: max_len - 1]) + [eos_id]


def classification_example(
    ids_a: Sequence[int],
    ids_b: Sequence[int] | None,
    label: int,
    *,
    seq_len: int,
    cls_id: int,
    sep_id: int,
) -> dict[str, np.ndarray]:
  """[CLS] a [SEP] (b [SEP]) with token types 0 / 1; the longer sentence is truncated first."""
  a, b = list(ids_a), list(ids_b) if ids_b is not None else None
  budget = seq_len - (3 if b is not None else 2)
  if budget < 1:
    raise ValueError(f"data.seq_len={seq_len} leaves no room for text after [CLS]/[SEP]")
  while len(a) + (len(b) if b is not None else 0) > budget:
    if b is not None and len(b) > len(a):
      b.pop()
    else:
      a.pop()
  inputs = [cls_id, *a, sep_id]
  types = [0] * len(inputs)
  if b is not None:
    inputs += [*b, sep_id]
    types += [1] * (len(b) + 1)
  return {
      "inputs": _i32(inputs),
      "token_type_ids": _i32(types),
      "labels": np.int32(label),
      "weights": np.float32(1.0),
  }
