"""HuggingFace interop: load a transformers model directory, write one back.

    config, module, params = hf.from_pretrained("path/to/gpt2")   # config.json + safetensors
    logits = module.apply({"params": params}, ids_BT)
    hf.to_pretrained(config, params, "out_dir")   # transformers.AutoModel*.from_pretrained(out_dir)

Architectures: BertModel, BertForMaskedLM, BertForSequenceClassification, GPT2LMHeadModel,
T5ForConditionalGeneration (v1.0 and v1.1), LlamaForCausalLM. A config option that tx_jax
does not implement (another activation, RoPE scaling, ...) is an error naming it, never a
silently different model. Weights are read from safetensors only, never unpickled.
Mappings live in `tx_jax.interop`; transformers is not needed at runtime.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import traverse_util
from flax.core import unfreeze

from tx_jax import models
from tx_jax.interop.architecture import Architecture, equal
from tx_jax.interop.bert import BERT_CLASSIFIER, BERT_MLM, BERT_MODEL
from tx_jax.interop.decoders import GPT2, LLAMA
from tx_jax.interop.rules import ConversionError, HFConfig
from tx_jax.interop.safetensors_io import read_weights, write_weights
from tx_jax.interop.t5 import T5
from tx_jax.models.config import ModelConfig

ARCHITECTURES: dict[str, Architecture] = {
    a.name: a for a in (BERT_MODEL, BERT_MLM, BERT_CLASSIFIER, GPT2, T5, LLAMA)
}
# config.model fields that choose how the model runs, not what it computes.
RUNTIME_FIELDS = (
    "dtype", "param_dtype", "attention_backend", "scan_layers", "remat_policy", "fused_qkv",
)  # fmt: skip
_TASKS = {
    ("decoder", "none"): "lm",
    ("encoder", "mlm"): "mlm",
    ("encoder", "classification"): "classification",
    ("encdec", "none"): "seq2seq",
}
_LEGACY_NAMES = (
    (re.compile(r"LayerNorm\.gamma$"), "LayerNorm.weight"),
    (re.compile(r"LayerNorm\.beta$"), "LayerNorm.bias"),
)
_HEAD_PREFIXES = ("lm_head.", "cls.", "classifier.")  # keys outside the trunk
_STACKED = re.compile(r"^(stack|encoder|decoder)/layer_(\d+)/(.*)$")
# fused_qkv's stacked kernels and the separate projections each stacks (MultiHeadAttention).
_STACKS = {"qkv": ("query", "key", "value"), "kv": ("key", "value")}
_SEPARATE_QKV = re.compile(r"^(.*/self_attention/)query/(kernel|bias)$")  # one match per leaf
_FUSED_QKV = re.compile(r"^(.*/self_attention/)(qkv|kv)/(kernel|bias)$")

__all__ = ["ARCHITECTURES", "ConversionError", "from_pretrained", "model_fields", "to_pretrained"]


def _architecture(values: Mapping[str, Any], where: str) -> Architecture:
  names = values.get("architectures") or []
  known = [n for n in names if n in ARCHITECTURES]
  if not known:
    raise ConversionError(
        f"{where}: architectures={names} is not supported; supported: " f"{sorted(ARCHITECTURES)}"
    )
  return ARCHITECTURES[known[0]]


def model_fields(
    hf_config: Mapping[str, Any], weights: Mapping[str, np.ndarray] | None = None
) -> dict[str, Any]:
  """The config.model fields of a config.json dict.

  Weights settle what only they tell (an untied head, a pooler); without them the
  config's flags decide.
  """
  arch = _architecture(hf_config, "config.json")
  return arch.read_config(HFConfig(dict(hf_config), arch.name), weights)


def _base_config() -> ml_collections.ConfigDict:
  """configs.common.base_config(): the typed schema every config fills."""
  try:  # pylint: disable=import-outside-toplevel
    from tx_jax.configs import common  # installed: configs/ ships as tx_jax.configs
  except ModuleNotFoundError:  # a checkout run without installing it
    from configs import common

  return common.base_config()


def _fill(section: ml_collections.ConfigDict, values: Mapping[str, Any]) -> None:
  """Sets fields, casting to each field's declared type (JSON has no int/float split)."""
  for key, value in values.items():
    current = section[key]
    section[key] = type(current)(value) if isinstance(current, (bool, int, float)) else value


def _stack_layers(flat: dict[str, Any]) -> dict[str, Any]:
  """Unrolled `stack/layer_{i}/...` -> scanned `stack/layers/layer/...` [L, ...]."""
  out, groups = {}, {}
  for path, value in flat.items():
    match = _STACKED.match(path)
    if match is None:
      out[path] = value
      continue
    stack, index, rest = match.groups()
    groups.setdefault(f"{stack}/layers/layer/{rest}", {})[int(index)] = value
  for path, by_index in groups.items():
    out[path] = np.stack([by_index[i] for i in range(len(by_index))])
  return out


def _fuse_qkv(flat: dict[str, Any]) -> dict[str, Any]:
  """Self-attention's query/key/value kernels [D, N, H] (biases [N, H]) -> fused_qkv's layout:
  qkv [D, 3, N, H] when key has query's heads, else query and kv [D, 2, K, H]."""
  out = dict(flat)
  for match in filter(None, map(_SEPARATE_QKV.match, flat)):
    prefix, leaf = match.groups()
    same_heads = out[f"{prefix}key/{leaf}"].shape == out[f"{prefix}query/{leaf}"].shape
    stacked = "qkv" if same_heads else "kv"
    parts = [out.pop(f"{prefix}{name}/{leaf}") for name in _STACKS[stacked]]
    out[f"{prefix}{stacked}/{leaf}"] = np.stack(parts, axis=-3)
  return out


def _split_qkv(flat: dict[str, Any]) -> dict[str, Any]:
  """The inverse of `_fuse_qkv`: the layout the HF mappings name."""
  out = {}
  for path, value in flat.items():
    match = _FUSED_QKV.match(path)
    if match is None:
      out[path] = value
      continue
    prefix, stacked, leaf = match.groups()
    for i, name in enumerate(_STACKS[stacked]):
      out[f"{prefix}{name}/{leaf}"] = np.take(np.asarray(value), i, axis=-3)
  return out


def _load_params(
    arch: Architecture,
    mc: ModelConfig,
    weights: dict[str, np.ndarray],
    where: str,
) -> dict[str, Any]:
  flat, missing, consumed = {}, [], set()
  for rule in arch.rules(mc):
    absent = [k for k in rule.hf if k not in weights]
    if absent:
      missing += absent
      continue
    consumed.update(rule.hf)
    try:
      flat.update(zip(rule.ours, rule.load([weights[k] for k in rule.hf])))
    except ValueError as e:  # a reshape: config.json's widths disagree with the tensor
      shapes = [tuple(weights[k].shape) for k in rule.hf]
      raise ConversionError(
          f"{where}: tensor {', '.join(rule.hf)} (tx_jax {', '.join(rule.ours)}) has shape "
          f"{shapes[0] if len(shapes) == 1 else shapes}, which config.json's sizes do not fit "
          f"({e})"
      ) from None
  if missing:
    raise ConversionError(
        f"{where}: the weights lack {len(missing)} tensors that "
        f"{arch.name} needs, e.g. {missing[:8]}"
    )
  copies, unexpected = arch.tied_copies(mc), []
  for key in sorted(set(weights) - consumed):
    if key in copies:
      if not equal(weights, key, copies[key]):
        raise ConversionError(
            f"{where}: {key} should be a tied copy of {copies[key]} "
            "but differs from it; tx_jax cannot untie it"
        )
    elif not any(re.search(p, key) for p in arch.ignored):
      unexpected.append(key)
  if unexpected:
    raise ConversionError(
        f"{where}: {len(unexpected)} tensors have no place in a "
        f"{arch.name} as tx_jax builds it, e.g. {unexpected[:8]}"
    )
  if mc.fused_qkv:
    flat = _fuse_qkv(flat)
  if mc.scan_layers:
    flat = _stack_layers(flat)
  expected = traverse_util.flatten_dict(models.abstract_params(mc), sep="/")
  wrong = sorted(set(expected) ^ set(flat))
  if wrong:  # a mapping bug, not a user error
    raise ConversionError(f"{where}: converted parameters do not match the model: {wrong[:8]}")
  for path, spec in expected.items():
    if flat[path].shape != spec.shape:
      raise ConversionError(
          f"{where}: parameter {path} has shape {flat[path].shape} from "
          f"the weights, the config implies {spec.shape}"
      )
  params = {
      path: jnp.asarray(np.asarray(value, dtype=spec.dtype))
      for (path, value), spec in ((item, expected[item[0]]) for item in flat.items())
  }
  return traverse_util.unflatten_dict(params, sep="/")


def from_pretrained(
    path: str | pathlib.Path, **runtime: Any
) -> tuple[ml_collections.ConfigDict, nn.Module, dict[str, Any]]:
  """(config, flax module, params) of a HuggingFace model directory.

  `config` is `configs.common.base_config()` with the model section filled (and the data
  task set to the family's); `tx_jax.workdir.from_hf_dir` adds the tokenizer and special ids. `runtime` overrides RUNTIME_FIELDS of config.model, e.g.
  dtype="bfloat16" or scan_layers=True; parameters are stored in config.model.param_dtype.
  """
  path = pathlib.Path(path)
  config_file = path / "config.json"
  if not config_file.is_file():
    raise ConversionError(f"{path} is not a HuggingFace model directory: no config.json")
  values = json.loads(config_file.read_text())
  arch = _architecture(values, str(config_file))
  weights = {}
  raw = read_weights(path)
  # Checkpoints saved from the bare trunk (the official "gpt2") lack its prefix.
  add_prefix = arch.base_prefix and not any(k.startswith(arch.base_prefix) for k in raw)
  for key, tensor in raw.items():
    for pattern, replacement in _LEGACY_NAMES:
      key = pattern.sub(replacement, key)
    if add_prefix and not key.startswith(_HEAD_PREFIXES):
      key = arch.base_prefix + key
    weights[key] = tensor
  fields = arch.read_config(HFConfig(values, arch.name), weights)
  bad = sorted(set(runtime) - set(RUNTIME_FIELDS))
  if bad:
    raise ValueError(
        f"from_pretrained overrides {bad} would change the model; only "
        f"{list(RUNTIME_FIELDS)} may be set"
    )
  config = _base_config()
  _fill(config.model, {**fields, **runtime})
  mc = ModelConfig.from_config(config.model)
  task = _TASKS.get((mc.family, mc.head))
  if task is not None:
    config.data.task = task
  module = models.build(mc)
  return config, module, _load_params(arch, mc, weights, str(path))


def architecture_for(mc: ModelConfig) -> Architecture:
  """The HF class that expresses a tx_jax model (its rules name PEFT's modules too)."""
  return _architecture_for(mc)


def stack_layers(flat: dict[str, Any]) -> dict[str, Any]:
  """Unrolled `stack/layer_{i}/...` params (flat "a/b/c") as scan_layers stacks them."""
  return _stack_layers(flat)


def _architecture_for(mc: ModelConfig) -> Architecture:
  """The HF class that expresses a tx_jax model, by family and position scheme / head."""
  if mc.family == "decoder" and mc.positions in ("learned", "rope"):
    return GPT2 if mc.positions == "learned" else LLAMA
  if mc.family == "encoder":
    return {"none": BERT_MODEL, "mlm": BERT_MLM, "classification": BERT_CLASSIFIER}[mc.head]
  if mc.family == "encdec" and mc.positions == "relative":
    return T5
  raise ConversionError(
      f"config.model.family={mc.family!r} with positions={mc.positions!r} has no HuggingFace "
      "architecture here; accepted: decoder+learned (GPT-2), decoder+rope (LLaMA), "
      "encoder (BERT), encdec+relative (T5)"
  )


def _relevant(fields: Mapping[str, Any]) -> dict[str, Any]:
  """Drops fields the family's model never reads given the others (e.g. rope_theta w/o RoPE)."""
  drop = {"init", "init_std", "fused_qkv"}  # fused_qkv: how tx_jax stores q, k, v, not what
  if fields["norm"] == "rmsnorm":
    drop.add("norm_bias")
  if fields["positions"] != "rope":
    drop.add("rope_theta")
  if fields["positions"] != "relative":
    drop.update(("relative_buckets", "relative_max_distance"))
  if fields["positions"] != "learned":
    drop.add("max_len")
  if not fields["tie_embeddings"]:
    drop.add("tied_output_rescale")
  if fields.get("head") != "classification":
    drop.add("num_classes")
  return {k: v for k, v in fields.items() if k not in drop}


def to_pretrained(
    config: ml_collections.ConfigDict | ModelConfig,
    params: Mapping[str, Any],
    path: str | pathlib.Path,
    *,
    max_shard_bytes: int = 5 * 2**30,
    hf_config: Mapping[str, Any] | None = None,
) -> Architecture:
  """Writes `params` as a HuggingFace directory (config.json + safetensors) at `path`.

  `config` is a full config (with .model) or the model section. `hf_config` adds values
  to config.json (token ids, label names); a value that would change the model is an
  error, as is any config.model field the HF architecture cannot express.
  Returns the architecture written.
  """
  if isinstance(config, ModelConfig):
    mc = config
  else:
    mc = ModelConfig.from_config(config.model if "model" in config else config)
  arch = _architecture_for(mc)
  params = models.unstack_layers(unfreeze(nn.unbox(jax.device_get(params))))  # as unrolled
  flat = _split_qkv(traverse_util.flatten_dict(params, sep="/"))
  rules = arch.rules(mc)
  values = {
      **arch.write_config(mc),
      **dict(hf_config or {}),
      "architectures": [arch.name],
      "model_type": arch.model_type,
  }
  # Check before touching tensors: does the written config load back as this model?
  # Distinct placeholders stand in for the tensors (what is present, nothing tied).
  names = {k: np.full(1, i) for i, k in enumerate(k for r in rules for k in r.hf)}
  back = _relevant(arch.read_config(HFConfig(values, arch.name), names))
  differ = {k: (getattr(mc, k), v) for k, v in back.items() if getattr(mc, k) != v}
  if differ:
    raise ConversionError(
        f"{arch.name} cannot express this model: "
        + "; ".join(
            f"config.model.{k}={ours!r} would load back as {theirs!r}"
            for k, (ours, theirs) in sorted(differ.items())
        )
    )
  tensors, used, missing = {}, set(), []
  for rule in rules:
    absent = [p for p in rule.ours if p not in flat]
    if absent:
      missing += absent
      continue
    used.update(rule.ours)
    tensors.update(zip(rule.hf, rule.save([np.asarray(flat[p]) for p in rule.ours])))
  if missing:
    raise ConversionError(f"params lack {missing[:8]} that {arch.name} needs")
  unused = sorted(set(flat) - used)
  if unused:
    raise ConversionError(f"params {unused[:8]} have no place in {arch.name}")
  dtypes = {str(t.dtype) for t in tensors.values()}
  values["dtype"] = dtypes.pop() if len(dtypes) == 1 else "float32"
  path = pathlib.Path(path)
  path.mkdir(parents=True, exist_ok=True)
  write_weights(path, tensors, max_shard_bytes)
  (path / "config.json").write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")
  return arch
