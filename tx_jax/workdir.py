"""One place that reads and writes a workdir: config.json, params, tokenizer, special ids.

A trainer workdir holds `config.json` (the resolved config) and Orbax checkpoints under
`checkpoints/`; a converted HuggingFace model is a step-0 workdir whose tokenizer files sit
under `tokenizer/` and whose special ids are recorded in `config.data`. An HF model
directory (config.json naming `architectures`) is read through `tx_jax.hf` and gets the same
data fields, so decoding a converted workdir and decoding its HF source use the same ids.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
from flax import traverse_util

from tx_jax import checkpoint, checkpoint_params, hf, lora, models
from tx_jax.interop import peft
from tx_jax.data import hf_tokenizer, tokenizers

CONFIG_FILE = "config.json"
CHECKPOINTS = "checkpoints"
TOKENIZER_DIR = "tokenizer"  # a converted model's tokenizer files, inside the workdir
# Tokenizer files of an HF directory that transformers' AutoTokenizer reads.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "spiece.model",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
# config.data special-id fields <- the HF config.json keys that hold them.
HF_ID_KEYS = {
    "bos_id": "bos_token_id",
    "eos_id": "eos_token_id",
    "pad_id": "pad_token_id",
    "decoder_start_id": "decoder_start_token_id",
}


@dataclasses.dataclass(frozen=True)
class SpecialIds:
  """The ids decoding needs; None where the model has none (no EOS: decode to the limit)."""

  bos: int | None
  eos: int | None
  pad: int | None
  decoder_start: int | None


# --- config.json ----------------------------------------------------------------------


def _fill(schema: ml_collections.ConfigDict, values: Mapping[str, Any], where: str) -> None:
  """Sets every JSON value on the schema, keeping each field's declared type."""
  for key, value in values.items():
    if key not in schema:
      raise ValueError(
          f"{where}.{key} in config.json is not a config field; accepted: "
          f"{sorted(schema.keys())}"
      )
    current = schema[key]
    if isinstance(current, ml_collections.ConfigDict):
      _fill(current, value, f"{where}.{key}")
    elif isinstance(current, tuple) and isinstance(value, list):
      schema[key] = tuple(value)  # JSON has no tuples
    elif isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
      schema[key] = float(value)  # JSON writes 1.0 as 1
    else:
      schema[key] = value


def _base_config() -> ml_collections.ConfigDict:
  try:  # pylint: disable=import-outside-toplevel
    from tx_jax.configs import common  # installed: configs/ ships as tx_jax.configs
  except ModuleNotFoundError:  # a checkout run without installing it
    from configs import common

  return common.base_config()


def _json(path: pathlib.Path) -> dict[str, Any]:
  file = path / CONFIG_FILE
  if not file.is_file():
    raise FileNotFoundError(
        f"no {CONFIG_FILE} in {str(path)!r}; accepted: a directory written by experiments.train "
        "or experiments.convert, or a HuggingFace model directory"
    )
  try:
    return json.loads(file.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{file} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")


def is_hf_dir(path: str | pathlib.Path) -> bool:
  """Whether `path` is a HuggingFace model directory (its config.json names architectures)."""
  return "architectures" in _json(pathlib.Path(path))


def read_config(path: str | pathlib.Path) -> ml_collections.ConfigDict:
  """The typed config of a workdir: its config.json filled into configs.common's schema."""
  config = _base_config()
  _fill(config, _json(pathlib.Path(path)), "config")
  return config


def write_config(config: ml_collections.ConfigDict, path: str | pathlib.Path) -> None:
  """Writes the resolved config as `path`/config.json."""
  pathlib.Path(path, CONFIG_FILE).write_text(config.to_json_best_effort(indent=2) + "\n")


# --- tokenizer and special ids ---------------------------------------------------------


def _first(value: Any) -> int | None:
  """An HF id field: an int, a list of ints (LLaMA-3's several EOS: the first), or null."""
  if isinstance(value, list):
    value = value[0] if value else None
  return value if isinstance(value, int) else None


def hf_data_fields(hf_dir: str | pathlib.Path, family: str) -> dict[str, Any]:
  """config.data fields that an HF directory defines: its tokenizer and its special ids."""
  hf_dir = pathlib.Path(hf_dir).absolute()
  values = _json(hf_dir)
  fields: dict[str, Any] = {k: _first(values.get(hf_key)) for k, hf_key in HF_ID_KEYS.items()}
  if family != "encdec":
    fields["decoder_start_id"] = None
  fields.update(tokenizer="none", tokenizer_path="", spm_model_path="", num_sentinels=0)
  if (hf_dir / hf_tokenizer.TOKENIZER_FILE).is_file():
    fields.update(tokenizer="hf", tokenizer_path=str(hf_dir))
  elif family == "encdec" and (hf_dir / "spiece.model").is_file():
    # T5's SentencePiece vocabulary (pad 0, eos 1, unk 2) + its <extra_id_k> on top.
    side = hf_dir / "tokenizer_config.json"
    extra = json.loads(side.read_text()).get("extra_ids", 100) if side.is_file() else 100
    fields.update(
        tokenizer="sentencepiece", spm_model_path=str(hf_dir / "spiece.model"), num_sentinels=extra
    )
  return fields


def build_tokenizer(config: ml_collections.ConfigDict) -> tokenizers.Tokenizer | None:
  """The workdir's tokenizer, or None for a model that came without one (ids only).

  Its ids must fit config.model.vocab_size; an error names both numbers.
  """
  if config.data.tokenizer == "none":
    return None
  tok = tokenizers.build_tokenizer(config.data)
  tokenizers.check_fits(tok, config.model.vocab_size, with_sentinels=False)
  return tok


def special_ids(
    config: ml_collections.ConfigDict, tokenizer: tokenizers.Tokenizer | None
) -> SpecialIds:
  """The ids config.data records (a converted model's), else the tokenizer's own."""
  d = config.data

  def pick(field: str, own: Any) -> int | None:
    return d[field] if d[field] is not None else own

  if tokenizer is None:
    return SpecialIds(d.bos_id, d.eos_id, d.pad_id, d.decoder_start_id)
  return SpecialIds(
      bos=pick("bos_id", tokenizer.bos_id),
      eos=pick("eos_id", tokenizer.eos_id),
      pad=pick("pad_id", getattr(tokenizer, "hf_pad_id", tokenizer.pad_id)),
      decoder_start=pick("decoder_start_id", tokenizer.decoder_start_id),
  )


def copy_tokenizer_files(source: str | pathlib.Path, target: str | pathlib.Path) -> list[str]:
  """Copies an HF directory's tokenizer files (TOKENIZER_FILES) into `target`; their names."""
  source, target = pathlib.Path(source), pathlib.Path(target)
  names = [n for n in TOKENIZER_FILES if (source / n).is_file()]
  if names:
    target.mkdir(parents=True, exist_ok=True)
  for name in names:
    shutil.copyfile(source / name, target / name)
  return names


# --- params ----------------------------------------------------------------------------


def _abstract_params(model_cfg: Any) -> Any:
  """Shapes and dtypes of the model's params, each placed on the first device."""
  shapes = models.abstract_params(model_cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)


def restore_params(
    path: str | pathlib.Path, model_cfg: Any, step: int | None = None
) -> tuple[Any, int]:
  """(params, step) of a workdir's checkpoint (the newest by default); optimizer state unread.

  A LoRA workdir's frozen params come from its frozen base (tx_jax.frozen_base).
  """
  return checkpoint_params.restore_params(
      pathlib.Path(path) / CHECKPOINTS, _abstract_params(model_cfg), step, model_cfg.lora
  )


def save_step0(
    config: ml_collections.ConfigDict,
    params: Any,
    path: str | pathlib.Path,
    data_iter: Any = None,
) -> pathlib.Path:
  """Writes config.json and a step-0 TrainState checkpoint, as experiments.train would.

  The optimizer state is freshly initialised from config.optimizer. `data_iter` (a fresh
  `tx_jax.data.build_train_iterator(config)`) is saved with it, because the trainer resumes
  the data iterator together with the state. Refuses a workdir that already holds
  checkpoints. Returns the checkpoint directory.
  """
  from tx_jax.train import optimizers, state  # pylint: disable=import-outside-toplevel

  path = pathlib.Path(path)
  manager = checkpoint.Checkpointer(path / CHECKPOINTS, config.checkpoint, config.model)
  try:
    if manager.latest_step() is not None:
      raise hf.ConversionError(
          f"{path} already holds checkpoints (latest step {manager.latest_step()}); "
          "choose an empty --workdir"
      )
    write_config(config, path)
    tx, _ = optimizers.build_optimizer(config)
    manager.save(0, state.make_init_fn(lambda _: params, tx, config.seed)(), data_iter)
  finally:
    manager.close()
  return manager.directory


def from_hf_dir(
    hf_dir: str | pathlib.Path, **runtime: Any
) -> tuple[ml_collections.ConfigDict, Any, Any]:
  """(config, module, params) of an HF directory, config.data holding its tokenizer and ids."""
  config, module, params = hf.from_pretrained(hf_dir, **runtime)
  config.data.update(hf_data_fields(hf_dir, config.model.family))
  return config, module, params


def load(path: str | pathlib.Path, step: int | None = None) -> tuple[Any, Any, int | None]:
  """(config, params, step) of a trainer workdir or an HF directory (step None there)."""
  if is_hf_dir(path):
    config, _, params = from_hf_dir(path)
    return config, params, None
  config = read_config(path)
  params, step = restore_params(path, config.model, step)
  return config, params, step


# --- conversion ------------------------------------------------------------------------


def import_hf(
    hf_dir: str | pathlib.Path,
    path: str | pathlib.Path,
    base: ml_collections.ConfigDict | None = None,
    check: Any = None,
    peft_dir: str | pathlib.Path | None = None,
) -> pathlib.Path:
  """An HF directory -> a step-0 workdir keeping its tokenizer files and special ids.

  `base` supplies the training and data sections (default: configs.common's); the model,
  the tokenizer and the special ids always come from the HF directory. `check(config)`
  (e.g. `tx_jax.validation.train_config`) runs on a `base` config before anything is
  written. Returns the checkpoint directory.
  """
  from tx_jax import data  # pylint: disable=import-outside-toplevel

  config, _, params = from_hf_dir(hf_dir)
  adapters = None
  if peft_dir is not None:  # the adapter's LoRA settings replace the config's
    lora_fields, adapters = _read_peft(config, hf_dir, peft_dir)
    (base or config).model.lora.update(lora_fields)
  if base is not None:
    run_lora = base.model.lora.to_dict()  # LoRA is the run's choice, not the HF model's
    base.model = config.model
    base.model.lora.update(run_lora)
    base.data.update(hf_data_fields(hf_dir, config.model.family))
    config = base
    if check is not None:
      check(config)  # the preset's data and training must fit the HF model
  # PEFT names an adapter's base by the path it was loaded from; _read_peft compares its name.
  config.converted_from = str(pathlib.Path(hf_dir).absolute())
  path = pathlib.Path(path).absolute()
  if (path / CHECKPOINTS).is_dir() and any((path / CHECKPOINTS).iterdir()):
    # Checked before the tokenizer files are copied over the workdir's own.
    raise hf.ConversionError(f"{path} already holds checkpoints; choose an empty --workdir")
  if copy_tokenizer_files(hf_dir, path / TOKENIZER_DIR):
    if config.data.tokenizer == "hf":
      config.data.tokenizer_path = str(path / TOKENIZER_DIR)
    elif config.data.tokenizer == "sentencepiece":
      config.data.spm_model_path = str(path / TOKENIZER_DIR / "spiece.model")
  iterator = data.build_train_iterator(config) if config.data.tokenizer != "none" else None
  if adapters is not None:
    params = _with_adapters(config.model, params, adapters)
  elif config.model.lora.rank > 0:
    params = lora.attach(config.model, params, config.seed)
  return save_step0(config, params, path, iterator)


def _read_peft(config, hf_dir, peft_dir) -> tuple[dict[str, Any], dict[str, Any]]:
  """(config.model.lora fields, flat unrolled adapters) of a PEFT directory for the HF base."""
  values = peft.read_config(peft_dir)
  recorded = values.get("base_model_name_or_path")
  if recorded and pathlib.PurePath(recorded).name != pathlib.Path(hf_dir).absolute().name:
    raise hf.ConversionError(
        f"--from_peft={peft_dir} was trained on base_model_name_or_path={recorded!r}, not on "
        f"--from_hf={hf_dir}; give the base it names"
    )
  mc = lora.base_config(config.model)
  return peft.from_peft(mc, hf.architecture_for(mc), peft_dir)


def _with_adapters(model_cfg: Any, params: Any, adapters: dict[str, Any]) -> Any:
  """The base params plus adapters read from PEFT (unrolled), stacked as the model scans."""
  mc = models.ModelConfig.from_config(model_cfg)
  lora.check_targets(mc)
  flat = traverse_util.flatten_dict(params, sep="/")
  flat.update({k: jnp.asarray(v, mc.storage_dtype) for k, v in adapters.items()})
  if mc.scan_layers:
    flat = hf.stack_layers(flat)
  shapes = traverse_util.flatten_dict(models.abstract_params(mc), sep="/")
  if set(shapes) != set(flat):
    raise hf.ConversionError(
        f"the PEFT adapters do not fit this model: {sorted(set(shapes) ^ set(flat))[:4]}"
    )
  return traverse_util.unflatten_dict(flat, sep="/")


def export_peft(
    path: str | pathlib.Path, out: str | pathlib.Path, step: int | None = None
) -> tuple[list[str], int]:
  """A LoRA workdir's adapters as a PEFT directory; (PEFT modules written, the step)."""
  config, params, step = load(path, step)
  mc = models.ModelConfig.from_config(config.model)
  if not mc.lora.enabled:
    raise hf.ConversionError(f"{path} has no LoRA adapters (config.model.lora.rank=0)")
  params = models.unstack_layers(nn.unbox(jax.device_get(params)))
  flat = traverse_util.flatten_dict(params, sep="/")
  base = config.converted_from or None  # None: a base initialised here has no HF name
  return peft.to_peft(mc, hf.architecture_for(mc), flat, out, base_model=base), step


def _tokenizer_source(config: ml_collections.ConfigDict) -> pathlib.Path | None:
  """The folder holding the workdir's tokenizer files, if it has an HF-loadable tokenizer."""
  d = config.data
  if d.tokenizer == "hf":
    return hf_tokenizer.tokenizer_file(d.tokenizer_path).parent
  if d.tokenizer == "sentencepiece" and pathlib.Path(d.spm_model_path).name == "spiece.model":
    return pathlib.Path(d.spm_model_path).parent
  return None


def export_hf(
    path: str | pathlib.Path, out: str | pathlib.Path, step: int | None = None, merge: bool = False
) -> tuple[Any, int]:
  """A workdir's checkpoint -> an HF directory with its special ids and tokenizer files.

  A LoRA workdir needs `merge`: the adapters folded into the weights, which transformers
  then loads without PEFT.

  Returns (the architecture written, the step exported).
  """
  config, params, step = load(path, step)
  tok = build_tokenizer(config)
  ids = special_ids(config, tok)
  start = ids.decoder_start if config.model.family == "encdec" else None
  hf_config = {
      hf_key: value
      for hf_key, value in (
          ("bos_token_id", ids.bos),
          ("eos_token_id", ids.eos),
          ("pad_token_id", ids.pad),
          ("decoder_start_token_id", start),
      )
      if value is not None
  }
  model = config
  if config.model.lora.rank > 0:
    if not merge:
      raise hf.ConversionError(
          f"{path} holds LoRA adapters (config.model.lora.rank={config.model.lora.rank}): add "
          "--merge to fold them into the weights, or write them with --to_peft"
      )
    model, params = lora.merge(config.model, params)
  arch = hf.to_pretrained(model, params, out, hf_config=hf_config)
  source = _tokenizer_source(config)
  if source is not None:
    copied = copy_tokenizer_files(source, out)
    if "tokenizer_config.json" not in copied and isinstance(tok, hf_tokenizer.HFTokenizer):
      _write_tokenizer_config(tok, ids, pathlib.Path(out))
  return arch, step


def _write_tokenizer_config(tok: Any, ids: SpecialIds, out: pathlib.Path) -> None:
  """Names the special tokens for transformers' AutoTokenizer (a bare tokenizer.json has none)."""
  roles = {"bos_token": ids.bos, "eos_token": ids.eos, "pad_token": ids.pad}
  roles["mask_token"] = tok.mask_id
  values = {"tokenizer_class": "PreTrainedTokenizerFast"}
  values.update({k: tok.token(i) for k, i in roles.items() if i is not None and tok.token(i)})
  (out / "tokenizer_config.json").write_text(json.dumps(values, indent=2) + "\n")
