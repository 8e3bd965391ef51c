"""The resolved config of an existing workdir: --config=configs/workdir.py:DIR.

Trains or fine-tunes whatever a workdir holds (for example a HuggingFace model converted by
experiments.convert) without a matching preset: DIR/config.json fills the typed schema of
configs/common.py, so `--config.a.b=value` overrides still work and the config stays locked.
"""

import json
import pathlib
from typing import Any

import ml_collections

from configs import common


def _fill(schema: ml_collections.ConfigDict, values: dict[str, Any], where: str) -> None:
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


def get_config(workdir: str | None = None) -> ml_collections.ConfigDict:
  if not workdir:
    raise ValueError("configs/workdir.py needs a workdir: --config=configs/workdir.py:DIR")
  path = pathlib.Path(workdir) / "config.json"
  if not path.is_file():
    raise ValueError(
        f"configs/workdir.py:{workdir}: no config.json in {workdir!r}; accepted: "
        "a directory written by experiments.train or experiments.convert"
    )
  config = common.base_config()
  try:
    values = json.loads(path.read_text())
  except json.JSONDecodeError as e:  # its own constructor needs 3 arguments: config_flags'
    # re-raise would fail with a TypeError, so report it as a ValueError naming the file
    raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}")
  _fill(config, values, "config")
  return config
