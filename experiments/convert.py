r"""Convert between HuggingFace model directories, PEFT adapters and tx_jax trainer workdirs.

  python -m experiments.convert --from_hf DIR --workdir OUT [--config=configs/gpt.py:gpt2-small]
  python -m experiments.convert --from_hf DIR --from_peft ADAPTER --workdir OUT
  python -m experiments.convert --to_hf OUT_HF --workdir OUT [--merge]
  python -m experiments.convert --to_peft OUT_ADAPTER --workdir OUT

--from_hf writes OUT/config.json and a step-0 Orbax checkpoint (state + a fresh data
iterator) under OUT/checkpoints, so experiments.train and experiments.decode resume from
it. The config is configs/common.py's base config, or --config's (its training and data
sections, and its model.lora: a LoRA config puts fresh adapters on the converted base); the
model section, the tokenizer (files copied to OUT/tokenizer/) and the special ids
(config.data.bos_id / eos_id / pad_id / decoder_start_id) come from DIR. --from_peft adds a
HuggingFace PEFT LoRA adapter trained on DIR (its rank, alpha and modules replace
--config's model.lora). --to_hf writes the newest checkpoint of OUT as config.json +
safetensors + tokenizer files that transformers' from_pretrained and AutoTokenizer load; a
LoRA workdir needs --merge, which folds the adapters into the weights. --to_peft writes a LoRA
workdir's adapters as a PEFT directory (PeftModel.from_pretrained(base, OUT_ADAPTER)).
"""

import pathlib

from absl import app
from absl import flags
from ml_collections import config_flags

from tx_jax import cli

_FROM_HF = flags.DEFINE_string("from_hf", None, "HuggingFace model directory to read.")
_FROM_PEFT = flags.DEFINE_string("from_peft", None, "PEFT LoRA adapter for --from_hf's model.")
_TO_HF = flags.DEFINE_string("to_hf", None, "HuggingFace model directory to write.")
_TO_PEFT = flags.DEFINE_string("to_peft", None, "PEFT adapter directory to write.")
_MERGE = flags.DEFINE_bool("merge", False, "--to_hf: fold a LoRA workdir's adapters in.")
_WORKDIR = flags.DEFINE_string("workdir", None, "tx_jax trainer workdir.", required=True)
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Config file[:preset] whose non-model sections (and model.lora) --from_hf uses.",
    lock_config=False,
)


def _check_flags() -> None:
  directions = [f for f in (_FROM_HF, _TO_HF, _TO_PEFT) if f.value is not None]
  if len(directions) != 1:
    raise app.UsageError("give exactly one of --from_hf DIR, --to_hf OUT_HF or --to_peft OUT")
  if _FROM_PEFT.value is not None and _FROM_HF.value is None:
    raise app.UsageError("--from_peft needs --from_hf: the base model the adapter was trained on")
  if _MERGE.value and _TO_HF.value is None:
    raise app.UsageError("--merge goes with --to_hf OUT_HF")


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  _check_flags()
  from tx_jax import validation, workdir as wd  # pylint: disable=g-import-not-at-top

  workdir = pathlib.Path(_WORKDIR.value)
  if _FROM_HF.value:
    source = pathlib.Path(_FROM_HF.value)
    if not (source / "config.json").is_file():
      raise FileNotFoundError(f"--from_hf={source}: no config.json; give a HuggingFace model dir")
    validation.read_json(source / "config.json", "a HuggingFace config")
    if (workdir / "checkpoints").is_dir() and any((workdir / "checkpoints").iterdir()):
      raise ValueError(f"--workdir={workdir} already holds checkpoints; choose an empty --workdir")
    where = wd.import_hf(
        source, workdir, _CONFIG.value, check=validation.train_config, peft_dir=_FROM_PEFT.value
    )
    print(f"wrote {workdir}/config.json and step 0 under {where}")
    return 0
  if not (workdir / "config.json").is_file():
    raise FileNotFoundError(f"--workdir={workdir}: no config.json; give a tx_jax workdir")
  validation.read_json(workdir / "config.json", "the workdir's config")
  if _TO_PEFT.value:
    modules, step = wd.export_peft(workdir, _TO_PEFT.value)
    print(f"wrote the LoRA adapters of step {step} ({len(modules)} modules) to {_TO_PEFT.value}")
  else:
    arch, step = wd.export_hf(workdir, _TO_HF.value, merge=_MERGE.value)
    print(f"wrote step {step} of {workdir} as {arch.name} to {_TO_HF.value}")
  return 0


if __name__ == "__main__":
  cli.run(main)
