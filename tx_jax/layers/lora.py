"""LoRA (Hu et al. 2021): which projections get low-rank adapters, and the adapter's product.

A LoRA projection computes x·W + (alpha/rank)·dropout(x)·A·B with A [*in, r] and B [r, *out],
B zero at init, so the base model's output is unchanged until B trains. `Linear` owns the
adapter params and computes the term; this module says which Linears take one
(`LoraSpec.applies_to`), how A and B are named, boxed and drawn, and which params train
(`trainable_mask`), so the model files only pass the spec down.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax.layers import axes
from tx_jax.pytree import path_str

Array = jnp.ndarray
ADAPTERS = ("lora_a", "lora_b")  # the param names a LoRA projection adds (layers/linear.py)

# Logical projection names a target may use -> the module names of the Linears they select
# (attention's, the MLP's and the untied output head's, as the layers name them).
LOGICAL_TARGETS: dict[str, tuple[str, ...]] = {
    "query": ("query",),
    "key": ("key",),
    "value": ("value",),
    "output": ("out",),
    "qkv": ("qkv", "kv"),  # the stacked kernels of model.fused_qkv
    "mlp_up": ("wi", "wi_1"),
    "mlp_gate": ("wi_0",),
    "mlp_down": ("wo",),
    "lm_head": ("lm_head",),
}


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  """config.model.lora: adapter shape and which projections (and params) train."""

  rank: int = 0  # 0: LoRA off
  alpha: float = 16.0
  dropout: float = 0.0
  targets: tuple[str, ...] = ()  # LOGICAL_TARGETS names, or regexes on "a/b/c" module paths
  also_train: tuple[str, ...] = ()  # regexes on param paths trained in full (the optimizer's)

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return self.alpha / self.rank

  def applies_to(self, module_path: str) -> bool:
    """Whether the Linear at `module_path` ("decoder/.../self_attention/query") is adapted."""
    return self.enabled and any(target_matches(t, module_path) for t in self.targets)


def target_matches(target: str, module_path: str) -> bool:
  """A logical name matches the module's own name; anything else is a regex on its path."""
  if target in LOGICAL_TARGETS:
    return module_path.rsplit("/", 1)[-1] in LOGICAL_TARGETS[target]
  return re.search(target, module_path) is not None


def trainable_mask(params: Any, lora: Any) -> Any:
  """True for the params training updates: all, or with LoRA on (`lora`: config.model.lora or
  a LoraSpec) the adapters and the params whose path matches one of `lora.also_train`."""
  if lora.rank <= 0:
    return jax.tree.map(lambda _: True, params)
  patterns = [re.compile(p) for p in lora.also_train]

  def trains(path, _) -> bool:
    name = path_str(path)
    return name.rsplit("/", 1)[-1] in ADAPTERS or any(p.search(name) for p in patterns)

  return jax.tree_util.tree_map_with_path(trains, params)


def from_dict(values: dict) -> LoraSpec:
  """The spec from config.model.lora's fields (JSON lists become tuples)."""
  fields = {f.name for f in dataclasses.fields(LoraSpec)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ValueError(f"config.model.lora has unknown fields {unknown}; accepted: {sorted(fields)}")
  values = {k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in values.items()}
  return LoraSpec(**values)


def validate(spec: LoraSpec) -> None:
  """Field checks that need no model; targets and rank vs width are checked on the params."""
  if spec.rank < 0:
    raise ValueError(f"config.model.lora.rank={spec.rank} must be >= 0 (0 turns LoRA off)")
  if not spec.enabled:
    return
  if not spec.targets:
    raise ValueError(
        "config.model.lora.targets=() adapts nothing; name projections from "
        f"{sorted(LOGICAL_TARGETS)} or regexes on module paths"
    )
  if not 0.0 <= spec.dropout < 1.0:
    raise ValueError(f"config.model.lora.dropout={spec.dropout} must be in [0, 1)")
  for field in ("targets", "also_train"):
    for pattern in getattr(spec, field):
      try:
        re.compile(pattern)
      except re.error as e:
        raise ValueError(f"config.model.lora.{field} has {pattern!r}, not a regex: {e}") from e


def adapter_axes(kernel_axes: tuple, in_dims: int) -> tuple[tuple, tuple]:
  """Logical axes of A (the kernel's input axes + rank) and B (rank + its output axes)."""
  return kernel_axes[:in_dims] + (axes.LORA_RANK,), (axes.LORA_RANK,) + kernel_axes[in_dims:]


def init_a(rng: jax.Array, flat_shape: tuple[int, int], dtype=jnp.float32) -> Array:
  """PEFT's default A: kaiming_uniform(a=sqrt(5)) over fan_in, i.e. U(+-1/sqrt(fan_in))."""
  return nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")(rng, flat_shape, dtype)
