"""Helpers that launch `python -m experiments.train` as a real process for end-to-end tests."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]


def write_corpus(path: pathlib.Path, lines: int = 400, seed: int = 0) -> pathlib.Path:
  """A small deterministic English-like text file, one document per line."""
  rng = np.random.default_rng(seed)
  words = (
      "the king of a crown and my lord shall speak to thee now what is love but "
      "a sigh come hither good friend"
  ).split()
  text = "\n".join(" ".join(rng.choice(words, rng.integers(5, 15))) for _ in range(lines))
  path.write_text(text + "\n")
  return path


def tiny_gpt_flags(
    corpus: pathlib.Path, workdir: pathlib.Path, steps: int = 60, **overrides
) -> list[str]:
  """Flags for the tiny GPT preset on a local text file, logging every step."""
  values = {
      "data.source": "text_files",
      "data.task": "lm",
      "data.train_files": str(corpus),
      "data.eval_files": str(corpus),
      "data.seq_len": 32,
      "data.global_batch_size": 8,
      "data.eval_global_batch_size": 8,
      "data.pack": False,
      "train.steps": steps,
      "train.log_every": 1,
      "train.eval_every": 0,
      "train.eval_batches": 2,
      "train.progress": "log",
      "train.plot": False,
      "checkpoint.every": 10,
      "schedule.warmup_steps": 5,
      "model.num_layers": 2,
  }
  values.update(overrides)
  return ["--config=configs/gpt.py:tiny", f"--workdir={workdir}"] + [
      f"--config.{k}={v}" for k, v in values.items()
  ]


def env(**extra: str) -> dict:
  """A child process's environment: one CPU device, as a user's run has (the session's 8
  fake ones only slow a 2-core machine down), and conftest's fast-compile flags kept."""
  e = dict(os.environ, JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="3", **extra)
  e["XLA_FLAGS"] = " ".join(f for f in e.get("XLA_FLAGS", "").split() if "device_count" not in f)
  return e


def launch(flags: list[str], **kwargs) -> subprocess.Popen:
  """Starts the trainer as a child process in the repository root."""
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.train", *flags],
      cwd=REPO,
      env=env(),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      **kwargs,
  )


def run(
    flags: list[str], timeout: float = 600, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
  """Runs the trainer to completion."""
  return subprocess.run(
      [sys.executable, "-m", "experiments.train", *flags],
      cwd=REPO,
      env=dict(env(), **(extra_env or {})),
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def losses(workdir: pathlib.Path) -> dict[int, float]:
  """step -> training loss from metrics.jsonl."""
  rows = [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines() if l]
  return {r["step"]: r["loss"] for r in rows if "loss" in r}


def last_logged_step(workdir: pathlib.Path) -> int:
  """The newest step in metrics.jsonl, 0 if none yet."""
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return 0
  steps = [json.loads(l)["step"] for l in path.read_text().splitlines() if l.strip()]
  return max(steps, default=0)


def saved_state(workdir: pathlib.Path, step: int) -> dict:
  """The `state` item saved at `step`, as numpy (no shardings to guess, so Orbax has no warning)."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  path = workdir / "checkpoints" / str(step) / "state"
  checkpointer = ocp.PyTreeCheckpointer()
  saved = checkpointer.metadata(path).item_metadata.tree
  as_numpy = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
      saved,
      is_leaf=lambda x: isinstance(x, ocp.metadata.ArrayMetadata),
  )
  return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
