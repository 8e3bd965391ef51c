"""The training loop: `train_and_evaluate(config, workdir) -> summary`.

Shapes first (`jax.eval_shape`), then shardings, then a sharded `jax.jit(init)` or a restore
from the workdir's newest good checkpoint; one jitted `train_step` with the state donated;
metrics fetched one step late so the host never stalls the device.
"""

import functools
import json
import pathlib
import signal
import threading
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from tx_jax import checkpoint as checkpoint_lib
from tx_jax import data
from tx_jax import models
from tx_jax import sharding
from tx_jax import validation
from tx_jax.models import summary as model_summary
from tx_jax.train import evaluator as evaluation, metrics as metrics_lib, optimizers, progress as progress_lib
from tx_jax.train import state as state_lib, steps

NONFINITE = validation.NONFINITE


class NonFiniteLossError(RuntimeError):
  """The loss or gradient went non-finite and config.train.nonfinite is 'abort'."""


def validate(config: ml_collections.ConfigDict) -> None:
  """Every cross-field check of a training config, before anything is built (tx_jax.validation)."""
  validation.train_config(config)


def make_apply_fn(module: Any, model_cfg: ml_collections.ConfigDict) -> steps.ApplyFn:
  """(params, batch, train, rng) -> logits for any family, via models.model_inputs."""

  def apply_fn(params, batch, train, rng):
    args, kwargs = models.model_inputs(model_cfg, batch)
    return module.apply({"params": params}, *args, **kwargs, train=train, rngs={"dropout": rng})

  return apply_fn


class _StopFlag:
  """Records SIGTERM / SIGINT so the loop can save at the current step and return."""

  def __init__(self):
    self.signum = None
    self._previous = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      for s in (signal.SIGTERM, signal.SIGINT):
        self._previous[s] = signal.signal(s, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.signum = signum

  def __exit__(self, *exc):
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def is_set(self) -> bool:
    """Whether any process got a signal (all processes must save the same step)."""
    local = self.signum is not None
    if jax.process_count() == 1:
      return local
    return bool(np.any(multihost_utils.process_allgather(np.array(local))))


def dry_run_report(config: ml_collections.ConfigDict) -> str:
  """--dry_run text: model summary, then each parameter's PartitionSpec and per-device bytes.

  Everything is abstract (jax.eval_shape): no data is read and no weights are allocated.
  """
  module = models.build(config.model)
  seq_len, target_len = model_summary.sequence_lengths(config)
  ids = lambda n: jnp.zeros((1, n), jnp.int32)  # noqa: E731
  example = (
      {"encoder_inputs": ids(seq_len), "decoder_inputs": ids(target_len)}
      if config.model.family == "encdec"
      else {"inputs": ids(seq_len)}
  )
  args, kwargs = models.model_inputs(config.model, example)
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.logical_rules(config)
  init = lambda rng: module.init({"params": rng}, *args, **kwargs, train=False)["params"]  # noqa: E731
  boxed = jax.eval_shape(init, jax.random.PRNGKey(0))
  tx, _ = optimizers.build_optimizer(config)
  opt_state = jax.eval_shape(tx.init, nn.unbox(boxed))
  return "\n".join(
      [model_summary.describe(config), sharding.describe_shardings(boxed, mesh, rules, opt_state)]
  )


# --- nothing lost: the trained state outlives a failing eval or checkpoint bookkeeping ---
def save_trained_state(
    ckpt: checkpoint_lib.Checkpointer, step: int, state: Any, data_iter: Any
) -> None:
  """Saves `state` at `step` (no metrics) when a failure after training would lose it.

  Called while another exception propagates: a failure here is logged, never raised, so
  the original error is the one reported.
  """
  try:
    ckpt.save(step, state, data_iter)
    ckpt.wait()
    print(f"saved the trained state at step {step} in {ckpt.directory}", flush=True)
  except Exception as e:  # noqa: BLE001 -- e.g. a non-finite state, which is never saved
    print(
        f"could not save step {step} ({e}); the last good checkpoint is step "
        f"{ckpt.latest_step()}",
        flush=True,
    )


def _host(tree: Any) -> Any:
  return jax.tree.map(np.asarray, jax.device_get(tree))


def train_and_evaluate(
    config: ml_collections.ConfigDict, workdir: str | pathlib.Path
) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its checkpoints) and returns a summary.

  Writes config.json, metrics.jsonl, TensorBoard events under tensorboard/, checkpoints/
  and curves.png. Stops early, after saving, on SIGTERM / SIGINT (summary["preempted"]).
  """
  wall_start = time.time()
  validate(config)
  sharding.validate(config, jax.device_count(), jax.process_count())
  workdir = pathlib.Path(workdir)
  is_main = jax.process_index() == 0
  if is_main:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")

  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.logical_rules(config)
  replicated = sharding.replicated(mesh)
  batch_sharding = sharding.batch_sharding(mesh)
  to_global = lambda b: data.make_global_batch(b, mesh, sharding.BATCH_AXES)  # noqa: E731

  module = models.build(config.model)
  apply_fn = make_apply_fn(module, config.model)
  tx, schedule = optimizers.build_optimizer(config)
  train_iter = data.build_train_iterator(config)
  first_batch = next(train_iter)

  example = {k: jnp.zeros((1,) + v.shape[1:], v.dtype) for k, v in first_batch.items()}

  def init_params(rng):
    args, kwargs = models.model_inputs(config.model, example)
    return module.init({"params": rng}, *args, **kwargs, train=False)["params"]

  init_fn = state_lib.make_init_fn(init_params, tx, config.seed)
  # Init is not wrapped in the rules context (sharding.with_rules says so): out_shardings
  # place the parameters.
  boxed_params = jax.eval_shape(init_params, jax.random.PRNGKey(0))
  abstract_state = jax.eval_shape(init_fn)
  shardings = sharding.state_shardings(abstract_state, boxed_params, mesh, rules)

  ckpt = checkpoint_lib.Checkpointer(workdir / "checkpoints", config.checkpoint, config.model)
  restored = None
  if config.checkpoint.resume:
    restored = ckpt.restore_latest(
        checkpoint_lib.abstract_with_shardings(abstract_state, shardings), train_iter
    )
  if restored is not None:
    state, start = restored
    pending_batch = None  # the iterator resumes exactly after the checkpoint's last batch
    if is_main:
      print(f"resumed from step {start} in {ckpt.directory}", flush=True)
  else:
    state = jax.jit(init_fn, out_shardings=shardings)()
    start, pending_batch = 0, first_batch

  # Traced under the mesh and logical rules, so the models' activation constraints apply.
  train_step = jax.jit(
      sharding.with_rules(
          functools.partial(
              steps.train_step,
              apply_fn=apply_fn,
              tx=tx,
              schedule=schedule,
              label_smoothing=config.loss.label_smoothing,
              z_loss=config.loss.z_loss,
              grad_accum_steps=config.train.grad_accum_steps,
          ),
          mesh,
          rules,
      ),
      in_shardings=(shardings, batch_sharding),
      out_shardings=(shardings, replicated),
      donate_argnums=0,
  )
  eval_step = jax.jit(
      sharding.with_rules(functools.partial(steps.eval_step, apply_fn=apply_fn), mesh, rules),
      in_shardings=(shardings.params, batch_sharding),
      out_shardings=replicated,
  )
  evaluator = evaluation.Evaluator(config, module, eval_step, to_global, replicated)

  counts = model_summary.count_params(
      models.ModelConfig.from_config(config.model), nn.unbox(boxed_params)
  )
  flops_per_token = model_summary.flops_per_token(
      models.ModelConfig.from_config(config.model), counts, *model_summary.sequence_lengths(config)
  )
  peak = metrics_lib.peak_flops(config.train.peak_flops)

  writer = metrics_lib.MetricWriter(workdir, start)
  total = config.train.steps
  bar = progress_lib.Progress(config.train.progress, start, total, enabled=is_main)
  t = config.train
  window = {"sums": None, "tokens": 0, "time": time.time()}
  last_eval: dict[str, float] = {}
  last_train: dict[str, float] = {}
  preempted = False

  def consume(step: int, device_metrics: dict, tokens: int) -> None:
    """Host side of one finished step: non-finite check, window sums, a log line."""
    m = _host(device_metrics)
    if int(m["nonfinite"]):
      if t.nonfinite == "abort":
        raise NonFiniteLossError(
            f"non-finite loss or gradient at step {step} (config.train.nonfinite='abort'); "
            f"the last good checkpoint is step {ckpt.latest_step()} in {ckpt.directory}"
        )
      bar.write(f"step {step}: non-finite loss or gradient; update skipped")
    sums = {k: m[k] for k in ("loss_sum", "correct_sum", "weight_sum")}
    window["sums"] = (
        sums if window["sums"] is None else {k: window["sums"][k] + sums[k] for k in sums}
    )
    window["tokens"] += tokens
    window["last"] = m
    if step % t.log_every == 0 or step == total:
      elapsed = max(time.time() - window["time"], 1e-9)
      s = window["sums"]
      denom = max(float(s["weight_sum"]), 1e-9)
      tokens_per_sec = window["tokens"] / elapsed
      line = {
          "loss": float(s["loss_sum"]) / denom,
          "accuracy": float(s["correct_sum"]) / denom,
          "learning_rate": float(m["learning_rate"]),
          "grad_norm": float(m["grad_norm"]),
          "tokens_per_sec": tokens_per_sec,
          "mfu": tokens_per_sec * flops_per_token / peak,
      }
      last_train.update(line)
      writer.write(step, line)
      bar.update(step, line)
      window.update(sums=None, tokens=0, time=time.time())

  pending = None  # (step, device metrics, tokens) of the last dispatched step
  with _StopFlag() as stop:
    try:
      for step in range(start + 1, total + 1):
        local = pending_batch if pending_batch is not None else next(train_iter)
        pending_batch = None
        state, device_metrics = train_step(state, to_global(local))
        if pending is not None:
          consume(*pending)
        pending = (step, device_metrics, metrics_lib.batch_tokens(local))
        if step == start + 1:  # the first step's time is mostly compilation
          consume(*pending)
          pending = None
          window.update(tokens=0, time=time.time())
        is_eval = step == total or (t.eval_every and step % t.eval_every == 0)
        is_save = step == total or (config.checkpoint.every and step % config.checkpoint.every == 0)
        stopping = stop.is_set()
        if is_eval or is_save or stopping:
          if pending is not None:
            consume(*pending)
            pending = None
        eval_metrics = None
        try:
          if is_eval and not stopping:
            eval_metrics = evaluator.evaluate(state.params)
            last_eval.update(eval_metrics)
            writer.write(step, eval_metrics)
            bar.update(step, eval_metrics)
            window["time"] = time.time()  # eval time is not training throughput
          best = eval_metrics if config.checkpoint.best_metric else None
          if is_save or stopping or best is not None:
            ckpt.save(step, state, train_iter, metrics=best)
        except Exception:
          save_trained_state(ckpt, step, state, train_iter)
          raise
        if stopping:
          bar.write(f"signal {stop.signum} received: saved step {step}, exiting")
          preempted = True
          break
      if pending is not None:
        consume(*pending)
    finally:
      bar.close()
      writer.close()
      ckpt.close()

  final_step = int(jax.device_get(state.step))
  result = {
      "step": final_step,
      "preempted": preempted,
      "workdir": str(workdir),
      "wall_time_sec": time.time() - wall_start,
      "params": counts.total,
      "skipped_updates": int(jax.device_get(state.skipped)),
      **last_train,
      **last_eval,
  }
  if not preempted and is_main:
    if t.plot:
      result["curves"] = str(metrics_lib.plot_curves(workdir))
    if t.decode_metrics and t.print_examples:
      for src, out, ref in evaluator.examples(state.params, t.print_examples):
        print(f"  {src!r} -> {out!r}   (reference {ref!r})")
    print(
        f"metrics: {workdir / 'metrics.jsonl'}  curves: {result.get('curves', '-')}  "
        f"TensorBoard: tensorboard --logdir {workdir / 'tensorboard'}"
    )
    (workdir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
  return result
