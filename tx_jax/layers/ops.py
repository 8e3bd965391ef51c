"""The one seam between the layers and platform kernels: projections, norms, einsums, attention.

Layers never call a platform kernel directly. They take a `kernels` name (the config's
`model.kernels`) and call `ops.get(kernels).project(...)` and friends. "plain" is JAX's own
ops under JAX's own autodiff, the default on every platform, so `jax.jvp`, `jax.linearize`,
`vmap(grad)` and `jax.checkpoint` work on every model. Other sets are found by name under
the entry point group `tx_jax.kernels` (declared in a package's metadata, as `tx_jax.cpu`
declares "cpu" in pyproject.toml), so the layers never import them; `register` adds one
at run time.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Callable

import jax
import jax.numpy as jnp

Array = jnp.ndarray

PLAIN = "plain"


def project(
    x: Array,
    kernel: Array,
    in_dims: int,
    *,
    preferred_element_type=None,
    kernel_transposed: bool = False,
) -> Array:
  """x [*batch, *in] · kernel [*in, *out] -> [*batch, *out].

  kernel_transposed: the kernel is stored [*out, *in] (a tied embedding's [V, D] table).
  """
  if kernel_transposed:
    out_dims = kernel.ndim - in_dims
    kernel_dims, x_dims = tuple(range(out_dims, kernel.ndim)), tuple(range(x.ndim - in_dims, x.ndim))
    return jax.lax.dot_general(
        x, kernel, ((x_dims, kernel_dims), ((), ())), preferred_element_type=preferred_element_type
    )
  contract = tuple(range(x.ndim - in_dims, x.ndim))
  return jax.lax.dot_general(
      x,
      kernel,
      ((contract, tuple(range(in_dims))), ((), ())),
      preferred_element_type=preferred_element_type,
  )


def normalize(
    x: Array, scale: Array, bias: Array | None, *, epsilon: float, center: bool, out_dtype
) -> Array:
  """(x − mean) / sqrt(var + eps) · scale (+ bias) over the last axis, as flax computes it.

  Statistics in at least float32, with flax's fast variance E[x²] − E[x]²; center=False is
  RMSNorm (no mean). The parameters and outputs are those of `nn.LayerNorm` / `nn.RMSNorm`.
  """
  xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  mean_sq = jnp.mean(jax.lax.square(xf), axis=-1, keepdims=True)
  var, centered = mean_sq, x
  if center:
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.maximum(0.0, mean_sq - jax.lax.square(mean))
    centered = x - mean
  y = centered * (jax.lax.rsqrt(var + epsilon) * scale)
  if bias is not None:
    y = y + bias
  return y.astype(out_dtype)


def einsum(equation: str, x: Array, y: Array, *, preferred_element_type=None) -> Array:
  """`jnp.einsum` of two operands."""
  return jnp.einsum(equation, x, y, preferred_element_type=preferred_element_type)


@dataclasses.dataclass(frozen=True)
class Kernels:
  """One implementation of each operation the layers delegate.

  dense_attention: None, or (q_BTNH, k_BSKH, v_BSKH, spec, *, scale) -> out_BTNH replacing
  the `dense` backend's reference computation where it has no dropout.
  """

  name: str
  project: Callable[..., Array] = project
  normalize: Callable[..., Array] = normalize
  einsum: Callable[..., Array] = einsum
  dense_attention: Callable[..., Array] | None = None


ENTRY_POINT_GROUP = "tx_jax.kernels"
_REGISTRY: dict[str, Kernels] = {PLAIN: Kernels(PLAIN)}


def register(kernels: Kernels) -> None:
  """Makes a kernel set selectable by its name (`model.kernels`)."""
  _REGISTRY[kernels.name] = kernels


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
  return {e.name: e for e in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


def names() -> tuple[str, ...]:
  """Every selectable kernel set, "plain" first."""
  return tuple(dict.fromkeys([*_REGISTRY, *_entry_points()]))


def get(name: str) -> Kernels:
  """The kernel set called `name`, with an error listing the accepted ones."""
  if name not in _REGISTRY:
    found = _entry_points().get(name)
    if found is None:
      raise ValueError(f"model.kernels={name!r} is not one of {list(names())}")
    _REGISTRY[name] = found.load()
  return _REGISTRY[name]

