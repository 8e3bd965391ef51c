"""Abstract model summaries: parameter counts, training FLOPs per token, memory.

Everything here works on `jax.eval_shape`: no weights are allocated, so it is
safe for multi-billion-parameter presets on a laptop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tx_jax.layers.lora import trainable_mask
from tx_jax.models import abstract_params
from tx_jax.models.config import ModelConfig
from tx_jax.pytree import path_str

# Encoder heads are not part of the backbone count (HF's BertModel has none).
_HEAD_MODULES = ("mlm_transform", "mlm_norm", "mlm_bias", "classifier")


@dataclasses.dataclass(frozen=True)
class ParamCounts:
  total: int
  backbone: int  # without encoder heads: what the `params:` line reports
  matmul: int  # weights that multiply activations, the N of MaxText's 6·N
  per_module: dict[str, int]
  bytes: int
  encoder_matmul: int = 0  # the part of `matmul` in an encoder-decoder's encoder stack


def count_params(config: ModelConfig, params: Any | None = None) -> ParamCounts:
  """Parameter counts of a model, from its abstract parameter tree."""
  params = abstract_params(config) if params is None else params
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  per_module: dict[str, int] = {}
  total = backbone = matmul = encoder_matmul = nbytes = 0
  for path, leaf in leaves:
    name = path_str(path)
    size = int(np.prod(leaf.shape))
    total += size
    nbytes += size * jnp.dtype(leaf.dtype).itemsize
    top = name.split("/")[0]
    per_module[top] = per_module.get(top, 0) + size
    if top not in _HEAD_MODULES:
      backbone += size
    if name.endswith("kernel"):
      matmul += size
      if config.family == "encdec" and top == "encoder":
        encoder_matmul += size
  if config.tie_embeddings:
    matmul += config.vocab_size * config.d_model  # the tied output projection
  return ParamCounts(total, backbone, matmul, per_module, nbytes, encoder_matmul)


def flops_per_token(
    config: ModelConfig, counts: ParamCounts, seq_len: int, target_len: int = 0
) -> float:
  """Training FLOPs per token, counted as MaxText does: 6·N_matmul + the attention term.

  The attention term is 12·L·T·N·H per token (QKᵀ and AV, forward and
  backward, full T² as MaxText counts it). For encoder-decoders the cost of
  one example (S source + T target tokens, self- and cross-attention) is
  divided by S + T.
  """
  per_layer_attention = 12 * config.num_heads * config.head_dim
  if config.family != "encdec":
    return 6.0 * counts.matmul + per_layer_attention * config.num_layers * seq_len
  source, target = seq_len, target_len
  attention = per_layer_attention * (
      config.num_layers * source * source
      + config.num_decoder_layers * (target * target + target * source)
  )
  # Matmul weights act on every token of their stack; split them by stack.
  decoder_matmul = counts.matmul - counts.encoder_matmul
  total = 6.0 * (counts.encoder_matmul * source + decoder_matmul * target) + attention
  return total / (source + target)


def sequence_lengths(config: Any) -> tuple[int, int]:
  """(T, target T) from the data section: LM/encoder length, or source/target lengths."""
  if config.model.family == "encdec":
    return int(config.data.source_len), int(config.data.target_len)
  return int(config.data.seq_len), 0


def describe(config: Any, params: Any | None = None) -> str:
  """A human- and grep-readable summary of `config.model` (the `--dry_run` output).

  `params`: the model's abstract (unboxed) parameter tree, if the caller has it; tracing
  one again costs seconds for the large presets (t5-large: ~3.5 s here).
  """
  model_config = ModelConfig.from_config(config.model)
  counts = count_params(model_config, params)
  seq_len, target_len = sequence_lengths(config)
  flops = flops_per_token(model_config, counts, seq_len, target_len)
  param_bytes = counts.bytes
  params = abstract_params(model_config) if params is None else params
  mask = jax.tree.leaves(trainable_mask(params, model_config.lora))
  trainable = sum(int(np.prod(p.shape)) for p, t in zip(jax.tree.leaves(params), mask) if t)
  adam_bytes = 2 * trainable * 4  # AdamW keeps two float32 moments per trained parameter
  lines = [
      f"model: {model_config.family}  layers={model_config.num_layers}"
      + (f"+{model_config.num_decoder_layers}" if model_config.family == "encdec" else "")
      + f"  d_model={model_config.d_model}  heads={model_config.num_heads}"
      f"/{model_config.num_kv_heads}  vocab={model_config.vocab_size}",
      "parameters per module:",
  ]
  width = max(len(k) for k in counts.per_module)
  for name, size in counts.per_module.items():
    lines.append(f"  {name:<{width}}  {size:>15,}")
  if counts.total != counts.backbone:
    lines.append(f"total with heads: {counts.total:,}")
  lines += [
      f"training FLOPs/token: {flops:.4g} (6*{counts.matmul:,} + attention at "
      f"T={seq_len}{f', target T={target_len}' if target_len else ''})",
      f"parameter memory: {param_bytes / 2**20:,.1f} MiB ({model_config.param_dtype}); "
      f"with AdamW moments: {(param_bytes + adam_bytes) / 2**20:,.1f} MiB",
      f"params: {counts.backbone}",
      f"trainable params: {trainable:,} of {counts.total:,} "
      f"({100 * trainable / counts.total:.3g}%)",
  ]
  return "\n".join(lines)
