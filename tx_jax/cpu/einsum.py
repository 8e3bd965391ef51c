"""Batched float32 matrix products on CPU through MKL, for attention: the einsums of the
`blockwise` backend and of `chunked_attention` under the `cpu` kernels.

- `einsum` is `jnp.einsum` of two operands as `gemm`'s GEMMs over the batch letters,
  with a custom VJP of two more contractions, per device under a mesh that splits the batch.
  Its operands are laid out as [batch, M, K] and [batch, K, N] first.
- `in_place_einsum` is one batched product whose operands and result stay where they lie:
  the strided handler reads each matrix through an offset, batch strides and a row stride,
  so a query chunk of [B, T, N, H] is a window of it, not a transposed copy
  (`chunked_attention`, `dense`'s forward and backward; no autodiff of its own).

Where `cpu_gemm` does not apply (see its docstring), both are jnp.einsum.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from tx_jax.cpu import gemm as cpu_gemm

Array = jnp.ndarray

# A contraction smaller than this in any of M, N, K, or in FLOPs, stays with XLA's dot: a
# matrix-vector product (a decoding step's attention) fuses with its neighbours there.
MIN_EINSUM_DIM = 16
MIN_EINSUM_FLOPS = 1 << 20


class _Plan(NamedTuple):
  equation: str
  axes: tuple[str, ...]  # mesh axes that split the shared leading (batch) letter


def einsum(equation: str, x: Array, y: Array, *, preferred_element_type=None) -> Array:
  """`jnp.einsum` of two operands, as MKL's GEMMs over the batch letters where that applies.

  Applies to float32 on CPU when the equation is a batched matrix product (every letter
  kept, or shared by both operands, none repeated) of at least MIN_EINSUM_DIM in each of
  M, N and K. The operands are transposed to [batch, M, K] and [batch, K, N], or passed
  transposed to the GEMM when they already are; under a mesh that splits the batch, the
  leading letter of both operands and the output must be that batch. Elsewhere, jnp.einsum.
  """
  plan = _einsum_plan(equation, x, y)
  if plan is None:
    return jnp.einsum(equation, x, y, preferred_element_type=preferred_element_type)
  return _einsum(x, y, plan)


def _letters(equation: str) -> tuple[str, str, str] | None:
  inputs, arrow, out = equation.replace(" ", "").partition("->")
  x, comma, y = inputs.partition(",")
  if not arrow or not comma or not (x + y + out).isalpha():
    return None
  if any(len(set(s)) != len(s) for s in (x, y, out)):
    return None
  if set(out) - set(x) - set(y) or set(x) - set(out) - set(y) or set(y) - set(out) - set(x):
    return None
  return x, y, out


def _roles(x: str, y: str, out: str) -> tuple[str, str, str, str]:
  batch = "".join(c for c in out if c in x and c in y)
  m = "".join(c for c in x if c in out and c not in y)
  n = "".join(c for c in y if c in out and c not in x)
  k = "".join(c for c in x if c in y and c not in out)
  return batch, m, n, k


def _einsum_plan(equation: str, x: Array, y: Array) -> _Plan | None:
  letters = _letters(equation)
  if letters is None or not cpu_gemm.applies(x, y):
    return None
  xs, ys, out = letters
  batch, m, n, k = _roles(xs, ys, out)
  size = {**dict(zip(xs, x.shape)), **dict(zip(ys, y.shape))}
  dims = [math.prod(size[c] for c in part) for part in (batch, m, n, k)]
  if not (m and n and k) or min(dims[1:]) < MIN_EINSUM_DIM:
    return None
  if 2 * math.prod(dims) < MIN_EINSUM_FLOPS:
    return None
  found = cpu_gemm.batch_split()
  if found is None:
    return None
  split, devices = found
  if split and not (xs[0] == ys[0] == out[0] and xs[0] in batch):
    return None
  if size[xs[0]] % devices:
    return None
  return _Plan(equation, split)


def _as_matrices(operand: Array, letters: str, batch: str, first: str, second: str):
  """operand as [batch, first, second], or as [batch, second, first] and True (transposed)."""
  size = dict(zip(letters, operand.shape))
  extent = lambda part: math.prod(size[c] for c in part)  # noqa: E731
  if letters == batch + second + first:
    return operand.reshape(extent(batch), extent(second), extent(first)), True
  if letters != batch + first + second:
    operand = operand.transpose([letters.index(c) for c in batch + first + second])
  return operand.reshape(extent(batch), extent(first), extent(second)), False


def _contract(equation: str, x: Array, y: Array) -> Array:
  xs, ys, out = _letters(equation)
  batch, m, n, k = _roles(xs, ys, out)
  a, trans_a = _as_matrices(x, xs, batch, m, k)
  b, trans_b = _as_matrices(y, ys, batch, k, n)
  size = {**dict(zip(xs, x.shape)), **dict(zip(ys, y.shape))}
  c = cpu_gemm.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
  c = c.reshape([size[ch] for ch in batch + m + n])
  return c.transpose([(batch + m + n).index(ch) for ch in out])


def _einsum_per_device(x: Array, y: Array, plan: _Plan) -> Array:
  rows = PartitionSpec(plan.axes)
  fn = functools.partial(_contract, plan.equation)
  return cpu_gemm.per_device(fn, plan.axes, (rows, rows), rows)(x, y)


_einsum = jax.custom_vjp(_einsum_per_device, nondiff_argnums=(2,))


def _einsum_fwd(x, y, plan):
  return _einsum_per_device(x, y, plan), (x, y)


def _einsum_bwd(plan, residuals, dout):
  """dx = dout ⋅ y and dy = x ⋅ dout over the letters each lacks: two more contractions."""
  x, y = residuals
  xs, ys, out = _letters(plan.equation)
  dx = _einsum_per_device(dout, y, _Plan(f"{out},{ys}->{xs}", plan.axes))
  dy = _einsum_per_device(x, dout, _Plan(f"{xs},{out}->{ys}", plan.axes))
  return dx, dy


_einsum.defvjp(_einsum_fwd, _einsum_bwd)


# ----------------------------------------------------------------------------- in place


def in_place_applies(x: Array, y: Array) -> bool:
  """Whether `in_place_einsum` reads x and y in place through MKL (else it slices them and
  calls jnp.einsum): float32 on CPU, MKL available, a mesh that splits at most the batch,
  into equal parts of x's leading dim (as `einsum`'s plan asks)."""
  if not cpu_gemm.applies(x, y):
    return False
  found = cpu_gemm.batch_split()
  return found is not None and x.ndim > 0 and x.shape[0] % found[1] == 0


def in_place_einsum(
    equation: str,
    x: Array,
    y: Array,
    *,
    batch: str,
    sizes: dict[str, int] | None = None,
    starts: tuple[dict[str, int], dict[str, int]] | None = None,
) -> Array:
  """One batched matrix product over windows of x and y, read where they lie in memory.

  equation: letters as jnp.einsum's; `batch` names the letters every GEMM of the batch has
  (at most three, leading letter first; an operand without one repeats along it). The
  others, after dropping letters of extent 1, must be one row and one column letter per
  operand (M, K for x; K, N for y), and each operand's or the output's last letter one of
  its two. sizes: {letter: extent} (default: the operands' extents); starts: ({letter:
  start} for x, {letter: start} for y), the windows' corners (a query chunk, a prefix of the
  keys). The output is a new array, laid out as its letters say. No operand or result is
  transposed or sliced by a copy: the GEMMs read and write them in place. Where that does
  not apply (`in_place_applies`), jnp.einsum of the windows.

  Under a mesh that splits the batch, every operand's and the output's leading letter is
  the batch, split per device (`shard_map`); windows apply to the other letters.
  """
  xs, ys, out = _letters(equation)
  extent = {**dict(zip(xs, x.shape)), **dict(zip(ys, y.shape)), **(sizes or {})}
  x_starts, y_starts = starts or ({}, {})
  for operand, letters, corner in ((x, xs, x_starts), (y, ys, y_starts)):
    for c, dim in zip(letters, operand.shape):
      if not 0 <= corner.get(c, 0) <= corner.get(c, 0) + extent[c] <= dim:
        raise ValueError(f"in_place_einsum {equation!r}: {c} window [{corner.get(c, 0)}, "
                         f"+{extent[c]}) is outside its operand's extent {dim}")
  if not in_place_applies(x, y):
    return jnp.einsum(equation, _window(x, xs, extent, x_starts), _window(y, ys, extent, y_starts))
  split, devices = cpu_gemm.batch_split()
  if split and not (xs[0] == ys[0] == out[0] == batch[0] and batch[0] not in (sizes or {})):
    raise ValueError(f"in_place_einsum {equation!r}: the mesh splits the leading letter, "
                     f"which must be the batch {batch!r} of every operand")
  local = {**extent, batch[0]: extent[batch[0]] // devices} if split else extent
  fn = functools.partial(_in_place, xs, ys, out, batch, local, x_starts, y_starts)
  rows = PartitionSpec(split)
  return cpu_gemm.per_device(fn, split, (rows, rows), rows)(x, y)


def _window(operand: Array, letters: str, extent: dict, starts: dict) -> Array:
  begin = [starts.get(c, 0) for c in letters]
  return jax.lax.slice(operand, begin, [b + extent[c] for b, c in zip(begin, letters)])


def _in_place(xs, ys, out, batch, extent, x_starts, y_starts, x, y):
  """The strided handler's call for one device's operands (see `in_place_einsum`)."""
  kept = lambda letters: {c for c in letters if c not in batch and extent[c] > 1}  # noqa: E731
  rx, ry, ro = kept(xs), kept(ys), kept(out)
  m, n, k = rx & ro, ry & ro, rx & ry
  if (len(batch) > 3 or set(batch) - set(out) or max(len(m), len(n), len(k)) > 1
      or rx != m | k or ry != k | n or ro != m | n or not k):
    raise ValueError(f"in_place_einsum: {xs},{ys}->{out} over batch {batch!r} is not one GEMM")
  m, n, k = (next(iter(role), None) for role in (m, n, k))
  out_shape = tuple(extent[c] for c in out)
  c_view = _view(out, out_shape, {}, batch, m, n)
  if c_view[-1]:
    raise ValueError(f"in_place_einsum: {out!r} must end in its column letter {n!r}")
  size = lambda c: 1 if c is None else extent[c]  # noqa: E731
  shape = [extent[c] for c in batch] + [1] * (3 - len(batch)) + [size(m), size(n), size(k)]
  call = jax.ffi.ffi_call(
      cpu_gemm.STRIDED_TARGET,
      jax.ShapeDtypeStruct(out_shape, jnp.float32),
      vmap_method="sequential",
  )
  return call(
      x,
      y,
      shape=np.array(shape, np.int64),
      a_view=np.array(_view(xs, x.shape, x_starts, batch, m, k), np.int64),
      b_view=np.array(_view(ys, y.shape, y_starts, batch, k, n), np.int64),
      c_view=np.array(c_view, np.int64),
  )


def _view(letters: str, shape, starts: dict, batch: str, row: str | None, col: str | None):
  """[offset, batch strides x3, ld, trans] of the [row, col] matrices of a row-major array."""
  stride = {c: math.prod(shape[i + 1 :]) for i, c in enumerate(letters)}
  offset = sum(starts.get(c, 0) * stride[c] for c in letters)
  batch_strides = [stride.get(c, 0) for c in batch] + [0] * (3 - len(batch))
  row_stride, col_stride = stride.get(row), stride.get(col, 1)
  if col_stride == 1:  # rows ld apart (a lone row: ld is any width that holds it)
    return [offset, *batch_strides, row_stride if row else max(shape[-1], 1), 0]
  if row_stride in (1, None):
    return [offset, *batch_strides, col_stride, 1]
  raise ValueError(f"in_place_einsum: neither {row!r} nor {col!r} is {letters!r}'s last letter")
