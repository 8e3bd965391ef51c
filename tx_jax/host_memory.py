"""Keep freed host memory for reuse, so XLA:CPU's per-step buffers stop costing page faults.

Why this exists: every execution of a compiled XLA:CPU program mallocs one block for all
its temporaries (136 MiB for the `configs/gpt.py:tiny-shakespeare` train step, 1.1 GiB for
the benchmark's GPT) from a runtime worker thread, and frees it when the step ends. glibc
serves a block that large with a fresh `mmap` (a worker thread's own arena cannot hold it),
so the kernel zero-fills every page again on every step: 35,600 page faults and 0.65 of 2
cores spent in the kernel per 130 ms step. With one malloc arena, no `mmap` for large blocks
and no trimming of the heap top, the block is reused and the same step takes 80 ms
(docs/performance.md; a 2 GiB trim threshold was not enough for the 1.1 GiB block).

`reuse_freed_memory()` applies those three glibc settings with `mallopt`. It must run before
JAX starts its CPU backend (the worker threads pick their arena on their first malloc), so
the trainer, every `experiments.*` command and the test suite call it first. It changes
nothing when:

- the process does not use glibc (macOS, musl);
- an accelerator plugin is installed or `jax_platforms` names a non-CPU platform first: the
  host then only feeds the device, and one arena could make its input threads contend;
- the user chose for themselves: `MALLOC_ARENA_MAX`, `MALLOC_MMAP_MAX_`,
  `MALLOC_TRIM_THRESHOLD_` or malloc `GLIBC_TUNABLES` in the environment;
- `TX_JAX_HOST_MALLOC=system` is set (the opt-out);
- a JAX backend is already running (too late to help; the returned reason says so).

The cost: the process keeps its peak heap instead of returning freed memory to the system,
as a caching allocator would.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's <malloc.h> parameters
_NEVER_TRIM = -1  # mallopt(M_TRIM_THRESHOLD, -1): never give the heap top back
_USER_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_")
_state = {"result": None}


def _glibc():
  """glibc's handle, or None when the C library is not glibc."""
  if not sys.platform.startswith("linux"):
    return None
  try:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.gnu_get_libc_version  # noqa: B018 -- only glibc exports it
  except (OSError, AttributeError):
    return None
  return libc


def _accelerator_expected() -> str | None:
  """Why the host is probably not the compute device, or None when it is."""
  jax = sys.modules.get("jax")  # not imported yet: its config is still the environment's
  platforms = jax.config.jax_platforms if jax is not None else os.environ.get("JAX_PLATFORMS")
  if platforms:
    first = platforms.split(",")[0].strip()
    return None if first == "cpu" else f"jax_platforms={platforms!r}"
  plugins = [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
  plugins += [
      d.metadata["Name"]
      for d in importlib.metadata.distributions()
      if (d.metadata["Name"] or "").lower().startswith(("jax-cuda", "jax_cuda", "jax-rocm", "libtpu"))
  ]
  return f"accelerator plugin installed ({', '.join(sorted(set(plugins)))})" if plugins else None


def _skip_reason() -> str | None:
  if os.environ.get("TX_JAX_HOST_MALLOC", "").lower() == "system":
    return "TX_JAX_HOST_MALLOC=system"
  chosen = [k for k in _USER_SETTINGS if k in os.environ]
  if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
    chosen.append("GLIBC_TUNABLES")
  if chosen:
    return f"malloc settings already chosen in the environment ({', '.join(chosen)})"
  xla_bridge = sys.modules.get("jax._src.xla_bridge")
  if xla_bridge is not None and xla_bridge.backends_are_initialized():
    return "a JAX backend is already running; call reuse_freed_memory() before any JAX work"
  return _accelerator_expected()


def reuse_freed_memory() -> str:
  """Applies the malloc settings above when they can help; returns what happened, in words.

  Idempotent: the first call decides and later calls return the same answer.
  """
  if _state["result"] is None:
    libc = _glibc()
    reason = "not glibc" if libc is None else _skip_reason()
    if reason is None:
      ok = all(
          libc.mallopt(param, value) == 1
          for param, value in (
              (_M_ARENA_MAX, 1),
              (_M_MMAP_MAX, 0),
              (_M_TRIM_THRESHOLD, _NEVER_TRIM),
          )
      )
      _state["result"] = "applied" if ok else "mallopt refused a setting"
    else:
      _state["result"] = f"unchanged: {reason}"
  return _state["result"]
