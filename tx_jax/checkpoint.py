"""One asynchronous Orbax CheckpointManager: keep the last K + the best, resume, damage checks.

A checkpoint step holds three items: `state` (the TrainState pytree), `data` (the grain
iterator's state, one JSON file per process) and `meta` (step + a fingerprint of every
state leaf). Restoring recomputes the fingerprints, so a truncated or bit-flipped newest
checkpoint is detected instead of loaded; the manager then falls back to the previous good
step or stops naming the damaged one (`config.checkpoint.on_corrupt`). Non-finite states are
never written.
"""

import pathlib
import shutil
from typing import Any

from absl import logging
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

ON_CORRUPT = ("fallback", "stop")


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or restored; the message says which and why."""


def _words(x: jax.Array) -> jax.Array:
  """The raw bits of `x` as uint32 words (one per element)."""
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
  if unsigned is None:
    raise CheckpointError(f"cannot fingerprint dtype {x.dtype}: 1-, 2- or 4-byte types only")
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def fingerprint(tree: Any) -> tuple[jax.Array, jax.Array]:
  """(per-leaf uint32 checksums, whether every float leaf is finite) of a pytree of arrays.

  The checksum is sum_i bits_i * (2i + 1) mod 2^32: exact integer arithmetic, so it is the
  same under any sharding or reduction order, and it notices changed or moved elements.
  """
  sums, finite = [], jnp.array(True)
  for x in jax.tree_util.tree_leaves(tree):
    x = jnp.asarray(x)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
      index += jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride % 2**32)
      stride *= x.shape[d]
    sums.append(jnp.sum(_words(x) * (index * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32))
    if jnp.issubdtype(x.dtype, jnp.inexact):
      finite &= jnp.all(jnp.isfinite(x))
  return jnp.stack(sums) if sums else jnp.zeros((0,), jnp.uint32), finite


class Checkpointer:
  """Saves and restores (TrainState, data iterator) under `directory` with one Orbax manager."""

  def __init__(self, directory: str | pathlib.Path, ckpt_cfg: ml_collections.ConfigDict):
    if ckpt_cfg.on_corrupt not in ON_CORRUPT:
      raise ValueError(
          f"config.checkpoint.on_corrupt={ckpt_cfg.on_corrupt!r}: expected one " f"of {ON_CORRUPT}"
      )
    if ckpt_cfg.keep < 1:
      raise ValueError(f"config.checkpoint.keep={ckpt_cfg.keep}: must be >= 1")
    if ckpt_cfg.best_mode not in ("min", "max"):
      raise ValueError(
          f"config.checkpoint.best_mode={ckpt_cfg.best_mode!r}: expected 'min' " "or 'max'"
      )
    self.directory = pathlib.Path(directory).absolute()
    self.cfg = ckpt_cfg
    policies = [ocp.checkpoint_managers.LatestN(n=ckpt_cfg.keep)]
    if ckpt_cfg.best_metric:
      name = ckpt_cfg.best_metric
      # BestN sorts ascending and keeps the tail: descending order keeps the minimum.
      policies.append(
          ocp.checkpoint_managers.BestN(
              get_metric_fn=lambda m: m[name],
              reverse=ckpt_cfg.best_mode == "min",
              n=1,
              keep_checkpoints_without_metrics=False,
          )
      )
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=ckpt_cfg.async_save,
        create=True,
    )
    self.manager = ocp.CheckpointManager(
        self.directory, options=options, item_names=("state", "data", "meta")
    )

  def latest_step(self) -> int | None:
    """The newest saved step, or None."""
    return self.manager.latest_step()

  def save(
      self, step: int, state: Any, data_iter: Any = None, metrics: dict[str, float] | None = None
  ) -> None:
    """Starts saving `state` (and the iterator state) at `step`; refuses non-finite states."""
    if step in self.manager.all_steps():
      return
    sums, finite = jax.device_get(fingerprint(state))
    if not finite:
      raise CheckpointError(
          f"refusing to save step {step}: the state holds a NaN or Inf; "
          f"the last good checkpoint is step {self.latest_step()}"
      )
    items = {
        "state": ocp.args.StandardSave(state),
        "meta": ocp.args.JsonSave({"step": int(step), "fingerprints": [int(s) for s in sums]}),
    }
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    if metrics is not None and self.cfg.best_metric and self.cfg.best_metric not in metrics:
      raise CheckpointError(
          f"config.checkpoint.best_metric={self.cfg.best_metric!r} is not "
          f"among the eval metrics {sorted(metrics)}"
      )
    self.manager.save(step, args=ocp.args.Composite(**items), metrics=metrics, force=True)

  def _restore_step(self, step: int, abstract_state: Any, data_iter: Any) -> Any:
    items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    state, meta = restored["state"], restored["meta"]
    sums, finite = jax.device_get(fingerprint(state))
    if meta["step"] != step or [int(s) for s in sums] != meta["fingerprints"]:
      raise CheckpointError("restored values do not match the fingerprints saved with them")
    if not finite:
      raise CheckpointError("restored state holds a NaN or Inf")
    return state

  def restore_latest(self, abstract_state: Any, data_iter: Any = None) -> tuple[Any, int] | None:
    """(state, step) from the newest good checkpoint, or None when there is none.

    `abstract_state` is a pytree of jax.ShapeDtypeStruct with shardings; `data_iter` (a
    grain iterator) has its state set in place. Damaged steps are reported by number.
    """
    self.manager.reload()
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      try:
        return self._restore_step(step, abstract_state, data_iter), step
      except Exception as e:  # noqa: BLE001 -- any failure to read a step means it is damaged
        reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        where = self.directory / str(step)
        if self.cfg.on_corrupt == "stop":
          raise CheckpointError(
              f"checkpoint step {step} at {where} is damaged ({reason}); stopping because "
              "config.checkpoint.on_corrupt='stop'. Move that step away to resume from an "
              "older one, or set --config.checkpoint.on_corrupt=fallback."
          ) from None
        logging.warning(
            "checkpoint step %d at %s is damaged (%s); moving it to %s and "
            "falling back to the previous checkpoint",
            step,
            where,
            reason,
            self._quarantine(step),
        )
    if steps:
      raise CheckpointError(f"every checkpoint in {self.directory} (steps {steps}) is damaged")
    return None

  def _quarantine(self, step: int) -> pathlib.Path:
    """Moves a damaged step out of the manager's directory so that it can be saved again."""
    target = self.directory.parent / "checkpoints_damaged" / str(step)
    if jax.process_index() == 0:
      target.parent.mkdir(parents=True, exist_ok=True)
      if target.exists():
        shutil.rmtree(target)
      shutil.move(str(self.directory / str(step)), str(target))
    self.manager.reload()
    return target

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk."""
    self.manager.wait_until_finished()

  def close(self) -> None:
    """Finishes pending saves and releases the manager."""
    self.manager.wait_until_finished()
    self.manager.close()


def restore_params(
    directory: str | pathlib.Path, abstract_params: Any, step: int | None = None
) -> tuple[Any, int]:
  """(params, step) of a saved TrainState, the newest step by default; nothing else is read.

  `abstract_params` holds jax.ShapeDtypeStruct leaves with shardings. The params' own
  fingerprints (saved in `meta`) are checked, so a damaged checkpoint is not decoded from.
  """
  directory = pathlib.Path(directory).absolute()
  if not directory.is_dir():
    raise FileNotFoundError(
        f"no checkpoints/ directory in {directory.parent}; train first "
        "(python -m experiments.train --workdir ...) or convert (python -m experiments.convert)"
    )
  manager = ocp.CheckpointManager(
      directory,
      item_names=("state", "meta"),
      options=ocp.CheckpointManagerOptions(create=False, read_only=True),
  )
  try:
    steps = sorted(manager.all_steps())
    if not steps:
      raise FileNotFoundError(f"{directory} holds no finished checkpoint")
    if step is None:
      step = steps[-1]
    elif step not in steps:
      raise ValueError(f"checkpoint step {step} is not in {directory}; available: {steps}")
    item = {"params": abstract_params}
    restore_args = ocp.checkpoint_utils.construct_restore_args(item)
    restored = manager.restore(
        step,
        args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                item=item, restore_args=restore_args, partial_restore=True
            ),
            meta=ocp.args.JsonRestore(),
        ),
    )
  finally:
    manager.close()
  params = restored["state"]["params"]
  # TrainState flattens as (step, params..., opt_state..., rng, skipped): params come 2nd.
  sums, _ = jax.device_get(fingerprint(params))
  saved = restored["meta"]["fingerprints"][1 : 1 + len(sums)]
  if [int(s) for s in sums] != saved:
    raise CheckpointError(
        f"checkpoint step {step} at {directory / str(step)}: restored params do not match the "
        "fingerprints saved with them (damaged checkpoint)"
    )
  return params, step


def abstract_with_shardings(state: Any, shardings: Any) -> Any:
  """jax.ShapeDtypeStruct leaves carrying the shardings to restore onto."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
  )


def np_tree(tree: Any) -> Any:
  """Host numpy copy of a pytree (for tests and comparisons)."""
  return jax.tree.map(np.asarray, jax.device_get(tree))
