"""Keep freed host memory for reuse, so XLA:CPU's per-step buffers stop costing page faults.

Why this exists: every execution of a compiled XLA:CPU program mallocs the block for its
temporaries from a runtime worker thread, and frees it when the step ends. glibc serves a
block that large with a fresh `mmap`, so the kernel zero-fills every page again on every
step, a large share of a small step's time on few cores (measured in docs/performance.md).

`reuse_freed_memory()` makes glibc keep those blocks, and keeps each thread's own arena:

- no `mmap` for large blocks (`M_MMAP_MAX` 0) and no trimming of the heap top
  (`M_TRIM_THRESHOLD` -1), so a freed block stays in its arena for the next step;
- a 64 MiB top pad (`M_TOP_PAD`): glibc deletes a worker thread's heap as soon as it is
  wholly free (a thread's arena grows in heaps of at most 64 MiB) unless the heap before it
  lacks that much room, so without the pad the step's block went back to the kernel anyway;
- XLA told to split each program's temporaries into blocks of at most 60 MiB
  (`--xla_multiheap_size_constraint_per_heap`, added to XLA_FLAGS unless already there), so
  that they fit a thread's heap: a block over 64 MiB can only be `mmap`ped there. A single
  buffer over 60 MiB still is, and XLA logs a warning for it when it compiles the program.

One arena for the whole process did the same for the blocks, and was this module's first
answer: it serialised every malloc of XLA's threads on one lock, which slowed every step
and every compile.

It must run before JAX starts its CPU backend (the worker threads pick their arena on their
first malloc, and XLA reads XLA_FLAGS once), so every `experiments.*` command (`cli.run`)
and the test suite call it first. The library never does: `train_and_evaluate` called from
Python leaves malloc and the environment as the caller set them. It changes nothing when:

- the process does not use glibc (macOS, musl);
- an accelerator plugin is installed or `jax_platforms` names a non-CPU platform first: the
  host then only feeds the device;
- the user chose for themselves: `MALLOC_ARENA_MAX`, `MALLOC_MMAP_MAX_`,
  `MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_` or malloc `GLIBC_TUNABLES` in the environment;
- `TX_JAX_HOST_MALLOC=system` is set (the opt-out);
- a JAX backend is already running (too late to help; the returned reason says so).

The cost: each arena keeps its peak heap instead of returning freed memory to the system,
as a caching allocator would (the shipped tiny-shakespeare run peaks at 0.77 GB either way),
and each new thread heap reserves its whole 64 MiB of address space (untouched pages cost
no memory unless the kernel is set to refuse overcommit).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
import sys

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4  # glibc's <malloc.h> parameters
_NEVER_TRIM = -1  # mallopt(M_TRIM_THRESHOLD, -1): never give the heap top back
# glibc's largest heap of a thread's arena on 64-bit hosts (HEAP_MAX_SIZE). As the top pad,
# it keeps every emptied heap: glibc deletes one only if the heap before it has more room.
_THREAD_HEAP_BYTES = 64 << 20
# XLA's temporaries in blocks that fit one such heap with its header. (XLA logs a warning
# for each single buffer above it: such a buffer is mmapped at every step, as by default.)
_TEMP_BLOCK_BYTES = 60 << 20
_SPLIT_FLAG = "--xla_multiheap_size_constraint_per_heap"
_USER_SETTINGS = (
    "MALLOC_ARENA_MAX",
    "MALLOC_MMAP_MAX_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
)
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


def _split_temporaries() -> None:
  """Adds the 60 MiB limit on XLA's blocks of temporaries to XLA_FLAGS, unless one is set."""
  flags = os.environ.get("XLA_FLAGS", "")
  if _SPLIT_FLAG not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} {_SPLIT_FLAG}={_TEMP_BLOCK_BYTES}".strip()


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
              (_M_MMAP_MAX, 0),
              (_M_TRIM_THRESHOLD, _NEVER_TRIM),
              (_M_TOP_PAD, _THREAD_HEAP_BYTES),
          )
      )
      if ok:
        _split_temporaries()
      _state["result"] = "applied" if ok else "mallopt refused a setting"
    else:
      _state["result"] = f"unchanged: {reason}"
  return _state["result"]
