"""experiments.benchmark: its helpers against hand-computed values, and every section's keys.

The end-to-end tests run the real command in a subprocess (one real CPU device, as a
user runs it) at --smoke sizes and check the names scripts rely on (issue "Performance").
"""

import json
import math
import pathlib
import statistics
import subprocess
import sys
import time

import pytest

from tests.train import runs
from tx_jax.benchmarks import common, gemm_one_core, models, time_to_loss, train

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_bench_flops_per_token_by_hand():
  """6·N_matmul + 12·L·T·D for the bench config, N counted by hand (tied output included)."""
  s = common.BENCH
  matmul = s.num_layers * 12 * s.d_model**2 + s.vocab * s.d_model
  want = 6 * matmul + 12 * s.num_layers * s.seq_len * s.d_model
  assert train.flops_per_token(models.jax_config(s)) == want == 147_849_216


def test_seconds_to_takes_the_first_eval_at_or_below():
  points = [{"seconds": 1.0, "loss": 2.5}, {"seconds": 2.0, "loss": 1.9}, {"seconds": 3.0, "loss": 1.7}]
  assert time_to_loss.seconds_to(points, 1.90) == 2.0
  assert time_to_loss.seconds_to(points, 1.0) is None


def test_seconds_to_interpolated_is_linear_between_the_evals_around_the_crossing():
  points = [{"seconds": s, "loss": loss} for s, loss in ((10.0, 2.5), (20.0, 2.0), (30.0, 1.5))]
  # 1.90 lies a fifth of the way from 2.0 (20 s) to 1.5 (30 s).
  assert time_to_loss.seconds_to_interpolated(points, 1.90) == pytest.approx(22.0)
  assert time_to_loss.seconds_to_interpolated(points, 2.0) == 20.0  # reached at an eval
  assert time_to_loss.seconds_to_interpolated(points, 3.0) == 10.0  # below from the first eval
  assert time_to_loss.seconds_to_interpolated(points, 1.0) is None


def test_interleaved_calls_each_runner_once_per_round_after_warmup_rounds():
  calls = []
  wall, cores = common.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, 3)
  assert calls == ["a", "b"] * (common.WARMUP_ROUNDS + 3)
  assert len(wall["a"]) == len(cores["b"]) == 3


def test_rounds_record_each_call_and_the_calling_threads_cpu():
  timer = common.Rounds({"spin": lambda: sum(range(200_000)), "sleep": lambda: time.sleep(0.05)})
  timer.round()
  timer.round()
  assert len(timer.wall["spin"]) == len(timer.thread_cpu["sleep"]) == 2
  assert all(w >= 0.05 for w in timer.wall["sleep"])
  assert max(timer.thread_cpu["sleep"]) < 0.02 < min(timer.wall["sleep"])  # asleep, not busy
  assert min(timer.thread_cpu["spin"]) > 0


def test_rounds_start_each_call_after_the_threads_of_the_one_before_went_quiet():
  """Like torch's OpenMP workers, a runner leaves a thread busy for 10 ms after it returns;
  the next runner's call must not be charged for it."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top

  def spin_until(end):
    block = bytes(1 << 20)
    while time.perf_counter() < end:
      hashlib.sha256(block)  # releases the GIL, as torch's threads never held it

  def leaves_a_busy_thread():
    threading.Thread(target=spin_until, args=(time.perf_counter() + 0.01,)).start()

  timer = common.Rounds({"busy_after": leaves_a_busy_thread, "sleep": lambda: time.sleep(0.05)})
  for _ in range(3):
    timer.round()
  assert max(timer.cores["sleep"]) < 0.05  # no other thread ran during its call


def test_matmul_peak_records_one_flop_rate_per_call_against_a_numpy_product():
  peak = common.MatmulPeak("jax", 64)
  peak()
  peak()
  assert len(peak.flops) == 2 and min(peak.flops) > 0
  for framework in ("xla", "torch"):  # XLA's own dot beside tx_jax's product; torch's
    other = common.MatmulPeak(framework, 64)
    other()
    assert len(other.flops) == 1 and other.flops[0] > 0
  with pytest.raises(ValueError, match="framework='tf'"):
    common.MatmulPeak("tf", 64)


@pytest.mark.slow  # a child process importing torch and JAX
def test_one_core_gemm_runs_in_a_child_pinned_to_one_cpu_with_one_torch_thread():
  rows = gemm_one_core.measure([(16, 8, 4), (8, 4, 2)], rounds=1)
  assert [row["shape"] for row in rows] == [[16, 8, 4], [8, 4, 2]]
  for row in rows:
    assert row["cpus"] == 1 and row["torch_threads"] == 1
    assert row["jax_flops"] > 0 and row["torch_flops"] > 0
    assert row["jax_over_torch"] == pytest.approx(row["jax_flops"] / row["torch_flops"])


@pytest.mark.parametrize("argv", [["abc"], ["5", "1", "2"], ["0", "4", "4", "4"], []])
def test_one_core_gemm_rejects_bad_arguments_in_one_error_line(argv):
  out = subprocess.run(
      [sys.executable, "-m", "tx_jax.benchmarks.gemm_one_core", *argv],
      capture_output=True,
      text=True,
  )
  assert out.returncode == 2 and out.stdout == ""
  assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ")


def test_minimal_torch_gpt_starts_at_uniform_loss():
  """At GPT-2's 0.02 init the logits are ~0, so the loss is ~ln(vocab) (an independent fact)."""
  torch = pytest.importorskip("torch")
  from tx_jax.benchmarks import torch_gpt

  torch.manual_seed(0)
  model = torch_gpt.GPT(vocab=97, d_model=32, num_layers=2, num_heads=4, max_len=16)
  ids = torch.randint(0, 97, (3, 17))
  loss = torch_gpt.loss_fn(model, ids[:, :-1], ids[:, 1:], torch.ones(3, 16))
  assert abs(loss.item() - math.log(97)) < 0.05


def test_unknown_section_is_an_error_naming_it(tmp_path):
  from tx_jax.benchmarks import runner

  with pytest.raises(ValueError, match="trian"):
    runner.run(tmp_path, ["trian"], common.Options(smoke=True))
  with pytest.raises(ValueError, match="preset"):
    runner.run(tmp_path, [], common.Options(preset="a100"))


@pytest.mark.parametrize(
    "args, names",
    [
        # Zero rounds would run every section and take medians of nothing.
        (["--rounds=0"], "--rounds"),
        # Checked before any section: otherwise each data section would fail in turn.
        (["--only=attention,small", "--data_dir={tmp}/nowhere"], "--data_dir="),
    ],
)
def test_bad_flag_is_one_error_line_before_any_section_runs(tmp_path, args, names):
  args = [a.format(tmp=tmp_path) for a in args]
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark", "--out", str(tmp_path / "b"), *args],
      cwd=REPO,
      env=runs.env(TFDS_DATA_DIR=str(tmp_path / "tfds")),  # nothing prepared
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.strip().splitlines() == [proc.stderr.strip()], proc.stderr[-3000:]
  assert proc.stderr.startswith("error: ") and names in proc.stderr, proc.stderr
  assert not (tmp_path / "b").exists()


def _run_benchmark(out: pathlib.Path, data_dir: pathlib.Path, *args: str) -> dict:
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.benchmark", "--smoke", "--out", str(out), "--data_dir", str(data_dir), *args],
      cwd=REPO,
      env=runs.env(),  # one device, as a user runs it; compiled fast: --smoke times nothing
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return json.loads((out / "benchmark.json").read_text())


@pytest.mark.slow
def test_smoke_run_writes_every_section_and_the_names_scripts_rely_on(tmp_path, data_dir):
  report = _run_benchmark(tmp_path, data_dir)
  for section in ("train", "small", "time_to_loss", "attention", "decode", "data", "compile",
                  "context"):
    assert "error" not in report[section], report[section]
    assert (tmp_path / f"{section}.png").stat().st_size > 0
  for key in (
      "tokens_per_sec",
      "step_tokens_per_sec",
      "torch_eager_tokens_per_sec",
      "torch_compile_tokens_per_sec",
      "mfu",
      "matmul_peak_flops",
      "xla_matmul_peak_flops",
  ):
    assert key in report["train"], key
  assert report["train"]["step_tokens_per_sec"] > 0 and report["train"]["mfu"] > 0
  # MFU is paired by round: each trainer window over the matmul peak timed in its round.
  train = report["train"]
  peaks, windows = train["matmul_peak_flops_all"], train["trainer_windows_tokens_per_sec"]
  assert len(peaks) == len(windows) == len(train["torch_matmul_peak_flops_all"])
  assert min(peaks) > 0
  per_round = [t * train["flops_per_token"] / p for t, p in zip(windows, peaks)]
  assert train["mfu"] == pytest.approx(statistics.median(per_round))
  for key in (
      "loop_overhead",
      "loop_overhead_paired",
      "loop_overhead_round_paired",
      "trainer_thread_cpu_ms_per_step",
  ):
    assert isinstance(report["train"][key], float), key
  # The loop phase after the rounds: its own pairs of a trainer window and a bare step.
  assert train["loop_pairs"] == len(train["loop_overhead_paired_all"]) == 2
  assert len(train["loop_overhead_round_paired_all"]) == len(windows)
  # The step and the trainer run on the device count the probe found faster.
  probe = {int(n): ms for n, ms in train["cpu_devices_probe_ms"].items()}
  assert set(probe) == {1, 2} and train["cpu_devices"] == min(probe, key=probe.get)
  assert train["other_cpu_devices"] == 3 - train["cpu_devices"]
  rows = report["attention"]["rows"]
  assert rows and all({"backend", "seq_len", "time_ms", "peak_bytes"} <= set(r) for r in rows)
  keys = ("tx_jax_seconds", "torch_seconds", "tx_jax_over_torch_interpolated", "tx_jax_final_loss")
  for key in keys:
    assert key in report["time_to_loss"], key
  assert report["time_to_loss"]["tx_jax_final_loss"] > 0
  assert {r["scan_layers"] for r in report["compile"]["rows"]} == {True, False}
  rows = report["context"]["rows"]
  assert {(r["variant"], r["sequence"]) for r in rows} == {
      (v, s) for v in ("ring", "all_gather", "gspmd") for s in (1, 2, 4, 8)
  }
  assert all({"variant", "sequence", "seq_len", "time_ms", "peak_bytes"} <= set(r) for r in rows)
  assert report["machine"]["loadavg"]
  # The process runs on the CPU presets' devices; each section's step is also measured on
  # the other device count.
  assert report["machine"]["devices"] == ["cpu:0", "cpu:1"]
  for section in ("train", "small"):
    assert report[section]["ratios"]["step_over_other_devices"] > 0
    for gemm in report[section]["gemms"]:
      assert gemm["one_core"]["shape"] == gemm["shape"] and gemm["one_core"]["cpus"] == 1
      assert min(gemm[f"{fw}_flops"] for fw in ("jax", "xla", "torch")) > 0


@pytest.mark.slow
def test_h200_preset_code_path_runs_on_cpu_at_toy_sizes(tmp_path, data_dir):
  report = _run_benchmark(tmp_path, data_dir, "--preset", "h200")
  rows = report["train"]["rows"]
  assert [r["model"] for r in rows] == ["tiny", "llama-tiny"]
  assert all(r["dtype"] == "bfloat16" and r["mfu"] > 0 for r in rows), rows
  assert report["attention"]["dtype"] == "bfloat16" and report["attention"]["rows"]
  blocks = [r for r in report["blocks"]["rows"] if r["backend"] == "blockwise"]
  assert [r["block"] for r in blocks] == [16, 32] and all(r["time_ms"] > 0 for r in blocks)
