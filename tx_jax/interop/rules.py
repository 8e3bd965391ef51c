"""The building blocks of a weight mapping: invertible tensor rules and a config.json reader.

A `Rule` ties HuggingFace tensors (by state-dict key) to tx_jax parameters (by "a/b/c"
path) with a pair of inverse functions, so one table serves loading and writing and a
round trip is exact by construction. Layouts: torch `nn.Linear` stores [out, in], GPT-2's
`Conv1D` stores [in, out]; tx_jax `Dense` kernels are [in, out] and attention kernels are
DenseGeneral [D, N, H] (q/k/v) and [N, H, D] (out).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

Arrays = Sequence[np.ndarray]

# HuggingFace activation names (transformers.activations.ACT2FN) -> tx_jax's.
# "gelu_new" and "gelu_pytorch_tanh" are the same tanh formula.
ACTIVATIONS_FROM_HF = {
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "silu": "silu",
    "swish": "silu",
}
ACTIVATIONS_TO_HF = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_new", "silu": "silu"}


class ConversionError(ValueError):
  """A checkpoint or config that tx_jax cannot convert exactly; the message says why."""


@dataclasses.dataclass(frozen=True)
class Rule:
  """HF tensors `hf` <-> tx_jax params `ours`; `load` and `save` are inverses."""

  hf: tuple[str, ...]
  ours: tuple[str, ...]
  load: Callable[[Arrays], list[np.ndarray]]
  save: Callable[[Arrays], list[np.ndarray]]


def copy(hf: str, ours: str) -> Rule:
  """Same layout on both sides (embeddings, norms, biases, Conv1D kernels)."""
  return Rule((hf,), (ours,), lambda a: [a[0]], lambda a: [a[0]])


def linear(hf: str, ours: str) -> Rule:
  """torch Linear weight [out, in] <-> Dense kernel [in, out]."""
  return Rule((hf,), (ours,), lambda a: [a[0].T], lambda a: [a[0].T])


def heads_in(hf: str, ours: str, heads: int, head_dim: int) -> Rule:
  """q/k/v Linear weight [N*H, D] <-> DenseGeneral kernel [D, N, H]."""
  return Rule(
      (hf,),
      (ours,),
      lambda a: [a[0].T.reshape(a[0].shape[1], heads, head_dim)],
      lambda a: [a[0].reshape(a[0].shape[0], heads * head_dim).T],
  )


def heads_bias(hf: str, ours: str, heads: int, head_dim: int) -> Rule:
  """q/k/v bias [N*H] <-> [N, H]."""
  return Rule(
      (hf,),
      (ours,),
      lambda a: [a[0].reshape(heads, head_dim)],
      lambda a: [a[0].reshape(heads * head_dim)],
  )


def heads_out(hf: str, ours: str, heads: int, head_dim: int) -> Rule:
  """Output Linear weight [D, N*H] <-> DenseGeneral kernel [N, H, D]."""
  return Rule(
      (hf,),
      (ours,),
      lambda a: [a[0].T.reshape(heads, head_dim, a[0].shape[0])],
      lambda a: [a[0].reshape(heads * head_dim, a[0].shape[-1]).T],
  )


def conv_heads_out(hf: str, ours: str, heads: int, head_dim: int) -> Rule:
  """GPT-2 Conv1D output weight [N*H, D] <-> DenseGeneral kernel [N, H, D]."""
  return Rule(
      (hf,),
      (ours,),
      lambda a: [a[0].reshape(heads, head_dim, a[0].shape[1])],
      lambda a: [a[0].reshape(heads * head_dim, a[0].shape[-1])],
  )


def conv_fused_qkv(hf: str, ours: tuple[str, str, str], heads: int, head_dim: int) -> Rule:
  """GPT-2 Conv1D c_attn weight [D, 3*N*H] (q | k | v) <-> three kernels [D, N, H]."""

  def load(a: Arrays) -> list[np.ndarray]:
    return [w.reshape(w.shape[0], heads, head_dim) for w in np.split(a[0], 3, axis=1)]

  def save(a: Arrays) -> list[np.ndarray]:
    return [np.concatenate([w.reshape(w.shape[0], heads * head_dim) for w in a], axis=1)]

  return Rule((hf,), ours, load, save)


def conv_fused_qkv_bias(hf: str, ours: tuple[str, str, str], heads: int, head_dim: int) -> Rule:
  """GPT-2 c_attn bias [3*N*H] <-> three biases [N, H]."""
  return Rule(
      (hf,),
      ours,
      lambda a: [b.reshape(heads, head_dim) for b in np.split(a[0], 3)],
      lambda a: [np.concatenate([b.reshape(heads * head_dim) for b in a])],
  )


class HFConfig:
  """The values of a config.json, read by name, with checks for options we do not implement.

  `used` records every key read, so a test can prove that each option of the HF config
  class is either mapped or checked.
  """

  def __init__(self, values: dict[str, Any], architecture: str):
    self.values = values
    self.architecture = architecture
    self.used: set[str] = set()

  def get(self, key: str, default: Any = None) -> Any:
    """The value of `key`; `default` when the key is absent or null."""
    self.used.add(key)
    value = self.values.get(key)
    return default if value is None else value

  def require(self, key: str, accepted: Sequence[Any], default: Any = None) -> Any:
    """The value of `key`, which must be one of `accepted` (absent or null: `default`)."""
    value = self.get(key, default)
    if value not in accepted:
      raise ConversionError(
          f"{self.architecture} config.json has {key}={value!r}, which tx_jax does not "
          f"implement; accepted: {list(accepted)}"
      )
    return value

  def activation(self, key: str, default: str) -> str:
    """An HF activation name mapped to tx_jax's."""
    return ACTIVATIONS_FROM_HF[self.require(key, tuple(ACTIVATIONS_FROM_HF), default)]

  def same(self, keys: Sequence[str], default: Any) -> Any:
    """The common value of several options that tx_jax models with one field."""
    values = {k: self.get(k, default) for k in keys}
    if len(set(values.values())) > 1:
      raise ConversionError(
          f"{self.architecture} config.json has {values}; tx_jax models these with one "
          "value, so they must be equal"
      )
    return values[keys[0]]

  def error(self, message: str) -> ConversionError:
    return ConversionError(f"{self.architecture}: {message}")


def activation_to_hf(name: str, architecture: str) -> str:
  """A tx_jax activation name as HuggingFace spells it."""
  if name not in ACTIVATIONS_TO_HF:
    raise ConversionError(
        f"config.model.mlp_activation={name!r} has no {architecture} "
        f"equivalent; accepted: {sorted(ACTIVATIONS_TO_HF)}"
    )
  return ACTIVATIONS_TO_HF[name]


def divide(numerator: int, denominator: int, what: str) -> int:
  """numerator / denominator, which must be exact (e.g. head_dim = hidden / heads)."""
  if denominator <= 0 or numerator % denominator:
    raise ConversionError(f"{what}: {numerator} is not divisible by {denominator}")
  return numerator // denominator
