"""The install ships every tx_jax subpackage, and configs/ as tx_jax.configs."""

import pathlib
import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_subpackage():
  setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
  on_disk = {
      ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "tx_jax").rglob("__init__.py")
  }
  listed = set(setuptools["packages"])
  assert on_disk - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
  assert setuptools["package-dir"] == {"tx_jax.configs": "configs"}
  assert listed - on_disk == {"tx_jax.configs"}
