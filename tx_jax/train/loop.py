"""The training loop: `train_and_evaluate(config, workdir) -> summary`.

`run.setup` builds or restores everything; the loop below steps, then does whatever is due:
log (one step late, so the host never stalls the device), evaluate, save.
"""

import gc
import json
import pathlib
import signal
import threading
import time
from typing import Any, Callable

import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from tx_jax import checkpoint as checkpoint_lib
from tx_jax import evaluation
from tx_jax import models
from tx_jax import sharding
from tx_jax import validation
from tx_jax.models import summary as model_summary
from tx_jax.train import metrics as metrics_lib, optimizers
from tx_jax.train import run as run_lib
from tx_jax.train.run import NonFiniteLossError, make_apply_fn  # noqa: F401  (public here)

NONFINITE = validation.NONFINITE


def validate(config: ml_collections.ConfigDict) -> None:
  """Every cross-field check of a training config, before anything is built (tx_jax.validation)."""
  validation.train_config(config)


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


def any_process(*local: bool) -> tuple[bool, ...]:
  """Each flag, true when it is true on any process (all processes must stop at one step)."""
  if jax.process_count() == 1:
    return local
  gathered = multihost_utils.process_allgather(np.array(local, bool))
  return tuple(bool(b) for b in np.any(np.reshape(gathered, (-1, len(local))), axis=0))


def dry_run_report(config: ml_collections.ConfigDict) -> str:
  """--dry_run text: model summary, then each parameter's PartitionSpec and per-device bytes.

  Everything is abstract (jax.eval_shape): no data is read and no weights are allocated.
  """
  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.logical_rules(config)
  boxed = models.abstract_params(config.model, boxed=True)
  tx, _ = optimizers.build_optimizer(config)
  opt_state = jax.eval_shape(tx.init, nn.unbox(boxed))
  return "\n".join(
      [
          model_summary.describe(config, nn.unbox(boxed)),
          sharding.describe_shardings(boxed, mesh, rules, opt_state),
      ]
  )


class FrozenForGC:
  """Leaves everything alive after set-up and compilation out of the cyclic GC's walks.

  A set-up run holds hundreds of thousands of GC-tracked objects (JAX, Flax, grain,
  TensorFlow's modules, the traced step), and a full (generation 2) collection walks all
  of them on the loop's thread, on cores XLA's threads share. `freeze()` (after the first step has
  compiled) moves them to the permanent generation, so collections walk only what the
  loop allocates since. Unfrozen on exit, unless objects had been frozen before entry.
  """

  def __enter__(self) -> "FrozenForGC":
    self._frozen_before = gc.get_freeze_count() > 0
    return self

  def freeze(self) -> None:
    gc.collect()  # what is garbage now should not be kept for the whole run
    gc.freeze()

  def __exit__(self, *exc) -> None:
    if not self._frozen_before:
      gc.unfreeze()


def is_due(step: int, every: int, total: int) -> bool:
  """Periodic work (log, eval, save) runs every `every` steps (0 = never) and at the last step."""
  return step == total or (every > 0 and step % every == 0)


# --- nothing lost: the trained state outlives a failing eval or checkpoint bookkeeping ---
def save_trained_state(run: run_lib.TrainRun, step: int) -> None:
  """Saves the state at `step` (no metrics) when a failure after training would lose it.

  Called while another exception propagates: a failure here is printed, never raised, so
  the original error is the one reported.
  """
  try:
    run.save(step)
    run.ckpt.wait()
    print(f"saved the trained state at step {step} in {run.ckpt.directory}", flush=True)
  except checkpoint_lib.CheckpointError as e:  # a non-finite state (never saved), a failed write
    print(
        f"could not save step {step} ({e}); the last good checkpoint is step "
        f"{run.ckpt.latest_step()}",
        flush=True,
    )


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | pathlib.Path,
    *,
    after_log: Callable[[int], None] | None = None,
) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming from its checkpoints) and returns a summary.

  Writes config.json, metrics.jsonl, TensorBoard events under tensorboard/, checkpoints/
  and curves.png. Stops early, after saving, on SIGTERM / SIGINT (summary["preempted"]).

  Process-wide state is left as it was (no environment, malloc or hook changes; those are
  the entry points', tx_jax.cli.PROCESS_SETTINGS), except that SIGTERM / SIGINT handlers
  are installed while it trains and restored on return.

  `after_log(step)` runs after each training log line, once that step has finished and
  with the throughput clock paused: whatever it runs (the benchmark times other
  contestants there, round by round) neither shares the device with a training step nor
  counts in tokens_per_sec. The step after it starts from an idle device, which is
  counted.
  """
  wall_start = time.time()
  sharding.use_cpu_devices(config.mesh)  # before validation starts JAX; an error if too few
  validate(config)  # the mesh too: validation.train_config ends with sharding.validate
  run = run_lib.setup(config, pathlib.Path(workdir))
  total, eval_every, save_every = config.train.steps, config.train.eval_every, config.checkpoint.every
  window = metrics_lib.MetricsWindow(
      log_every=config.train.log_every,
      total=total,
      flops_per_token=run.flops_per_token,
      peak_flops=run.peak_flops,
      report=run.report,
      on_nonfinite=run.on_nonfinite,
  )
  last_eval, preempted = {}, False
  with _StopFlag() as stop, FrozenForGC() as gc_heap:
    try:
      for step in range(run.start + 1, total + 1):
        batch = run.next_batch()
        run.state, device_metrics = run.train_step(run.state, run.to_global(batch))
        window.push(step, device_metrics, metrics_lib.batch_tokens(batch))
        if step == run.start + 1:  # the first step's time is mostly compilation
          window.flush()
          gc_heap.freeze()
          window.restart_clock()
        # A failed save stops the run here: what it trains next could not be kept.
        preempted, save_failed = any_process(stop.signum is not None, run.ckpt.save_failed())
        if save_failed:
          run.ckpt.raise_save_failure()
        evaluate = is_due(step, eval_every, total) and not preempted
        save = is_due(step, save_every, total) or preempted
        hook = after_log is not None and is_due(step, config.train.log_every, total)
        if evaluate or save or hook:
          window.flush()
        if hook:
          with window.paused():
            after_log(step)
        eval_metrics = None
        try:
          if evaluate:
            with window.paused():
              eval_metrics = last_eval = run.evaluate(step)
          if save or (evaluate and config.checkpoint.best_metric):
            run.save(step, eval_metrics if config.checkpoint.best_metric else None)
        except checkpoint_lib.CheckpointSaveError:
          raise  # saving again would fail the same way
        except Exception:
          save_trained_state(run, step)
          raise
        if preempted:
          run.bar.write(f"signal {stop.signum} received: saved step {step}, exiting")
          break
      window.flush()
    finally:
      run.close()
  return _summarize(run, {**window.last, **last_eval}, preempted, time.time() - wall_start)


def _summarize(
    run: run_lib.TrainRun, metrics: dict[str, float], preempted: bool, wall_time: float
) -> dict[str, Any]:
  """The returned summary; after a complete run, also the plot, examples and summary.json."""
  t = run.config.train
  result = {
      "step": int(jax.device_get(run.state.step)),
      "preempted": preempted,
      "workdir": str(run.workdir),
      "wall_time_sec": wall_time,
      "params": run.params_total,
      "skipped_updates": int(jax.device_get(run.state.skipped)),
      **metrics,
  }
  if preempted or not run.is_main:
    return result
  if t.plot:
    result["curves"] = str(metrics_lib.plot_curves(run.workdir))
  if t.decode_metrics and t.print_examples:
    for src, out, ref in run.evaluator.examples(run.state.params, t.print_examples):
      print(f"  {src!r} -> {out!r}   (reference {ref!r})")
  print(
      f"metrics: {run.workdir / 'metrics.jsonl'}  curves: {result.get('curves', '-')}  "
      f"TensorBoard: tensorboard --logdir {run.workdir / 'tensorboard'}"
  )
  (run.workdir / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
  return result
