"""Projections and norms with custom VJPs that choose what XLA:CPU transposes and fuses.

Both are reverse-mode only (`jax.custom_vjp`): `jax.jvp` and `jax.linearize` refuse them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tx_jax.cpu import gemm
from tx_jax.layers import ops

Array = jnp.ndarray


def _contract(x: Array, kernel: Array, in_dims: int, preferred_element_type=None) -> Array:
  """x [*batch, *in] · kernel [*in, *out] -> [*batch, *out], as the plain kernels compute it."""
  return ops.project(x, kernel, in_dims, preferred_element_type=preferred_element_type)


def project(
    x: Array,
    kernel: Array,
    in_dims: int,
    *,
    preferred_element_type=None,
    kernel_transposed: bool = False,
) -> Array:
  """`layers.ops.project` through MKL where it applies, else XLA's dot differentiated so
  that XLA:CPU transposes the smaller operand.

  The kernel's gradient Σ_batch x ⊗ dy needs x or dy transposed. Autodiff's form
  (dot(dy, x)ᵀ) transposes dy, which XLA:CPU then runs in Eigen rather than YNNPACK; for a
  projection that widens or keeps its width, dy is the larger operand, so the custom VJP
  transposes x instead. Where the projection narrows, autodiff's form is kept.
  """
  if gemm.applies(x, kernel):
    axes = gemm.batch_axes(x, in_dims)
    if axes is not None:
      return gemm.project(x, kernel, in_dims, axes, kernel_transposed)
  if kernel_transposed:
    out_dims = kernel.ndim - in_dims
    kernel = jnp.moveaxis(kernel, tuple(range(out_dims)), tuple(range(in_dims, kernel.ndim)))
  in_size = int(np.prod(kernel.shape[:in_dims]))
  out_size = int(np.prod(kernel.shape[in_dims:]))
  if in_size <= out_size:
    return _project_transposing_x(x, kernel, in_dims, preferred_element_type)
  return _contract(x, kernel, in_dims, preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _project_transposing_x(x, kernel, in_dims, preferred_element_type):
  return _contract(x, kernel, in_dims, preferred_element_type)


def _project_transposing_x_fwd(x, kernel, in_dims, preferred_element_type):
  return _contract(x, kernel, in_dims, preferred_element_type), (x, kernel)


def _project_transposing_x_bwd(in_dims, preferred_element_type, residuals, dy):
  """As autodiff's transpose (same dtypes), but dkernel = dot(x, dy) over the batch dims."""
  x, kernel = residuals
  batch = tuple(range(x.ndim - in_dims))
  out_dy = tuple(range(len(batch), dy.ndim))
  out_kernel = tuple(range(in_dims, kernel.ndim))
  dx = jax.lax.dot_general(
      dy, kernel, ((out_dy, out_kernel), ((), ())), preferred_element_type=preferred_element_type
  )
  dkernel = jax.lax.dot_general(
      x, dy, ((batch, batch), ((), ())), preferred_element_type=preferred_element_type
  )
  return dx.astype(x.dtype), dkernel.astype(kernel.dtype)


_project_transposing_x.defvjp(_project_transposing_x_fwd, _project_transposing_x_bwd)


def normalize(x, scale, bias, *, epsilon, center, out_dtype):
  """`layers.ops.normalize` with a hand-written backward: autodiff of the fast variance gave
  XLA:CPU about twice the passes over [B, T, D], among them broadcasts of the scale."""
  return _normalize(x, scale, bias, epsilon, center, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _normalize(x, scale, bias, epsilon, center, out_dtype):
  return _normalize_fwd(x, scale, bias, epsilon, center, out_dtype)[0]


def _normalize_fwd(x, scale, bias, epsilon, center, out_dtype):
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  mean_sq = jnp.mean(jax.lax.square(xf), axis=-1, keepdims=True)
  mean, var, centered = None, mean_sq, x
  if center:
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, mean_sq - jax.lax.square(mean))
    centered = x - mean
  rstd = jax.lax.rsqrt(var + epsilon)
  y = centered * (rstd * scale)
  if bias is not None:
    y = y + bias
  return y.astype(out_dtype), (x, mean, rstd, scale, bias)


def _normalize_bwd(epsilon, center, out_dtype, residuals, dy):
  """d x = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ · x̂)) with ĝ = dy · scale (no mean(ĝ) for RMS);
  d scale = Σ dy · x̂ and d bias = Σ dy over every axis but the last."""
  del epsilon, out_dtype
  x, mean, rstd, scale, bias = residuals
  f32 = rstd.dtype
  g = dy.astype(f32)
  x_hat = (x.astype(f32) if mean is None else x.astype(f32) - mean) * rstd
  g_hat = g * scale.astype(f32)
  batch_axes = tuple(range(x.ndim - 1))
  d_scale = jnp.sum(g * x_hat, axis=batch_axes).astype(scale.dtype)
  d_bias = None if bias is None else jnp.sum(g, axis=batch_axes).astype(bias.dtype)
  projection = jnp.mean(g_hat * x_hat, axis=-1, keepdims=True)
  if center:
    g_hat = g_hat - jnp.mean(g_hat, axis=-1, keepdims=True)
  dx = rstd * (g_hat - x_hat * projection)
  return dx.astype(x.dtype), d_scale, d_bias


_normalize.defvjp(_normalize_fwd, _normalize_bwd)
