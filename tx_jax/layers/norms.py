"""LayerNorm (with or without bias) and RMSNorm, and the pre-/post-norm residual wiring."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from tx_jax.layers import axes

Array = jnp.ndarray

NORMS = ("layernorm", "rmsnorm")


@dataclasses.dataclass(frozen=True)
class NormSpec:
  """Which norm a model uses and how; `make_norm(spec, name)` builds one."""

  kind: str = "layernorm"  # one of NORMS
  eps: float = 1e-6
  use_bias: bool = True  # LayerNorm only; RMSNorm has no bias
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32


def make_norm(spec: NormSpec, name: str | None = None) -> nn.Module:
  """A LayerNorm or RMSNorm whose scale (and bias) carry the logical axis "embed"."""
  scale_init = nn.with_logical_partitioning(nn.initializers.ones, (axes.EMBED,))
  if spec.kind == "layernorm":
    return nn.LayerNorm(
        epsilon=spec.eps,
        use_bias=spec.use_bias,
        scale_init=scale_init,
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)),
        dtype=spec.dtype,
        param_dtype=spec.param_dtype,
        name=name,
    )
  if spec.kind == "rmsnorm":
    return nn.RMSNorm(
        epsilon=spec.eps,
        scale_init=scale_init,
        dtype=spec.dtype,
        param_dtype=spec.param_dtype,
        name=name,
    )
  raise ValueError(f"model.norm={spec.kind!r} is not one of {list(NORMS)}")


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
