"""Linear: the one dense projection (MaxText's DenseGeneral), its kernel boxed with logical axes.

Attention's q/k/v/out, the MLP, the encoder's pooler and heads and the untied output projection
all use it, so every kernel is created, boxed and multiplied the same way.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tx_jax.layers import ops

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
  kernels: str = ops.PLAIN  # which `layers.ops` kernel set multiplies

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
    y = ops.get(self.kernels).project(x, kernel, self.in_dims)
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
