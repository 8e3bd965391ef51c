"""LayerNorm (with or without bias) and RMSNorm, and the pre-/post-norm residual wiring."""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax.numpy as jnp

Array = jnp.ndarray

NORMS = ("layernorm", "rmsnorm")


def make_norm(
    kind: str,
    *,
    eps: float,
    use_bias: bool = True,
    dtype=jnp.float32,
    param_dtype=jnp.float32,
    name: str | None = None,
) -> nn.Module:
  """A LayerNorm or RMSNorm whose scale (and bias) carry the logical axis "embed"."""
  scale_init = nn.with_logical_partitioning(nn.initializers.ones, ("embed",))
  if kind == "layernorm":
    return nn.LayerNorm(
        epsilon=eps,
        use_bias=use_bias,
        scale_init=scale_init,
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
        dtype=dtype,
        param_dtype=param_dtype,
        name=name,
    )
  if kind == "rmsnorm":
    return nn.RMSNorm(
        epsilon=eps, scale_init=scale_init, dtype=dtype, param_dtype=param_dtype, name=name
    )
  raise ValueError(f"model.norm={kind!r} is not one of {list(NORMS)}")


def residual(
    x: Array,
    sublayer: Callable[[Array], Array],
    norm: nn.Module,
    *,
    pre_norm: bool,
    dropout: Callable[[Array], Array],
) -> Array:
  """Pre-norm: x + drop(f(norm(x))). Post-norm (the paper, BERT): norm(x + drop(f(x)))."""
  if pre_norm:
    return x + dropout(sublayer(norm(x)))
  return norm(x + dropout(sublayer(x)))
