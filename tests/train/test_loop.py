"""train_and_evaluate in-process: NaN batches skipped or aborting, outputs, locked-config typos."""

import gc
import json
import subprocess
import sys
import threading
import time

import jax
from jax._src import dispatch  # BACKEND_COMPILE_EVENT: the name of a backend compile
import numpy as np
import pytest

from configs import gpt
from tests.train import runs
from tx_jax.train import loop
from tx_jax.train import run as run_lib

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
  real = run_lib._to_global  # pylint: disable=protected-access  # every batch passes here
  calls = {"n": 0}

  def poisoned(batch, mesh, order):
    if "targets" in batch and batch["targets"].ndim == 2 and batch is not None:
      calls["n"] += 1
      if calls["n"] == 5:
        batch = dict(batch, weights=np.full_like(batch["weights"], np.nan))
    return real(batch, mesh, order)

  monkeypatch.setattr(run_lib, "_to_global", poisoned)
  return calls


def test_nan_batch_is_skipped_and_outputs_are_written(tmp_path, poison_step_5):
  corpus = runs.write_corpus(tmp_path / "corpus.txt")
  # Eval batches go through _to_global too: evaluate only at the end.
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


def test_frozen_for_gc_keeps_an_earlier_freeze():
  gc.freeze()
  try:
    with loop.FrozenForGC() as heap:
      heap.freeze()
    assert gc.get_freeze_count() > 0  # someone else's freeze is theirs to undo
  finally:
    gc.unfreeze()
  with loop.FrozenForGC() as heap:
    heap.freeze()
    assert gc.get_freeze_count() > 0
  assert gc.get_freeze_count() == 0


def test_after_log_runs_after_each_logged_step_outside_the_throughput_clock(tmp_path):
  """The hook sees its step's line already written, and its time is not training time."""
  corpus = runs.write_corpus(tmp_path / "corpus.txt")
  config = _config(
      corpus, **{"train.log_every": 2, "train.eval_every": 0, "checkpoint.every": 0}
  )
  metrics_path = tmp_path / "w" / "metrics.jsonl"
  seen = []
  hook_seconds = 1.0

  def after_log(step):
    logged = [json.loads(l)["step"] for l in metrics_path.read_text().splitlines()]
    seen.append((step, logged[-1]))
    frozen.append(gc.get_freeze_count())
    time.sleep(hook_seconds)

  frozen = []
  assert gc.get_freeze_count() == 0
  loop.train_and_evaluate(config, tmp_path / "w", after_log=after_log)
  assert seen == [(2, 2), (4, 4), (6, 6), (8, 8)]
  # Set-up and the compiled step are frozen out of the GC while the loop runs, not after.
  assert min(frozen) > 10_000 and gc.get_freeze_count() == 0
  rows = [json.loads(l) for l in metrics_path.read_text().splitlines()]
  window_tokens = 2 * 8 * 16  # log_every steps of 8 rows x 16 tokens
  # Were the sleep counted, each window after the first would read < tokens / 1 s.
  windows = [r for r in rows if r["step"] in (4, 6, 8) and "tokens_per_sec" in r]
  assert len(windows) == 3
  for row in windows:
    assert row["tokens_per_sec"] > 2 * window_tokens / hook_seconds, row


def test_setup_compiles_the_train_step_while_init_runs(tmp_path):
  """run.setup compiles the step on a thread beside `init`; the first step compiles nothing.

  A resumed run restores instead, and its step compiles at the first call as before.
  """
  corpus = runs.write_corpus(tmp_path / "corpus.txt")
  config = _config(corpus, **{"train.eval_every": 0, "checkpoint.every": 0})
  compiles = []

  def on_compile(event, duration, **kwargs):
    del duration, kwargs
    if event == dispatch.BACKEND_COMPILE_EVENT:
      compiles.append(event)

  run = run_lib.setup(config, tmp_path / "w")
  jax.monitoring.register_event_duration_secs_listener(on_compile)
  try:
    batch = run.next_batch()
    run.state, metrics = run.train_step(run.state, run.to_global(batch))
    jax.block_until_ready(metrics)
  finally:
    jax.monitoring.unregister_event_duration_listener(on_compile)
    run.close()
  assert compiles == [], compiles
  assert not [t for t in threading.enumerate() if t.name == "tx_jax-compile-ahead"]
