r"""Convert between HuggingFace model directories and tx_jax trainer workdirs.

  python -m experiments.convert --from_hf DIR --workdir OUT [--config=configs/gpt.py:gpt2-small]
  python -m experiments.convert --to_hf OUT_HF --workdir OUT

--from_hf writes OUT/config.json and a step-0 Orbax checkpoint (state + a fresh data
iterator) under OUT/checkpoints, so experiments.train and experiments.decode resume from
it. The config is configs/common.py's base config, or --config's (its training and data
sections); the model section, the tokenizer (files copied to OUT/tokenizer/) and the special
ids (config.data.bos_id / eos_id / pad_id / decoder_start_id) come from DIR. --to_hf writes
the newest checkpoint of OUT as config.json + safetensors + tokenizer files that transformers'
from_pretrained and AutoTokenizer load.
"""

import sys

from absl import app
from absl import flags
from ml_collections import config_flags

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
  from tx_jax import hf, workdir  # pylint: disable=g-import-not-at-top

  try:
    if _FROM_HF.value:
      where = workdir.import_hf(_FROM_HF.value, _WORKDIR.value, _CONFIG.value)
      print(f"wrote {_WORKDIR.value}/config.json and step 0 under {where}")
    else:
      arch, step = workdir.export_hf(_WORKDIR.value, _TO_HF.value)
      print(f"wrote step {step} of {_WORKDIR.value} as {arch.name} to {_TO_HF.value}")
  except (hf.ConversionError, FileNotFoundError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  app.run(main)
