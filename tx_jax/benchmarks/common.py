"""Shared pieces of the benchmark sections: the bench shapes, interleaved timing, peaks.

Every section is `run(options) -> dict` (JSON-ready) plus `plot(result, path)`; the
numbers are medians over interleaved rounds, because the machines these run on are shared
and a slow minute should hit every contestant alike.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import statistics
import time
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class Options:
  """What every section reads: sizes scale down under `smoke`, up under the h200 preset."""

  smoke: bool = False  # tiny sizes and few repeats: checks the code path, not the speed
  preset: str = "cpu"  # "cpu" (the CPU comparisons) or "h200" (bf16 GPU presets)
  data_dir: str = ""  # offline data folder holding tinyshakespeare/input.txt
  rounds: int = 5  # interleaved timing rounds (median reported)
  kernels: str = "plain"  # config.model.kernels of tx_jax's contestants (layers/ops.py)


@dataclasses.dataclass(frozen=True)
class Shape:
  """A GPT-2-style LM shape for the train comparisons."""

  num_layers: int
  d_model: int
  num_heads: int
  seq_len: int
  batch: int
  vocab: int
  # tx_jax's config.mesh.cpu_devices for this shape: below ~2k tokens per step the
  # collectives of 2 devices cost more than they save (2-core VMs, docs/performance.md).
  cpu_devices: int = 1
  # The mesh axis those devices form: "data" (params replicated) or "fsdp" (params and
  # optimizer state split, ZeRO-3), which halves each device's AdamW work for per-layer
  # all-gathers and so pays only on the larger shapes.
  mesh_axis: str = "data"

  @property
  def tokens(self) -> int:
    return self.seq_len * self.batch


BENCH = Shape(
    num_layers=6, d_model=512, num_heads=8, seq_len=256, batch=8, vocab=8192, cpu_devices=2,
    mesh_axis="fsdp",
)
SMALL = Shape(num_layers=4, d_model=128, num_heads=4, seq_len=64, batch=12, vocab=360)
# vocab 360: the byte tokenizer's ids fit.
SMOKE = Shape(num_layers=2, d_model=32, num_heads=2, seq_len=16, batch=2, vocab=360)


def preset_module(name: str):
  """configs/<name>.py: tx_jax.configs.<name> when installed, configs.<name> in a bare checkout."""
  try:
    return importlib.import_module(f"tx_jax.configs.{name}")
  except ModuleNotFoundError:
    return importlib.import_module(f"configs.{name}")


def machine() -> dict:
  """How busy the machine was and what it is: the context every number needs."""
  import jax  # pylint: disable=g-import-not-at-top

  info = {
      "cpu_count": os.cpu_count(),
      "loadavg": list(os.getloadavg()),
      "jax": jax.__version__,
      "backend": jax.default_backend(),
      "devices": [str(d) for d in jax.devices()],
      "xla_flags": os.environ.get("XLA_FLAGS", ""),
  }
  try:
    import torch  # pylint: disable=g-import-not-at-top

    info["torch"] = torch.__version__
    info["torch_threads"] = torch.get_num_threads()
  except ImportError:
    pass
  try:
    with open("/proc/cpuinfo") as f:
      info["cpu"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return info


WARMUP_ROUNDS = 3
# Untimed pause before each timed call: torch's OpenMP workers keep spinning briefly after
# each call, on the cores the next contestant is timed on (tuned on 2-core VMs,
# docs/performance.md).
SETTLE_SECONDS = 0.02


class Rounds:
  """Calls every runner once per `round()`, in turn, and records each call.

  Per call: wall seconds, cores busy (process CPU time / wall time, the thread use of that
  call) and the calling thread's own CPU seconds (the host work that a jitted call leaves
  on it: dispatch, Python). Each call starts after SETTLE_SECONDS of quiet, so no runner
  pays for the threads of the one before. `warm()` runs WARMUP_ROUNDS untimed rounds first:
  compilation, then the allocator, whose heap grows for a few calls until every
  contestant's pattern of large blocks fits (tx_jax.host_memory).
  """

  def __init__(self, runners: dict[str, Callable[[], None]]):
    self.runners = runners
    self.wall: dict[str, list[float]] = {name: [] for name in runners}
    self.cores: dict[str, list[float]] = {name: [] for name in runners}
    self.thread_cpu: dict[str, list[float]] = {name: [] for name in runners}

  def warm(self) -> None:
    for _ in range(WARMUP_ROUNDS):
      for fn in self.runners.values():
        fn()

  def round(self) -> None:
    for name, fn in self.runners.items():
      time.sleep(SETTLE_SECONDS)
      start, cpu_start, thread_start = time.perf_counter(), time.process_time(), time.thread_time()
      fn()
      elapsed = time.perf_counter() - start
      self.thread_cpu[name].append(time.thread_time() - thread_start)
      self.wall[name].append(elapsed)
      self.cores[name].append((time.process_time() - cpu_start) / max(elapsed, 1e-9))


def interleaved(
    runners: dict[str, Callable[[], None]], rounds: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
  """(wall seconds, cores busy) per call of each runner, over `rounds` rounds after warm-up."""
  timer = Rounds(runners)
  timer.warm()
  for _ in range(rounds):
    timer.round()
  return timer.wall, timer.cores


def seconds(fn: Callable[[], object]) -> float:
  """Wall seconds of one call of fn."""
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def median(values: list[float]) -> float | None:
  return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
  """a / b, or None when either is missing."""
  if a is None or b is None or b == 0:
    return None
  return a / b


class MatmulPeak:
  """A `Rounds` runner: each call times REPEATS fp32 [size, size] @ [size, size] GEMMs in
  one framework and appends the best FLOP/s to `flops`.

  Timed in every round beside the contestants, so each round's MFU divides by the peak of
  the same minute of this shared machine; a peak measured once per run moved with the
  machine's load from one run to the next.
  """

  REPEATS = 10

  def __init__(self, framework: str, size: int, kernels: str = "plain"):
    self.size, self.flops = size, []
    self._gemm = gemm_callable(framework, size, size, size, kernels)

  def __call__(self) -> None:
    best = min(seconds(self._gemm) for _ in range(self.REPEATS))
    self.flops.append(2.0 * self.size**3 / best)


def gemm_callable(
    framework: str, m: int, k: int, n: int, kernels: str = "plain"
) -> Callable[[], Any]:
  """One fp32 [m, k] @ [k, n] GEMM in `framework` ('jax' or 'torch'), its inputs made and
  its first call (compile, first touch) done; each call runs it and waits for it."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((m, k), np.float32), rng.standard_normal((k, n), np.float32)
  if framework in ("jax", "xla"):
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp

    from tx_jax.layers import ops  # pylint: disable=g-import-not-at-top

    # 'jax': the product tx_jax's models run with `kernels` (MKL's GEMM under "cpu" where
    # the cpu-mkl extra is installed); 'xla': XLA's own dot.
    project = ops.get(kernels).project
    fn = (lambda a, b: project(a, b, 1)) if framework == "jax" else jnp.matmul
    a, b, matmul = jnp.asarray(a), jnp.asarray(b), jax.jit(fn)
    gemm = lambda: matmul(a, b).block_until_ready()  # noqa: E731
  elif framework == "torch":
    import torch  # pylint: disable=g-import-not-at-top

    a, b = torch.from_numpy(a), torch.from_numpy(b)
    gemm = lambda: a @ b  # noqa: E731
  else:
    raise ValueError(f"framework={framework!r}; accepted: 'jax', 'xla', 'torch'")
  gemm()
  return gemm


def gemm_times(m: int, k: int, n: int, rounds: int) -> dict:
  """One [m, k] @ [k, n] fp32 GEMM as tx_jax runs it, in XLA and in torch, interleaved: the
  ceiling of a step."""
  frameworks = ("jax", "xla", "torch")
  times, _ = interleaved({fw: gemm_callable(fw, m, k, n) for fw in frameworks}, rounds)
  flops = 2.0 * m * k * n
  return {
      "shape": [m, k, n],
      **{f"{fw}_flops": flops / median(times[fw]) for fw in frameworks},
      "jax_over_torch": median(times["torch"]) / median(times["jax"]),
      "xla_over_torch": median(times["torch"]) / median(times["xla"]),
  }


def pyplot():
  """matplotlib.pyplot on the Agg backend (no display here)."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  return plt
