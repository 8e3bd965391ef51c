"""JAX's persistent compilation cache for `experiments.train` and `experiments.decode`.

Why: compiling `init`, the train step and the eval step is a large part of a short run's
start-up, and researchers re-run the same command constantly (resume after a crash, a
changed eval, a second seed); with the cache warm, those compiles are read back instead.

Which directory, in this order:
- `--compilation_cache_dir=DIR` on the command line; `--compilation_cache_dir=` turns it off;
- else JAX's own settings, when the environment already chose (`JAX_COMPILATION_CACHE_DIR`,
  or `JAX_ENABLE_COMPILATION_CACHE=false`);
- else `$XDG_CACHE_HOME/tx_jax/xla` (`~/.cache/tx_jax/xla`).

A folder tx_jax picks or is given is kept under `MAX_BYTES` by JAX's least-recently-used
eviction, and programs that compile in `MIN_COMPILE_SECONDS` or more are kept.

Only entry points call `enable`, before their first compile: library code (`loop.
train_and_evaluate` from a notebook, the tests, the benchmarks) leaves JAX's process-wide
settings alone, and the benchmarks turn the cache off so compiles are measured cold.
A cached executable is the same program, so results are bit-identical
(`tests/test_compile_cache.py` checks a re-run's losses against the first run's).
"""

from __future__ import annotations

import os
import pathlib
import sys

import jax

MAX_BYTES = 2 << 30  # the folder's size cap; JAX evicts the least recently used programs
# JAX caches programs that took at least this long to compile (its own default is 1 s,
# which leaves out the ~0.45 s eval step of tiny-shakespeare on 2 cores).
MIN_COMPILE_SECONDS = 0.25
_MIN_COMPILE_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"


def default_dir() -> pathlib.Path:
  """`$XDG_CACHE_HOME/tx_jax/xla`, or `~/.cache/tx_jax/xla`."""
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "tx_jax" / "xla"


def _unusable(path: pathlib.Path) -> str | None:
  """Why `path` cannot hold the cache (created if missing), or None when it can."""
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    return f"cannot create the directory ({e.strerror})"
  if not os.access(path, os.W_OK | os.X_OK):
    return "the directory is not writable"
  return None


def resolve(flag: str | None) -> pathlib.Path | None:
  """The directory `enable(flag)` would use; None when the cache stays off or is JAX's own.

  A folder named by the flag that cannot be used is a ValueError naming the flag. The
  default folder is only a convenience: when it cannot be used (a read-only home), the run
  goes on without a cache and a one-line note says why.
  """
  if flag is None:
    if jax.config.jax_compilation_cache_dir or not jax.config.jax_enable_compilation_cache:
      return None  # the environment chose; JAX's settings stand
    path = default_dir()
    problem = _unusable(path)
    if problem:
      print(f"note: no compilation cache: {path}: {problem}", file=sys.stderr)
      return None
    return path
  if not flag:
    return None
  path = pathlib.Path(flag).expanduser()
  problem = _unusable(path)
  if problem:
    raise ValueError(
        f"--compilation_cache_dir={flag!r}: {problem}; pass a writable directory, or an "
        "empty value to turn the cache off"
    )
  return path


def enable(flag: str | None) -> pathlib.Path | None:
  """Points JAX's persistent compilation cache at `resolve(flag)`; call before any compile.

  Returns the directory in use, or None when the cache is off or left to JAX's settings.
  """
  path = resolve(flag)
  if flag == "":
    jax.config.update("jax_enable_compilation_cache", False)
  if path is not None:
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    if _MIN_COMPILE_ENV not in os.environ:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  return path


def disable() -> None:
  """Compiles stay cold whatever the environment says (the benchmarks measure them)."""
  jax.config.update("jax_enable_compilation_cache", False)
