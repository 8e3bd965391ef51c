"""A converted GPT-2-shaped model fine-tunes on Tiny Shakespeare with its own BPE.

The HF directory ships a byte-level BPE trained on Tiny Shakespeare; experiments.convert
keeps it, and `experiments.train --config=configs/workdir.py:OUT` trains from step 0 with
batches tokenized by that tokenizer (not the byte tokenizer), the loss going down.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from tests import hf_models
from tests.conftest import shared_data_dir
from tests.train import runs
from tx_jax import workdir as wd

pytestmark = pytest.mark.slow


def test_converted_gpt2_fine_tunes_with_its_own_bpe(tmp_path):
  hf_models.save_model("gpt2", tmp_path / "src", scale=0.05)
  shakespeare = shared_data_dir() / "tinyshakespeare" / "input.txt"
  out = tmp_path / "workdir"
  flags = [
      "--config=configs/gpt.py:tiny",
      "--config.data.source=text_files",
      "--config.data.task=lm",
      f"--config.data.train_files={shakespeare}",
      f"--config.data.eval_files={shakespeare}",
      "--config.data.seq_len=48",
      "--config.data.global_batch_size=8",
      "--config.train.steps=30",
      "--config.train.log_every=1",
      "--config.train.eval_every=0",
      "--config.train.progress=log",
      "--config.train.plot=False",
      "--config.schedule.warmup_steps=3",
      "--config.optimizer.learning_rate=3e-3",
  ]
  done = subprocess.run(
      [sys.executable, "-m", "experiments.convert", "--from_hf", str(tmp_path / "src"),
       "--workdir", str(out), *flags],
      cwd=runs.REPO, env=runs.env(), capture_output=True, text=True, timeout=600,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  config = wd.read_config(out)
  assert config.data.tokenizer == "hf"
  assert config.model.vocab_size == hf_models.TOKENIZER_VOCAB["gpt2"]
  done = runs.run([f"--config=configs/workdir.py:{out}", f"--workdir={out}"])
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  losses = runs.losses(out)
  assert sorted(losses) == list(range(1, 31))
  first, last = np.mean([losses[s] for s in (1, 2, 3)]), np.mean([losses[s] for s in (28, 29, 30)])
  print(json.dumps({"first3": first, "last3": last}))
  assert last < first - 0.5, losses
