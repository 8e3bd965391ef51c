"""Token embedding with attend() for a tied output projection."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from tx_jax.layers import ops
from tx_jax.layers.axes import EMBED, VOCAB

Array = jnp.ndarray


class Embed(nn.Module):
  """Lookup table [num_embeddings, dim]; `attend` reuses it as the output projection."""

  num_embeddings: int
  dim: int
  axes: tuple[str, str] = (VOCAB, EMBED)
  embedding_init: nn.initializers.Initializer = nn.initializers.normal(0.02)
  dtype: jnp.dtype = jnp.float32
  param_dtype: jnp.dtype = jnp.float32
  kernels: str = ops.PLAIN  # which `layers.ops` kernel set multiplies in `attend`

  def setup(self):
    self.embedding = self.param(
        "embedding",
        nn.with_logical_partitioning(self.embedding_init, self.axes),
        (self.num_embeddings, self.dim),
        self.param_dtype,
    )

  def __call__(self, ids_BT: Array) -> Array:
    return jnp.take(self.embedding, ids_BT, axis=0).astype(self.dtype)

  def attend(self, x_BTD: Array) -> Array:
    """Tied output logits x·Eᵀ, accumulated and returned in float32; E is read as stored."""
    return ops.get(self.kernels).project(
        x_BTD.astype(self.dtype),
        self.embedding.astype(self.dtype),
        1,
        preferred_element_type=jnp.float32,
        kernel_transposed=True,
    )
