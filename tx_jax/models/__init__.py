"""Model families: a registry from `config.model.family` to its module."""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp

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
    "decoder": (("inputs",), ("segment_ids", "positions", "token_index")),
    "encoder": (("inputs",), ("token_type_ids", "segment_ids", "positions")),
    "encdec": (
        ("encoder_inputs", "decoder_inputs"),
        (
            "encoder_segment_ids",
            "decoder_segment_ids",
            "encoder_positions",
            "decoder_positions",
            "decoder_token_index",
        ),
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


def abstract_params(model_cfg: Any, *, boxed: bool = False) -> Any:
  """The parameter tree of `config.model` as ShapeDtypeStructs; nothing is allocated.

  With boxed=True the leaves keep their logical-axis boxes (what `tx_jax.sharding` reads).
  """
  ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)  # parameter shapes do not depend on length
  family = model_cfg.family
  batch = {"encoder_inputs": ids, "decoder_inputs": ids} if family == "encdec" else {"inputs": ids}
  args, kwargs = model_inputs(model_cfg, batch)
  module = build(model_cfg)
  init = lambda *a: module.init(jax.random.key(0), *a, **kwargs, train=False)  # noqa: E731
  params = jax.eval_shape(init, *args)["params"]
  return params if boxed else nn.meta.unbox(params)


def unstack_layers(params: Any) -> Any:
  """Params of scanned stacks (`layers/layer`, leading L axis) as unrolled `layer_{i}` subtrees."""
  if not isinstance(params, Mapping):
    return params
  out = {}
  for key, value in params.items():
    if key == "layers" and isinstance(value, Mapping) and set(value) == {"layer"}:
      stacked = value["layer"]
      for i in range(jax.tree.leaves(stacked)[0].shape[0]):
        out[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    else:
      out[key] = unstack_layers(value)
  return out


__all__ = [
    "ModelConfig",
    "REGISTRY",
    "abstract_params",
    "build",
    "model_inputs",
    "unstack_layers",
    "Decoder",
    "Encoder",
    "EncoderDecoder",
]
