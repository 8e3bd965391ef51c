"""`compile`: time to the first train step, layers scanned and unrolled.

For the bench config and gpt2-small (batch 1 x 256 tokens, so the step itself is ~1/10
of the total on 2 cores), from nothing to the first step's metrics on the host: state
init, tracing, XLA compilation and one step, each part timed.
"""

from __future__ import annotations

import functools
import time

from tx_jax.benchmarks import common, models
from tx_jax.benchmarks.common import Options

GPT2_SMALL_TOKENS = (1, 256)  # (batch, seq_len) of gpt2-small's first step


def first_step(config, batch: dict) -> dict:
  """Seconds of init, trace+lower, compile and the first step of config's train step."""
  import jax  # pylint: disable=g-import-not-at-top

  from tx_jax import models as tx_models  # pylint: disable=g-import-not-at-top
  from tx_jax.train import loop, optimizers, run as run_lib, state as state_lib, steps as steps_lib

  start = time.perf_counter()
  module = tx_models.build(config.model)
  apply_fn = loop.make_apply_fn(module, config.model)
  tx, schedule = optimizers.build_optimizer(config)

  def init_params(rng):
    args, kwargs = tx_models.model_inputs(config.model, batch)
    return module.init({"params": rng}, *args, **kwargs, train=False)["params"]

  init = jax.jit(
      state_lib.make_init_fn(init_params, tx, config.seed),
      compiler_options=run_lib.init_compiler_options(jax.default_backend()),
  )
  state = jax.block_until_ready(init())
  t_init = time.perf_counter()
  step = jax.jit(
      functools.partial(steps_lib.train_step, apply_fn=apply_fn, tx=tx, schedule=schedule),
      donate_argnums=0,
      compiler_options=run_lib.train_step_compiler_options(jax.default_backend()),
  )
  lowered = step.lower(state, batch)
  t_lower = time.perf_counter()
  compiled = lowered.compile()
  t_compile = time.perf_counter()
  _, metrics = compiled(state, batch)
  jax.device_get(metrics)
  t_step = time.perf_counter()
  return {
      "init_s": t_init - start,
      "trace_lower_s": t_lower - t_init,
      "compile_s": t_compile - t_lower,
      "step_s": t_step - t_compile,
      "first_step_s": t_step - start,
  }


def run(options: Options) -> dict:
  """The `compile` section's JSON: one row per (model, scan_layers)."""
  gpt = common.preset_module("gpt")

  if options.smoke:
    targets = [("smoke", models.jax_config(common.SMOKE), common.SMOKE.batch, common.SMOKE.seq_len)]
  else:
    small = gpt.get_config("gpt2-small")
    small.model.dropout_rate = small.model.attention_dropout_rate = 0.0
    targets = [
        ("bench", models.jax_config(common.BENCH), common.BENCH.batch, common.BENCH.seq_len),
        ("gpt2-small", small, *GPT2_SMALL_TOKENS),
    ]
  rows = []
  for name, config, batch_size, seq_len in targets:
    for scan in (True, False):
      config = config.copy_and_resolve_references()
      config.model.scan_layers = scan
      config.data.seq_len, config.data.global_batch_size = seq_len, batch_size
      import numpy as np  # pylint: disable=g-import-not-at-top

      ids = np.random.default_rng(0).integers(4, config.model.vocab_size, (batch_size, seq_len + 1))
      batch = {
          "inputs": ids[:, :-1].astype(np.int32),
          "targets": ids[:, 1:].astype(np.int32),
          "weights": np.ones((batch_size, seq_len), np.float32),
      }
      rows.append({"model": name, "scan_layers": scan, "batch": batch_size, "seq_len": seq_len, **first_step(config, batch)})
  return {"rows": rows}


def plot(result: dict, path) -> None:
  """Stacked bars: init, trace, compile, step per (model, scan)."""
  plt = common.pyplot()
  labels = [f"{r['model']}\n{'scan' if r['scan_layers'] else 'unrolled'}" for r in result["rows"]]
  fig, ax = plt.subplots(figsize=(7, 3.5))
  left = [0.0] * len(labels)
  for part in ("init_s", "trace_lower_s", "compile_s", "step_s"):
    values = [r[part] for r in result["rows"]]
    ax.barh(labels, values, left=left, label=part[:-2])
    left = [a + b for a, b in zip(left, values)]
  ax.set(xlabel="seconds to the first step", title="compile")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
