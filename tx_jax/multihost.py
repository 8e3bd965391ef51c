"""Several processes, one program: starting JAX's multi-controller runtime, and stepping together.

Every process runs the same script (`experiments.train` with --coordinator_address,
--num_processes and --process_id, or under SLURM with nothing extra) and feeds only its own
rows of each global batch; `sharding.py` places arrays across all processes' devices.

On CPU the cross-process collectives go through gloo, which sets up each group of devices
the first time a collective uses it and gives the other processes only 30 s to show up
(hard-coded in XLA; `--xla_cpu_collective_timeout_seconds` does not change it). Processes
reach a new executable at different times whenever one compiles or restores slower, so
`compile_in_lockstep` compiles first, then waits at a coordination-service barrier (whose
timeout we choose) before the first run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

# A peer may still be compiling a large model on a loaded host; a dead peer is caught
# sooner by the coordination service's heartbeat.
BARRIER_TIMEOUT_S = 1800


def barrier(name: str, timeout_s: int = BARRIER_TIMEOUT_S) -> None:
  """Blocks until every process reaches `name` (no-op with one process); no collectives used."""
  if jax.process_count() == 1:
    return
  # The coordination-service client has no public accessor; orbax reaches it the same way.
  from jax._src import distributed  # pylint: disable=g-import-not-at-top

  distributed.global_state.client.wait_at_barrier(f"tx_jax/{name}", timeout_s * 1000)


def _signature(args: Any) -> tuple:
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple(
      (np.shape(x), str(getattr(x, "dtype", type(x).__name__)), getattr(x, "sharding", None))
      for x in leaves
  )


def compile_in_lockstep(jitted: Any, name: str) -> Callable[..., Any]:
  """`jitted` itself with one process; otherwise compile per input signature, meet, then run.

  The barrier sits between compilation and the first execution, so gloo's 30 s set-up
  window only has to cover the skew in running, not in compiling.
  """
  if jax.process_count() == 1:
    return jitted
  executables: dict[tuple, Any] = {}

  def call(*args):
    key = _signature(args)
    executable = executables.get(key)
    if executable is None:
      executable = jitted.lower(*args).compile()
      barrier(f"{name}/compiled/{len(executables)}")
      executables[key] = executable
    return executable(*args)

  return call


def cluster_detected() -> bool:
  """Whether JAX's own cluster detection (SLURM, Open MPI, Cloud TPU, k8s) finds a cluster."""
  # jax.distributed.initialize() consults this registry itself; there is no public query.
  from jax._src.clusters import ClusterEnv  # pylint: disable=g-import-not-at-top

  return any(
      env.is_env_present()
      for env in ClusterEnv._cluster_types  # pylint: disable=protected-access
      if not env.opt_in_only_method
  )


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
  """Start JAX's multi-controller runtime; returns whether it runs multi-process.

  Pass the three arguments for a manual launch (one process per host, the same command
  everywhere but `process_id`). With none given it initialises only where JAX detects a
  cluster (SLURM, Open MPI, a Cloud TPU pod slice) and otherwise stays single-process.
  Call before anything touches a device.
  """
  given = (coordinator_address, num_processes, process_id)
  if all(x is None for x in given):
    if not cluster_detected():
      return False
    jax.distributed.initialize()
    return jax.process_count() > 1
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"--num_processes={num_processes}: expected an int >= 1")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(
        f"--process_id={process_id}: expected 0 <= process_id < --num_processes={num_processes}"
    )
  jax.distributed.initialize(
      coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
  )
  return jax.process_count() > 1
