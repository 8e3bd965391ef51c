"""Linear: the one dense projection (MaxText's DenseGeneral), its kernel boxed with logical axes.

Attention's q/k/v/out, the MLP, the encoder's pooler and heads and the untied output projection
all use it, so every kernel is created, boxed and multiplied the same way.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tx_jax.layers import cpu_gemm

Array = jnp.ndarray


class Linear(nn.Module):
  """x contracted over its last `in_dims` dims with a kernel [*in_dims, *features] (+ bias).

  flax 0.12's DenseGeneral boxes the *flattened* [in, out] kernel with the full-rank logical
  names and unboxes it, also in apply (its shape check re-traces the init), which fails as
  soon as a mesh and logical rules are active. Here the initializer sees the same flattened
  shape (same fans, same random numbers as nn.Dense / DenseGeneral) and the box wraps the
  reshaped kernel.
  """

  features: int | tuple[int, ...]
  axes: tuple[str | None, ...]  # logical names of the kernel: input dims, then feature dims
  in_dims: int = 1  # trailing input dims contracted
  use_bias: bool = False
  kernel_init: nn.initializers.Initializer = nn.initializers.lecun_normal()
  dtype: jnp.dtype = jnp.float32  # compute
  param_dtype: jnp.dtype = jnp.float32  # storage

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = (self.features,) if isinstance(self.features, int) else tuple(self.features)
    if len(self.axes) != self.in_dims + len(features):
      raise ValueError(
          f"Linear {self.name}: axes={self.axes} must name {self.in_dims} input and "
          f"{len(features)} feature dims"
      )
    in_shape = x.shape[x.ndim - self.in_dims :]
    flat = (int(np.prod(in_shape)), int(np.prod(features)))

    def init(rng, shape, dtype=jnp.float32):
      return jnp.reshape(self.kernel_init(rng, flat, dtype), shape)

    kernel = self.param(
        "kernel",
        nn.with_logical_partitioning(init, self.axes),
        in_shape + features,
        self.param_dtype,
    )
    bias = None
    if self.use_bias:
      bias = self.param(
          "bias",
          nn.with_logical_partitioning(nn.initializers.zeros, self.axes[self.in_dims :]),
          features,
          self.param_dtype,
      )
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    y = project(x, kernel, self.in_dims)
    return y if bias is None else y + bias


def stacked_init(init: nn.initializers.Initializer, parts: int) -> nn.initializers.Initializer:
  """`init` on each of `parts` equal column blocks of a flat [in, out] kernel, side by side.

  A kernel that holds several projections (q | k | v) then draws each block from the
  distribution it would have alone: fan-based inits count one projection, not all of them.
  """

  def stacked(rng, shape, dtype=jnp.float32):
    rows, cols = shape
    keys = jax.random.split(rng, parts)
    return jnp.concatenate([init(key, (rows, cols // parts), dtype) for key in keys], axis=1)

  return stacked


def _contract(x: Array, kernel: Array, in_dims: int, preferred_element_type=None) -> Array:
  """x [*batch, *in] · kernel [*in, *out] -> [*batch, *out]."""
  contract = tuple(range(x.ndim - in_dims, x.ndim))
  return jax.lax.dot_general(
      x,
      kernel,
      ((contract, tuple(range(in_dims))), ((), ())),
      preferred_element_type=preferred_element_type,
  )


def project(
    x: Array, kernel: Array, in_dims: int, preferred_element_type=None, *,
    kernel_transposed: bool = False,
) -> Array:
  """`_contract`, differentiated so that XLA:CPU transposes the smaller operand.

  kernel_transposed: the kernel is stored [*out, *in] (a tied embedding's [V, D] table).

  The kernel's gradient Σ_batch x ⊗ dy needs x or dy transposed. Autodiff's form
  (dot(dy, x)ᵀ, which XLA folds into one dot) transposes dy, and XLA:CPU then runs the dot
  in Eigen rather than YNNPACK. For a projection that widens, dy is the larger operand:
  at the bench shape the MLP's up projection (512 -> 2048) took 56 ms fwd+bwd that way,
  against 32 ms for dot(x, dy), which transposes x; the tied output embedding (512 ->
  8192) 160 ms against 131. At equal widths dot(x, dy) also wins inside the model: q, k
  and v share their input, so XLA transposes x once instead of three cotangents (bench
  step 1.5% faster). Where the projection narrows, autodiff's form is as fast or faster
  (MLP down: 35 vs 39 ms) and is kept (docs/performance_cpu_changes.md).

  float32 on CPU goes through MKL instead where it can (`cpu_gemm`, which says why).
  """
  if cpu_gemm.applies(x, kernel):
    axes = cpu_gemm.batch_axes(x, in_dims)
    if axes is not None:
      return cpu_gemm.project(x, kernel, in_dims, axes, kernel_transposed)
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
