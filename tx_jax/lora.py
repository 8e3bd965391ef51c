"""LoRA on whole models: check the targets, put fresh adapters on a base, fold them back in.

The adapters themselves live in `tx_jax.layers.linear` / `layers.lora`; this module works on
parameter trees ("a/b/c" paths), so the trainer, the converter and the PEFT interop
(`tx_jax.interop.peft`) share one notion of which params are adapters and how they merge.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from tx_jax import models
from tx_jax.layers import lora as lora_lib
from tx_jax.models.config import ModelConfig

ADAPTERS = lora_lib.ADAPTERS


def _model_config(model_cfg: Any) -> ModelConfig:
  return model_cfg if isinstance(model_cfg, ModelConfig) else ModelConfig.from_config(model_cfg)


def adapted_modules(params: Any) -> list[str]:
  """The module paths ("stack/layer_0/self_attention/query") that carry adapters."""
  flat = traverse_util.flatten_dict(nn.unbox(params), sep="/")
  return sorted({k.rsplit("/", 1)[0] for k in flat if k.endswith("/lora_a")})


def check_targets(model_cfg: Any) -> None:
  """Every config.model.lora target selects at least one projection; rank fits each one.

  The rank check runs inside Linear while the shapes are traced (it knows in and out).
  """
  mc = _model_config(model_cfg)
  if not mc.lora.enabled:
    return
  modules = adapted_modules(models.abstract_params(mc))
  matches = lambda t: any(lora_lib.target_matches(t, m) for m in modules)  # noqa: E731
  unmatched = [t for t in mc.lora.targets if not matches(t)]
  if unmatched:
    base = dataclasses.replace(mc, lora=lora_lib.LoraSpec())
    flat = traverse_util.flatten_dict(models.abstract_params(base), sep="/")
    names = sorted({k.rsplit("/", 2)[-2] for k in flat if k.endswith("/kernel")})
    hint = ""
    if mc.fused_qkv and set(unmatched) & {"query", "key", "value"}:
      hint = (
          "; with model.fused_qkv=True q, k, v are one kernel: target 'qkv' (PEFT's c_attn on "
          "GPT-2) or set model.fused_qkv=False"
      )
    raise ValueError(
        f"config.model.lora.targets={list(mc.lora.targets)}: {unmatched} match no projection "
        f"of this model, whose projections are named {names} (logical names: "
        f"{sorted(lora_lib.LOGICAL_TARGETS)}; a tied output embedding takes no adapter){hint}"
    )


def base_config(model_cfg: Any) -> ModelConfig:
  """The model without adapters (what a merged or base checkpoint holds)."""
  return dataclasses.replace(_model_config(model_cfg), lora=lora_lib.LoraSpec())


def split(params: Any) -> tuple[dict[str, Any], dict[str, Any]]:
  """(base, adapters) as flat {"a/b/c": array} dicts."""
  flat = traverse_util.flatten_dict(nn.unbox(params), sep="/")
  adapters = {k: v for k, v in flat.items() if k.rsplit("/", 1)[-1] in ADAPTERS}
  return {k: v for k, v in flat.items() if k not in adapters}, adapters


def attach(model_cfg: Any, base_params: Any, seed: int = 0) -> Any:
  """`base_params` (a model without adapters) plus freshly initialised adapters (B = 0)."""
  mc = _model_config(model_cfg)
  shapes = traverse_util.flatten_dict(models.abstract_params(mc), sep="/")
  base, adapters = split(base_params)
  if adapters:
    raise ValueError(f"attach: the base params already hold adapters, e.g. {sorted(adapters)[:2]}")
  missing = sorted(k for k in shapes if k not in base and k.rsplit("/", 1)[-1] not in ADAPTERS)
  if missing or set(base) - set(shapes):
    raise ValueError(
        f"attach: the base params are not this model's without adapters: missing {missing[:4]}, "
        f"unexpected {sorted(set(base) - set(shapes))[:4]}"
    )
  ids = jnp.ones((1, 1), jnp.int32)
  family = mc.family
  batch = {"encoder_inputs": ids, "decoder_inputs": ids} if family == "encdec" else {"inputs": ids}
  args, kwargs = models.model_inputs(mc, batch)
  fresh = models.build(mc).init(jax.random.key(seed), *args, **kwargs)["params"]
  _, new_adapters = split(fresh)
  return traverse_util.unflatten_dict({**base, **new_adapters}, sep="/")


def merge(model_cfg: Any, params: Any) -> tuple[ModelConfig, Any]:
  """(the model without adapters, its params with W + (alpha/r)·A·B folded into each kernel).

  The merged model computes what the adapted one does in eval mode (no adapter dropout).
  """
  mc = _model_config(model_cfg)
  base, adapters = split(jax.device_get(params))
  scale = mc.lora.scale if mc.lora.enabled else 0.0
  merged = dict(base)
  for module in {k.rsplit("/", 1)[0] for k in adapters}:
    a = np.asarray(adapters[module + "/lora_a"], np.float64)
    b = np.asarray(adapters[module + "/lora_b"], np.float64)
    kernel = np.asarray(base[module + "/kernel"])
    if kernel.ndim == a.ndim + b.ndim - 2:
      d = np.tensordot(a, b, axes=([a.ndim - 1], [0]))
    else:  # scanned layers: A, B and the kernel share a leading layers axis
      d = np.stack([np.tensordot(x, y, axes=([x.ndim - 1], [0])) for x, y in zip(a, b)])
    d = scale * d
    merged[module + "/kernel"] = (kernel.astype(np.float64) + d).astype(kernel.dtype)
  return base_config(mc), traverse_util.unflatten_dict(merged, sep="/")
