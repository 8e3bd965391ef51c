"""A run that has trained leaves its final state on disk, whatever fails after training."""

import pytest

from configs import gpt
from tx_jax.decode import workdir as workdir_lib
from tx_jax import evaluation
from tx_jax.train import loop

pytestmark = pytest.mark.slow


def _config():
  config = gpt.get_config("tiny")
  m = config.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 1, 32, 2, 2, 16, 64
  config.data.seq_len, config.data.global_batch_size, config.data.eval_global_batch_size = 16, 8, 8
  t = config.train
  t.steps, t.eval_every, t.log_every, t.eval_batches, t.plot, t.progress = 3, 0, 1, 1, False, "log"
  config.schedule.warmup_steps = 1
  config.checkpoint.every = 0  # only at the end: the save a failing eval used to skip
  return config


def test_final_state_is_saved_when_the_final_eval_fails(tmp_path, monkeypatch):
  def broken(self, params):
    raise RuntimeError("eval exploded")

  monkeypatch.setattr(evaluation.Evaluator, "evaluate", broken)
  config = _config()
  with pytest.raises(RuntimeError, match="eval exploded"):
    loop.train_and_evaluate(config, tmp_path)
  _, step = workdir_lib.restore_params(tmp_path / "checkpoints", config.model)
  assert step == 3
