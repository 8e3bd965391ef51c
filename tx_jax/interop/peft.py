"""LoRA adapters <-> HuggingFace PEFT adapter directories (adapter_config.json +
adapter_model.safetensors), for the decoders `tx_jax.hf` converts (GPT-2, LLaMA).

Module names come from the architecture's own weight rules (interop/decoders.py): a rule
that maps HF "x.y.weight" to our "a/b/kernel" maps PEFT's LoRA on module "x.y" to our
adapters on "a/b", so there is no second name table. PEFT's lora_A is a Linear [r, in] and
lora_B [out, r] whatever the base layer (GPT-2's Conv1D too), with `in` and `out` flattened
in the order our kernels' dims flatten (heads-major N*H, and q|k|v for GPT-2's c_attn), so
A = a.reshape(-1, r).T and B = b.reshape(r, -1).T for every module.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from tx_jax.interop.architecture import Architecture
from tx_jax.interop.rules import ConversionError
from tx_jax.layers import lora as lora_lib
from tx_jax.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# A stacked kernel of model.fused_qkv and the separate projections it holds, in order.
_STACKS = {"qkv": ("query", "key", "value"), "kv": ("key", "value")}
# Our module name -> the logical target that selects it (layers/lora.py).
_LOGICAL = {m: t for t, ms in lora_lib.LOGICAL_TARGETS.items() for m in ms}
# PEFT options that change what an adapter computes; tx_jax implements their defaults only.
_UNSUPPORTED = {
    "use_rslora": False, "use_dora": False, "rank_pattern": {}, "alpha_pattern": {},
    "layers_to_transform": None, "bias": "none", "modules_to_save": None,
}  # fmt: skip


def _modules(arch: Architecture, mc: ModelConfig) -> dict[str, tuple[str, int, int]]:
  """Our unrolled, unfused module path -> (PEFT module name, part, parts) from the rules.

  `parts` > 1 where one HF weight holds several of our projections (GPT-2's c_attn).
  """
  plain = dataclasses.replace(mc, fused_qkv=False, scan_layers=False)
  out = {}
  for rule in arch.rules(plain):
    kernels = [p for p in rule.ours if p.endswith("/kernel")]
    if len(rule.hf) != 1 or not rule.hf[0].endswith(".weight") or len(kernels) != len(rule.ours):
      continue
    for part, path in enumerate(kernels):
      out[path[: -len("/kernel")]] = (rule.hf[0][: -len(".weight")], part, len(kernels))
  return out


def _stack_parts(module: str) -> list[str]:
  """A fused "…/qkv" or "…/kv" module's separate projections; [module] otherwise."""
  head, _, name = module.rpartition("/")
  return [f"{head}/{p}" for p in _STACKS[name]] if name in _STACKS else [module]


def to_peft(
    mc: ModelConfig, arch: Architecture, params: dict[str, np.ndarray], out: str | pathlib.Path,
    base_model: str | None = None,
) -> list[str]:
  """Writes the adapters of `params` (flat "a/b/c" arrays, layers unrolled) as a PEFT
  directory. Returns the PEFT module names written."""
  if not mc.lora.enabled:
    raise ConversionError("the workdir has no LoRA adapters (config.model.lora.rank=0)")
  if mc.lora.also_train:
    raise ConversionError(
        f"config.model.lora.also_train={list(mc.lora.also_train)} trained base params that a "
        "PEFT LoRA adapter does not hold; export the whole model with --to_hf --merge"
    )
  names, r = _modules(arch, mc), mc.lora.rank
  tensors = {}
  for module in sorted({k.rsplit("/", 1)[0] for k in params if k.endswith("/lora_a")}):
    a, b = np.asarray(params[module + "/lora_a"]), np.asarray(params[module + "/lora_b"])
    parts = _stack_parts(module)
    if parts[0] not in names:
      raise ConversionError(f"{arch.name} has no PEFT module for the adapter on {module}")
    hf, _, count = names[parts[0]]
    if len(parts) == count:  # one HF weight for the whole (stacked) kernel: c_attn
      b_parts = [b]
    elif count == 1:  # a stacked kernel of separate HF weights: A shared, B split
      b_parts = [b[:, i] for i in range(len(parts))]
    else:
      raise ConversionError(
          f"the adapter on {module} covers part of {arch.name}'s {hf}, which PEFT adapts as one "
          "module; train with model.fused_qkv=True and lora.targets=('qkv',)"
      )
    for part, b_part in zip(parts, b_parts):
      hf = names[part][0]
      tensors[f"{_PREFIX}{hf}.lora_A.weight"] = np.ascontiguousarray(a.reshape(-1, r).T)
      tensors[f"{_PREFIX}{hf}.lora_B.weight"] = np.ascontiguousarray(b_part.reshape(r, -1).T)
  modules = sorted({k[len(_PREFIX) : -len(".lora_A.weight")] for k in tensors if "lora_A" in k})
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
  config = {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "base_model_name_or_path": base_model,
      "r": r,
      "lora_alpha": mc.lora.alpha,
      "lora_dropout": mc.lora.dropout,
      "target_modules": modules,  # full names: PEFT adapts exactly these
      "fan_in_fan_out": arch.name == "GPT2LMHeadModel",  # GPT-2's Conv1D stores [in, out]
      "init_lora_weights": True,
      "inference_mode": True,
      **_UNSUPPORTED,
  }
  (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  return modules


def read_config(path: str | pathlib.Path) -> dict[str, Any]:
  """adapter_config.json of a PEFT LoRA directory, refusing options tx_jax does not compute."""
  path = pathlib.Path(path)
  file = path / CONFIG_FILE
  if not file.is_file():
    raise ConversionError(f"--from_peft={path}: no {CONFIG_FILE}; give a PEFT adapter directory")
  try:
    values = json.loads(file.read_text())
  except json.JSONDecodeError as e:
    raise ConversionError(f"{file} is not valid JSON: {e}") from e
  if values.get("peft_type") != "LORA":
    raise ConversionError(f"{file}: peft_type={values.get('peft_type')!r}; only 'LORA' is read")
  for key, default in _UNSUPPORTED.items():
    if values.get(key, default) not in (default, None, {}, False, []):
      raise ConversionError(
          f"{file}: {key}={values[key]!r} is not implemented here; accepted: {default!r}"
      )
  return values


def from_peft(
    mc: ModelConfig, arch: Architecture, path: str | pathlib.Path
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """(config.model.lora fields, flat unrolled adapter params) of a PEFT directory for the
  base `mc` (no adapters, layers unrolled; fused_qkv as the model stores q, k, v)."""
  path = pathlib.Path(path)
  values = read_config(path)
  file = path / WEIGHTS_FILE
  if not file.is_file():
    raise ConversionError(f"--from_peft={path}: no {WEIGHTS_FILE} (only safetensors are read)")
  try:
    with safe_open(str(file), framework="numpy") as f:
      tensors = {k: f.get_tensor(k) for k in f.keys()}
  except (SafetensorError, OSError) as e:
    raise ConversionError(f"{file}: not a readable safetensors file ({e})") from e
  r = int(values["r"])
  names = _modules(arch, mc)
  ours_of = {}  # PEFT module -> our separate modules, in part order
  for module, (hf, part, _) in sorted(names.items(), key=lambda kv: kv[1][1]):
    ours_of.setdefault(hf, []).append(module)
  shapes = _kernel_shapes(mc)
  adapters: dict[str, np.ndarray] = {}
  for key in sorted(tensors):
    if not key.endswith(".lora_A.weight"):
      continue
    hf = key[len(_PREFIX) : -len(".lora_A.weight")] if key.startswith(_PREFIX) else None
    if hf not in ours_of:
      raise ConversionError(
          f"{file}: {key} adapts no module of this {arch.name} (e.g. {sorted(ours_of)[:3]}); "
          "is it an adapter for another architecture?"
      )
    a_hf, b_hf = tensors[key], tensors[key.replace("lora_A", "lora_B")]
    modules = ours_of[hf]
    in_shape = shapes[modules[0]][0]
    out_shapes = [shapes[m][1] for m in modules]
    want_a, want_b = (r, int(np.prod(in_shape))), (sum(int(np.prod(s)) for s in out_shapes), r)
    if a_hf.shape != want_a or b_hf.shape != want_b:
      raise ConversionError(
          f"{file}: {hf} has lora_A {a_hf.shape} and lora_B {b_hf.shape}; this {arch.name} "
          f"with r={r} needs {want_a} and {want_b} (an adapter for a model of another shape?)"
      )
    a = a_hf.T.reshape(in_shape + (r,))
    bounds = np.cumsum([0] + [int(np.prod(s)) for s in out_shapes])
    for i, module in enumerate(modules):
      adapters[module + "/lora_a"] = a
      adapters[module + "/lora_b"] = b_hf[bounds[i] : bounds[i + 1]].T.reshape((r,) + out_shapes[i])
  if not adapters:
    raise ConversionError(f"{file} holds no lora_A / lora_B weights")
  adapters = _fuse(mc, adapters)
  lora = {
      "rank": r,
      "alpha": float(values.get("lora_alpha", 8)),
      "dropout": float(values.get("lora_dropout", 0.0)),
      "targets": _targets(mc, adapters),
  }
  return lora, adapters


def _kernel_shapes(mc: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
  """Our unfused module path -> (input dims, output dims) of its kernel, read off the shapes
  of rank-1 adapters on every projection (A [*in, 1], B [1, *out])."""
  from tx_jax import models  # pylint: disable=import-outside-toplevel

  probe = lora_lib.LoraSpec(rank=1, targets=(".",))
  plain = dataclasses.replace(mc, fused_qkv=False, scan_layers=False, lora=probe)
  flat = _flatten(models.abstract_params(plain))
  return {
      path[: -len("/lora_a")]: (tuple(leaf.shape[:-1]), tuple(flat[path[:-1] + "b"].shape[1:]))
      for path, leaf in flat.items()
      if path.endswith("/lora_a")
  }


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  if not isinstance(tree, dict):
    return {prefix: tree}
  out = {}
  for k, v in tree.items():
    out.update(_flatten(v, f"{prefix}/{k}" if prefix else k))
  return out


def _fuse(mc: ModelConfig, adapters: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Separate q/k/v adapters as the fused "qkv" / "kv" kernels' adapters, when the model
  stacks them (A must then be one matrix for all parts, as on GPT-2's c_attn)."""
  if not mc.fused_qkv:
    return adapters
  stack = "qkv" if mc.num_kv_heads == mc.num_heads else "kv"
  out = dict(adapters)
  heads = {
      k.rsplit("/", 2)[0] for k in adapters if k.rsplit("/", 2)[-2] in _STACKS[stack]
  }
  for head in sorted(heads):
    parts = [f"{head}/{p}" for p in _STACKS[stack]]
    if not all(p + "/lora_a" in adapters for p in parts):
      raise ConversionError(
          f"the model stacks {_STACKS[stack]} in one kernel ({head}/{stack}) but the adapter "
          f"covers only some of them; convert with model.fused_qkv=False"
      )
    a = adapters[parts[0] + "/lora_a"]
    if not all(np.array_equal(adapters[p + "/lora_a"], a) for p in parts):
      raise ConversionError(
          f"{head}/{stack} stacks {_STACKS[stack]}, whose adapters differ in A; convert with "
          "model.fused_qkv=False"
      )
    for p in parts:
      del out[p + "/lora_a"], out[p + "/lora_b"]
    out[f"{head}/{stack}/lora_a"] = a
    out[f"{head}/{stack}/lora_b"] = np.stack([adapters[p + "/lora_b"] for p in parts], axis=1)
  return out


def _targets(mc: ModelConfig, adapters: dict[str, np.ndarray]) -> tuple[str, ...]:
  """config.model.lora.targets selecting exactly the adapted modules: logical names when
  every layer has the same ones, else one anchored path regex per module."""
  modules = sorted({k.rsplit("/", 1)[0] for k in adapters})
  by_name = {}
  for m in modules:
    by_name.setdefault(m.rsplit("/", 1)[-1], []).append(m)
  layers = {m.split("/")[1] for m in modules if m.startswith("stack/layer_")}
  uniform = all(
      len(ms) == mc.num_layers or ms == ["lm_head"] for ms in by_name.values()
  ) and (not layers or len(layers) == mc.num_layers)
  if uniform and all(n in _LOGICAL for n in by_name):
    return tuple(sorted({_LOGICAL[n] if n not in ("qkv", "kv") else "qkv" for n in by_name}))
  return tuple(f"^{m}$" for m in modules)
