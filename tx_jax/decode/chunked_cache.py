"""A KV cache that decode loops update in chunks, so a step never copies the long cache.

Inside a `lax.while_loop`, XLA on CPU did not update the [B, K, S_max, H] cache in place
when the same step also reads it: it copied every cache buffer (twice, per layer, per
step), so a step's cost grew with S_max at several times the cost of reading the cache.
A chunked cache splits each self-attention cache into

- the long cache (`cached_key` / `cached_value`, slots below `flushed_index`), which the
  steps of a chunk only read: it is "frozen", closed over by the inner loop, not carried;
- a recent buffer (`recent_key` / `recent_value`, [B, K, chunk, H]), which the steps
  write (`MultiHeadAttention._attend_chunked_cache`), carried with everything else
  ("live");

and once per chunk `flush` writes the recent buffer into the long cache. The long cache
must have room for a whole chunk past every flush point: `padded_length`.

Caches are the flax "cache" collection of a tx_jax model (nested dicts). A tree without
self-attention caches (a recompute baseline's buffers) has nothing frozen.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import traverse_util

_LONG = ("cached_key", "cached_value")
_RECENT = {"cached_key": "recent_key", "cached_value": "recent_value"}


def padded_length(prompt_len: int, max_new_tokens: int, chunk: int) -> int:
  """Cache slots for a chunked decode: the prompt, then whole chunks of fed-back tokens.

  The last new token is never fed back, so max_new_tokens - 1 tokens are written after the
  prompt, the first chunk starting at slot prompt_len.
  """
  return prompt_len + max(1, -(-(max_new_tokens - 1) // chunk)) * chunk


def _flat(cache: Any) -> dict[tuple[str, ...], Any]:
  return traverse_util.flatten_dict(cache) if isinstance(cache, dict) else {}


def start(cache: Any, chunk: int) -> tuple[dict, Any]:
  """(frozen, live) after the prefill: recent buffers added, flushed_index = cache_index."""
  flat = _flat(cache)
  if not flat:
    return {}, cache
  for path, value in list(flat.items()):
    if path[-1] in _LONG:
      batch, heads, _, head_dim = value.shape
      recent = jnp.zeros((batch, heads, chunk, head_dim), value.dtype)
      flat[path[:-1] + (_RECENT[path[-1]],)] = recent
      flat[path[:-1] + ("flushed_index",)] = flat[path[:-1] + ("cache_index",)]
  return split(traverse_util.unflatten_dict(flat))


def split(cache: Any) -> tuple[dict, Any]:
  """(frozen long caches, everything else) of a cache tree."""
  flat = _flat(cache)
  if not flat:
    return {}, cache
  frozen = {p: v for p, v in flat.items() if p[-1] in _LONG}
  live = {p: v for p, v in flat.items() if p[-1] not in _LONG}
  return traverse_util.unflatten_dict(frozen), traverse_util.unflatten_dict(live)


def merge(frozen: dict, live: Any) -> Any:
  """The cache tree `split` took apart."""
  if not frozen:
    return live
  return traverse_util.unflatten_dict({**_flat(frozen), **_flat(live)})


def flush(frozen: dict, live: Any) -> tuple[dict, Any]:
  """Writes every recent buffer into its long cache at flushed_index; flushed_index moves
  to cache_index. Recent slots past cache_index are written too, but stay masked: they are
  past flushed_index, and the next chunk's steps overwrite them in the recent buffer."""
  if not frozen:
    return frozen, live
  long_flat, live_flat = _flat(frozen), dict(_flat(live))
  for path, value in long_flat.items():
    layer = path[:-1]
    recent = live_flat[layer + (_RECENT[path[-1]],)]
    flushed = live_flat[layer + ("flushed_index",)]
    long_flat[path] = jax.lax.dynamic_update_slice(value, recent, (0, 0, flushed, 0))
  for layer in {path[:-1] for path in long_flat}:
    live_flat[layer + ("flushed_index",)] = live_flat[layer + ("cache_index",)]
  return traverse_util.unflatten_dict(long_flat), traverse_util.unflatten_dict(live_flat)
