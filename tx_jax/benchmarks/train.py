"""`train` and `small`: tx_jax's train step and trainer against PyTorch on the same shape.

In one process, interleaved round by round: tx_jax's jitted `train_step` alone, PyTorch
(transformers' GPT2LMHeadModel, dropout 0, torch.optim.AdamW) eager and under
torch.compile, and for `small` also the minimal PyTorch GPT of torch_gpt.py. The real
trainer (`tx_jax.train.loop.train_and_evaluate`, Tiny Shakespeare through the data
pipeline) drives the rounds: one after each of its log windows. tx_jax runs on 1 or 2
CPU devices (config.mesh.cpu_devices; 2 form an fsdp axis for the bench config, a data
axis for `small`), whichever a probe in the same process finds faster; the same step on
the other count is a contestant too, to show what the choice buys. After the rounds, a loop
phase pairs more trainer windows each with one call of the bare step alone:
`loop_overhead_paired`, the loop's own cost.
MFU = model FLOPs (the dry run's formula) / the fp32 matmul peak timed in the same rounds
(round by round, then the median), for each framework against its own peak.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
import time

from tx_jax.benchmarks import common, gemm_one_core, models
from tx_jax.benchmarks.common import Options, Shape

CALL_SECONDS = 1.0  # target duration of one timed call of a runner
PEAK_SIZE = 1024  # square fp32 GEMM whose FLOP/s is "the matmul peak"
PROBE_ROUNDS = 3  # alternating runs per CPU device count when choosing one
# The loop's cost is measured in its own phase after the rounds: trainer windows alternating
# with a call of the bare step alone, LOOP_SECONDS in all, between MIN_ and MAX_LOOP_PAIRS.
LOOP_SECONDS = 60.0
MIN_LOOP_PAIRS, MAX_LOOP_PAIRS = 8, 24


def flops_per_token(config) -> float:
  """Training FLOPs per token of config's model, as `--dry_run` prints them."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  from tx_jax import models as tx_models  # pylint: disable=g-import-not-at-top
  from tx_jax.models import summary

  model_config = tx_models.ModelConfig.from_config(config.model)
  params = summary.abstract_params(model_config)
  counts = summary.count_params(model_config, nn.unbox(params))
  return summary.flops_per_token(model_config, counts, config.data.seq_len)


def trainer_windows(config, steps: int, log_every: int, after_log) -> list[dict]:
  """The logged windows of a real `train_and_evaluate` run (compile excluded).

  `after_log(step)` runs after each window with the device idle and the clock paused
  (loop.train_and_evaluate). Each window also gets the main thread's CPU seconds per step,
  up to the start of its after_log call: the loop's own host work (data, transfer,
  dispatch, metrics) shares the cores with XLA's threads.
  """
  from tx_jax.train import loop, metrics as metrics_lib  # pylint: disable=g-import-not-at-top

  config = config.copy_and_resolve_references()
  t = config.train
  t.steps, t.log_every, t.eval_every, t.eval_batches = steps, log_every, 0, 1
  t.plot, t.progress, t.peak_flops = False, "log", 1.0  # our own peak is measured once, below
  config.checkpoint.every = 0
  config.schedule.warmup_steps = 0  # short runs; the schedule does not change the cost
  thread_cpu: list[float] = []
  clock = {"since": time.thread_time()}

  def hook(step: int) -> None:
    thread_cpu.append(time.thread_time() - clock["since"])
    after_log(step)
    clock["since"] = time.thread_time()

  with tempfile.TemporaryDirectory() as workdir, contextlib.redirect_stdout(io.StringIO()):
    loop.train_and_evaluate(config, workdir, after_log=hook)
    rows = [r for r in metrics_lib.read_metrics(workdir) if "tokens_per_sec" in r]
  # The first window starts at step 2 (step 1 compiles), the others span log_every steps.
  # The first window's CPU also holds setup and compilation: a warm-up window, never timed.
  per_window = [log_every - 1] + [log_every] * (len(rows) - 1)
  return [
      {"tokens_per_sec": r["tokens_per_sec"], "thread_cpu_ms_per_step": 1e3 * cpu / n}
      for r, cpu, n in zip(rows, thread_cpu, per_window)
  ]


def compare(shape: Shape, options: Options, *, minimal_torch: bool, torch_compile: bool) -> dict:
  """The interleaved comparison on `shape`; the JSON of the `train` / `small` sections.

  The trainer drives the rounds: after each of its log windows, every other contestant
  runs once (`after_log`), so the trainer and the bare step see the same minute of this
  shared machine and `loop_overhead` compares like with like.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import torch

  from tx_jax import data  # pylint: disable=g-import-not-at-top
  from tx_jax.benchmarks import torch_gpt  # pylint: disable=g-import-not-at-top
  from tx_jax.train import metrics as metrics_lib  # pylint: disable=g-import-not-at-top

  threads = models.set_torch_threads()
  torch.manual_seed(0)
  config = models.jax_config(shape, options.data_dir, options.kernels)
  # The bare step runs on a batch of the trainer's own pipeline: the same keys (segment
  # ids, positions) give the same computation, so the loop's cost is all that differs.
  batch = next(data.build_train_iterator(config))
  # config.mesh.cpu_devices is a per-machine choice (2 devices won the bench step on one
  # 2-core VM, 1 on another). Both counts are built and probed; the faster runs the step and
  # the trainer (what a user tuning the config would ship), the other is timed beside them.
  other = 1 if shape.cpu_devices > 1 else 2
  configs = {shape.cpu_devices: config}
  if other <= len(jax.devices()):
    configs[other] = config.copy_and_resolve_references()
    configs[other].mesh.cpu_devices = other
  jax_steps = {n: models.jax_step(c, batch) for n, c in configs.items()}
  for jax_step in jax_steps.values():
    jax_step()  # compile

  def back_to_back(step, steps: int):  # as the trainer dispatches steps: wait for the last,
    def run() -> None:  # and never run more than MAX_PENDING ahead
      for i in range(1, steps):
        step(wait=i % metrics_lib.MetricsWindow.MAX_PENDING == 0)
      step()

    return run

  # The probe picks the device count and sizes the calls: one call of each runner should
  # last ~CALL_SECONDS so timer noise and one-off stalls stay small against it. Steps run
  # back to back (a lone step waits for its own dispatch), after a first run of 4 that also
  # grows the heap (tx_jax.host_memory; an estimate from a cold step sized the calls far too
  # short), then runs of >= 2 s that alternate between the counts, PROBE_ROUNDS each, and
  # the median per count. Probing one count after the other let the machine's drift
  # between them decide, and once chose the count every later round found slower.
  estimate = {n: common.seconds(back_to_back(s, 4)) / 4 for n, s in jax_steps.items()}
  probe_steps = max(2, round((0.05 if options.smoke else 2.0) / min(estimate.values())))
  probe_timer = common.Rounds({n: back_to_back(s, probe_steps) for n, s in jax_steps.items()})
  for _ in range(PROBE_ROUNDS):
    probe_timer.round()
  probe = {n: common.median(w) / probe_steps for n, w in probe_timer.wall.items()}
  chosen = min(probe, key=probe.get)
  other = next((n for n in jax_steps if n != chosen), other)
  config, jax_step, step_seconds = configs[chosen], jax_steps[chosen], probe[chosen]
  # At least 2, so that each call, like each trainer window, overlaps dispatch with a step.
  calls = max(2, round((0.05 if options.smoke else CALL_SECONDS) / step_seconds))
  repeat = lambda fn: lambda: [fn() for _ in range(calls)]  # noqa: E731

  runners = {"step": back_to_back(jax_step, calls)}
  if other in jax_steps:  # what the device count buys: the same step on the other choice
    runners["step_other_devices"] = back_to_back(jax_steps[other], calls)
  runners["torch_eager"] = repeat(
      models.torch_step(models.hf_gpt2(shape), shape, models.hf_loss, False)
  )
  if torch_compile:
    runners["torch_compile"] = repeat(
        models.torch_step(models.hf_gpt2(shape), shape, models.hf_loss, True)
    )
  if minimal_torch:
    gpt = torch_gpt.GPT(
        shape.vocab, shape.d_model, shape.num_layers, shape.num_heads, shape.seq_len
    )
    runners["torch_minimal_eager"] = repeat(
        models.torch_step(gpt, shape, models.minimal_loss, False)
    )
  # The matmul peak of each framework is timed in every round too (MFU per round, below).
  # jax: the product tx_jax's models run (MKL's GEMM on CPU), which the MFU divides by;
  # xla: XLA's own dot, recorded beside it.
  peaks = {fw: common.MatmulPeak(fw, PEAK_SIZE, options.kernels) for fw in ("jax", "xla", "torch")}
  timer = common.Rounds({**runners, **{f"{fw}_matmul_peak": peak for fw, peak in peaks.items()}})
  timer.warm()
  # The trainer's first windows grow the heap for its own executables (tx_jax.host_memory):
  # they and the rounds after them are recorded but left out of the medians.
  warmup = 0 if options.smoke else common.WARMUP_ROUNDS
  log_every = calls  # a trainer window and a call of the bare step run as many steps
  # After the rounds, the loop phase: each window is followed by one call of the bare step
  # alone. Its first pair is dropped: that window ran right after the last round's torch.
  fitting = round(LOOP_SECONDS / (2 * calls * step_seconds))
  loop_pairs = 2 if options.smoke else max(MIN_LOOP_PAIRS, min(MAX_LOOP_PAIRS, fitting))
  round_windows = warmup + options.rounds
  loop_step_wall: list[float] = []

  def after_log(_) -> None:
    if len(timer.wall["step"]) < round_windows:
      timer.round()
    else:
      loop_step_wall.append(common.seconds(runners["step"]))

  windows = trainer_windows(
      config, (round_windows + 1 + loop_pairs) * log_every, log_every, after_log
  )
  loop_windows, windows = windows[round_windows + 1 :], windows[:round_windows]
  wall = {name: w[warmup:] for name, w in timer.wall.items()}
  cores = {name: c[warmup:] for name, c in timer.cores.items()}
  tokens = shape.tokens * calls
  result: dict = {"shape": shape.__dict__, "torch_threads": threads, "steps_per_call": calls}
  result["cpu_devices"], result["other_cpu_devices"] = chosen, other
  result["cpu_devices_probe_ms"] = {str(n): 1e3 * t for n, t in probe.items()}
  for name in runners:
    result[f"{name}_tokens_per_sec"] = tokens / common.median(wall[name])
    result[f"{name}_ms"] = 1e3 * common.median(wall[name]) / calls
    result[f"{name}_cores_busy"] = common.median(cores[name])
    result[f"{name}_all_ms"] = [1e3 * w / calls for w in wall[name]]
  result.setdefault("torch_compile_tokens_per_sec", None)
  step_cpu = common.median(timer.thread_cpu["step"][warmup:])
  result["step_thread_cpu_ms_per_step"] = 1e3 * step_cpu / calls

  result["trainer_warmup_windows_tokens_per_sec"] = [w["tokens_per_sec"] for w in windows[:warmup]]
  windows = windows[warmup:]
  result["tokens_per_sec"] = common.median([w["tokens_per_sec"] for w in windows])
  result["trainer_windows_tokens_per_sec"] = [w["tokens_per_sec"] for w in windows]
  result["trainer_thread_cpu_ms_per_step"] = common.median(
      [w["thread_cpu_ms_per_step"] for w in windows]
  )
  result["loop_overhead"] = 1.0 - result["tokens_per_sec"] / result["step_tokens_per_sec"]

  def paired(trainer: list[dict], step_wall: list[float]) -> list[float]:
    """1 - trainer / bare step within each pair: the machine's drift cancels in a pair."""
    return [1.0 - w["tokens_per_sec"] * s / tokens for w, s in zip(trainer, step_wall)]

  # Window i with the bare step's call right after it. In the rounds a window starts right
  # after torch's contestants, and such windows ran slower than windows after the bare step
  # alone: a cost of sharing the process with torch, not of the loop. The loop phase, where the two alternate with
  # nothing between them, gives loop_overhead_paired; the rounds' pairs are kept beside it.
  result["loop_overhead_round_paired_all"] = paired(windows, wall["step"])
  result["loop_overhead_round_paired"] = common.median(result["loop_overhead_round_paired_all"])
  result["loop_overhead_paired_all"] = paired(loop_windows, loop_step_wall[1:])
  result["loop_overhead_paired"] = common.median(result["loop_overhead_paired_all"])
  result["loop_pairs"] = len(result["loop_overhead_paired_all"])

  # MFU per round: that round's tokens/s over that round's peak, then the median. The
  # trainer's window i and round i's peak ran within seconds of each other.
  flops = flops_per_token(config)
  jax_peaks, torch_peaks = (peaks[fw].flops[-len(windows) :] for fw in ("jax", "torch"))

  def mfu(tokens_per_sec: list[float], peak_flops: list[float]) -> float:
    return common.median([t * flops / p for t, p in zip(tokens_per_sec, peak_flops)])

  per_call = {name: [tokens / w for w in wall[name]] for name in runners}
  result.update(
      flops_per_token=flops,
      matmul_peak_flops=common.median(jax_peaks),
      matmul_peak_flops_all=jax_peaks,
      xla_matmul_peak_flops=common.median(peaks["xla"].flops[-len(windows) :]),
      torch_matmul_peak_flops=common.median(torch_peaks),
      torch_matmul_peak_flops_all=torch_peaks,
      mfu=mfu(result["trainer_windows_tokens_per_sec"], jax_peaks),
      step_mfu=mfu(per_call["step"], jax_peaks),
      torch_eager_mfu=mfu(per_call["torch_eager"], torch_peaks),
  )
  if "torch_compile" in per_call:
    result["torch_compile_mfu"] = mfu(per_call["torch_compile"], torch_peaks)
  best_torch_eager = max(
      v for k, v in result.items() if k.startswith("torch_") and k.endswith("eager_tokens_per_sec")
  )
  result["ratios"] = {
      "step_over_torch_compile": common.ratio(
          result["step_tokens_per_sec"], result["torch_compile_tokens_per_sec"]
      ),
      "trainer_over_torch_compile": common.ratio(
          result["tokens_per_sec"], result["torch_compile_tokens_per_sec"]
      ),
      "step_over_torch_eager": common.ratio(
          result["step_tokens_per_sec"], result["torch_eager_tokens_per_sec"]
      ),
      "step_over_fastest_torch_eager": common.ratio(
          result["step_tokens_per_sec"], best_torch_eager
      ),
      "step_over_other_devices": common.ratio(
          result["step_tokens_per_sec"], result.get("step_other_devices_tokens_per_sec")
      ),
      "trainer_mfu_over_jax_peak": result["mfu"],
  }
  # The ceiling: the step's two largest GEMMs alone, XLA vs torch, same threads; and each
  # on one core, which separates XLA's kernel from how it splits the GEMM over threads.
  shapes = [(shape.tokens, shape.d_model, n) for n in (4 * shape.d_model, shape.vocab)]
  result["gemms"] = [common.gemm_times(*mkn, options.rounds) for mkn in shapes]
  for gemm, one_core in zip(result["gemms"], gemm_one_core.measure(shapes, options.rounds)):
    gemm["one_core"] = one_core
  return result


def run_train(options: Options) -> dict:
  """The `train` section: the bench config (6 layers, d 512, T 256, batch 8, vocab 8192)."""
  shape = common.SMOKE if options.smoke else common.BENCH
  return compare(shape, options, minimal_torch=False, torch_compile=not options.smoke)


def run_small(options: Options) -> dict:
  """The `small` section: 4 layers, d 128, 4 heads, T 64, batch 12."""
  shape = common.SMOKE if options.smoke else common.SMALL
  return compare(shape, options, minimal_torch=True, torch_compile=not options.smoke)


def plot(result: dict, path, title: str) -> None:
  """Bar chart of tokens/s per contestant, with the per-round spread."""
  plt = common.pyplot()
  names = [
      k[: -len("_tokens_per_sec")]
      for k, v in result.items()
      if k.endswith("_tokens_per_sec") and isinstance(v, float) and not k.startswith("pipeline")
  ]
  names = ["tokens"] + [n for n in names if n != "tokens"] if "tokens_per_sec" in result else names
  labels = {
      "tokens": "tx_jax trainer",
      "step": "tx_jax jitted step",
      "step_other_devices": "tx_jax step, other CPU device count",
  }
  values = [
      result["tokens_per_sec"] if n == "tokens" else result[f"{n}_tokens_per_sec"] for n in names
  ]
  fig, ax = plt.subplots(figsize=(7, 3.5))
  ax.barh([labels.get(n, n.replace("_", " ")) for n in names], values)
  for i, v in enumerate(values):
    ax.text(v, i, f" {v:,.0f}", va="center")
  ax.set(xlabel="tokens / s (median)", title=title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
