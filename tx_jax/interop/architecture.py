"""What one HuggingFace architecture needs: its config mapping and its weight rules."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from tx_jax.interop.rules import ConversionError, HFConfig, Rule
from tx_jax.models.config import ModelConfig

# None: no weights at hand (config.json alone); the config's own flags then decide.
Weights = Mapping[str, np.ndarray] | None


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One HF class (`name`, as in config.json "architectures") and its mapping to tx_jax.

  read_config: config.json values (+ the weights, for what only they tell: a pooler,
    an untied head) -> every config.model field that shapes this family's model.
  write_config: config.model -> the config.json values of this architecture.
  rules: config.model -> the tensor rules of every parameter.
  tied_copies: config.model -> {HF key: HF key it may duplicate}; such a tensor is
    accepted on load only when bit-equal to its source, and never written.
  ignored: regexes of HF keys that hold no parameters (buffers, heads HF drops too).
  base_prefix: the prefix of the trunk's keys ("transformer.", "bert.", "model."), which
    checkpoints saved from the bare trunk class lack; transformers adds it, so do we.
  """

  name: str
  model_type: str
  read_config: Callable[[HFConfig, Weights], dict[str, Any]]
  write_config: Callable[[ModelConfig], dict[str, Any]]
  rules: Callable[[ModelConfig], list[Rule]]
  tied_copies: Callable[[ModelConfig], dict[str, str]]
  ignored: tuple[str, ...] = ()
  base_prefix: str = ""


def equal(weights: Weights, a: str, b: str) -> bool:
  """Whether tensors `a` and `b` are both present and bit-identical."""
  if weights is None or a not in weights or b not in weights:
    return False
  x, y = weights[a], weights[b]
  return x.shape == y.shape and x.dtype == y.dtype and x.tobytes() == y.tobytes()


def output_tied(hf: HFConfig, weights: Weights, head: str, embedding: str, default: bool) -> bool:
  """Whether the output projection is the token embedding, as transformers decides it.

  transformers ties when the config says so, unless the checkpoint holds a head that
  differs from the embedding (then it loads the head untied, with a warning).
  """
  tie = bool(hf.get("tie_word_embeddings", default))
  if weights is None:
    return tie
  if head not in weights:
    if not tie:
      raise ConversionError(
          f"{hf.architecture}: tie_word_embeddings is false but the " f"weights have no {head!r}"
      )
    return True
  return tie and equal(weights, head, embedding)
