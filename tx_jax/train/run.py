"""Everything a training run needs before its first step, as one small object.

`setup(config, workdir)` builds shapes first (`jax.eval_shape`), then shardings and the
jitted train/eval steps, then a restore from the workdir's newest good checkpoint or a
sharded `jax.jit(init)`, with the train step compiling on a thread beside it. The loop in
`loop.py` only steps, logs, evaluates and saves.
"""

import dataclasses
import functools
import math
import os
import pathlib
import threading
from typing import Any, Callable, Iterator, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections

from tx_jax import checkpoint as checkpoint_lib
from tx_jax import data
from tx_jax import evaluation
from tx_jax import models
from tx_jax import multihost
from tx_jax import sharding
from tx_jax.layers import axes
from tx_jax.models import summary as model_summary
from tx_jax.train import metrics as metrics_lib, optimizers
from tx_jax.train import progress as progress_lib, state as state_lib, steps


class NonFiniteLossError(RuntimeError):
  """The loss or gradient went non-finite and config.train.nonfinite is 'abort'."""


def make_apply_fn(module: Any, model_cfg: ml_collections.ConfigDict) -> steps.ApplyFn:
  """(params, batch, train, rng) -> logits for any family, via models.model_inputs.

  With LoRA on, the frozen params enter behind stop_gradient (optimizers.freeze).
  """

  def apply_fn(params, batch, train, rng):
    params = optimizers.freeze(params, model_cfg.lora)
    args, kwargs = models.model_inputs(model_cfg, batch)
    return module.apply({"params": params}, *args, **kwargs, train=train, rngs={"dropout": rng})

  return apply_fn


@dataclasses.dataclass
class TrainRun:
  """A run ready to step: state, jitted steps, data, and where its outputs go."""

  config: ml_collections.ConfigDict
  workdir: pathlib.Path
  is_main: bool
  state: Any
  start: int  # the step the state holds (0 for a fresh run)
  train_step: Callable
  evaluator: evaluation.Evaluator
  train_iter: Iterator
  to_global: Callable[[dict], Any]
  ckpt: checkpoint_lib.Checkpointer
  writer: metrics_lib.MetricWriter
  bar: progress_lib.Progress
  params_total: int
  flops_per_token: float
  peak_flops: float
  first_batch: dict | None  # read to learn the shapes; trained on first unless resumed

  def next_batch(self) -> dict:
    """The next host-local batch (the one read for the shapes comes first)."""
    batch, self.first_batch = self.first_batch, None
    return batch if batch is not None else next(self.train_iter)

  def report(self, step: int, metrics: dict[str, float]) -> None:
    """One line of metrics to metrics.jsonl, TensorBoard and the progress display."""
    self.writer.write(step, metrics)
    self.bar.update(step, metrics)

  def evaluate(self, step: int) -> dict[str, float]:
    """Runs every configured eval on the current params and reports it."""
    metrics = self.evaluator.evaluate(self.state.params)
    self.report(step, metrics)
    return metrics

  def save(self, step: int, metrics: dict[str, float] | None = None) -> None:
    self.ckpt.save(step, self.state, self.train_iter, metrics=metrics)

  def on_nonfinite(self, step: int) -> None:
    """Aborts, naming the last good checkpoint, or notes the skipped update."""
    if self.config.train.nonfinite == "abort":
      raise NonFiniteLossError(
          f"non-finite loss or gradient at step {step} (config.train.nonfinite='abort'); "
          f"the last good checkpoint is step {self.ckpt.latest_step()} in {self.ckpt.directory}"
      )
    self.bar.write(f"step {step}: non-finite loss or gradient; update skipped")

  def close(self) -> None:
    self.bar.close()
    self.writer.close()
    self.ckpt.close()


def bind_train_step(config, apply_fn, tx, schedule) -> Callable:
  """steps.train_step with config's static arguments bound: (state, batch) -> (state, metrics)."""
  return functools.partial(
      steps.train_step,
      apply_fn=apply_fn,
      tx=tx,
      schedule=schedule,
      label_smoothing=config.loss.label_smoothing,
      z_loss=config.loss.z_loss,
      grad_accum_steps=config.train.grad_accum_steps,
  )


def context_order(config: ml_collections.ConfigDict, mesh: jax.sharding.Mesh, rules) -> Callable:
  """host batch -> host batch: causal rows in zig-zag order over the devices that split the
  sequence (data/context_order.py), when config.model.context_load_balance is "data"; else
  the batch as it is."""
  seq_axes = sharding.mesh_axes_of(axes.ACT_LEN, rules)
  devices = math.prod(mesh.shape[a] for a in seq_axes if a in mesh.shape)
  if devices <= 1 or config.model.context_load_balance != "data":
    return lambda batch: batch
  return functools.partial(data.to_zigzag, task=config.data.task, devices=devices)


def _to_global(batch: dict, mesh: jax.sharding.Mesh, order: Callable[[dict], dict]) -> dict:
  """A host batch as the jitted steps take it, in the token order `order` gives.

  Across processes: global jax.Arrays (data.make_global_batch). In one process the host
  batch is the global batch: after the same divisibility check it goes to the step as
  numpy, and jit copies it to its in_shardings in C++, cheaper for the loop's thread than
  device_put's Python path.
  """
  batch = order(batch)
  if jax.process_count() > 1:
    return data.make_global_batch(batch, mesh, sharding.BATCH_AXES)
  data.check_global_rows(batch, mesh, sharding.BATCH_AXES)
  return batch


class StateLayout(NamedTuple):
  """What building or restoring the train state needs, before any weight exists."""

  init_fn: Callable[[], Any]  # () -> the initial state (jit it with out_shardings=shardings)
  boxed_params: Any  # abstract params with their logical-axis boxes
  abstract_state: Any  # jax.eval_shape(init_fn)
  shardings: Any  # the state's shardings on the mesh


def state_layout(config, module, tx, example: dict, mesh, rules) -> StateLayout:
  """The train state of config's model on `mesh`, abstractly (jax.eval_shape).

  `example` is a batch of the run's shapes (its leading size is irrelevant).
  """

  def init_params(rng):
    args, kwargs = models.model_inputs(config.model, example)
    return module.init({"params": rng}, *args, **kwargs, train=False)["params"]

  init_fn = state_lib.make_init_fn(init_params, tx, config.seed)
  # Init is not wrapped in the rules context (sharding.with_rules says so): out_shardings
  # place the parameters.
  boxed_params = jax.eval_shape(init_params, jax.random.PRNGKey(0))
  abstract_state = jax.eval_shape(init_fn)
  shardings = sharding.state_shardings(abstract_state, boxed_params, mesh, rules)
  return StateLayout(init_fn, boxed_params, abstract_state, shardings)


# XLA:CPU's default copy insertion copies every donated buffer that two fusions with no
# order between them read. In the train step those are all of Adam's moments: the
# parameter update's fusion recomputes the new moments from the old ones while the
# moments' own fusion overwrites them in place, so each step began with a copy of every
# moment leaf (136 on tiny-shakespeare, 1.7M floats). Region analysis finds the order
# that makes the copies unnecessary; the program computes the same bits. Given per
# program, not through XLA_FLAGS, so a
# user's own programs in the same process are left as they were.
CPU_TRAIN_STEP_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def train_step_compiler_options(platform: str) -> dict[str, Any]:
  """`jax.jit(compiler_options=...)` for a train step that runs on `platform`'s devices."""
  return dict(CPU_TRAIN_STEP_OPTIONS) if platform == "cpu" else {}


# The state's initialisation runs once but compiles slowly: LLVM optimising one fusion of
# threefry and erf_inv per parameter. At LLVM's -O1 it compiles sooner and computes the same bits
# (tests/train/test_init_program.py compares every family; level 0 changes them). The
# steps, which run thousands of times, keep XLA's default level.
CPU_INIT_OPTIONS = {"xla_backend_optimization_level": 1}


def init_compiler_options(platform: str) -> dict[str, Any]:
  """`jax.jit(compiler_options=...)` for the state's initialisation on `platform`.

  A level the user names in XLA_FLAGS is theirs for every program, `init` included: the
  per-program option would override it.
  """
  if platform != "cpu" or "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
    return {}
  return dict(CPU_INIT_OPTIONS)


def jit_init(layout: "StateLayout", mesh: jax.sharding.Mesh) -> Callable[[], Any]:
  """`layout.init_fn` jitted to build the state in place on `mesh` (its own compile options)."""
  return jax.jit(
      layout.init_fn,
      out_shardings=layout.shardings,
      compiler_options=init_compiler_options(mesh.devices.flat[0].platform),
  )


def jit_steps(config, module, tx, schedule, shardings, mesh, rules):
  """The train step (state donated) and eval step, traced under the mesh and logical rules."""
  apply_fn = make_apply_fn(module, config.model)
  replicated = sharding.replicated(mesh)
  batch_sharding = sharding.batch_sharding(mesh)
  step_fn = bind_train_step(config, apply_fn, tx, schedule)

  def train_step(state, batch):  # metrics packed: one buffer to pull (steps.pack_metrics)
    state, metrics = step_fn(state, batch)
    return state, steps.pack_metrics(metrics)

  train_step = jax.jit(
      sharding.with_rules(train_step, mesh, rules),
      in_shardings=(shardings, batch_sharding),
      out_shardings=(shardings, replicated),
      donate_argnums=0,
      compiler_options=train_step_compiler_options(mesh.devices.flat[0].platform),
  )
  eval_step = jax.jit(
      sharding.with_rules(functools.partial(steps.eval_step, apply_fn=apply_fn), mesh, rules),
      in_shardings=(shardings.params, batch_sharding),
      out_shardings=replicated,
  )
  return (
      multihost.compile_in_lockstep(train_step, "train_step"),
      multihost.compile_in_lockstep(eval_step, "eval_step"),
  )


def compile_ahead(train_step, abstract_state, batch: dict) -> threading.Thread | None:
  """Starts compiling the train step on a thread, while `init` builds the state.

  Tracing is Python and XLA's compile passes run on one thread, so `init`'s compile and
  the step's overlap on 2 cores, and the second step comes sooner. The first call
  then finds the executable in JAX's caches. With several processes the step compiles in
  lockstep at its first call (multihost.compile_in_lockstep), so nothing is started.

  Best effort: the thread does not see JAX config contexts the caller entered around
  training (they are thread-local, e.g. `jax.default_matmul_precision`). Under one, its
  program is another cache entry, never used: the first call compiles its own, as without
  the thread, and any error of that compile is raised there, in the caller's thread.
  """
  if jax.process_count() > 1:
    return None

  def compile_step() -> None:
    try:
      train_step.lower(abstract_state, batch).compile()
    except Exception:  # noqa: BLE001 -- not this thread's to report: see the docstring
      pass

  thread = threading.Thread(target=compile_step, name="tx_jax-compile-ahead")
  thread.start()
  return thread


def setup(config: ml_collections.ConfigDict, workdir: pathlib.Path) -> TrainRun:
  """Builds (or restores) the sharded state and the jitted steps for `config` in `workdir`."""
  is_main = jax.process_index() == 0
  if is_main:
    workdir.mkdir(parents=True, exist_ok=True)

  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.logical_rules(config)
  order = context_order(config, mesh, rules)
  to_global = functools.partial(_to_global, mesh=mesh, order=order)

  module = models.build(config.model)
  tx, schedule = optimizers.build_optimizer(config)
  train_iter = data.build_train_iterator(config)
  first_batch = next(train_iter)
  example = {k: jnp.zeros((1,) + v.shape[1:], v.dtype) for k, v in first_batch.items()}
  layout = state_layout(config, module, tx, example, mesh, rules)
  shardings = layout.shardings

  train_step, eval_step = jit_steps(config, module, tx, schedule, shardings, mesh, rules)
  abstract_state = checkpoint_lib.abstract_with_shardings(layout.abstract_state, shardings)
  ckpt = checkpoint_lib.Checkpointer(workdir / "checkpoints", config.checkpoint, config.model)
  restored = None
  if config.checkpoint.resume:
    restored = ckpt.restore_latest(abstract_state, train_iter)
  if restored is not None:
    state, start = restored
    first_batch = None  # the iterator resumes exactly after the checkpoint's last batch
    if is_main:
      print(f"resumed from step {start} in {ckpt.directory}", flush=True)
  else:
    compiling = compile_ahead(train_step, abstract_state, order(first_batch))
    try:
      state = jit_init(layout, mesh)()
    finally:  # also when init fails: no compile outlives the set-up
      if compiling is not None:
        compiling.join()
    start = 0
  if is_main:
    # Only now that the checkpoint restored (or none was there) and the steps built: a run
    # refused on the way must leave the workdir's record of its config as it was.
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2) + "\n")
  evaluator = evaluation.Evaluator(
      config, module, eval_step, to_global, sharding.replicated(mesh)
  )
  model_config = models.ModelConfig.from_config(config.model)
  counts = model_summary.count_params(model_config, nn.unbox(layout.boxed_params))
  flops_per_token = model_summary.flops_per_token(
      model_config, counts, *model_summary.sequence_lengths(config)
  )
  return TrainRun(
      config=config,
      workdir=workdir,
      is_main=is_main,
      state=state,
      start=start,
      train_step=train_step,
      evaluator=evaluator,
      train_iter=train_iter,
      to_global=to_global,
      ckpt=ckpt,
      writer=metrics_lib.MetricWriter(workdir, start),
      bar=progress_lib.Progress(config.train.progress, start, config.train.steps, enabled=is_main),
      params_total=counts.total,
      flops_per_token=flops_per_token,
      peak_flops=metrics_lib.peak_flops(config.train.peak_flops),
      first_batch=first_batch,
  )
