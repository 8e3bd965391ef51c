"""The sweep command's flow: expand, validate, (dry run | run locally | submit), summarise."""

import contextlib
import fcntl
import json
import os
import pathlib
import shlex
from typing import Any, Callable

from tx_jax.sweep import grid
from tx_jax.sweep import plan as plan_lib
from tx_jax.sweep import runner
from tx_jax.sweep import summary as summary_lib

LAUNCHERS = ("local", "slurm")
LOCK_FILE = ".launcher.lock"


def expand(
    config_arg: str, cli_overrides: grid.Overrides, workdir: str | pathlib.Path
) -> list[plan_lib.Run]:
  """The config file's sweep(add), named, resolved and checked; raises SweepError."""
  overrides = grid.collect(plan_lib.load_sweep_fn(config_arg))
  runs = plan_lib.plan_runs(config_arg, cli_overrides, pathlib.Path(workdir).absolute(), overrides)
  plan_lib.semantic_check(runs)
  return runs


def write_spec(
    sweep_dir: pathlib.Path,
    config_arg: str,
    cli_overrides: grid.Overrides,
    runs: list[plan_lib.Run],
    metric: str,
) -> dict[str, Any]:
  """DIR/sweep.json: what --summarize needs (runs, their overrides, the default metric)."""
  checkpoint = runs[0].config.checkpoint
  metric = metric or checkpoint.best_metric or "eval_loss"
  spec = {
      "config": config_arg,
      "cli_overrides": {k: grid.format_value(v) for k, v in cli_overrides.items()},
      "swept_keys": grid.swept_keys([r.overrides for r in runs]) if len(runs) > 1 else [],
      "runs": [{"name": r.name, "overrides": plan_lib.jsonable(r.overrides)} for r in runs],
      "metric": metric,
      "metric_mode": summary_lib.metric_mode(
          metric, checkpoint.best_metric, checkpoint.best_mode
      ),
  }
  sweep_dir.mkdir(parents=True, exist_ok=True)
  (sweep_dir / summary_lib.SWEEP_FILE).write_text(json.dumps(spec, indent=2) + "\n")
  return spec


def dry_run_lines(runs: list[plan_lib.Run], config_arg: str) -> list[str]:
  """One line per run: name, its overrides, its status, then its command."""
  lines = [f"{len(runs)} runs of {config_arg}:"]
  for run in runs:
    values = " ".join(f"{k}={grid.format_value(v)}" for k, v in run.overrides.items())
    status = runner.read_status(run.workdir)["status"]
    lines.append(f"  {run.name}  [{status}]  {values}")
    lines.append(f"    {shlex.join(run.command(config_arg))}")
  return lines


def launch(
    config_arg: str,
    cli_overrides: grid.Overrides,
    workdir: str | pathlib.Path,
    *,
    parallel: int = 1,
    pin: bool = True,
    dry_run: bool = False,
    retry_failed: bool = False,
    metric: str = "",
    metric_mode: str = "",
    launcher: str = "local",
    slurm_options: Any = None,
    slurm_cluster: str = "slurm",
    log: Callable[[str], None] = lambda line: print(line, flush=True),
) -> int:
  """Runs the sweep (or lists it); returns the exit status: 1 when any run has failed."""
  if launcher not in LAUNCHERS:
    raise grid.SweepError(f"--launcher={launcher!r}: expected one of {LAUNCHERS}")
  sweep_dir = pathlib.Path(workdir).absolute()
  runs = expand(config_arg, cli_overrides, sweep_dir)
  if dry_run:
    for line in dry_run_lines(runs, config_arg):
      log(line)
    return 0
  sweep_dir.mkdir(parents=True, exist_ok=True)
  with _exclusive(sweep_dir):
    write_spec(sweep_dir, config_arg, cli_overrides, runs, metric)
    todo, skipped = runner.select(runs, config_arg, retry_failed)
    if launcher == "slurm":
      from tx_jax.sweep import slurm  # pylint: disable=g-import-not-at-top

      folder = sweep_dir / "slurm"
      queued = [r for r in todo if slurm.still_queued(folder, runner.read_status(r.workdir))]
      skipped += [f"[skip] {r.name}: still queued or running on the cluster" for r in queued]
      todo = [r for r in todo if r not in queued]
    for line in skipped:
      log(line)
    log(f"{len(runs)} runs: {len(skipped)} skipped, {len(todo)} to run")
    if todo and launcher == "local":
      # Fewer runs than slots: each gets a bigger share of the cores.
      runner.LocalRunner(config_arg, min(parallel, len(todo)), pin, log=log).run(todo)
    elif todo:
      executor = slurm.make_executor(folder, slurm_options, cluster=slurm_cluster)
      slurm.wait(todo, slurm.submit(todo, config_arg, executor, log=log), log=log)
    rows = summary_lib.summarize(sweep_dir, metric, metric_mode)
  counts = {s: sum(r["status"] == s for r in rows) for s in runner.STATUSES}
  log(
      "sweep: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
      + f"; summary {sweep_dir / 'summary.md'}, plot {sweep_dir / 'curves.png'}"
  )
  return 1 if counts["failed"] else 0


@contextlib.contextmanager
def _exclusive(sweep_dir: pathlib.Path):
  """One launcher per sweep directory: a second one would start the same runs twice."""
  with (sweep_dir / LOCK_FILE).open("a+") as lock:
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      lock.seek(0)
      raise grid.SweepError(
          f"another sweep launcher (pid {lock.read().strip() or '?'}) is running in {sweep_dir}"
      ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(str(os.getpid()))
    lock.flush()
    yield
