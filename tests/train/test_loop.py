"""train_and_evaluate in-process: NaN batches skipped or aborting, outputs, locked-config typos."""

import json
import subprocess
import sys

import numpy as np
import pytest

from configs import gpt
from tests.train import runs
from tx_jax import data
from tx_jax.train import loop

pytestmark = pytest.mark.slow


def _config(corpus, **overrides):
  config = gpt.get_config("tiny")
  values = {
      "data.source": "text_files",
      "data.task": "lm",
      "data.train_files": str(corpus),
      "data.eval_files": str(corpus),
      "data.seq_len": 16,
      "data.global_batch_size": 8,
      "data.eval_global_batch_size": 8,
      "train.steps": 8,
      "train.log_every": 1,
      "train.eval_every": 4,
      "train.eval_batches": 1,
      "train.progress": "log",
      "checkpoint.every": 2,
      "schedule.warmup_steps": 2,
      "model.num_layers": 1,
      "model.d_model": 32,
      "model.mlp_dim": 64,
      "model.head_dim": 8,
      "train.peak_flops": 1e12,
  }
  values.update(overrides)
  for key, value in values.items():
    section, field = key.split(".")
    config[section][field] = value
  return config


@pytest.fixture
def poison_step_5(monkeypatch):
  """Makes the 5th global batch's weights NaN, as a corrupt record would."""
  real = data.make_global_batch
  calls = {"n": 0}

  def poisoned(batch, mesh, axes):
    if "targets" in batch and batch["targets"].ndim == 2 and batch is not None:
      calls["n"] += 1
      if calls["n"] == 5:
        batch = dict(batch, weights=np.full_like(batch["weights"], np.nan))
    return real(batch, mesh, axes)

  monkeypatch.setattr(data, "make_global_batch", poisoned)
  return calls


def test_nan_batch_is_skipped_and_outputs_are_written(tmp_path, poison_step_5):
  corpus = runs.write_corpus(tmp_path / "corpus.txt")
  # Eval batches go through make_global_batch too: evaluate only at the end.
  result = loop.train_and_evaluate(_config(corpus, **{"train.eval_every": 0}), tmp_path / "w")
  assert result["step"] == 8 and result["skipped_updates"] == 1
  rows = [json.loads(l) for l in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
  train_rows = {r["step"]: r for r in rows if "loss" in r}
  assert sorted(train_rows) == list(range(1, 9))
  assert np.isnan(train_rows[5]["loss"]) and np.isfinite(train_rows[6]["loss"])
  for key in ("loss", "accuracy", "learning_rate", "grad_norm", "tokens_per_sec", "mfu"):
    assert key in train_rows[8], key
  assert any("eval_loss" in r and "eval_bits_per_byte" in r for r in rows)
  for name in ("config.json", "curves.png", "summary.json"):
    assert (tmp_path / "w" / name).is_file(), name
  assert any((tmp_path / "w" / "tensorboard").iterdir())
  assert json.loads((tmp_path / "w" / "config.json").read_text())["train"]["steps"] == 8


def test_nan_batch_aborts_keeping_last_good_checkpoint(tmp_path, poison_step_5):
  corpus = runs.write_corpus(tmp_path / "corpus.txt")
  config = _config(corpus, **{"train.nonfinite": "abort", "train.eval_every": 0})
  with pytest.raises(loop.NonFiniteLossError, match="step 5 .*last good checkpoint is step 4"):
    loop.train_and_evaluate(config, tmp_path / "w")
  steps = sorted(
      int(p.name) for p in (tmp_path / "w" / "checkpoints").iterdir() if p.name.isdigit()
  )
  assert steps == [2, 4]


def test_locked_config_typo_names_the_key():
  out = subprocess.run(
      [
          sys.executable,
          "-m",
          "experiments.train",
          "--config.trian.steps=3",
          "--workdir=/nonexistent/never",
      ],
      cwd=runs.REPO,
      env=runs.env(),
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode != 0
  assert "trian" in out.stderr
