"""`data`: LM input pipeline throughput on Tiny Shakespeare, next to the train-step rate.

Prepares TFDS's tiny_shakespeare offline from data_dir/tinyshakespeare, times batches of
the byte-level LM pipeline (packing on, seq_len 256, the tiny GPT's batch 16), then the
jitted train step of configs/gpt.py:tiny on one such batch. ratio = pipeline / step rate:
> 1 means input is not the bottleneck.
"""

from __future__ import annotations

import pathlib
import time

from tx_jax.benchmarks import common
from tx_jax.benchmarks.common import Options


def pipeline_rate(config, batches: int) -> tuple[float, dict]:
  """Batches/s of config's train iterator after a warm-up batch, and that first batch."""
  from tx_jax import data  # pylint: disable=g-import-not-at-top

  it = data.build_train_iterator(config)
  first = next(it)  # preparation and the first shuffle window are not the steady state
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  return batches / (time.perf_counter() - start), first


def run(options: Options) -> dict:
  """The `data` section's JSON."""
  gpt = common.preset_module("gpt")
  from tx_jax.benchmarks import models

  config = gpt.get_config("tiny")
  d = config.data
  d.source, d.tfds_name, d.task, d.tokenizer = "tfds", "tiny_shakespeare", "lm", "byte"
  d.manual_dir = str(pathlib.Path(options.data_dir) / "tinyshakespeare")
  d.seq_len = min(256, config.model.max_len)
  d.pack = True
  if options.smoke:
    d.global_batch_size = 2
  batches, steps = (5, 2) if options.smoke else (200, 10)
  pipe, batch = pipeline_rate(config, batches)
  run_step = models.jax_step(config, batch)
  run_step()  # compile
  start = time.perf_counter()
  for _ in range(steps):
    run_step()
  step_rate = steps / (time.perf_counter() - start)
  return {
      "pipeline_batches_per_s": pipe,
      "pipeline_tokens_per_s": pipe * batch["inputs"].size,
      "batch_shape": list(batch["inputs"].shape),
      "train_steps_per_s": step_rate,
      "pipeline_to_step_ratio": pipe / step_rate,
      "config": {
          "seq_len": d.seq_len,
          "global_batch_size": d.global_batch_size,
          "read_threads": d.read_threads,
          "worker_count": d.worker_count,
      },
  }


def plot(result: dict, path) -> None:
  """Two bars: pipeline batches/s and train steps/s (log scale)."""
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(6, 2.8))
  values = [result["pipeline_batches_per_s"], result["train_steps_per_s"]]
  ax.barh(["input pipeline (batches/s)", "tiny GPT train step (steps/s)"], values)
  ax.set(xscale="log", title=f"data: pipeline / step = {result['pipeline_to_step_ratio']:.0f}x")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
