"""Checksums of every leaf of a train state, equal under any sharding and on host or device.

A checkpoint stores them with each step (tx_jax.checkpoint) and checks them on restore, so a
truncated, bit-flipped or edited file is detected instead of loaded.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tx_jax import sharding

# Leaves up to this many elements are checksummed by numpy from the host's shards, because
# compiling one small XLA program per shape costs more than numpy's pass over a small leaf;
# larger ones keep the program (tuned on tiny-shakespeare's first save, docs/performance.md).
HOST_FINGERPRINT_MAX_ELEMENTS = 1 << 16


def _unsigned(dtype: Any) -> Any:
  """The unsigned integer type of `dtype`'s width (numpy's, which jnp accepts too)."""
  unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}.get(np.dtype(dtype).itemsize)
  if unsigned is None:
    raise ValueError(f"cannot fingerprint dtype {dtype}: 1-, 2- or 4-byte types only")
  return unsigned


def _words(x: jax.Array) -> jax.Array:
  """The raw bits of `x` as uint32 words (one per element)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(x, _unsigned(x.dtype)).astype(jnp.uint32)


@jax.jit
def _leaf_fingerprint(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(uint32 checksum, whether it is finite) of one array; see `fingerprint`."""
  x = jnp.asarray(x)
  index = jnp.zeros(x.shape, jnp.uint32)
  stride = 1
  for d in reversed(range(x.ndim)):
    index += jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride % 2**32)
    stride *= x.shape[d]
  total = jnp.sum(_words(x) * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)
  finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.array(True)
  return total, finite


def _host_blocks(x: Any) -> list[tuple[tuple[int, ...], np.ndarray]] | None:
  """(offset, values) of each distinct block of `x`, or None if this host lacks some.

  Replicas are skipped (replica_id > 0). On CPU np.asarray of a shard copies nothing.
  """
  if not isinstance(x, jax.Array):
    values = np.asarray(x)
    return [((0,) * values.ndim, values)]
  if not x.is_fully_addressable:
    return None
  return [
      (tuple(s.start or 0 for s in shard.index), np.asarray(shard.data))
      for shard in x.addressable_shards
      if shard.replica_id == 0
  ]


def _host_leaf_fingerprint(
    shape: tuple[int, ...], blocks: list[tuple[tuple[int, ...], np.ndarray]]
) -> tuple[int, bool]:
  """`_leaf_fingerprint` in numpy over an array's blocks: the same value, bit for bit.

  Indexes wrap mod 2^64 and the products and sums mod 2^32, which leaves the checksum
  (a value mod 2^32) exactly the device's.
  """
  strides = [int(np.prod(shape[d + 1 :], dtype=np.int64)) for d in range(len(shape))]
  total, finite = 0, True
  for offset, values in blocks:
    index = np.zeros(values.shape, np.uint64)
    for d, size in enumerate(values.shape):
      along = (offset[d] + np.arange(size, dtype=np.uint64)) * np.uint64(strides[d])
      index += along.reshape((size,) + (1,) * (values.ndim - d - 1))
    weights = (index * np.uint64(2) + np.uint64(1)).astype(np.uint32)
    if values.dtype == np.bool_:
      words = values.astype(np.uint32)
    else:
      words = values.view(_unsigned(values.dtype)).astype(np.uint32)
    total = (total + int(np.sum(words * weights, dtype=np.uint32))) % 2**32
    inexact = jnp.issubdtype(values.dtype, jnp.inexact)
    finite = finite and (not inexact or bool(np.isfinite(values).all()))
  return total, finite


def fingerprint(tree: Any) -> tuple[np.ndarray, bool]:
  """(per-leaf uint32 checksums, whether every float leaf is finite) of a pytree of arrays.

  The checksum is sum_i bits_i * (2i + 1) mod 2^32: exact integer arithmetic, so it is the
  same under any sharding or reduction order, and it notices changed or moved elements.
  Small leaves (HOST_FINGERPRINT_MAX_ELEMENTS) whose blocks are all on this host are
  summed by numpy; the rest by one small program per distinct leaf shape, dtype and
  sharding, because a single program over the whole tree (gpt2-small: 589 leaves, 10
  distinct shapes) compiled far longer, at the first save and again at every restore.
  """
  leaves = jax.tree_util.tree_leaves(tree)
  results: list[Any] = [None] * len(leaves)
  on_device = []
  for i, x in enumerate(leaves):
    blocks = _host_blocks(x) if np.size(x) <= HOST_FINGERPRINT_MAX_ELEMENTS else None
    if blocks is None:
      on_device.append(i)
    else:
      results[i] = _host_leaf_fingerprint(np.shape(x), blocks)
  group = sharding.MAX_COLLECTIVE_PROGRAMS_IN_FLIGHT  # each sharded leaf's sum is a collective
  for start in range(0, len(on_device), group):
    chunk = on_device[start : start + group]
    for i, result in zip(chunk, jax.device_get([_leaf_fingerprint(leaves[i]) for i in chunk])):
      results[i] = result
  sums = np.array([int(total) for total, _ in results], dtype=np.uint32)
  return sums, all(bool(finite) for _, finite in results)
