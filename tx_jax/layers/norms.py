"""LayerNorm (with or without bias) and RMSNorm, and the pre-/post-norm residual wiring."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax.numpy as jnp

from tx_jax.layers import axes, ops

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
  kernels: str = ops.PLAIN  # which `layers.ops` kernel set normalises


def make_norm(spec: NormSpec, name: str | None = None) -> nn.Module:
  """A LayerNorm or RMSNorm whose scale (and bias) carry the logical axis "embed"."""
  if spec.kind not in NORMS:
    raise ValueError(f"model.norm={spec.kind!r} is not one of {list(NORMS)}")
  return Norm(
      center=spec.kind == "layernorm",
      epsilon=spec.eps,
      use_bias=spec.kind == "layernorm" and spec.use_bias,
      dtype=spec.dtype,
      param_dtype=spec.param_dtype,
      kernels=spec.kernels,
      name=name,
  )


class Norm(nn.Module):
  """LayerNorm (center=True) or RMSNorm over the last axis.

  The parameters ("scale", and "bias" for LayerNorm with use_bias) and the forward are
  flax's `nn.LayerNorm` / `nn.RMSNorm` op for op: the same checkpoints, and outputs equal
  bit for bit. flax's modules box their parameters without logical axis names, which the
  mesh rules need.
  """

  center: bool = True
  epsilon: float = 1e-6
  use_bias: bool = True
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  kernels: str = ops.PLAIN

  @nn.compact
  def __call__(self, x: Array) -> Array:
    features = (x.shape[-1],)
    scale = self.param(
        "scale",
        nn.with_logical_partitioning(nn.initializers.ones, (axes.EMBED,)),
        features,
        self.param_dtype,
    )
    bias = None
    if self.use_bias:
      bias = self.param(
          "bias",
          nn.with_logical_partitioning(nn.initializers.zeros, (axes.EMBED,)),
          features,
          self.param_dtype,
      )
    out_dtype = self.dtype or jnp.result_type(x, *(p for p in (scale, bias) if p is not None))
    return ops.get(self.kernels).normalize(
        x, scale, bias, epsilon=self.epsilon, center=self.center, out_dtype=out_dtype
    )


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
