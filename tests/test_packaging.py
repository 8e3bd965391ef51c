"""Paths a user relies on: the install ships every subpackage (configs/ as tx_jax.configs),
and a clone without the offline data says where to put it."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_subpackage():
  setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  inits = (ROOT / "tx_jax").rglob("__init__.py")
  on_disk = {".".join(init.parent.relative_to(ROOT).parts) for init in inits}
  listed = set(setuptools["packages"])
  assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
  assert setuptools["package-dir"] == {"tx_jax.configs": "configs"}
  assert listed - on_disk == {"tx_jax.configs"}


@pytest.mark.slow  # starts the trainer in a fresh process: ~3 s
def test_real_data_preset_without_data_says_where_to_put_it(tmp_path):
  """A clone alone (no ../shared, $TX_JAX_DATA_DIR unset) gets one error line, not a download."""
  checkout = tmp_path / "checkout"
  for folder in ("tx_jax", "configs", "experiments"):
    shutil.copytree(ROOT / folder, checkout / folder, ignore=shutil.ignore_patterns("__pycache__"))
  env = {k: v for k, v in os.environ.items() if k != "TX_JAX_DATA_DIR"}
  env.update(PYTHONPATH=str(checkout), TFDS_DATA_DIR=str(tmp_path / "tfds"))
  result = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--config=configs/gpt.py:tiny-shakespeare",
       f"--workdir={tmp_path / 'run'}"],
      cwd=checkout, env=env, capture_output=True, text=True, timeout=300, check=False,
  )
  errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
  assert result.returncode == 2, result.stderr[-2000:]
  assert len(errors) == 1 and "TX_JAX_DATA_DIR" in errors[0], result.stderr[-2000:]
  assert str(checkout / "data" / "tinyshakespeare") in errors[0]
