"""`--launcher slurm`: the same runs as one SLURM job array, through submitit.

Each array task runs the run's trainer command as a subprocess on every node of its
allocation (one task per node). The trainer's `multihost.initialize_distributed()` finds
SLURM's environment (SLURM_PROCID, SLURM_NTASKS, the node list) and starts
`jax.distributed`, so a run with several nodes trains multi-host without extra flags.
Before the time limit or on preemption submitit signals the job: the trainer gets SIGTERM,
saves, and the task is requeued; the requeued trainer resumes from that checkpoint.
"""

import dataclasses
import os
import pathlib
import signal
import subprocess
import time
from typing import Any, Callable

import submitit

from tx_jax.sweep import plan as plan_lib
from tx_jax.sweep import runner

ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING")


class TrainerTask(submitit.helpers.Checkpointable):
  """One run inside a SLURM allocation: the trainer subprocess plus status.json (rank 0)."""

  def __init__(self):
    self.process: subprocess.Popen | None = None

  def __call__(self, command: list[str], workdir: str, cwd: str, steps: int) -> str:
    workdir_path = pathlib.Path(workdir)
    rank = submitit.JobEnvironment().global_rank
    status = runner.read_status(workdir_path) if rank == 0 else {}
    start = time.time()
    if rank == 0:
      status.update(
          status="running",
          command=command,
          start_time=start,
          end_time=None,
          attempts=status.get("attempts", 0) + 1,
          wall_time_sec=status.get("wall_time_sec", 0.0),
          error=[],
      )
      runner.write_status(workdir_path, status)
    log_path = workdir_path / (runner.LOG_FILE if rank == 0 else f"train.rank{rank}.log")
    with log_path.open("a") as log:
      env = dict(os.environ, PYTHONUNBUFFERED="1")
      self.process = subprocess.Popen(
          command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT
      )
      rc = self.process.wait()
    if rank != 0:
      return "worker"
    now = time.time()
    status.update(end_time=now, returncode=rc, wall_time_sec=status["wall_time_sec"] + now - start)
    if runner.finished(workdir_path, steps) is not None:
      status["status"] = "done"
    elif rc == 0:
      status["status"] = "running"  # stopped by a signal before the last step
    else:
      status.update(status="failed", error=runner.error_tail(workdir_path))
    runner.write_status(workdir_path, status)
    return status["status"]

  def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
    """Time limit or preemption: let the trainer save, then requeue the same task."""
    if self.process is not None and self.process.poll() is None:
      self.process.send_signal(signal.SIGTERM)
      self.process.wait()
    fresh = TrainerTask()  # a Popen does not pickle
    return submitit.helpers.DelayedSubmission(fresh, *args, **kwargs)


@dataclasses.dataclass
class SlurmOptions:
  """The flags of `--launcher slurm`."""

  partition: str  # "" = the cluster's default partition
  gpus_per_node: int  # GPUs on each node of a run
  nodes_per_run: int  # nodes of a run (one trainer process per node, multi-host when > 1)
  time_min: int  # time limit of each run, minutes
  cpus_per_task: int  # CPU cores per node of a run; 0 = the cluster's default
  parallel: int  # array tasks running at once (SLURM's %N); 0 = no limit


def make_executor(
    folder: str | pathlib.Path, options: SlurmOptions, cluster: str = "slurm"
) -> submitit.AutoExecutor:
  """A submitit executor for the runs; cluster="local" runs them on this machine (tests)."""
  executor = submitit.AutoExecutor(folder=folder, cluster=cluster)
  params: dict[str, Any] = dict(
      name="tx_jax_sweep",
      timeout_min=options.time_min,
      nodes=options.nodes_per_run,
      tasks_per_node=1,  # one JAX process per node, which drives all of its GPUs
      gpus_per_node=options.gpus_per_node,
  )
  if options.cpus_per_task:
    params["cpus_per_task"] = options.cpus_per_task
  if options.partition:
    params["slurm_partition"] = options.partition
  if options.parallel:
    params["slurm_array_parallelism"] = options.parallel
  executor.update_parameters(**params)
  return executor


def still_queued(folder: pathlib.Path, status: dict[str, Any]) -> bool:
  """Whether the run's earlier array task is still pending or running on the cluster."""
  job_id = status.get("slurm_job_id")
  if not job_id or status["status"] not in ("pending", "running"):
    return False
  # submitit bypasses a failing or missing sacct itself and reports "UNKNOWN" (not active).
  try:
    state = submitit.SlurmJob(folder=folder, job_id=job_id).state
  except (RuntimeError, OSError):  # submitit's "no slurm id", an unreadable job folder
    return False
  return state.split(" ")[0] in ACTIVE_STATES


def submit(
    runs: list[plan_lib.Run],
    config_arg: str,
    executor: submitit.AutoExecutor,
    cwd: str | pathlib.Path = ".",
    log: Callable[[str], None] = lambda line: print(line, flush=True),
) -> list[submitit.Job]:
  """Submits `runs` as one job array; records each task's job id in its status.json."""
  cwd = pathlib.Path(cwd).absolute()
  commands = [runner.prepare(run, config_arg, cwd) for run in runs]
  with executor.batch():
    jobs = [
        executor.submit(TrainerTask(), command, str(run.workdir), str(cwd), run.config.train.steps)
        for run, command in zip(runs, commands)
    ]
  for run, command, job in zip(runs, commands, jobs):
    status = runner.read_status(run.workdir)
    status.update(command=command, slurm_job_id=job.job_id)
    runner.write_status(run.workdir, status)
    log(f"[submitted] {run.name}: job {job.job_id}")
  return jobs


def wait(
    runs: list[plan_lib.Run],
    jobs: list[submitit.Job],
    log: Callable[[str], None] = lambda line: print(line, flush=True),
    poll_sec: float = 5.0,
) -> dict[str, int]:
  """Prints one line per run as it ends; Ctrl-C cancels the jobs (the trainers save first)."""
  counts = {s: 0 for s in runner.STATUSES}
  waiting = dict(zip(range(len(jobs)), zip(runs, jobs)))
  try:
    while waiting:
      for i, (run, job) in list(waiting.items()):
        if not job.done():
          continue
        del waiting[i]
        status = runner.read_status(run.workdir)
        counts[status["status"]] += 1
        tail = f": {status['error'][-1]}" if status.get("error") else ""
        log(f"[{status['status']}] {run.name}  job {job.job_id}{tail}")
        log(
            f"progress: {counts['done']} done, {counts['failed']} failed, "
            f"{len(waiting)} queued or running (of {len(jobs)})"
        )
      if waiting:
        time.sleep(poll_sec)
  except KeyboardInterrupt:
    log("interrupted: cancelling the jobs; their trainers save and exit, a relaunch resumes")
    for _, job in waiting.values():
      job.cancel(check=False)
    counts["running"] += len(waiting)
  return counts
