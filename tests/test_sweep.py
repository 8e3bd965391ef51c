"""Sweeps: expansion, naming, validation, resume logic, summary, SLURM parameters, end to end."""

import csv
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import transformer
from tx_jax.sweep import grid, launch, plan, runner, slurm, summary
from tx_jax.sweep.grid import SweepError

REPO = pathlib.Path(__file__).resolve().parents[1]
TX = "configs/transformer.py:tiny"


# --- expansion -------------------------------------------------------------------------------


def test_product_zip_cross_and_fixed_values():
  assert grid.product({"optimizer.learning_rate": [1, 2], "seed": [3, 4], "train.steps": 5}) == [
      {"train.steps": 5, "optimizer.learning_rate": 1, "seed": 3},
      {"train.steps": 5, "optimizer.learning_rate": 1, "seed": 4},
      {"train.steps": 5, "optimizer.learning_rate": 2, "seed": 3},
      {"train.steps": 5, "optimizer.learning_rate": 2, "seed": 4},
  ]
  # Tuples are values (config fields can be tuples), only lists are axes.
  assert grid.zipped({"a": [1, 2], "b": [3, 4]}, c=("x", "y")) == [
      {"c": ("x", "y"), "a": 1, "b": 3},
      {"c": ("x", "y"), "a": 2, "b": 4},
  ]
  assert grid.cross(grid.zipped(a=[1, 2], b=[3, 4]), grid.product(seed=[0, 1])) == [
      {"a": 1, "b": 3, "seed": 0},
      {"a": 1, "b": 3, "seed": 1},
      {"a": 2, "b": 4, "seed": 0},
      {"a": 2, "b": 4, "seed": 1},
  ]
  with pytest.raises(SweepError, match="one length"):
    grid.zipped(a=[1, 2], b=[3])
  with pytest.raises(SweepError, match=r"\['a'\]"):
    grid.cross([{"a": 1}], [{"a": 2}])
  with pytest.raises(SweepError, match="no values"):
    grid.product(a=[])


def test_collect_plain_loops_dicts_and_keywords():
  def sweep(add):
    for lr in (0.1, 0.2):
      add({"optimizer.learning_rate": lr}, seed=7)
    add(seed=1)

  assert grid.collect(sweep) == [
      {"optimizer.learning_rate": 0.1, "seed": 7},
      {"optimizer.learning_rate": 0.2, "seed": 7},
      {"seed": 1},
  ]
  with pytest.raises(SweepError, match="no runs"):
    grid.collect(lambda add: None)
  with pytest.raises(SweepError, match="seed"):
    grid.collect(lambda add: add({"seed": 1}, seed=2))


def test_run_names_are_readable_unique_and_collisions_name_both_runs():
  runs = grid.product({"optimizer.learning_rate": [1e-3, 3e-4], "seed": [0, 1], "train.steps": 9})
  assert grid.run_names(runs) == [
      "learning_rate=0.001,seed=0",
      "learning_rate=0.001,seed=1",
      "learning_rate=0.0003,seed=0",
      "learning_rate=0.0003,seed=1",
  ]
  # Two swept keys ending alike keep their full dotted names.
  names = grid.run_names([{"optimizer.name": "adamw", "schedule.name": "constant"},
                          {"optimizer.name": "adafactor", "schedule.name": "constant"},
                          {"optimizer.name": "adamw", "schedule.name": "paper"}])
  assert names[0] == "optimizer.name=adamw,schedule.name=constant"
  with pytest.raises(SweepError, match=r"runs 0 .* and 2 .* both named 'seed=1'"):
    grid.run_names([{"seed": 1}, {"seed": 2}, {"seed": 1}])
  with pytest.raises(SweepError, match="both named"):  # a/b and a_b read the same
    grid.run_names([{"data.manual_dir": "a/b"}, {"data.manual_dir": "a_b"}])


# --- validation -------------------------------------------------------------------------------


def test_command_line_overrides_reach_every_run_exactly_as_the_trainer_parses_them(tmp_path):
  sweeps = [
      {"optimizer.learning_rate": 0.01, "seed": 1},
      {"optimizer.learning_rate": 0.02, "seed": 2},
  ]
  runs = plan.plan_runs(TX, {"train.steps": 7, "train.decode_metrics": ()}, tmp_path, sweeps)
  for run, overrides in zip(runs, sweeps):
    reference = transformer.get_config("tiny")  # independent: the preset, edited by hand
    reference.train.steps, reference.train.decode_metrics = 7, ()
    reference.optimizer.learning_rate, reference.seed = overrides.values()
    assert run.config.to_dict() == reference.to_dict()
    assert run.workdir == tmp_path / run.name
    command = run.command(TX)
    assert command[1:4] == ["-m", "experiments.train", f"--config={TX}"]
    assert "--config.train.steps=7" in command and "--config.seed=%d" % overrides["seed"] in command
  assert not list(tmp_path.iterdir())  # planning writes nothing


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"optimizer.lerning_rate": 0.1}, r"unknown key 'optimizer.lerning_rate'.*learning_rate"),
        ({"optimizr.learning_rate": 0.1}, r"config has no field 'optimizr'"),
        ({"train.steps": 2.5}, r"train.steps=2.5 is a float; config.train.steps is a int"),
        ({"train.steps": True}, r"train.steps=True is a bool"),
        ({"model.norm": 3}, r"model.norm=3 is a int; config.model.norm is a str"),
        ({"optimizer": 1}, r"whole section"),
        ({"train.log_every": 3}, r"swept and also set on the command line"),
    ],
)
def test_bad_keys_and_types_name_the_run_and_the_field(tmp_path, overrides, message):
  with pytest.raises(SweepError, match=r"run (seed=0|seed=1).*" + message):
    plan.plan_runs(TX, {"train.log_every": 5}, tmp_path, [{"seed": 0}, {"seed": 1, **overrides}])
  assert not list(tmp_path.iterdir())


def test_trainer_checks_run_before_anything_starts(tmp_path):
  runs = plan.plan_runs(TX, {}, tmp_path, [{"seed": 0}, {"seed": 1, "model.num_heads": 3}])
  with pytest.raises(SweepError, match=r"run seed=1,num_heads=3: config.model.num_heads=3"):
    plan.semantic_check(runs)


@pytest.mark.parametrize(
    "config", ["gpt.py:tiny", "transformer.py:tiny", "bert.py:tiny", "t5.py:tiny"]
)
def test_every_config_file_has_a_valid_example_sweep(tmp_path, config):
  runs = launch.expand(f"configs/{config}", {}, tmp_path)
  assert len(runs) >= 4 and len({r.name for r in runs}) == len(runs)
  assert all(r.overrides for r in runs)


def test_dry_run_lists_every_run_and_writes_nothing(tmp_path):
  lines = []
  assert launch.launch("configs/gpt.py:tiny", {"train.steps": 5}, tmp_path / "s", dry_run=True,
                       log=lines.append) == 0
  assert lines[0] == "4 runs of configs/gpt.py:tiny:"
  assert "  learning_rate=0.003,seed=1  [pending]  optimizer.learning_rate=0.003 seed=1" in lines
  assert sum("--config.train.steps=5 --config.optimizer.learning_rate" in l for l in lines) == 4
  assert not (tmp_path / "s").exists()


def test_sweep_cli_rejects_an_unknown_command_line_key_before_running(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "experiments.sweep", f"--config={TX}", f"--workdir={tmp_path / 's'}",
       "--config.trian.steps=5"],
      cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
  )
  assert result.returncode != 0 and "trian" in result.stderr
  assert not (tmp_path / "s").exists()


# --- relaunch logic and resources ------------------------------------------------------------


def test_select_skips_done_and_failed_runs_and_retries_failed_only_when_asked(tmp_path):
  runs = plan.plan_runs(TX, {}, tmp_path, [{"seed": s} for s in range(4)])
  for run, state in zip(runs, ["done", "failed", "running", None]):
    if state:
      run.workdir.mkdir()
      runner.write_status(run.workdir, {"status": state, "command": run.command(TX)})
  todo, skipped = runner.select(runs, TX, retry_failed=False)
  assert [r.name for r in todo] == ["seed=2", "seed=3"]
  assert skipped == [
      "[skip] seed=0: done",
      "[skip] seed=1: failed before (--retry_failed reruns it)",
  ]
  todo, _ = runner.select(runs, TX, retry_failed=True)
  assert [r.name for r in todo] == ["seed=1", "seed=2", "seed=3"]
  # A done run whose command changed (say, more steps) runs again and resumes.
  changed = plan.plan_runs(TX, {"train.steps": 9}, tmp_path, [{"seed": s} for s in range(4)])
  assert [r.name for r in runner.select(changed, TX, False)[0]] == ["seed=0", "seed=2", "seed=3"]


def test_parallel_slots_get_disjoint_cores_and_matching_thread_pools(monkeypatch):
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  slots = runner.make_slots(2)
  assert [s.cores for s in slots] == [[0, 1], [2, 3]]
  env = slots[0].env({"XLA_FLAGS": "--xla_dump_to=x"})
  assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "2"
  assert env["XLA_FLAGS"] == "--xla_dump_to=x"  # XLA sizes its pool from the affinity mask
  one = runner.make_slots(5)[4].env({})
  assert one["OMP_NUM_THREADS"] == "1" and "--xla_cpu_multi_thread_eigen=false" in one["XLA_FLAGS"]
  assert runner.make_slots(1)[0].cores is None  # a lone run keeps the whole machine
  with pytest.raises(ValueError, match="--parallel 6 needs at least 6 CPU cores, but only 5"):
    runner.make_slots(6)
  monkeypatch.setenv("JAX_PLATFORMS", "")
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
  assert [s.gpus for s in runner.make_slots(2)] == [["0", "1"], ["2", "3"]]
  assert runner.make_slots(2)[1].env({})["CUDA_VISIBLE_DEVICES"] == "2,3"


# --- summary ---------------------------------------------------------------------------------


def _fake_sweep(root: pathlib.Path, seed: int = 0) -> dict[str, list[dict]]:
  """A sweep directory with three runs' metrics.jsonl / status.json, written by hand."""
  rng = np.random.default_rng(seed)
  runs = [
      {"name": f"learning_rate={lr},seed=0", "overrides": {"optimizer.learning_rate": lr}}
      for lr in (0.1, 0.2, 0.3)
  ]
  spec = {
      "config": TX,
      "cli_overrides": {"train.steps": "30"},
      "swept_keys": ["optimizer.learning_rate"],
      "runs": runs,
      "metric": "eval_loss",
      "metric_mode": "min",
  }
  root.mkdir(parents=True, exist_ok=True)
  (root / "sweep.json").write_text(json.dumps(spec))
  lines = {}
  for run, state in zip(runs, ["done", "failed", "running"]):
    workdir = root / run["name"]
    workdir.mkdir()
    rows = []
    for step in (10, 20, 30):
      rows.append({"step": step, "loss": float(rng.uniform(1, 3))})
      rows.append({"step": step, "eval_loss": float(rng.uniform(1, 3)),
                   "eval_accuracy": float(rng.uniform(0, 1))})
    lines[run["name"]] = rows
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    error = ["Traceback", "ValueError: bad"] if state == "failed" else []
    runner.write_status(workdir, {"status": state, "wall_time_sec": 12.0, "error": error})
  return lines


def test_summary_matches_the_runs_metrics(tmp_path):
  lines = _fake_sweep(tmp_path)
  summary.summarize(tmp_path)
  with (tmp_path / "summary.csv").open() as f:
    rows = list(csv.DictReader(f))
  expected = {}
  for name, metrics in lines.items():
    losses = [r["eval_loss"] for r in metrics if "eval_loss" in r]
    accs = [r["eval_accuracy"] for r in metrics if "eval_accuracy" in r]
    expected[name] = (min(losses), losses[-1], max(accs), accs[-1])
  assert [r["name"] for r in rows] == sorted(expected, key=lambda n: expected[n][0])
  for row in rows:
    best, final, best_acc, final_acc = expected[row["name"]]
    assert float(row["best_eval_loss"]) == pytest.approx(best, rel=1e-12)
    assert float(row["final_eval_loss"]) == pytest.approx(final, rel=1e-12)
    assert float(row["best_eval_accuracy"]) == pytest.approx(best_acc, rel=1e-12)
    assert float(row["final_eval_accuracy"]) == pytest.approx(final_acc, rel=1e-12)
    assert row["steps"] == "30" and row["workdir"] == str(tmp_path / row["name"])
    assert row["optimizer.learning_rate"] == row["name"].split("=")[1].split(",")[0]
  assert {r["name"]: r["status"] for r in rows} == {
      "learning_rate=0.1,seed=0": "done", "learning_rate=0.2,seed=0": "failed",
      "learning_rate=0.3,seed=0": "running"}
  markdown = (tmp_path / "summary.md").read_text()
  assert all(name in markdown for name in lines) and "ValueError: bad" in markdown
  assert (tmp_path / "curves.png").stat().st_size > 1000
  # --metric with a higher-is-better name sorts descending.
  summary.summarize(tmp_path, metric="eval_accuracy")
  with (tmp_path / "summary.csv").open() as f:
    order = [r["name"] for r in csv.DictReader(f)]
  assert order == sorted(expected, key=lambda n: -expected[n][2])


# --- SLURM -----------------------------------------------------------------------------------


def test_slurm_array_submission_parameters(tmp_path, monkeypatch):
  """Submits through submitit's real SlurmExecutor against a fake sbatch; reads the script."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "srun").write_text("#!/bin/sh\nexit 0\n")
  (bin_dir / "sbatch").write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
  for tool in ("srun", "sbatch"):
    (bin_dir / tool).chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
  runs = plan.plan_runs(TX, {"train.steps": 5}, tmp_path / "sweep", [{"seed": s} for s in range(3)])
  options = slurm.SlurmOptions(partition="gpu", gpus_per_node=8, nodes_per_run=2, time_min=30,
                               cpus_per_task=16, parallel=2)
  executor = slurm.make_executor(tmp_path / "sweep" / "slurm", options)
  jobs = slurm.submit(runs, TX, executor, cwd=REPO, log=lambda line: None)
  assert [j.job_id for j in jobs] == ["4242_0", "4242_1", "4242_2"]
  script = jobs[0].paths.submission_file.read_text()
  for line in ["#SBATCH --partition=gpu", "#SBATCH --gpus-per-node=8", "#SBATCH --nodes=2",
               "#SBATCH --ntasks-per-node=1", "#SBATCH --time=30", "#SBATCH --cpus-per-task=16",
               "#SBATCH --array=0-2%2"]:
    assert line in script.splitlines(), line
  for run, job in zip(runs, jobs):
    task = pickle_load(job.paths.submitted_pickle)
    assert isinstance(task.function, slurm.TrainerTask)
    assert task.args[0] == run.command(TX) and task.args[1] == str(run.workdir)
    assert runner.read_status(run.workdir)["slurm_job_id"] == job.job_id


def pickle_load(path):
  import submitit  # pylint: disable=g-import-not-at-top

  return submitit.helpers.DelayedSubmission.load(path)


# --- end to end (subprocesses) ---------------------------------------------------------------

SMALL_CONFIG = '''
from configs import transformer


def get_config(arg=None):
  config = transformer.get_config("tiny")
  m, t = config.model, config.train
  m.num_layers = m.num_decoder_layers = 1
  m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 2, 2, 16, 64
  config.data.global_batch_size = config.data.eval_global_batch_size = 8
  t.steps, t.log_every, t.eval_every, t.eval_batches = {steps}, 1, 0, 1
  t.decode_metrics, t.plot, t.peak_flops, t.progress = (), False, 1e12, "log"
  config.schedule.warmup_steps = 1
  config.checkpoint.every, config.checkpoint.best_metric = {every}, ""
  return config


def sweep(add):
{body}
'''


def _write_config(tmp_path, body, steps=3, every=0) -> str:
  path = tmp_path / "small.py"
  path.write_text(SMALL_CONFIG.format(steps=steps, every=every, body=body))
  return str(path)


def _env() -> dict[str, str]:
  """One CPU device per trainer (conftest's 8 fake devices only slow a tiny run down)."""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  flags = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
  env["XLA_FLAGS"] = flags.strip()
  return env


def _sweep(*args, check_rc=None):
  result = subprocess.run([sys.executable, "-m", "experiments.sweep", *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=900, check=False)
  if check_rc is not None:
    assert result.returncode == check_rc, result.stdout + result.stderr
  return result


@pytest.mark.slow
def test_local_parallel_sweep_isolates_a_failure_overlaps_and_relaunch_skips(tmp_path):
  body = ('  add({"optimizer.learning_rate": 1e-3})\n  add({"optimizer.learning_rate": 3e-3})\n'
          '  add({"optimizer.learning_rate": 3e-3, "optimizer.name": "sgd_typo"})')
  config = _write_config(tmp_path, body)
  out = tmp_path / "sweep"
  first = _sweep(f"--config={config}", f"--workdir={out}", "--parallel=2", check_rc=1)
  statuses = {p.parent.name: runner.read_status(p.parent) for p in out.glob("*/status.json")}
  good = ["learning_rate=0.001", "learning_rate=0.003"]
  bad = "learning_rate=0.003,name=sgd_typo"
  assert {n: s["status"] for n, s in statuses.items()} == {
      good[0]: "done",
      good[1]: "done",
      bad: "failed",
  }
  assert any("sgd_typo" in line for line in statuses[bad]["error"])
  # --parallel 2 really overlaps: the two good runs' wall-clock intervals intersect.
  (a, b) = (statuses[n] for n in good)
  assert max(a["start_time"], b["start_time"]) < min(a["end_time"], b["end_time"])
  assert {a["slot"], b["slot"]} == {"cores 0", "cores 1"}
  assert "[start 1/3]" in first.stdout and "[failed]" in first.stdout
  # The command in each workdir reproduces the run alone.
  assert "--config.optimizer.learning_rate=0.003" in (out / good[1] / "command.sh").read_text()
  with (out / "summary.csv").open() as f:
    rows = {r["name"]: r for r in csv.DictReader(f)}
  for name in good:
    evals = [r["eval_loss"] for r in summary.read_metrics(out / name) if "eval_loss" in r]
    assert float(rows[name]["final_eval_loss"]) == pytest.approx(evals[-1])
    assert rows[name]["steps"] == "3"
  # A relaunch starts nothing: done runs are skipped, the failed one waits for --retry_failed.
  again = _sweep(f"--config={config}", f"--workdir={out}", "--parallel=2", check_rc=1)
  assert "3 runs: 3 skipped, 0 to run" in again.stdout and "[start" not in again.stdout
  assert runner.read_status(out / good[0])["attempts"] == 1


@pytest.mark.slow
def test_a_stopped_sweep_resumes_its_unfinished_run_from_its_checkpoint(tmp_path):
  steps = 100
  config = _write_config(tmp_path, '  add({"seed": 3})', steps=steps, every=2)
  out = tmp_path / "sweep"
  args = [sys.executable, "-m", "experiments.sweep", f"--config={config}", f"--workdir={out}"]
  process = subprocess.Popen(args, cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True)
  metrics = out / "seed=3" / "metrics.jsonl"
  deadline = time.time() + 600
  while time.time() < deadline and process.poll() is None:
    if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
      break
    time.sleep(0.05)
  process.send_signal(signal.SIGTERM)
  stdout, _ = process.communicate(timeout=300)
  status = runner.read_status(out / "seed=3")
  if status["status"] == "done":
    pytest.skip("the run finished all its steps before the signal arrived (a fast machine)")
  assert "[stopped] seed=3" in stdout, stdout
  assert status["status"] == "running" and status["returncode"] == 0
  log_lines = (out / "seed=3" / "train.log").read_text().splitlines()
  stop_line = next(line for line in log_lines if "received: saved step" in line)
  saved = int(stop_line.split("saved step ")[1].split(",")[0])
  assert 0 < saved < steps
  result = _sweep(f"--config={config}", f"--workdir={out}", check_rc=0)
  assert "[done] seed=3" in result.stdout
  assert f"resumed from step {saved}" in (out / "seed=3" / "train.log").read_text()
  assert runner.read_status(out / "seed=3")["attempts"] == 2
  logged = [r["step"] for r in summary.read_metrics(out / "seed=3") if "loss" in r]
  assert logged == list(range(1, steps + 1))


@pytest.mark.slow
def test_slurm_launcher_through_submitits_local_executor(tmp_path, monkeypatch):
  monkeypatch.chdir(REPO)
  for key, value in _env().items():
    monkeypatch.setenv(key, value)
  config = _write_config(tmp_path, '  add({"seed": 0})\n  add({"seed": 1})')
  out = tmp_path / "sweep"
  options = slurm.SlurmOptions("", 0, 1, 20, 0, 2)
  lines = []
  rc = launch.launch(config, {}, out, launcher="slurm", slurm_options=options,
                     slurm_cluster="local", log=lines.append)
  assert rc == 0, "\n".join(lines)
  for name in ("seed=0", "seed=1"):
    status = runner.read_status(out / name)
    assert status["status"] == "done" and status["slurm_job_id"]
    assert "done: step=3" in (out / name / "train.log").read_text()
  with (out / "summary.csv").open() as f:
    assert sorted(r["status"] for r in csv.DictReader(f)) == ["done", "done"]
  again = []
  launch.launch(config, {}, out, launcher="slurm", slurm_options=options, slurm_cluster="local",
                log=again.append)
  assert "2 runs: 2 skipped, 0 to run" in again


def test_a_second_launcher_on_the_same_directory_is_refused(tmp_path):
  import fcntl  # pylint: disable=g-import-not-at-top

  tmp_path.mkdir(exist_ok=True)
  with (tmp_path / launch.LOCK_FILE).open("w") as held:
    held.write("12345")
    held.flush()
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with pytest.raises(SweepError, match=r"another sweep launcher \(pid 12345\)"):
      launch.launch(TX, {}, tmp_path, log=lambda line: None)
  assert not (tmp_path / "sweep.json").exists()
