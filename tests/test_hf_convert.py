"""experiments/convert.py: HuggingFace directory -> trainer workdir -> HuggingFace directory."""

from __future__ import annotations

import functools
import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import t5
from tests.train import runs
from tx_jax import hf, models, workdir as wd
from tx_jax.interop.safetensors_io import read_weights

REPO = pathlib.Path(__file__).resolve().parents[1]


def _convert(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "experiments.convert", *args],
      cwd=REPO,
      env=runs.env(),
      capture_output=True,
      text=True,
      timeout=300,
  )


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A tiny T5 v1.1 written by tx_jax (no torch involved)."""
  config = t5.get_config("tiny")
  m = config.model
  m.vocab_size, m.d_model, m.head_dim, m.mlp_dim = 37, 16, 12, 24
  m.num_heads = m.num_kv_heads = 2
  module = models.build(m)
  ids = jnp.ones((1, 3), jnp.int32)
  params = jax.jit(functools.partial(module.init, train=False))(jax.random.PRNGKey(0), ids, ids)[
      "params"
  ]
  directory = tmp_path_factory.mktemp("t5")
  hf.to_pretrained(config, params, directory)
  return directory


@pytest.mark.slow
def test_convert_round_trip_through_a_workdir(hf_dir, tmp_path):
  workdir, out = tmp_path / "workdir", tmp_path / "back"
  done = _convert("--from_hf", str(hf_dir), "--workdir", str(workdir))
  assert done.returncode == 0, done.stderr[-2000:]
  assert (workdir / "checkpoints" / "0").is_dir()
  expected, _, params = hf.from_pretrained(hf_dir)
  written = json.loads((workdir / "config.json").read_text())
  assert written["model"] == json.loads(expected.model.to_json_best_effort())

  # The checkpoint holds exactly the converted params, at step 0.
  config, restored, step = wd.load(workdir)
  assert step == 0
  flat = lambda tree: dict(jax.tree_util.tree_leaves_with_path(tree))  # noqa: E731
  a, b = flat(params), flat(restored)
  assert a.keys() == b.keys()
  assert all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)

  done = _convert("--to_hf", str(out), "--workdir", str(workdir))
  assert done.returncode == 0, done.stderr[-2000:]
  original, back = read_weights(hf_dir), read_weights(out)
  assert original.keys() == back.keys()
  assert all(np.array_equal(original[k], back[k]) for k in original)

  again = _convert("--from_hf", str(hf_dir), "--workdir", str(workdir))
  assert again.returncode == 2 and "already holds checkpoints" in again.stderr  # usage error
