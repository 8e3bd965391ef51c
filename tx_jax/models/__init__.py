"""Model families: a registry from `config.model.family` to its module."""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn

from tx_jax.models.config import ModelConfig
from tx_jax.models.decoder import Decoder
from tx_jax.models.encdec import EncoderDecoder
from tx_jax.models.encoder import Encoder

REGISTRY: dict[str, type[nn.Module]] = {
    "decoder": Decoder,
    "encoder": Encoder,
    "encdec": EncoderDecoder,
}

# Which batch-contract keys (ARCHITECTURE.md) each family reads: positional
# arguments first, then keyword arguments that are passed when present.
_INPUT_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "decoder": (("inputs",), ("segment_ids", "positions")),
    "encoder": (("inputs",), ("token_type_ids", "segment_ids", "positions")),
    "encdec": (
        ("encoder_inputs", "decoder_inputs"),
        ("encoder_segment_ids", "decoder_segment_ids", "encoder_positions", "decoder_positions"),
    ),
}


def build(model_cfg: Any) -> nn.Module:
  """The flax module for `config.model` (a ConfigDict, dict or ModelConfig)."""
  config = model_cfg if isinstance(model_cfg, ModelConfig) else ModelConfig.from_config(model_cfg)
  return REGISTRY[config.family](config)


def model_inputs(model_cfg: Any, batch: Mapping[str, Any]) -> tuple[tuple, dict]:
  """(args, kwargs) for `module.apply` from a batch that follows the batch contract."""
  family = model_cfg.family
  positional, optional = _INPUT_KEYS[family]
  missing = [k for k in positional if k not in batch]
  if missing:
    raise KeyError(
        f"a {family!r} batch needs keys {list(positional)}; missing {missing}; "
        f"got {sorted(batch)}"
    )
  args = tuple(batch[k] for k in positional)
  kwargs = {k: batch[k] for k in optional if k in batch}
  return args, kwargs


__all__ = [
    "ModelConfig",
    "REGISTRY",
    "build",
    "model_inputs",
    "Decoder",
    "Encoder",
    "EncoderDecoder",
]
