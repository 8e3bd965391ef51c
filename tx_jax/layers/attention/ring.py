"""Context-parallel self-attention over the mesh axis that splits the sequence: ring attention
(key/value blocks pass around the devices with `lax.ppermute`) and an all-gather baseline.

Three separable pieces, each in one place:

- the per-block kernel: `blockwise` (`attend_block` per block pair, its online softmax over
  one device's key block, and its recomputing backward against a given log-sum-exp);
- the merge of partial results: `blockwise.merge` (running max and sum);
- the ring: this module. Each device keeps its query block; the key block, its values and
  its segment ids, indices and positions travel, and the spec's `with_keys` describes every
  visiting block, so masks and biases (causal, padding, packing, window, T5 / ALiBi) come
  from positions alone. The backward pass runs the ring again, carrying each block's dk/dv
  accumulator with it, so no device ever holds all of K and V.

Causal load balance: with a plain split the last device sees every key and the first almost
none. The dual-chunk ("zig-zag") order of MaxText and Transformer Engine gives device i the
sequence chunks i and 2n-1-i. The trainer's batches arrive in that order already, with each
token's natural index in the spec (tx_jax/data/context_order.py), so attention here just
trusts the indices: causality holds in any order. For callers that feed natural order,
`reorder=True` makes the order here instead (`zigzag`: two ppermutes inside the shard_map,
undone the same way after), at the price of reordered copies of q, k, v and the output.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax.layers import axes, ops
from tx_jax.layers.attention import blockwise
from tx_jax.layers.attention.blockwise import Partial, empty_partial, finish, merge
from tx_jax.layers.attention.spec import SEQUENCE_FIELDS, AttentionSpec

Array = jnp.ndarray

VARIANTS = ("ring", "all_gather")
# Where causal rows are put in zig-zag order (config.model.context_load_balance): by the
# trainer's data path ("data"), inside attention ("attention"), or nowhere ("none").
LOAD_BALANCE = ("data", "attention", "none")

# Key/query block inside one ring step, half blockwise's default: a device holds its local
# [T/n, H] blocks plus a few [block, block] score tiles per head, and at 4k tokens per device
# a 512-tile weighs as much as a local block, so the tiles would not shrink with the ring.
RING_BLOCK = 256

# The per-block kernel's forward (out, lse over one key block, blocks skipped where masked)
# and its recomputing backward (given the final out and lse): blockwise's, reused whole.
_block_forward = blockwise._forward  # pylint: disable=protected-access
_block_backward = blockwise._backward  # pylint: disable=protected-access


def sequence_axis() -> str | None:
  """The mesh axis that splits activations along their length under the current logical
  rules and mesh, when it has more than one device; else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return None
  spec = nn.logical_to_mesh_axes((axes.ACT_LEN,))
  names = spec[0] if spec is not None else None
  if names is None:
    return None
  if isinstance(names, tuple):
    if len(names) != 1:
      raise ValueError(
          f"sharding rule {axes.ACT_LEN!r} -> {names}: context-parallel attention splits the "
          "sequence over one mesh axis; map it to a single axis"
      )
    (names,) = names
  return names if mesh.shape[names] > 1 else None


def _rotate(tree, axis_name: str, size: int):
  """Every leaf moves one device along the ring (device i -> i+1)."""
  perm = [(i, (i + 1) % size) for i in range(size)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


def _as_partial(out: Array, lse: Array) -> Partial:
  """A finished (out, lse) as a Partial: max = lse and sum = 1 mean the same softmax."""
  return Partial(out, lse, jnp.isfinite(lse).astype(jnp.float32))


def _key_fields(spec: AttentionSpec) -> tuple[Array, Array, Array]:
  return spec.key_segment_ids, spec.key_index, spec.key_positions


def _ring_forward(q_BTKGH, k_BSKH, v_BSKH, spec, scale, axis_name, block, einsum):
  size = jax.lax.axis_size(axis_name)
  batch, length, kv_heads, groups, head_dim = q_BTKGH.shape

  def attend(traveller) -> Partial:
    k, v, seg, index, pos = traveller
    spec_s = spec.with_keys(seg, index, pos)
    return _as_partial(*_block_forward(q_BTKGH, k, v, spec_s, scale, block, block, einsum))

  def step(carry, _):
    acc, traveller = carry
    acc = merge(acc, attend(traveller))
    return (acc, _rotate(traveller, axis_name, size)), None

  init = empty_partial(batch, kv_heads, groups, length, head_dim)
  traveller = (k_BSKH, v_BSKH) + _key_fields(spec)
  (acc, traveller), _ = jax.lax.scan(step, (init, traveller), None, length=size - 1)
  return finish(merge(acc, attend(traveller)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _ring(q_BTKGH, k_BSKH, v_BSKH, spec, scale, axis_name, block, einsum):
  out, _ = _ring_forward(q_BTKGH, k_BSKH, v_BSKH, spec, scale, axis_name, block, einsum)
  return out


def _ring_fwd(q_BTKGH, k_BSKH, v_BSKH, spec, scale, axis_name, block, einsum):
  out, lse = _ring_forward(q_BTKGH, k_BSKH, v_BSKH, spec, scale, axis_name, block, einsum)
  return out, (q_BTKGH, k_BSKH, v_BSKH, spec, out, lse)


def _ring_bwd(scale, axis_name, block, einsum, residuals, dout):
  """The ring again: each visiting block gives its dq share here, and its dk/dv accumulator
  travels with it, arriving home after a full turn."""
  q_BTKGH, k_BSKH, v_BSKH, spec, out, lse = residuals
  size = jax.lax.axis_size(axis_name)

  def step(carry, _):
    dq, dbias, traveller = carry
    k, v, seg, index, pos, dk, dv = traveller
    spec_s = spec.with_keys(seg, index, pos)
    dq_s, dk_s, dv_s, dbias_s = _block_backward(
        q_BTKGH, k, v, spec_s, scale, block, block, einsum, out, lse, dout
    )
    traveller = (k, v, seg, index, pos, dk + dk_s, dv + dv_s)
    carry = (dq + dq_s, jax.tree.map(jnp.add, dbias, dbias_s), _rotate(traveller, axis_name, size))
    return carry, None

  f32_zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
  traveller = (k_BSKH, v_BSKH) + _key_fields(spec) + (f32_zeros(k_BSKH), f32_zeros(v_BSKH))
  init = (f32_zeros(q_BTKGH), jax.tree.map(f32_zeros, spec.bias), traveller)
  (dq, dbias, traveller), _ = jax.lax.scan(step, init, None, length=size)
  dk, dv = traveller[-2:]
  # Each device's dbias covers its own queries only: the shard_map's transpose sums them
  # over the devices, as it does for every input replicated over the axis.
  dspec = blockwise.spec_cotangent(spec, dbias)
  return dq.astype(q_BTKGH.dtype), dk.astype(k_BSKH.dtype), dv.astype(v_BSKH.dtype), dspec


_ring.defvjp(_ring_fwd, _ring_bwd)


def local_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    spec: AttentionSpec,
    *,
    variant: str,
    scale: float,
    axis_name: str,
    block: int = RING_BLOCK,
    kernels: ops.Kernels = ops.get(ops.PLAIN),
) -> Array:
  """This device's attention output; call inside a shard_map over `axis_name`.

  q, k, v and the spec are the local blocks (equal lengths on every device); the spec's
  indices are global, so causality and windows hold across blocks. "ring" passes K/V around
  the devices; "all_gather" (the baseline) gathers every device's K/V and key fields and
  attends with the local queries.
  """
  if variant == "all_gather":
    gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)  # noqa: E731
    spec_all = spec.with_keys(*(gather(x) for x in _key_fields(spec)))
    return blockwise.blockwise_attention(
        q_BTNH, gather(k_BSKH), gather(v_BSKH), spec_all, scale=scale, block_q=block,
        block_k=block, kernels=kernels,
    )
  batch, length, num_heads, head_dim = q_BTNH.shape
  kv_heads = k_BSKH.shape[2]
  block, num_blocks = blockwise._blocks(length, block)  # pylint: disable=protected-access
  padded = block * num_blocks
  q_BTKGH = _pad(q_BTNH, padded).reshape(batch, padded, kv_heads, num_heads // kv_heads, head_dim)
  out_BKGTH = _ring(
      q_BTKGH,
      _pad(k_BSKH, padded),
      _pad(v_BSKH, padded),
      spec.padded(padded, padded),
      scale,
      axis_name,
      block,
      kernels.einsum,
  )
  out_BTKGH = jnp.moveaxis(out_BKGTH, 3, 1)[:, :length]
  return out_BTKGH.reshape(q_BTNH.shape).astype(q_BTNH.dtype)


def _pad(x_BT: Array, length: int) -> Array:
  pad = [(0, 0)] * x_BT.ndim
  pad[1] = (0, length - x_BT.shape[1])
  return jnp.pad(x_BT, pad)


def _zigzag_targets(size: int, half: int) -> list[tuple[int, int]]:
  """Where half `half` of each device's natural block (chunk 2d + half) goes: chunk c < n to
  device c (first slot), chunk c >= n to device 2n-1-c (second slot)."""
  target = lambda c: c if c < size else 2 * size - 1 - c  # noqa: E731
  return [(d, target(2 * d + half)) for d in range(size)]


def zigzag(x_BT: Array, axis_name: str, *, inverse: bool = False) -> Array:
  """Inside a shard_map: device d's natural chunks (2d, 2d+1) -> chunks (d, 2n-1-d), or back.

  Each device then holds an early and a late chunk, so causal work is even across the ring.
  """
  size = jax.lax.axis_size(axis_name)
  half = x_BT.shape[1] // 2
  first, second = x_BT[:, :half], x_BT[:, half:]
  # Even devices receive their first slot from the other devices' first halves, odd ones
  # from the second halves (and the reverse when undoing).
  even = jax.lax.axis_index(axis_name) % 2 == 0
  perms = [_zigzag_targets(size, h) for h in (0, 1)]
  if inverse:
    to_first, to_second = jnp.where(even, first, second), jnp.where(even, second, first)
    back = [[(t, s) for s, t in perm] for perm in perms]
    first = jax.lax.ppermute(to_first, axis_name, back[0])
    second = jax.lax.ppermute(to_second, axis_name, back[1])
    return jnp.concatenate([first, second], axis=1)
  got_first = jax.lax.ppermute(first, axis_name, perms[0])
  got_second = jax.lax.ppermute(second, axis_name, perms[1])
  return jnp.concatenate(
      [jnp.where(even, got_first, got_second), jnp.where(even, got_second, got_first)], axis=1
  )


def context_parallel_attention(
    q_BTNH: Array,
    k_BSKH: Array,
    v_BSKH: Array,
    spec: AttentionSpec,
    *,
    scale: float,
    axis_name: str,
    variant: str = "ring",
    reorder: bool = False,
    block: int = RING_BLOCK,
    kernels: ops.Kernels = ops.get(ops.PLAIN),
) -> Array:
  """Self-attention as an explicit shard_map over `axis_name` of the current mesh (other mesh
  axes stay with the compiler). Lengths the devices do not divide are padded (segment id 0).

  variant "ring" passes K/V around the devices; "all_gather" gathers them (the baseline).
  reorder: put causal rows in zig-zag order here (`zigzag`) and back after; leave it False
  when they arrive in that order with their indices in the spec.
  """
  if variant not in VARIANTS:
    raise ValueError(f"context-parallel variant={variant!r} is not one of {VARIANTS}")
  if spec.explicit_mask is not None:
    raise ValueError(
        "context-parallel attention describes each device's keys by segment ids, indices and "
        "positions; an explicit_mask can't travel with them. Use mesh.sequence=1 for it"
    )
  if q_BTNH.shape[1] != k_BSKH.shape[1]:
    raise ValueError(
        f"context-parallel attention is self-attention: query length {q_BTNH.shape[1]} != "
        f"key length {k_BSKH.shape[1]}"
    )
  size = jax.sharding.get_abstract_mesh().shape[axis_name]
  balance = reorder and spec.causal and size > 1
  multiple = size * (2 if balance else 1)
  length = q_BTNH.shape[1]
  padded = -(-length // multiple) * multiple

  def local(q, k, v, spec_local):
    if balance:
      q, k, v = (zigzag(x, axis_name) for x in (q, k, v))
      spec_local = spec_local.replace(
          **{f: zigzag(getattr(spec_local, f), axis_name) for f in SEQUENCE_FIELDS}
      )
    out = local_attention(
        q, k, v, spec_local, variant=variant, scale=scale, axis_name=axis_name, block=block,
        kernels=kernels,
    )
    return zigzag(out, axis_name, inverse=True) if balance else out

  split = jax.sharding.PartitionSpec(None, axis_name)
  spec_specs = spec.replace(
      bias=jax.tree.map(lambda _: jax.sharding.PartitionSpec(), spec.bias),
      **{f: split for f in SEQUENCE_FIELDS},
  )
  out = jax.shard_map(
      local,
      in_specs=(split, split, split, spec_specs),
      out_specs=split,
      axis_names={axis_name},
      check_vma=False,
  )(_pad(q_BTNH, padded), _pad(k_BSKH, padded), _pad(v_BSKH, padded), spec.padded(padded, padded))
  return out[:, :length]
