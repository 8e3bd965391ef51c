"""LoRA checkpoints: the frozen base written once beside steps that hold only the adapters,
their optimizer state and the counters; restores whole, refuses a missing, damaged or other
base without setting any step aside."""

import gc
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from configs import gpt
from tests import disk_faults
from tx_jax import checkpoint, frozen_base, models, orbax_noise
from tx_jax import workdir as workdir_lib
from tx_jax.layers.lora import trainable_mask
from tx_jax.train import optimizers, state as state_lib


def _config(rank: int = 4):
  config = gpt.get_config("tiny")
  config.model.num_layers = 1
  config.model.lora.update(rank=rank, targets=("qkv",))
  config.checkpoint.async_save = False
  return config


def _state(config, shift: float = 0.0, base_shift: float = 0.0):
  """A real TrainState of config's model; `shift` moves what trains, `base_shift` the rest."""
  tx, _ = optimizers.build_optimizer(config)
  ramp = lambda p: jnp.arange(p.size, dtype=p.dtype).reshape(p.shape) / 1e3  # noqa: E731
  params = jax.tree.map(ramp, models.abstract_params(config.model))
  state = state_lib.make_init_fn(lambda _: params, tx, config.seed)()
  mask = trainable_mask(state.params, config.model.lora)
  moved = jax.tree.map(lambda p, t: p + (shift if t else base_shift), state.params, mask)
  opt_state = jax.tree.map(lambda x: x + shift if x.ndim else x, state.opt_state)
  return state.replace(params=moved, opt_state=opt_state, step=jnp.int32(shift))


def _abstract(state):
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), state)


def _manager(tmp_path, config):
  return checkpoint.Checkpointer(tmp_path / "checkpoints", config.checkpoint, config.model)


def _save(tmp_path, config, steps):
  ck = _manager(tmp_path, config)
  for s in steps:
    ck.save(s, _state(config, float(s)))
  ck.close()


def _equal(a, b):
  a, b = jax.tree.leaves(a), jax.tree.leaves(b)
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert np.asarray(x).tobytes() == np.asarray(y).tobytes()


def _files(root: pathlib.Path) -> dict[str, tuple[bytes, int]]:
  return {
      str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
      for p in sorted(root.rglob("*"))
      if p.is_file()
  }


def _bytes(root: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _saved_params(step_dir: pathlib.Path) -> set[str]:
  tree = ocp.StandardCheckpointHandler().metadata(step_dir / "state").tree
  return {"/".join(k) for k in traverse_util.flatten_dict(tree["params"])}


def test_steps_hold_the_adapters_and_the_base_is_written_once(tmp_path):
  config = _config()
  ck = _manager(tmp_path, config)
  ck.save(1, _state(config, 1.0))
  base = tmp_path / frozen_base.DIRNAME
  written = _files(base)
  assert written
  for s in (2, 3):
    ck.save(s, _state(config, float(s)))
  ck.close()
  assert _files(base) == written  # neither rewritten nor touched

  trainable, frozen = frozen_base.split_params(_state(config).params, config.model.lora)
  adapters = {"/".join(k) for k in traverse_util.flatten_dict(trainable)}
  assert adapters and all(k.endswith(("lora_a", "lora_b")) for k in adapters)
  for s in (1, 2, 3):
    assert _saved_params(tmp_path / "checkpoints" / str(s)) == adapters
    meta = json.loads((tmp_path / "checkpoints" / str(s) / "meta" / "metadata").read_text())
    assert meta["frozen_base"]["path"] == frozen_base.DIRNAME
    assert len(meta["frozen_base"]["fingerprints"]) == len(jax.tree.leaves(frozen))

  # Restored whole, bit for bit: frozen base, adapters and their optimizer state.
  restored, step = _manager(tmp_path, config).restore_latest(_abstract(_state(config)))
  assert step == 3
  _equal(restored, _state(config, 3.0))
  params, step = workdir_lib.restore_params(tmp_path, config.model, step=2)
  _equal(params, _state(config, 2.0).params)

  # A full fine-tune of the same model saves every param and two moments for each.
  full = _config(rank=0)
  _save(tmp_path / "full", full, [1])
  lora_step = _bytes(tmp_path / "checkpoints" / "3")
  full_step = _bytes(tmp_path / "full" / "checkpoints" / "1")
  assert lora_step * 5 < full_step, (lora_step, full_step)
  assert not (tmp_path / "full" / frozen_base.DIRNAME).exists()


@pytest.mark.parametrize("damage", ["flip", "delete_file", "delete_base", "replace_base"])
def test_a_bad_base_is_named_and_no_step_is_set_aside(tmp_path, damage):
  config = _config()
  _save(tmp_path, config, [1, 2])
  base = tmp_path / frozen_base.DIRNAME
  files = sorted(
      (p for p in (base / "params").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size
  )
  if damage == "flip":
    raw = bytearray(files[-1].read_bytes())
    mid = len(raw) // 2
    raw[mid : mid + 8] = bytes(b ^ 0xFF for b in raw[mid : mid + 8])
    files[-1].write_bytes(bytes(raw))
  elif damage == "delete_file":
    files[-1].unlink()
  elif damage == "delete_base":
    shutil.rmtree(base)
  else:  # another run's base, intact, where this one's was
    shutil.rmtree(base)
    other = _state(config, base_shift=1.0)
    frozen_base.FrozenBase(base).record(frozen_base.split_state(other, config.model.lora)[1])
  steps = _files(tmp_path / "checkpoints")
  wanted = {"flip": "damaged", "delete_file": "could not be read", "delete_base": "is missing",
            "replace_base": "is not the one"}[damage]  # fmt: skip
  with orbax_noise.HeldBack():
    with pytest.raises(checkpoint.FrozenBaseError, match=wanted) as e:
      _manager(tmp_path, config).restore_latest(_abstract(_state(config)))
    assert str(base) in str(e.value) and "left in place" in str(e.value)
    with pytest.raises(checkpoint.FrozenBaseError, match=str(base)):
      workdir_lib.restore_params(tmp_path, config.model)
  assert _files(tmp_path / "checkpoints") == steps
  assert not (tmp_path / "checkpoints_damaged").exists()


def test_a_base_with_other_values_is_never_overwritten(tmp_path):
  config = _config()
  _save(tmp_path, config, [1])
  base = tmp_path / frozen_base.DIRNAME
  written = _files(base)
  ck = _manager(tmp_path, config)
  with pytest.raises(checkpoint.FrozenBaseError, match=r"differ from the frozen base .*overwrite"):
    ck.save(2, _state(config, 2.0, base_shift=0.5))
  ck.close()
  assert _files(base) == written
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [1]


def test_rotation_keeps_the_base_and_the_kept_steps_restore(tmp_path):
  config = _config()
  config.checkpoint.keep = 2
  _save(tmp_path, config, [1, 2, 3, 4, 5])
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [4, 5]
  assert (tmp_path / frozen_base.DIRNAME).is_dir()
  for s in (4, 5):
    params, _ = workdir_lib.restore_params(tmp_path, config.model, step=s)
    _equal(params, _state(config, float(s)).params)
  # A damaged newest step still falls back to the one before, on the same base.
  shutil.rmtree(tmp_path / "checkpoints" / "5" / "state")
  with orbax_noise.HeldBack():
    restored, step = _manager(tmp_path, config).restore_latest(_abstract(_state(config)))
  assert step == 4
  _equal(restored, _state(config, 4.0))
  assert (tmp_path / "checkpoints_damaged" / "5").is_dir()


def test_a_failed_base_write_leaves_no_base_and_the_next_save_writes_it(tmp_path, monkeypatch):
  config = _config()
  with monkeypatch.context() as patch:
    failing = disk_faults.failing_save_fn(frozen_base.DIRNAME)  # the base's unfinished folder
    patch.setattr(disk_faults.HANDLER, "_save_fn", failing)
    ck = _manager(tmp_path, config)
    with orbax_noise.HeldBack():
      with pytest.raises(checkpoint.CheckpointSaveError, match="step 1 .*No space left"):
        ck.save(1, _state(config, 1.0))
      ck.close()
      gc.collect()
  assert not (tmp_path / frozen_base.DIRNAME).exists()  # no half base that looks finished
  _save(tmp_path, config, [2])
  written = [p.name for p in tmp_path.iterdir() if p.name.startswith(frozen_base.DIRNAME)]
  assert written == [frozen_base.DIRNAME]  # an unfinished write's folder is removed too
  restored, step = _manager(tmp_path, config).restore_latest(_abstract(_state(config)))
  assert step == 2
  _equal(restored, _state(config, 2.0))


def test_a_lora_run_stops_at_a_failed_background_save_and_keeps_the_last_good_step(
    tmp_path, monkeypatch
):
  from tests.train import test_failed_save  # pylint: disable=g-import-not-at-top
  from tx_jax.train import loop  # pylint: disable=g-import-not-at-top

  config = test_failed_save._config(async_save=True)  # pylint: disable=protected-access
  config.model.lora.update(rank=2, targets=("qkv",))
  monkeypatch.setattr(disk_faults.HANDLER, "_save_fn", disk_faults.failing_save_fn(4))
  with orbax_noise.HeldBack():  # as cli.run holds Orbax's abandoned writes back
    with pytest.raises(checkpoint.CheckpointSaveError, match="step 4 .*last good .* step 2"):
      loop.train_and_evaluate(config, tmp_path)
    gc.collect()  # they report when collected: here, not in a later test
  _, step = workdir_lib.restore_params(tmp_path, config.model)
  assert step == 2 and (tmp_path / frozen_base.DIRNAME).is_dir()


def test_restores_onto_the_requested_shardings(tmp_path):
  config = _config()
  _save(tmp_path, config, [1])
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
  split = lambda x: bool(x.ndim) and x.shape[0] % mesh.size == 0  # noqa: E731
  sharding = lambda x: jax.sharding.NamedSharding(mesh, P("x") if split(x) else P())  # noqa: E731
  abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x)), _state(config)
  )
  restored, _ = _manager(tmp_path, config).restore_latest(abstract)
  _equal(restored, _state(config, 1.0))
  for got, wanted in zip(jax.tree.leaves(restored), jax.tree.leaves(abstract)):
    assert got.sharding == wanted.sharding
  frozen = frozen_base.split_params(restored.params, config.model.lora)[1]
  assert any(split(x) for x in jax.tree.leaves(frozen))  # the base is really sharded


@pytest.mark.slow
def test_a_moved_lora_workdir_resumes_decodes_and_exports(tmp_path, capsys):
  """The workdir is self-contained: moved elsewhere, it resumes, decodes and exports."""
  from tests.train import test_failed_save  # pylint: disable=g-import-not-at-top
  from tx_jax.decode import workdir as decode_workdir  # pylint: disable=g-import-not-at-top
  from tx_jax.train import loop  # pylint: disable=g-import-not-at-top

  config = test_failed_save._config(async_save=True)  # pylint: disable=protected-access
  config.model.lora.update(rank=2, targets=("qkv",))
  config.train.steps = 4
  loop.train_and_evaluate(config, tmp_path / "run")
  shutil.move(tmp_path / "run", tmp_path / "moved")
  capsys.readouterr()
  config.train.steps = 6
  loop.train_and_evaluate(config, tmp_path / "moved")
  assert "resumed from step 4" in capsys.readouterr().out
  _, _, params, step = decode_workdir.load(tmp_path / "moved")
  assert step == 6 and jax.tree.leaves(params)
  _, step = workdir_lib.export_hf(tmp_path / "moved", tmp_path / "merged", merge=True)
  assert step == 6 and (tmp_path / "merged" / "config.json").is_file()
  workdir_lib.export_peft(tmp_path / "moved", tmp_path / "adapter")
  values = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert values["base_model_name_or_path"] is None  # initialised here: no HF name to give


def test_a_base_of_other_shapes_is_a_mismatch_not_damage(tmp_path):
  config = _config()
  _save(tmp_path, config, [1])
  wider = _config()
  wider.model.vocab_size += 8  # the adapters on qkv keep their shapes: only the base differs
  with pytest.raises(checkpoint.CheckpointMismatchError, match=r"frozen base .*token_embed"):
    _manager(tmp_path, wider).restore_latest(_abstract(_state(wider)))
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [1]
  assert not (tmp_path / "checkpoints_damaged").exists()


def test_a_run_that_trains_every_param_writes_no_base(tmp_path):
  config = _config()
  config.model.lora.also_train = (".*",)
  _save(tmp_path, config, [1])
  assert not (tmp_path / frozen_base.DIRNAME).exists()
  restored, _ = _manager(tmp_path, config).restore_latest(_abstract(_state(config)))
  _equal(restored, _state(config, 1.0))
