r"""LM input pipeline throughput on Tiny Shakespeare, next to the tiny GPT's train-step rate.

  python -m experiments.benchmark_data --output=bench_out/data.json

Prepares TFDS's tiny_shakespeare offline from --data_dir/tinyshakespeare (or the
TFDS cache), times --batches batches of the byte-level LM pipeline (packing on,
seq_len 256, the tiny GPT's batch), then the jitted train step of --config on one
such batch, and writes {pipeline_batches_per_s, train_steps_per_s, ratio, ...}.
ratio = pipeline / step rate: > 1 means input is not the bottleneck.
"""

import json
import os
import pathlib
import time

from absl import app
from absl import flags
from ml_collections import config_flags

from tx_jax import cli

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    default="configs/gpt.py:tiny",
    help_string="Model whose train step is timed.",
    lock_config=True,
)
_DATA_DIR = flags.DEFINE_string(
    "data_dir",
    os.environ.get("TX_JAX_DATA_DIR", "../shared/data"),
    "Offline data folder holding tinyshakespeare/input.txt.",
)
_TFDS_DIR = flags.DEFINE_string("tfds_data_dir", None, "TFDS data_dir (None: TFDS default).")
_BATCHES = flags.DEFINE_integer("batches", 200, "Pipeline batches timed.")
_STEPS = flags.DEFINE_integer("steps", 10, "Train steps timed; 0 skips the step measurement.")
_OUTPUT = flags.DEFINE_string("output", "bench_out/data.json", "JSON written here.")


def pipeline_rate(config, batches: int) -> tuple[float, dict]:
  """Batches/s of config's train iterator after a warm-up batch, and one batch."""
  from tx_jax import data  # pylint: disable=g-import-not-at-top

  it = data.build_train_iterator(config)
  first = next(it)  # preparation and the first shuffle window are not the steady state
  start = time.perf_counter()
  for _ in range(batches):
    next(it)
  return batches / (time.perf_counter() - start), first


def train_step_rate(config, batch: dict, steps: int) -> float | None:
  """Steps/s of the trainer's jitted train step on one device, fed the same batch.

  The hook between the pipeline and the trainer: None when tx_jax.train is absent.
  """
  try:
    import jax  # pylint: disable=g-import-not-at-top
    from tx_jax import models  # pylint: disable=g-import-not-at-top
    from tx_jax.train import loop, optimizers  # pylint: disable=g-import-not-at-top
    from tx_jax.train import state as state_lib, steps as steps_lib  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  import functools  # pylint: disable=g-import-not-at-top

  module = models.build(config.model)
  apply_fn = loop.make_apply_fn(module, config.model)
  tx, schedule = optimizers.build_optimizer(config)

  def init_params(rng):
    args, kwargs = models.model_inputs(config.model, batch)
    return module.init({"params": rng}, *args, **kwargs, train=False)["params"]

  state = jax.jit(state_lib.make_init_fn(init_params, tx, config.seed))()
  step = jax.jit(
      functools.partial(steps_lib.train_step, apply_fn=apply_fn, tx=tx, schedule=schedule),
      donate_argnums=0,
  )
  batch = jax.device_put(batch)
  state, metrics = step(state, batch)  # compile
  jax.block_until_ready(metrics)
  start = time.perf_counter()
  for _ in range(steps):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  return steps / (time.perf_counter() - start)


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = _CONFIG.value
  d = config.data
  d.source, d.tfds_name, d.task, d.tokenizer = "tfds", "tiny_shakespeare", "lm", "byte"
  d.manual_dir = str(pathlib.Path(_DATA_DIR.value) / "tinyshakespeare")
  d.tfds_data_dir = _TFDS_DIR.value
  d.seq_len = min(256, config.model.max_len)
  d.pack = True
  pipe, batch = pipeline_rate(config, _BATCHES.value)
  step = train_step_rate(config, batch, _STEPS.value) if _STEPS.value else None
  result = {
      "pipeline_batches_per_s": pipe,
      "pipeline_tokens_per_s": pipe * batch["inputs"].size,
      "batch_shape": list(batch["inputs"].shape),
      "train_steps_per_s": step,
      "pipeline_to_step_ratio": None if step is None else pipe / step,
      "note": None if step is not None else "tx_jax.train absent or --steps=0: no step rate",
      "config": {
          "seq_len": d.seq_len,
          "global_batch_size": d.global_batch_size,
          "read_threads": d.read_threads,
          "worker_count": d.worker_count,
      },
  }
  out = pathlib.Path(_OUTPUT.value)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=2) + "\n")
  print(json.dumps(result, indent=2))


if __name__ == "__main__":
  cli.run(main)
