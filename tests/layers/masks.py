"""Attention masks as whole [B, 1, T, S] tensors, built from pure functions.

Every mask is boolean with shape [B, 1, T, S] (broadcast over heads): True
means "query t may attend to key s". Masks combine with `&` (`combine`).
Models no longer build these: they pass an `AttentionSpec` (`attention_spec.py`),
which each backend materialises per block. These functions stay as the
independent, tensor-level statement of the same rules that the spec is tested
against, and for code that holds a tensor mask anyway.
"""

from __future__ import annotations

import jax.numpy as jnp

Array = jnp.ndarray


def causal_mask(query_positions_BT: Array, key_positions_BS: Array) -> Array:
  """Query at position i may attend to keys at positions <= i."""
  return query_positions_BT[:, None, :, None] >= key_positions_BS[:, None, None, :]


def causal_mask_for_length(batch: int, length: int) -> Array:
  """Causal mask for an unpacked batch whose positions are 0..length-1."""
  pos = jnp.broadcast_to(jnp.arange(length)[None], (batch, length))
  return causal_mask(pos, pos)


def padding_mask(query_valid_BT: Array, key_valid_BS: Array) -> Array:
  """Only real (non-padding) queries attend, and only to real keys."""
  return query_valid_BT[:, None, :, None] & key_valid_BS[:, None, None, :]


def segment_mask(query_segment_ids_BT: Array, key_segment_ids_BS: Array) -> Array:
  """Packing: a token attends only within its own segment; segment 0 is padding."""
  same = query_segment_ids_BT[:, None, :, None] == key_segment_ids_BS[:, None, None, :]
  return same & padding_mask(query_segment_ids_BT != 0, key_segment_ids_BS != 0)


def combine(*masks: Array | None) -> Array | None:
  """Logical AND of the given masks; None entries are ignored."""
  present = [m for m in masks if m is not None]
  if not present:
    return None
  out = present[0]
  for m in present[1:]:
    out = out & m
  return out
