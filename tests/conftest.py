"""Test setup: 8 fake CPU devices, so sharding code really runs sharded."""

import os
from importlib import metadata

# Must happen before JAX is imported anywhere in the test session.
# Test models are tiny: compiling them costs far more than running them, so LLVM's
# optimisation passes are skipped (15-35% off compile-bound files such as
# tests/models/test_kv_cache.py). No fast-math either way, so every tolerance still means
# what it says; but level 0 can move a last bit against XLA's default level (the parameter
# init, by up to 7.5e-9), so bit-exact tests compare programs compiled alike
# (tests/train/test_init_program.py names its levels). XLA:CPU's older elemental emitters
# instead of its MLIR fusion emitters: the MLIR pipeline is set up again for every fusion,
# and the tests' programs are thousands of tiny fusions (tests/models/test_kv_cache.py with
# tests/train/test_memory_precision.py: 126 -> 85 s). One codegen thread per compile: the
# two xdist workers already keep both cores busy, and splitting a module across threads
# only repeats per-split set-up (a T5 tiny train step: 4.1-4.5 -> 3.6-3.7 CPU-seconds).
# TX_JAX_TEST_FAST_COMPILE=0 keeps XLA's defaults.
# Newer jaxlibs (0.12.1 at least) refuse the emitter flag, and an unknown XLA flag aborts;
# the flag is only asked of the jaxlib the lock pins and its kin.
_EMITTER_FLAG = tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2]) < (0, 11)
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
    + ("--xla_cpu_use_fusion_emitters=false " if _EMITTER_FLAG else "")
    + "--xla_cpu_parallel_codegen_split_count=1"
)
# `jax.jit(compiler_options=...)` that restore XLA's defaults for one program: a test that
# runs a step hundreds of times (tests/train/test_overfit.py) gains more from optimised code
# than it pays in compile time, and tests/train/test_init_program.py compares bits with what
# the trainer's own compile gives.
XLA_DEFAULT_LEVEL = {
    "xla_backend_optimization_level": 2,
    "xla_llvm_disable_expensive_passes": False,
    **({"xla_cpu_use_fusion_emitters": True} if _EMITTER_FLAG else {}),
}
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
    + ([_FAST_COMPILE] if os.environ.get("TX_JAX_TEST_FAST_COMPILE", "1") != "0" else [])
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# One XLA compilation cache for the whole session: the pytest-xdist workers and every
# trainer subprocess a test starts inherit it, so the same tiny model compiled by twenty
# tests compiles once. The process that runs conftest first (pytest itself) picks the
# folder; the rest find it in the environment. Opt out with TX_JAX_TEST_XLA_CACHE=0.
if os.environ.get("TX_JAX_TEST_XLA_CACHE", "1") != "0":
  import tempfile  # noqa: E402

  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="tx_jax_xla_cache_")
    os.environ["TX_JAX_TEST_XLA_CACHE_OWNER"] = str(os.getpid())
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")

import pathlib  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402

from tx_jax import host_memory  # noqa: E402

# As every tx_jax command does, before any test can start JAX: XLA:CPU's per-execution
# buffers are then reused instead of page-faulted in again on every call.
host_memory.reuse_freed_memory()

# Start the CPU backend now, with its 8 devices: a test that reaches
# sharding.use_cpu_devices (config.mesh.cpu_devices > 0) then runs on the first N of them
# instead of changing the device count for every later test.
import jax  # noqa: E402

jax.devices()


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


def pytest_unconfigure(config):
  """The session's compilation cache goes with the process that made it."""
  if os.environ.get("TX_JAX_TEST_XLA_CACHE_OWNER") == str(os.getpid()):
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
