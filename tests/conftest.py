"""Test setup: 8 fake CPU devices, so sharding code really runs sharded."""

import os

# Must happen before JAX is imported anywhere in the test session.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pathlib  # noqa: E402

import pytest  # noqa: E402


def shared_data_dir() -> pathlib.Path | None:
  """The offline data folder: $TX_JAX_DATA_DIR, else ../shared/data beside the repo."""
  env = os.environ.get("TX_JAX_DATA_DIR")
  candidates = [pathlib.Path(env)] if env else []
  candidates.append(pathlib.Path(__file__).resolve().parents[2] / "shared" / "data")
  for path in candidates:
    if path.is_dir():
      return path
  return None


@pytest.fixture
def data_dir() -> pathlib.Path:
  """Path to the shared offline data sets; skips the test when they are absent."""
  path = shared_data_dir()
  if path is None:
    pytest.skip("offline data not found: set TX_JAX_DATA_DIR to a copy of shared/data")
  return path


def pytest_addoption(parser):
  parser.addoption(
      "--reverse-order",
      action="store_true",
      help="run the collected tests in reverse order (flake hunting: hidden order dependence)",
  )


def pytest_collection_modifyitems(config, items):
  if config.getoption("--reverse-order"):
    items.reverse()
