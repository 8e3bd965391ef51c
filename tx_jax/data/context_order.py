"""Causal load balance for context parallelism, done on the host before a batch reaches the
devices.

With the sequence split over n devices in natural order, device n-1 holds the last tokens,
which see every key, and device 0 the first, which see almost none: causal attention's work
piles up on one device. The dual-chunk ("zig-zag") order of MaxText and Transformer Engine
cuts each row into 2n chunks and gives device d the chunks d and 2n-1-d, one early and one
late, so every device does about the same work (`causal_work`).

Reordering here, on the host's int32 batch, rather than inside attention, keeps the devices
from holding reordered copies of every layer's q, k, v and output. The model needs no token
order: the loss sums over tokens, positions come with the batch, and causality follows the
`token_index` key added here (each token's index in its natural row), which
`AttentionSpec`'s index rule reads. `config.model.context_load_balance="data"` turns it on
(the trainer's `to_global`), "attention" reorders inside attention instead (for callers that
feed natural order), "none" keeps natural order.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple

import numpy as np


class CausalStream(NamedTuple):
  """The [B, T] fields of a task's causal stream, which move together, and the key that
  carries each token's natural index to the model."""

  segment_ids: str
  positions: str
  others: tuple[str, ...]
  index: str


# Bidirectional streams (BERT, T5's encoder) do the same work on every device and stay in
# natural order.
CAUSAL_STREAMS: dict[str, CausalStream] = {
    "lm": CausalStream("segment_ids", "positions", ("inputs", "targets", "weights"), "token_index"),
    "seq2seq": CausalStream(
        "decoder_segment_ids",
        "decoder_positions",
        ("decoder_inputs", "targets", "weights"),
        "decoder_token_index",
    ),
}
CAUSAL_STREAMS["span_corruption"] = CAUSAL_STREAMS["seq2seq"]


def zigzag_permutation(length: int, devices: int) -> np.ndarray:
  """Natural indices in the order the devices hold them (device d: entries d*L/n..(d+1)*L/n-1).

  `length` must be a multiple of 2 * devices.
  """
  if length % (2 * devices):
    raise ValueError(f"zig-zag order needs a length divisible by 2 x {devices}; got {length}")
  chunk = length // (2 * devices)
  chunks = [c for d in range(devices) for c in (d, 2 * devices - 1 - d)]
  return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def causal_work(order: np.ndarray | list[int], devices: int) -> list[int]:
  """Visible (query, key) pairs per device under a causal mask, for queries in `order`: the
  ring's work on each device, whichever device holds the keys."""
  local = len(order) // devices
  return [int(sum(int(i) + 1 for i in order[d * local : (d + 1) * local])) for d in range(devices)]


def to_zigzag(batch: Mapping[str, np.ndarray], task: str, devices: int) -> dict[str, np.ndarray]:
  """`batch` with its causal stream in zig-zag order over `devices` and its natural indices
  under the stream's index key; other fields unchanged.

  Rows are padded first (id 0, weight 0, segment 0: padding by the batch contract) to a
  multiple of 2 * devices. Absent segment ids and positions are filled with the model's
  defaults (one segment; natural positions) first, since the model can no longer derive them
  from the token order. A task without a causal stream, or one device, returns the batch.
  """
  if task not in CAUSAL_STREAMS or devices <= 1:
    return dict(batch)
  stream = CAUSAL_STREAMS[task]
  rows, length = np.shape(batch[stream.others[0]])[:2]
  stream_fields = {name: batch[name] for name in stream.others if name in batch}
  one_segment = np.ones((rows, length), np.int32)
  stream_fields[stream.segment_ids] = batch.get(stream.segment_ids, one_segment)
  natural = np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length))
  stream_fields[stream.positions] = batch.get(stream.positions, natural)
  padded = -(-length // (2 * devices)) * (2 * devices)
  order = zigzag_permutation(padded, devices)
  out = dict(batch)
  for name, x in stream_fields.items():
    x = np.asarray(x)
    if x.shape[:2] != (rows, length):
      raise ValueError(
          f"batch[{name!r}] has shape {x.shape}; the {task!r} stream is [{rows}, {length}, ...]"
      )
    widths = [(0, 0), (0, padded - length)] + [(0, 0)] * (x.ndim - 2)
    out[name] = np.pad(x, widths)[:, order]
  out[stream.index] = np.broadcast_to(order.astype(np.int32), (rows, padded)).copy()
  return out
