r"""Convert between HuggingFace model directories and tx_jax trainer workdirs.

  python -m experiments.convert --from_hf DIR --workdir OUT [--config=configs/gpt.py:gpt2-small]
  python -m experiments.convert --to_hf OUT_HF --workdir OUT

--from_hf writes OUT/config.json and a step-0 Orbax checkpoint (state + a fresh data
iterator) under OUT/checkpoints, so experiments.train and experiments.decode resume from
it. The config is configs/common.py's base config, or --config's (its training and data
sections), with the model section taken from DIR. --to_hf writes the newest checkpoint of OUT as
config.json + safetensors that transformers' from_pretrained loads.
"""

import pathlib

from absl import app
from absl import flags
from ml_collections import config_flags

from tx_jax import cli

_FROM_HF = flags.DEFINE_string("from_hf", None, "HuggingFace model directory to read.")
_TO_HF = flags.DEFINE_string("to_hf", None, "HuggingFace model directory to write.")
_WORKDIR = flags.DEFINE_string("workdir", None, "tx_jax trainer workdir.", required=True)
_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Config file[:preset] whose non-model sections --from_hf uses.",
    lock_config=False,
)


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if (_FROM_HF.value is None) == (_TO_HF.value is None):
    raise app.UsageError("give exactly one of --from_hf DIR or --to_hf OUT_HF")
  from tx_jax import hf, validation  # pylint: disable=g-import-not-at-top

  workdir = pathlib.Path(_WORKDIR.value)
  if _FROM_HF.value:
    source = pathlib.Path(_FROM_HF.value)
    if not (source / "config.json").is_file():
      raise FileNotFoundError(f"--from_hf={source}: no config.json; give a HuggingFace model dir")
    validation.read_json(source / "config.json", "a HuggingFace config")
    if (workdir / "checkpoints").is_dir() and any((workdir / "checkpoints").iterdir()):
      raise ValueError(f"--workdir={workdir} already holds checkpoints; choose an empty --workdir")
    config, _, params = hf.from_pretrained(source)
    if _CONFIG.value is not None:
      model, config = config.model, _CONFIG.value
      config.model = model
      validation.train_config(config)  # the preset's data and training must fit the HF model
    from tx_jax import data  # pylint: disable=g-import-not-at-top

    # The trainer restores the data iterator with the state: save a fresh one.
    where = hf.save_to_workdir(config, params, workdir, data.build_train_iterator(config))
    print(f"wrote {workdir}/config.json and step 0 under {where}")
  else:
    if not (workdir / "config.json").is_file():
      raise FileNotFoundError(f"--workdir={workdir}: no config.json; give a tx_jax workdir")
    validation.read_json(workdir / "config.json", "the workdir's config")
    config, params, step = hf.load_from_workdir(workdir)
    arch = hf.to_pretrained(config, params, _TO_HF.value)
    print(f"wrote step {step} of {workdir} as {arch.name} to {_TO_HF.value}")
  return 0


if __name__ == "__main__":
  cli.run(main)
