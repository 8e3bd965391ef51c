"""One fixed, tiny batch per task, in the batch contract's keys (ARCHITECTURE.md)."""

import numpy as np

B, T = 4, 12
EOS = 2  # the byte tokenizer's


def lm_batch(rng):
  ids = rng.integers(4, 260, (B, T + 1)).astype(np.int32)
  ones = np.ones((B, T), np.int32)
  return {
      "inputs": ids[:, :-1],
      "targets": ids[:, 1:],
      "weights": ones.astype(np.float32),
      "segment_ids": ones,
      "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)),
  }


def mlm_batch(rng):
  b = lm_batch(rng)
  chosen = rng.random((B, T)) < 0.3
  chosen[:, 0] = True
  return dict(
      b,
      targets=b["inputs"],
      inputs=np.where(chosen, 3, b["inputs"]).astype(np.int32),
      weights=chosen.astype(np.float32),
      token_type_ids=np.zeros((B, T), np.int32),
  )


def cls_batch(rng):
  b = mlm_batch(rng)
  del b["targets"]
  return dict(b, labels=np.array([0, 1, 1, 0], np.int32), weights=np.ones((B,), np.float32))


def seq2seq_batch(rng):
  # Reverse the source, which ends with EOS as real seq2seq sources do: without that marker a
  # relative-position model (T5) can't tell which source token comes last, and plateaus with
  # the first target token of some rows wrong.
  content = rng.integers(4, 260, (B, T - 1)).astype(np.int32)
  eos = np.full((B, 1), EOS, np.int32)
  src = np.concatenate([content, eos], 1)
  tgt = np.concatenate([content[:, ::-1], eos], 1)
  ones = np.ones((B, T), np.int32)
  pos = np.tile(np.arange(T, dtype=np.int32), (B, 1))
  return {
      "encoder_inputs": src,
      "encoder_segment_ids": ones,
      "encoder_positions": pos,
      "decoder_inputs": np.concatenate([np.ones((B, 1), np.int32), tgt[:, :-1]], 1),
      "decoder_segment_ids": ones,
      "decoder_positions": pos,
      "targets": tgt,
      "weights": ones.astype(np.float32),
  }
