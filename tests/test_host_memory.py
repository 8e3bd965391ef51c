"""tx_jax.host_memory: XLA:CPU's per-execution buffers are reused, not page-faulted in again."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tx_jax import host_memory

# A jitted MLP gradient with 72 MiB of XLA temporaries; the median of the minor page faults
# of ten calls after five warm-up calls. Without reuse, every call faults its temporaries in
# again (~35,000 faults of 4 KiB, for 18,400 pages of temporaries); with it, the freed
# blocks are handed back. 72 MiB is more than one heap of a worker thread's arena holds
# (64 MiB): only split into XLA's blocks of at most 60 MiB does it stay in the arena. (The
# first calls still grow the heaps until every allocation order fits: hence the warm-up and
# the median.)
_PROBE = textwrap.dedent(
    """
    import json, resource
    from tx_jax import host_memory
    result = host_memory.reuse_freed_memory()
    import jax, jax.numpy as jnp
    def loss(w, x):
      return jnp.sum(jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]) ** 2)
    f = jax.jit(jax.grad(loss))
    x = jnp.ones((8192, 256), jnp.float32)
    w = (jnp.full((256, 1024), 0.01), jnp.full((1024, 256), 0.01))
    temp = f.lower(w, x).compile().memory_analysis().temp_size_in_bytes
    faults = []
    for _ in range(15):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      jax.block_until_ready(f(w, x))
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    faults = sorted(faults[5:])
    print(json.dumps({"result": result, "temp_bytes": temp, "faults_per_call": faults[len(faults) // 2]}))
    """
)


def _run(code: str, **env) -> str:
  """stdout of `python -c code` in an environment free of the user's malloc choices."""
  clean = {
      k: v
      for k, v in os.environ.items()
      if not k.startswith(("MALLOC_", "TX_JAX_HOST")) and k not in ("GLIBC_TUNABLES", "JAX_PLATFORMS")
  }
  out = subprocess.run(
      [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True,
      check=True, timeout=300,
  )
  return out.stdout.strip().splitlines()[-1]


def _probe(**env) -> dict:
  return json.loads(_run(_PROBE, JAX_PLATFORMS="cpu", **env))


@pytest.mark.slow  # two child processes, each stepping a model 40 times (~25 s)
def test_reuse_removes_the_per_call_page_faults():
  if host_memory._glibc() is None:  # pylint: disable=protected-access
    pytest.skip("not a glibc process: the settings do not apply")
  reused, system = _probe(), _probe(TX_JAX_HOST_MALLOC="system")
  assert reused["result"] == "applied"
  assert system["result"] == "unchanged: TX_JAX_HOST_MALLOC=system"
  pages = reused["temp_bytes"] / 4096
  # The baseline really faults its temporaries in per call (else this test proves nothing)...
  assert system["faults_per_call"] > 0.8 * pages, system
  # ...and reuse removes it.
  assert reused["faults_per_call"] < 0.05 * system["faults_per_call"], (reused, system)


# How many malloc arenas the process uses after XLA:CPU's threads have run a program on
# two devices (glibc's malloc_info writes one <heap> element per arena).
_ARENAS = textwrap.dedent(
    """
    import ctypes, os, re, tempfile
    from tx_jax import host_memory
    host_memory.reuse_freed_memory()
    import jax, jax.numpy as jnp
    jax.config.update("jax_num_cpu_devices", 2)
    f = jax.jit(lambda a: jnp.tanh(a @ a).sum())
    jax.block_until_ready([f(jax.device_put(jnp.ones((256, 256)), d)) for d in jax.devices()])
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    path = os.path.join(tempfile.mkdtemp(), "malloc_info.xml")
    stream = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, ctypes.c_void_p(stream))
    libc.fclose(ctypes.c_void_p(stream))
    print(len(re.findall("<heap nr=", open(path).read())), os.environ.get("XLA_FLAGS", "-"))
    """
)


def test_threads_keep_their_own_arenas_and_xla_splits_temporaries():
  """One arena for every thread also kept the blocks, but serialised XLA's threads on one
  lock (the `small` step 20% and every compile ~30% slower): the threads keep their own."""
  if host_memory._glibc() is None:  # pylint: disable=protected-access
    pytest.skip("not a glibc process")
  arenas, flags = _run(_ARENAS, JAX_PLATFORMS="cpu").split(" ", 1)
  assert int(arenas) > 1, arenas
  assert "--xla_multiheap_size_constraint_per_heap=62914560" in flags, flags
  # A limit the user gave XLA is theirs.
  _, flags = _run(
      _ARENAS, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_multiheap_size_constraint_per_heap=-1"
  ).split(" ", 1)
  assert flags == "--xla_multiheap_size_constraint_per_heap=-1", flags


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"TX_JAX_HOST_MALLOC": "system"}, "TX_JAX_HOST_MALLOC=system"),
        ({"MALLOC_ARENA_MAX": "4"}, "already chosen in the environment (MALLOC_ARENA_MAX)"),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "(GLIBC_TUNABLES)"),
        ({"JAX_PLATFORMS": "cuda,cpu"}, "jax_platforms='cuda,cpu'"),
    ],
)
def test_user_choices_and_accelerators_are_left_alone(env, reason):
  if host_memory._glibc() is None:  # pylint: disable=protected-access
    pytest.skip("not a glibc process")
  out = _run("from tx_jax import host_memory; print(host_memory.reuse_freed_memory())", **env)
  assert out.startswith("unchanged:") and reason in out, out


def test_too_late_once_a_backend_runs():
  code = (
      "import jax; jax.devices()\n"
      "from tx_jax import host_memory; print(host_memory.reuse_freed_memory())"
  )
  out = _run(code, JAX_PLATFORMS="cpu")
  expected = "a JAX backend is already running" if host_memory._glibc() else "not glibc"  # pylint: disable=protected-access
  assert expected in out, out
