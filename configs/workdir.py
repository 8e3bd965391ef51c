"""The resolved config of an existing workdir: --config=configs/workdir.py:DIR.

Trains or fine-tunes whatever a workdir holds (for example a HuggingFace model converted by
experiments.convert) without a matching preset: DIR/config.json is the config, and
`--config.a.b=value` overrides still apply (the config stays locked).
"""

import json
import pathlib

import ml_collections


def get_config(workdir: str | None = None) -> ml_collections.ConfigDict:
    if not workdir:
        raise ValueError("configs/workdir.py needs a workdir: --config=configs/workdir.py:DIR")
    path = pathlib.Path(workdir) / "config.json"
    if not path.is_file():
        raise ValueError(f"configs/workdir.py:{workdir}: no config.json in {workdir!r}; accepted: "
                         "a directory written by experiments.train or experiments.convert")
    return ml_collections.ConfigDict(json.loads(path.read_text()))
