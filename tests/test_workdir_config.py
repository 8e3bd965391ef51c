"""configs/workdir.py rebuilds a typed, locked config from a workdir's config.json."""

import json

import pytest

from configs import gpt, workdir


def test_round_trip_keeps_values_and_types(tmp_path):
  original = gpt.get_config("llama-tiny")
  (tmp_path / "config.json").write_text(original.to_json_best_effort())
  loaded = workdir.get_config(str(tmp_path))
  assert json.loads(loaded.to_json_best_effort()) == json.loads(original.to_json_best_effort())
  assert loaded.model.to_dict() == original.model.to_dict()  # same Python types too
  loaded.data.manual_dir = "/data"  # a None placeholder keeps its str type
  assert isinstance(loaded.optimizer.no_decay, tuple)


def test_unknown_field_and_missing_dir_are_named(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model": {"d_modle": 8}}))
  with pytest.raises(ValueError, match="config.model.d_modle"):
    workdir.get_config(str(tmp_path))
  with pytest.raises(ValueError, match="no config.json"):
    workdir.get_config(str(tmp_path / "absent"))
