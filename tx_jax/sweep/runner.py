"""Runs a sweep on this machine: one trainer subprocess per run, N at a time, resumable.

Each run's workdir keeps `status.json` (pending / running / done / failed, wall time, the
error's last lines), `command.sh` (the trainer command that reproduces it alone) and
`train.log` (the trainer's output). A relaunch skips done runs, resumes the others (the
trainer restores its newest checkpoint) and reruns failed ones only when asked.
"""

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import time
from typing import Any, Callable

from tx_jax.sweep import plan as plan_lib

STATUS_FILE = "status.json"
COMMAND_FILE = "command.sh"
LOG_FILE = "train.log"
ERROR_TAIL_LINES = 20
STATUSES = ("pending", "running", "done", "failed")  # running = started, not finished


def read_status(workdir: str | pathlib.Path) -> dict[str, Any]:
  """A run's status.json, or {"status": "pending"} before its first start."""
  path = pathlib.Path(workdir) / STATUS_FILE
  return json.loads(path.read_text()) if path.exists() else {"status": "pending"}


def write_status(workdir: pathlib.Path, status: dict[str, Any]) -> None:
  """Replaces status.json atomically, so a reader never sees half a file."""
  tmp = workdir / (STATUS_FILE + ".tmp")
  tmp.write_text(json.dumps(status, indent=2) + "\n")
  tmp.replace(workdir / STATUS_FILE)


def prepare(run: plan_lib.Run, config_arg: str, cwd: pathlib.Path) -> list[str]:
  """Writes the run's config.json and command.sh; returns its command."""
  run.workdir.mkdir(parents=True, exist_ok=True)
  (run.workdir / "config.json").write_text(run.config.to_json_best_effort(indent=2) + "\n")
  command = run.command(config_arg)
  (run.workdir / COMMAND_FILE).write_text(
      "#!/bin/sh\n# Runs (or resumes) this run alone, outside the sweep.\n"
      + plan_lib.shell_command(command, cwd)
      + "\n"
  )
  return command


def select(
    runs: list[plan_lib.Run], config_arg: str, retry_failed: bool
) -> tuple[list[plan_lib.Run], list[str]]:
  """The runs to start now, and one line per run skipped (done, or failed without retry)."""
  todo, skipped = [], []
  for run in runs:
    status = read_status(run.workdir)
    same = status.get("command") == run.command(config_arg)
    if status["status"] == "done" and same:
      skipped.append(f"[skip] {run.name}: done")
    elif status["status"] == "failed" and not retry_failed:
      skipped.append(f"[skip] {run.name}: failed before (--retry_failed reruns it)")
    else:
      todo.append(run)
  return todo, skipped


def finished(workdir: pathlib.Path, steps: int) -> dict[str, Any] | None:
  """The trainer's summary.json if it completed all `steps` (config.train.steps), else None."""
  path = pathlib.Path(workdir) / "summary.json"
  if not path.exists():
    return None
  summary = json.loads(path.read_text())
  return summary if summary.get("step") == steps else None


def error_tail(workdir: pathlib.Path, lines: int = ERROR_TAIL_LINES) -> list[str]:
  """The last lines of the run's train.log (its traceback when it failed)."""
  path = workdir / LOG_FILE
  if not path.exists():
    return []
  return path.read_text(errors="replace").splitlines()[-lines:]


# --- resources: disjoint CPU cores (and GPUs) per concurrent run -------------------------


def visible_gpus() -> list[str]:
  """GPU ids this process may hand out: CUDA_VISIBLE_DEVICES, else /dev/nvidiaN; none on CPU."""
  if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
    return []
  if "CUDA_VISIBLE_DEVICES" in os.environ:
    return [g for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
  dev = pathlib.Path("/dev")
  return sorted(
      (p.name[len("nvidia") :] for p in dev.glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name)),
      key=int,
  )


def split_evenly(items: list, parts: int, what: str) -> list[list]:
  """`parts` disjoint, contiguous, equal chunks of `items` (the remainder stays unused)."""
  size = len(items) // parts
  if size < 1:
    raise ValueError(
        f"--parallel {parts} needs at least {parts} {what}, but only {len(items)} are "
        f"available ({items}); lower --parallel"
    )
  return [items[i * size : (i + 1) * size] for i in range(parts)]


@dataclasses.dataclass
class Slot:
  """The resources of one concurrent run: CPU cores, and GPUs when there are any."""

  cores: list[int] | None  # None: no pinning (a single run gets the whole machine)
  gpus: list[str] | None

  def describe(self) -> str:
    parts = []
    if self.cores is not None:
      parts.append("cores " + ",".join(map(str, self.cores)))
    if self.gpus is not None:
      parts.append("gpus " + ",".join(self.gpus))
    return " ".join(parts)

  def env(self, base: dict[str, str]) -> dict[str, str]:
    """The child's environment: thread pools sized to its cores, its GPUs only."""
    env = dict(base, PYTHONUNBUFFERED="1")
    if self.gpus is not None:
      env["CUDA_VISIBLE_DEVICES"] = ",".join(self.gpus)
    if self.cores is not None:
      n = str(len(self.cores))
      for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[name] = n
      env["TF_NUM_INTRAOP_THREADS"], env["TF_NUM_INTEROP_THREADS"] = n, "1"
      if len(self.cores) == 1:
        # XLA:CPU sizes its pool from the affinity mask; with one core, also skip Eigen's
        # thread pool inside ops, which would only add hand-offs.
        extra = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
        env["XLA_FLAGS"] = f"{base.get('XLA_FLAGS', '')} {extra}".strip()
    return env


def make_slots(parallel: int, pin: bool = True) -> list[Slot]:
  """One Slot per concurrent run: disjoint core sets (and GPU sets) when parallel > 1.

  pin=False lets every run use every core (only to measure what pinning buys).
  """
  if parallel < 1:
    raise ValueError(f"--parallel {parallel}: must be >= 1")
  if parallel == 1:
    return [Slot(None, None)]
  can_pin = pin and hasattr(os, "sched_getaffinity")
  cores = sorted(os.sched_getaffinity(0)) if can_pin else None
  core_sets = split_evenly(cores, parallel, "CPU cores") if can_pin else [None] * parallel
  gpus = visible_gpus()
  gpu_sets = split_evenly(gpus, parallel, "GPUs") if gpus else [None] * parallel
  return [Slot(c, g) for c, g in zip(core_sets, gpu_sets)]


# --- the local launcher ---------------------------------------------------------------------


@dataclasses.dataclass
class _Active:
  run: plan_lib.Run
  process: subprocess.Popen
  slot: int
  start: float
  status: dict[str, Any]


class LocalRunner:
  """Runs trainer subprocesses, `parallel` at a time; SIGTERM / SIGINT stop it cleanly."""

  def __init__(
      self,
      config_arg: str,
      parallel: int = 1,
      pin: bool = True,
      cwd: str | pathlib.Path = ".",
      log: Callable[[str], None] = lambda line: print(line, flush=True),
  ):
    self.config_arg = config_arg
    self.slots = make_slots(parallel, pin)
    self.cwd = pathlib.Path(cwd).absolute()
    self.log = log
    self.signals = 0
    self._active: dict[int, _Active] = {}  # slot index -> its running run

  def _on_signal(self, signum, frame) -> None:
    del frame
    self.signals += 1
    hard = self.signals > 1
    self.log(
        f"signal {signum}: "
        + ("killing the runs" if hard else "stopping; running trainers save and exit")
    )
    for active in self._active.values():
      if active.process.poll() is None:
        active.process.send_signal(signal.SIGKILL if hard else signal.SIGTERM)

  def _start(self, run: plan_lib.Run, slot_index: int) -> _Active:
    command = prepare(run, self.config_arg, self.cwd)
    slot = self.slots[slot_index]
    previous = read_status(run.workdir)
    status = {
        "status": "running",
        "command": command,
        "slot": slot.describe(),
        "start_time": time.time(),
        "end_time": None,
        "returncode": None,
        "attempts": previous.get("attempts", 0) + 1,
        "wall_time_sec": previous.get("wall_time_sec", 0.0),
        "error": [],
    }
    write_status(run.workdir, status)
    log = (run.workdir / LOG_FILE).open("a")
    log.write(f"=== attempt {status['attempts']}: {plan_lib.shell_command(command, self.cwd)}\n")
    log.flush()
    pin = (lambda: os.sched_setaffinity(0, slot.cores)) if slot.cores is not None else None
    process = subprocess.Popen(
        command,
        cwd=self.cwd,
        env=slot.env(dict(os.environ)),
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=pin,  # before exec: every thread the trainer starts inherits the mask
    )
    log.close()
    return _Active(run, process, slot_index, time.time(), status)

  def _finish(self, active: _Active) -> str:
    """Records how a run ended; returns its status."""
    rc = active.process.returncode
    status = active.status
    now = time.time()
    status.update(
        end_time=now, returncode=rc, wall_time_sec=status["wall_time_sec"] + now - active.start
    )
    if finished(active.run.workdir, active.run.config.train.steps) is not None:
      status["status"] = "done"
    elif rc == 0 or self.signals:
      status["status"] = "running"  # stopped before the last step; a relaunch resumes it
    else:
      status.update(status="failed", error=error_tail(active.run.workdir))
    write_status(active.run.workdir, status)
    return status["status"]

  def run(self, runs: list[plan_lib.Run]) -> dict[str, int]:
    """Runs `runs` (already filtered by select()); returns the count of each final status."""
    pending = list(runs)
    total = len(runs)
    counts = {s: 0 for s in STATUSES}
    self._active = {}
    previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    started = 0
    try:
      while pending or self._active:
        free = [i for i in range(len(self.slots)) if i not in self._active]
        while pending and free and not self.signals:
          run, slot = pending.pop(0), free.pop(0)
          self._active[slot] = self._start(run, slot)
          started += 1
          where = self.slots[slot].describe()
          self.log(f"[start {started}/{total}] {run.name}" + (f"  ({where})" if where else ""))
        if self.signals and not self._active:
          break
        for slot, active in list(self._active.items()):
          if active.process.poll() is None:
            continue
          del self._active[slot]
          result = self._finish(active)
          counts[result] += 1
          self.log(self._end_line(active, result))
          remaining = len(pending) + len(self._active)
          self.log(
              f"progress: {counts['done']} done, {counts['failed']} failed, "
              f"{len(self._active)} running, {remaining - len(self._active)} pending, "
              f"{counts['running']} stopped (of {total})"
          )
        time.sleep(0.2)
    finally:
      for s, handler in previous.items():
        signal.signal(s, handler)
    counts["pending"] = len(pending)
    return counts

  def _end_line(self, active: _Active, result: str) -> str:
    seconds = time.time() - active.start
    head = f"[{result if result != 'running' else 'stopped'}] {active.run.name}  {seconds:.1f}s"
    if result == "done":
      summary = finished(active.run.workdir, active.run.config.train.steps) or {}
      shown = [f"{k}={v:.4g}" for k, v in summary.items() if k.startswith("eval_")]
      return head + ("  " + " ".join(shown) if shown else "")
    if result == "failed":
      tail = "\n".join("    " + line for line in active.status["error"][-5:])
      return f"{head}  exit {active.process.returncode}; last lines of {LOG_FILE}:\n{tail}"
    return head + "  (relaunch to resume from its checkpoint)"
