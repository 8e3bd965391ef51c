"""The resolved config of an existing workdir: --config=configs/workdir.py:DIR.

Trains or fine-tunes whatever a workdir holds (for example a HuggingFace model converted by
experiments.convert) without a matching preset: DIR/config.json fills the typed schema of
configs/common.py (`tx_jax.workdir.read_config`), so `--config.a.b=value` overrides still work
and the config stays locked.
"""

import ml_collections


def get_config(workdir: str | None = None) -> ml_collections.ConfigDict:
  if not workdir:
    raise ValueError("configs/workdir.py needs a workdir: --config=configs/workdir.py:DIR")
  from tx_jax import workdir as wd  # pylint: disable=import-outside-toplevel

  try:
    return wd.read_config(workdir)
  except FileNotFoundError as e:
    raise ValueError(f"configs/workdir.py:{workdir}: {e}") from None
