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


def _tiny_workdir(path):
  """A step-0 workdir of a 1-layer llama-tiny, saved by tx_jax.workdir.save_step0."""
  import jax
  import jax.numpy as jnp

  from tx_jax import models
  from tx_jax import workdir as wd

  config = gpt.get_config("llama-tiny")
  config.model.num_layers, config.model.d_model, config.model.mlp_dim = 1, 32, 48
  config.model.num_heads, config.model.num_kv_heads, config.model.head_dim = 2, 1, 16
  module = models.build(config.model)
  import flax.linen as nn

  params = module.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32), train=False)["params"]
  params = jax.tree.map(lambda x: x + 1.5, nn.meta.unbox(params))  # not a fresh init
  wd.save_step0(config, params, path)
  return config, params


def test_restore_params_reads_params_only_and_checks_their_fingerprints(tmp_path):
  import jax
  import numpy as np

  from tx_jax import checkpoint
  from tx_jax import workdir as wd

  config, params = _tiny_workdir(tmp_path)
  loaded, restored, step = wd.load(tmp_path)
  assert step == 0 and loaded.model.to_dict() == config.model.to_dict()
  jax.tree.map(np.testing.assert_array_equal, restored, params)
  meta = next((tmp_path / "checkpoints" / "0" / "meta").glob("*"))
  values = json.loads(meta.read_text())
  values["fingerprints"][0] += 1  # the step's: not read, not checked
  meta.write_text(json.dumps(values))
  wd.restore_params(tmp_path, config.model)
  values["fingerprints"][1] += 1  # the first param's
  meta.write_text(json.dumps(values))
  with pytest.raises(checkpoint.CheckpointError, match="checkpoint step 0 .*damaged"):
    wd.restore_params(tmp_path, config.model)
  with pytest.raises(ValueError, match="checkpoint step 3 is not in"):
    wd.restore_params(tmp_path, config.model, step=3)
