"""Linear: the one dense projection (MaxText's DenseGeneral), its kernel boxed with logical axes.

Attention's q/k/v/out, the MLP, the encoder's pooler and heads and the untied output projection
all use it, so every kernel is created, boxed and multiplied the same way.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tx_jax.layers import lora as lora_lib
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
  # Low-rank adapters "lora_a" [*in, r] and "lora_b" [r, *features] when the spec's targets
  # select this module's path (layers/lora.py); None or rank 0: a plain projection.
  lora: lora_lib.LoraSpec | None = None

  @nn.compact
  def __call__(self, x: Array, *, train: bool = False) -> Array:
    """x [..., *in] -> [..., *features]; `train` turns on the adapter's input dropout."""
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
    adapter = None
    # A top-level Linear (tests, tools) has an empty scope path: its name is its path.
    path = "/".join(self.scope.path) or (self.name or "")
    if self.lora is not None and self.lora.applies_to(path):
      adapter = self._adapter(in_shape, features, flat)
    x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
    kernels = ops.get(self.kernels)
    y = kernels.project(x, kernel, self.in_dims)
    if adapter is not None:
      x_in = nn.Dropout(self.lora.dropout)(x, deterministic=not train)
      a, b = nn.dtypes.promote_dtype(*adapter, dtype=self.dtype)
      # x·A first: the [..., r] intermediate is what makes the adapter cheap.
      h = kernels.project(kernels.project(x_in, a, self.in_dims), b, 1)
      y = y + h * jnp.asarray(self.lora.scale, h.dtype)
    return y if bias is None else y + bias

  def _adapter(self, in_shape, features, flat) -> tuple[Array, Array]:
    """(A [*in, r], B [r, *features]): A as PEFT draws it, B zero so step 0 is the base."""
    rank = self.lora.rank
    if rank > min(flat):
      raise ValueError(
          f"config.model.lora.rank={rank} is larger than projection {self.name} "
          f"[{flat[0]} -> {flat[1]}]; use a rank <= {min(flat)}"
      )
    a_axes, b_axes = lora_lib.adapter_axes(self.axes, self.in_dims)

    def init_a(rng, shape, dtype=jnp.float32):
      return jnp.reshape(lora_lib.init_a(rng, (flat[0], rank), dtype), shape)

    a = self.param(
        "lora_a",
        nn.with_logical_partitioning(init_a, a_axes),
        in_shape + (rank,),
        self.param_dtype,
    )
    b = self.param(
        "lora_b",
        nn.with_logical_partitioning(nn.initializers.zeros, b_axes),
        (rank,) + features,
        self.param_dtype,
    )
    return a, b


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
