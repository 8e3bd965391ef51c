"""`time_to_loss`: configs/gpt.py:tiny-shakespeare vs a minimal PyTorch GPT, loss vs wall time.

Both train the same shape on the same batches (tx_jax's own byte-level, packed Tiny
Shakespeare iterator feeds both), with the same step count, AdamW hyperparameters,
weight-decay mask, clipping and learning-rate schedule (the config's optax schedule,
evaluated per step for PyTorch), and both evaluate on the same validation batches at the
same steps. Wall time runs from the start of each run (tx_jax's includes compilation and
its checkpoints, as a user sees them). The figure of merit is the wall time at which the
validation loss reaches THRESHOLD nats/byte, interpolated linearly between the evaluation
before and the first one at or below it. Evaluations come every 100 steps, so the first
one at or below alone can move the ratio by 100 steps' time when one run crosses just
after an evaluation and the other just before. Both are reported. The PyTorch GPT attends
across packed document boundaries (no segment mask; Tiny Shakespeare is one document per
split).
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import tempfile
import time
from unittest import mock

from tx_jax.benchmarks import common, models
from tx_jax.benchmarks.common import Options

THRESHOLD = 1.90  # nats per byte on the validation split
EVALS = 10  # evaluations per run at least (eval_every lowered to steps // EVALS if needed)


def shipped_config(options: Options):
  """configs/gpt.py:tiny-shakespeare as shipped, data from options.data_dir."""
  gpt = common.preset_module("gpt")

  config = gpt.get_config("tiny-shakespeare")
  config.data.manual_dir = str(pathlib.Path(options.data_dir) / "tinyshakespeare")
  config.model.kernels = options.kernels
  t = config.train
  t.eval_every = min(t.eval_every, max(1, t.steps // EVALS))
  t.plot, t.progress = False, "log"
  if options.smoke:
    s = common.SMOKE
    m = config.model
    m.num_layers, m.d_model, m.num_heads = s.num_layers, s.d_model, s.num_heads
    m.num_kv_heads, m.head_dim, m.mlp_dim = s.num_heads, s.d_model // s.num_heads, 4 * s.d_model
    config.data.seq_len, config.data.global_batch_size = s.seq_len, s.batch
    config.data.eval_global_batch_size = s.batch
    t.steps, t.eval_every, t.eval_batches = 4, 2, 1
    config.schedule.warmup_steps = 1
  return config


def run_tx_jax(config) -> tuple[list[dict], float]:
  """(eval points {step, seconds, loss}, total wall) of train_and_evaluate on config."""
  from tx_jax.train import loop, metrics as metrics_lib  # pylint: disable=g-import-not-at-top

  points, start = [], time.perf_counter()
  write = metrics_lib.MetricWriter.write

  def timed_write(writer, step, values):  # stamps each eval line with the run's wall clock
    if "eval_loss" in values:
      points.append({"step": int(step), "seconds": time.perf_counter() - start, "loss": float(values["eval_loss"])})
    return write(writer, step, values)

  with tempfile.TemporaryDirectory() as workdir, contextlib.redirect_stdout(io.StringIO()):
    with mock.patch.object(metrics_lib.MetricWriter, "write", timed_write):
      start = time.perf_counter()
      loop.train_and_evaluate(config, workdir)
  return points, time.perf_counter() - start


def run_torch(config) -> tuple[list[dict], float]:
  """The same run in the minimal PyTorch GPT: (eval points, total wall)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  import torch

  from tx_jax import data  # pylint: disable=g-import-not-at-top
  from tx_jax.benchmarks import torch_gpt
  from tx_jax.train import optimizers

  models.set_torch_threads()
  torch.manual_seed(config.seed)
  # The clock starts where tx_jax's does: before the schedule, the data and the model.
  start = time.perf_counter()
  m, o, t = config.model, config.optimizer, config.train
  _, schedule = optimizers.build_optimizer(config)
  lrs = np.asarray(schedule(np.arange(t.steps)), np.float64)
  as_torch = lambda batch: {k: torch.from_numpy(np.asarray(v)) for k, v in batch.items()}  # noqa: E731
  eval_batches = data.build_eval_batches(config, t.eval_split)
  eval_batches = [as_torch(b) for b in (eval_batches[: t.eval_batches] if t.eval_batches else eval_batches)]
  train_iter = data.build_train_iterator(config)
  model = torch_gpt.GPT(m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.max_len)
  opt = torch_gpt.adamw(model, o.learning_rate, o.b1, o.b2, o.eps, o.weight_decay)

  def evaluate() -> float:
    model.eval()
    nll = weight = 0.0
    with torch.no_grad():
      for b in eval_batches:
        w = b["weights"].float()
        logits = model(b["inputs"].long())
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), b["targets"].long().flatten(), reduction="none"
        )
        nll += float((loss * w.flatten()).sum())
        weight += float(w.sum())
    model.train()
    return nll / max(weight, 1e-9)

  points = []
  for step in range(1, t.steps + 1):
    b = as_torch(next(train_iter))
    for group in opt.param_groups:
      group["lr"] = float(lrs[step - 1])
    loss = torch_gpt.loss_fn(model, b["inputs"].long(), b["targets"].long(), b["weights"])
    loss.backward()
    if o.grad_clip_norm:
      torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if step == t.steps or step % t.eval_every == 0:
      points.append({"step": step, "seconds": time.perf_counter() - start, "loss": evaluate()})
  return points, time.perf_counter() - start


def seconds_to(points: list[dict], threshold: float) -> float | None:
  """Wall seconds at the first evaluation at or below threshold (None if never)."""
  return next((p["seconds"] for p in points if p["loss"] <= threshold), None)


def seconds_to_interpolated(points: list[dict], threshold: float) -> float | None:
  """Wall seconds where the loss reaches threshold, linear between the evals around it.

  The loss is taken as linear in wall time between the last evaluation above threshold
  and the first at or below it; None if never reached, the first eval's time if that one is.
  """
  for before, after in zip([None] + points, points):
    if after["loss"] <= threshold:
      if before is None:
        return after["seconds"]
      fraction = (before["loss"] - threshold) / (before["loss"] - after["loss"])
      return before["seconds"] + fraction * (after["seconds"] - before["seconds"])
  return None


def run(options: Options) -> dict:
  """The `time_to_loss` section's JSON."""
  config = shipped_config(options)
  # The data pipeline both runs share imports TFDS and registers its builder on first use
  # only: here, before either clock starts, so that the run going first does not pay it
  # for both.
  from tx_jax import data  # pylint: disable=g-import-not-at-top

  data.build_train_iterator(config)

  tx_points, tx_wall = run_tx_jax(config)
  torch_points, torch_wall = run_torch(config)
  tx_seconds, torch_seconds = seconds_to(tx_points, THRESHOLD), seconds_to(torch_points, THRESHOLD)
  tx_between = seconds_to_interpolated(tx_points, THRESHOLD)
  torch_between = seconds_to_interpolated(torch_points, THRESHOLD)
  return {
      "threshold_nats_per_byte": THRESHOLD,
      "steps": config.train.steps,
      "eval_every": config.train.eval_every,
      "batch": [config.data.global_batch_size, config.data.seq_len],
      "tx_jax_seconds": tx_seconds,
      "torch_seconds": torch_seconds,
      "tx_jax_over_torch": common.ratio(tx_seconds, torch_seconds),
      "tx_jax_seconds_interpolated": tx_between,
      "torch_seconds_interpolated": torch_between,
      "tx_jax_over_torch_interpolated": common.ratio(tx_between, torch_between),
      "tx_jax_final_loss": tx_points[-1]["loss"] if tx_points else None,
      "torch_final_loss": torch_points[-1]["loss"] if torch_points else None,
      "tx_jax_wall_seconds": tx_wall,
      "torch_wall_seconds": torch_wall,
      "tx_jax_curve": tx_points,
      "torch_curve": torch_points,
  }


def plot(result: dict, path) -> None:
  """Validation loss against wall time, both runs, with the threshold."""
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, label in (("tx_jax", "tx_jax"), ("torch", "PyTorch (minimal GPT)")):
    points = result[f"{name}_curve"]
    seconds, losses = [p["seconds"] for p in points], [p["loss"] for p in points]
    (line,) = ax.plot(seconds, losses, marker="o", label=label)
    crossing = result.get(f"{name}_seconds_interpolated")
    if crossing is not None:  # where the loss reaches the threshold, between evaluations
      ax.axvline(crossing, color=line.get_color(), linestyle=":", linewidth=1)
  ax.axhline(result["threshold_nats_per_byte"], color="gray", linestyle="--", linewidth=1)
  ax.set(xlabel="wall seconds", ylabel="validation nats / byte", title="time to loss: tiny-shakespeare")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
