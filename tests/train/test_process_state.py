"""The trainer's Python API leaves the process alone: environment, hooks, malloc (issue 47).

Entry points (tx_jax.cli.run) may make process-wide settings; train_and_evaluate, called
from a notebook or a test, must not.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import warnings

import jax

from configs import gpt
from tests.train import runs
from tx_jax import host_memory
from tx_jax.train import loop
from tx_jax.train import metrics as metrics_lib

REPO = runs.REPO


def _config(steps: int):
  config = gpt.get_config("tiny")
  config.data.source, config.data.task = "synthetic", "lm"
  m = config.model
  m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 1, 32, 2, 2, 16, 64
  config.data.seq_len, config.data.global_batch_size, config.data.eval_global_batch_size = 16, 8, 8
  t = config.train
  t.steps, t.eval_every, t.log_every, t.eval_batches = steps, 0, 1, 1
  t.plot, t.progress = False, "log"
  config.schedule.warmup_steps = 1
  config.checkpoint.every = 1
  config.mesh.cpu_devices = 1
  return config


def _process_state():
  return {
      "environ": dict(os.environ),
      "unraisablehook": sys.unraisablehook,
      "excepthook": sys.excepthook,
      "threading.excepthook": threading.excepthook,
      "warnings": list(warnings.filters),
      "signals": {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)},
      "logging filters": {n: list(logging.getLogger(n).filters) for n in ("absl", "asyncio")},
  }


def test_training_and_resuming_in_process_change_no_process_state(tmp_path, monkeypatch):
  def refuse(*args, **kwargs):
    raise AssertionError("the library touched glibc's malloc (host_memory)")

  monkeypatch.setattr(host_memory, "reuse_freed_memory", refuse)
  monkeypatch.setattr(host_memory, "_glibc", refuse)
  # Other libraries' first use, not tx_jax's: JAX's backend start-up sets TPU_SKIP_MDS_QUERY
  # and importing tensorboardX sets CRC32C_SW_MODE.
  jax.devices()
  metrics_lib.import_tensorboardx()
  before = _process_state()
  during = []  # while it trains, SIGTERM / SIGINT save and stop the run (restored after)

  def record(step):
    del step
    during.append({k: v for k, v in _process_state().items() if k != "signals"})

  loop.train_and_evaluate(_config(steps=2), tmp_path, after_log=record)  # a fresh run, saving
  assert _process_state() == before
  assert during == [{k: v for k, v in before.items() if k != "signals"}] * 2
  result = loop.train_and_evaluate(_config(steps=3), tmp_path)  # a resume: the restore path
  assert result["step"] == 3
  assert _process_state() == before


_IMPORT_AND_BUILD = """
import logging, os, sys, threading, warnings
import jax  # JAX's own import sets TF_CPP_MIN_LOG_LEVEL if unset: not tx_jax's doing
def state():
  return (dict(os.environ), sys.unraisablehook, sys.excepthook, threading.excepthook,
          list(warnings.filters), [logging.getLogger(n).filters[:] for n in ("absl", "asyncio")])
before = state()
import tx_jax, tx_jax.checkpoint, tx_jax.train.loop
from configs import gpt
from tx_jax import models
models.build(gpt.get_config("tiny").model)
print("unchanged" if state() == before else "changed")
"""


def test_importing_tx_jax_and_building_a_model_change_no_process_state():
  """In a fresh process, as a notebook would: nothing imported before."""
  out = subprocess.run(
      [sys.executable, "-c", _IMPORT_AND_BUILD], cwd=REPO, capture_output=True, text=True,
      timeout=120, env=runs.env(),
  )  # fmt: skip
  assert out.stdout.strip() == "unchanged", out.stdout + out.stderr[-2000:]
