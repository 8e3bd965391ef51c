"""Metric outputs of a run: metrics.jsonl, TensorBoard events, MFU, and the curves plot."""

import contextlib
import json
import math
import pathlib
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from tx_jax import sharding
from tx_jax.train import steps as steps_lib

TOKEN_KEYS = ("inputs", "encoder_inputs", "decoder_inputs")


def batch_tokens(batch: dict) -> int:
  """Positions the model computes on in a batch (padding included: it costs FLOPs too)."""
  return int(sum(np.prod(batch[k].shape) for k in TOKEN_KEYS if k in batch))


def measure_peak_flops(size: int = 1024, repeats: int = 5) -> float:
  """Matmul FLOP/s of the default device, measured once in-process (best of `repeats`).

  MFU divides achieved model FLOP/s by this times the device count; on CPU the fake
  devices share the same cores, so the process's peak is counted once there.
  """
  a = jnp.ones((size, size), jnp.float32)
  matmul = jax.jit(lambda x: x @ x)
  matmul(a).block_until_ready()
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2.0 * size**3 / best


def peak_flops(configured: float) -> float:
  """config.train.peak_flops per device if set, else the measured matmul peak, for the run."""
  per_device = configured if configured > 0 else measure_peak_flops()
  devices = 1 if jax.default_backend() == "cpu" else jax.device_count()
  return per_device * devices


def import_tensorboardx() -> Any:
  """The tensorboardX module, imported without importing torch.

  tensorboardX's writer imports torch whenever it is installed (it is, with the `test`
  extra), only to accept torch tensors as values, and that import would be a large part of
  every run's start-up. The writer logs Python floats, so torch is hidden while
  tensorboardX loads (an import of a None entry in sys.modules raises ImportError, which
  tensorboardX catches). A process that already imported torch keeps it as it is.
  """
  if "torch" in sys.modules:
    import tensorboardX  # pylint: disable=g-import-not-at-top

    return tensorboardX
  sys.modules["torch"] = None  # type: ignore[assignment]
  try:
    import tensorboardX  # pylint: disable=g-import-not-at-top
  finally:
    del sys.modules["torch"]
  return tensorboardX


class MetricWriter:
  """Appends metric lines to metrics.jsonl and TensorBoard (process 0 writes)."""

  def __init__(self, workdir: pathlib.Path, start_step: int):
    self.path = workdir / "metrics.jsonl"
    self.enabled = jax.process_index() == 0
    self.tb = None
    if not self.enabled:
      return
    # A resumed run replays the steps after its checkpoint: drop their old lines first.
    if self.path.exists():
      kept = [
          line
          for line in self.path.read_text().splitlines()
          if line.strip() and json.loads(line)["step"] <= start_step
      ]
      self.path.write_text("".join(line + "\n" for line in kept))
    self.tb = import_tensorboardx().SummaryWriter(
        str(workdir / "tensorboard"), purge_step=start_step + 1 if start_step else None
    )

  def write(self, step: int, values: dict[str, Any]) -> None:
    """One line {"step": step, **values}."""
    if not self.enabled:
      return
    line = {"step": int(step)}
    line.update(
        {
            k: float(v) if isinstance(v, (float, np.floating, np.ndarray, jax.Array)) else v
            for k, v in values.items()
        }
    )
    with self.path.open("a") as f:
      f.write(json.dumps(line) + "\n")
    for key, value in line.items():
      if key != "step" and isinstance(value, (int, float)):
        self.tb.add_scalar(key, value, step)

  def close(self) -> None:
    if self.tb is not None:
      self.tb.close()


def read_metrics(workdir: str | pathlib.Path) -> list[dict]:
  """The lines of a run's metrics.jsonl."""
  path = pathlib.Path(workdir) / "metrics.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_curves(workdir: str | pathlib.Path) -> pathlib.Path:
  """curves.png: training loss and every eval metric against step."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  rows = read_metrics(workdir)
  evals = sorted({k for r in rows for k in r if k.startswith("eval_")})
  fig, axes = plt.subplots(1, 1 + len(evals), figsize=(4.5 * (1 + len(evals)), 3.5), squeeze=False)
  for ax, key in zip(axes[0], ["loss"] + evals):
    points = [(r["step"], r[key]) for r in rows if key in r and r[key] is not None]
    if points:
      ax.plot(*zip(*points), marker="." if key != "loss" else None)
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  out = pathlib.Path(workdir) / "curves.png"
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out


class MetricsWindow:
  """Training metrics pulled to the host in arrears, summed over the steps since the last log.

  `push` hands over the step just dispatched (its metrics packed by steps.pack_metrics).
  Pulls wait only for the step before the newest, so the device always has a step queued,
  and they come at most every PULL_SECONDS: with short steps the loop's thread then sleeps
  and wakes once per few steps, not every step, because on a small CPU each wake-up takes
  time from XLA's threads. With steps longer than that every step is pulled, one step late. `flush` pulls everything (before an eval or a save).
  """

  SUMMED = ("loss_sum", "correct_sum", "weight_sum")
  PULL_SECONDS = 0.1
  # The most steps the host dispatches ahead of what it has pulled. Also a safety bound:
  # XLA:CPU with several devices (config.mesh.cpu_devices) hangs once more than ~33
  # programs with collectives are in flight (jax 0.10).
  MAX_PENDING = sharding.MAX_COLLECTIVE_PROGRAMS_IN_FLIGHT

  def __init__(
      self,
      *,
      log_every: int,
      total: int,
      flops_per_token: float,
      peak_flops: float,
      report: Callable[[int, dict[str, float]], None],
      on_nonfinite: Callable[[int], None],
  ):
    self.log_every, self.total = log_every, total
    self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
    self._report, self._on_nonfinite = report, on_nonfinite
    self._pending: list[tuple[int, Any, int]] = []  # (step, packed metrics, tokens) in flight
    self._last_pull = time.time()
    self.last: dict[str, float] = {}  # the newest logged line
    self._sums = None
    self.restart_clock()

  def restart_clock(self) -> None:
    """Counts throughput from now on (after the first step, which is mostly compilation)."""
    self._tokens, self._time = 0, time.time()

  @contextlib.contextmanager
  def paused(self):
    """Time spent inside (an eval) is not training time."""
    start = time.time()
    try:
      yield
    finally:
      self._time += time.time() - start

  def push(self, step: int, device_metrics: Any, tokens: int) -> None:
    self._pending.append((step, device_metrics, tokens))
    if len(self._pending) < 2:
      return
    # A log step is pulled as soon as it is done, so each window's clock stops at its end.
    if (
        self._logs(self._pending[-2][0])
        or time.time() - self._last_pull >= self.PULL_SECONDS
        or len(self._pending) > self.MAX_PENDING
    ):
      self._pull(len(self._pending) - 1)

  def _logs(self, step: int) -> bool:
    return step % self.log_every == 0 or step == self.total

  def flush(self) -> None:
    self._pull(len(self._pending))

  def _pull(self, count: int) -> None:
    """Consumes the oldest `count` pending steps, in order, in one transfer."""
    pulled, self._pending = self._pending[:count], self._pending[count:]
    if not pulled:
      return
    # Wait for the newest (the steps before it are done by then), then read each as numpy.
    # jax.device_get would first start an async host copy per array, which on XLA:CPU costs
    # this thread several times the plain reads.
    jax.block_until_ready(pulled[-1][1])
    values = np.stack([np.asarray(m) for _, m, _ in pulled])
    self._last_pull = time.time()
    for (step, _, tokens), row in zip(pulled, values):
      self._consume(step, dict(zip(steps_lib.METRIC_NAMES, row)), tokens)

  def _consume(self, step: int, m: dict[str, np.float32], tokens: int) -> None:
    if int(m["nonfinite"]):
      self._on_nonfinite(step)
    sums = {k: m[k] for k in self.SUMMED}
    self._sums = sums if self._sums is None else {k: self._sums[k] + sums[k] for k in sums}
    self._tokens += tokens
    if not self._logs(step):
      return
    tokens_per_sec = self._tokens / max(time.time() - self._time, 1e-9)
    denom = max(float(self._sums["weight_sum"]), 1e-9)
    self.last = {
        "loss": float(self._sums["loss_sum"]) / denom,
        "accuracy": float(self._sums["correct_sum"]) / denom,
        "learning_rate": float(m["learning_rate"]),
        "grad_norm": float(m["grad_norm"]),
        "tokens_per_sec": tokens_per_sec,
        "mfu": tokens_per_sec * self.flops_per_token / self.peak_flops,
    }
    self._report(step, self.last)
    self._sums = None
    self.restart_clock()
