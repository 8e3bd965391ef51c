"""A save that fails (a full disk) stops the trainer at the next step boundary, naming it."""

import json

import pytest

from configs import gpt
from tests import disk_faults
from tx_jax import checkpoint, orbax_noise
from tx_jax import workdir as workdir_lib
from tx_jax.train import loop


def _config(async_save: bool):
  config = gpt.get_config("tiny")
  config.data.source, config.data.task = "synthetic", "lm"
  m = config.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 1, 32, 2, 2, 16, 64
  config.data.seq_len, config.data.global_batch_size, config.data.eval_global_batch_size = 16, 8, 8
  t = config.train
  t.steps, t.eval_every, t.log_every, t.eval_batches, t.plot, t.progress = 40, 0, 1, 1, False, "log"
  config.schedule.warmup_steps = 1
  config.checkpoint.every, config.checkpoint.async_save = 2, async_save
  config.mesh.cpu_devices = 1
  return config


def _logged_steps(workdir):
  lines = (workdir / "metrics.jsonl").read_text().splitlines()
  return [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)]


@pytest.mark.parametrize("async_save", [True, False])
def test_the_run_stops_at_a_failed_save(tmp_path, monkeypatch, async_save):
  monkeypatch.setattr(disk_faults.HANDLER, "_save_fn", disk_faults.failing_save_fn(4))
  # HeldBack, as around experiments.train: Orbax's abandoned writes are not pytest's concern.
  with pytest.raises(checkpoint.CheckpointSaveError) as failed, orbax_noise.HeldBack():
    loop.train_and_evaluate(_config(async_save), tmp_path)
  assert str(failed.value).startswith(
      f"could not save checkpoint step 4 in {tmp_path / 'checkpoints' / '4'}: No space left "
      "on device; the last good checkpoint is step 2. Free space (or fix the cause) and rerun"
  )
  # A synchronous save fails at step 4; a background one is found at a step boundary, at
  # the latest when the next save (step 6) waits for it: no later step is trained.
  assert max(_logged_steps(tmp_path)) <= (6 if async_save else 4)
  saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
  assert saved[:1] == ["2"] and all("tmp" in name for name in saved[1:]), saved
  _, step = workdir_lib.restore_params(tmp_path, _config(async_save).model)
  assert step == 2
