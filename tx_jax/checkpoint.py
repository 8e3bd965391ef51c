"""One asynchronous Orbax CheckpointManager: keep the last K + the best, resume, damage checks.

A checkpoint step holds three items: `state` (the TrainState pytree), `data` (the grain
iterator's state, one JSON file per process) and `meta` (step, a fingerprint of every
state leaf and of every process's iterator state, and the model config when known).
Restoring recomputes the fingerprints, so a truncated, bit-flipped or edited newest
checkpoint is detected instead of loaded; the manager then falls back to the previous good
step or stops naming the damaged one (`config.checkpoint.on_corrupt`). Non-finite states are
never written.

A missing item is damage too: a step without its `state/`, `data/` or `meta/` folder is
reported naming the missing part, and set aside or stopped at like any other damage.

A save that fails (no space, quota, an I/O error, permissions) raises `CheckpointSaveError`,
naming the step, the cause and the last good step: at once when saving synchronously, and
once a background save has failed, from the next `save`, `wait` or `close`, or at the
loop's next step boundary (`save_failed()`, cheap enough for every step). The failed step's
unfinished `*.orbax-checkpoint-tmp` folder is removed; whatever Orbax's abandoned writes
still put there, the next run's manager removes (`cleanup_tmp_directories`).

With LoRA on, a step's `state` leaves out the frozen base, which is written once beside the
steps (tx_jax.frozen_base: why, and what a missing or damaged base does).

Mismatch is not damage: a checkpoint whose parameter tree or shapes differ from the
config's (another d_model, another preset) raises `CheckpointMismatchError`, naming the
differing fields, and is left where it is. Only real corruption (a fingerprint mismatch or
a failed read) is moved to `checkpoints_damaged/`.
"""

import json
import pathlib
import shutil
import zlib
from typing import Any

from absl import logging
import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from tx_jax import checkpoint_errors, checksums, frozen_base, validation

ON_CORRUPT = validation.ON_CORRUPT


# The exception types live beside the rules that sort Orbax's errors; re-exported here.
CheckpointError = checkpoint_errors.CheckpointError
CheckpointMismatchError = checkpoint_errors.CheckpointMismatchError
CheckpointSaveError = checkpoint_errors.CheckpointSaveError
FrozenBaseError = checkpoint_errors.FrozenBaseError


def data_fingerprint(state: Any) -> int:
  """crc32 of an iterator state in canonical JSON (grain's get_state() is JSON-able)."""
  canonical = json.dumps(json.loads(json.dumps(state, default=str)), sort_keys=True)
  return zlib.crc32(canonical.encode("utf-8"))


def _path(keys: tuple) -> str:
  parts = []
  for k in keys:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _shapes(tree: Any) -> dict[str, tuple]:
  """'a/b/c' -> shape of every array leaf of a pytree (or of Orbax tree metadata)."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {_path(keys): tuple(getattr(leaf, "shape", ())) for keys, leaf in flat}


def state_handler() -> ocp.PyTreeCheckpointHandler:
  """Orbax's pytree handler, saving jax.Arrays replica-parallel only across processes.

  Replica-parallel saving cuts every replicated array into one slice per replica, so that
  each replica writes 1/R of it. That pays when the replicas live on different hosts. On
  one process the same process writes every slice anyway, and cutting them costs one eager
  XLA slice per replica and leaf: 410 of them for tiny-shakespeare on 2 CPU devices, 0.9 s of
  its first save (their compiles) and 0.1 s of each later one (docs/performance.md). The
  bytes written are the same; only the chunk grid on disk differs, and either reads back.
  """
  default = ocp.type_handlers.get_type_handler(jax.Array)
  arrays = ocp.type_handlers.ArrayHandler(
      use_replica_parallel=jax.process_count() > 1,
      # The default handler's store: the per-array metadata files stay as they were.
      array_metadata_store=getattr(default, "_array_metadata_store", None),
  )
  registry = ocp.type_handlers.create_type_handler_registry(
      *[
          (ty, arrays if ty is jax.Array else ocp.type_handlers.get_type_handler(ty))
          for ty in ocp.type_handlers.supported_types()
      ]
  )
  return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


class Checkpointer:
  """Saves and restores (TrainState, data iterator) under `directory` with one Orbax manager."""

  def __init__(
      self,
      directory: str | pathlib.Path,
      ckpt_cfg: ml_collections.ConfigDict,
      model_cfg: ml_collections.ConfigDict | None = None,
  ):
    """`model_cfg` (config.model), when given, is stored with every step, so that a
    mismatching config is reported field by field ("step 20 has model.d_model=128")."""
    validation.checkpoint_section(ckpt_cfg)
    self.directory = pathlib.Path(directory).absolute()
    self.cfg = ckpt_cfg
    self.model = None if model_cfg is None else json.loads(model_cfg.to_json_best_effort())
    self.lora = None if model_cfg is None else model_cfg.lora
    self.base = None
    if frozen_base.enabled(self.lora):
      self.base = frozen_base.FrozenBase(self.directory.parent / frozen_base.DIRNAME)
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
        # The unfinished folder of a save a SIGKILL interrupted is removed, quietly.
        cleanup_tmp_directories=True,
    )
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=options,
        item_names=("state", "data", "meta"),
        item_handlers={"state": state_handler()},
    )
    self._saving = None  # the newest step handed to Orbax, until its save is known finished
    self._failure: CheckpointSaveError | None = None
    self._orbax_error: BaseException | None = None  # what Orbax re-raises for the failed save

  def latest_step(self) -> int | None:
    """The newest saved step, or None."""
    return self.manager.latest_step()

  def save(
      self, step: int, state: Any, data_iter: Any = None, metrics: dict[str, float] | None = None
  ) -> None:
    """Starts saving `state` (and the iterator state) at `step`; refuses non-finite states.

    Raises CheckpointSaveError when this save, or an earlier one still unchecked, failed.
    """
    if self._saving is not None or self._failure is not None:
      self.wait()  # as Orbax would, but a failure here is named with its own step
    if step in self.manager.all_steps():
      return
    frozen = None
    if self.base is not None:
      state, frozen = frozen_base.split_state(state, self.lora)
    sums, finite = checksums.fingerprint(state)
    if not finite:
      raise CheckpointError(
          f"refusing to save step {step}: the state holds a NaN or Inf; "
          f"the last good checkpoint is step {self.latest_step()}"
      )
    meta = {"step": int(step), "fingerprints": [int(s) for s in sums]}
    if frozen is not None:
      try:
        meta["frozen_base"] = self.base.record(frozen)  # written at the first save only
      except checkpoint_errors.WRITE_ERRORS as e:
        raise self._save_failed(step, e) from e
    if self.model is not None:
      meta["model"] = self.model
    items = {"state": ocp.args.PyTreeSave(state)}
    if data_iter is not None:
      meta["data_fingerprints"] = _all_processes(data_fingerprint(data_iter.get_state()))
      items["data"] = grain.checkpoint.CheckpointSave(data_iter)
    items["meta"] = ocp.args.JsonSave(meta)
    missing_metric = (
        metrics is not None and self.cfg.best_metric and self.cfg.best_metric not in metrics
    )
    # The state is saved either way: a bookkeeping error must never lose a trained model.
    kept = None if missing_metric else metrics
    self._saving = step
    try:
      self.manager.save(step, args=ocp.args.Composite(**items), metrics=kept, force=True)
    except checkpoint_errors.WRITE_ERRORS as e:
      raise self._save_failed(step, e) from e
    if missing_metric:
      self.wait()
      raise CheckpointError(
          f"config.checkpoint.best_metric={self.cfg.best_metric!r} is not among the eval "
          f"metrics {sorted(metrics)}; step {step} was saved without it"
      )

  def _check_match(self, step: int, abstract_state: Any) -> None:
    """Raises CheckpointMismatchError when step's parameters are not the config's shapes."""
    try:
      meta = json.loads((self.directory / str(step) / "meta" / "metadata").read_text())
      saved_tree = ocp.StandardCheckpointHandler().metadata(self.directory / str(step) / "state")
      saved = _shapes(saved_tree.tree)
    except (OSError, ValueError):  # unreadable or corrupt metadata is damage; the restore says so
      return
    wanted = _shapes(abstract_state)
    params = lambda d: {k: v for k, v in d.items() if k.startswith("params/")}  # noqa: E731
    saved_params, wanted_params = params(saved), params(wanted)
    if saved_params == wanted_params:
      return
    where = self.directory / str(step)
    differing = []
    if self.model is not None and isinstance(meta.get("model"), dict):
      shape_fields = (*validation.SHAPE_FIELDS, "max_len")
      differing = [
          f"model.{k}={meta['model'][k]!r}, the config says {v!r}"
          for k, v in self.model.items()
          if k in shape_fields and k in meta["model"] and meta["model"][k] != v
      ]
    if not differing:
      only_saved = sorted(set(saved_params) - set(wanted_params))
      only_wanted = sorted(set(wanted_params) - set(saved_params))
      shape = [
          k
          for k in sorted(set(saved_params) & set(wanted_params))
          if saved_params[k] != wanted_params[k]
      ]
      if shape:
        k = shape[0]
        differing = [f"{k} of shape {saved_params[k]}, the config makes {wanted_params[k]}"]
      elif only_saved:
        differing = [f"parameters {only_saved[:3]} the config lacks"]
      else:
        differing = [f"no {only_wanted[:3]}, which the config has"]
    raise CheckpointMismatchError(
        f"checkpoint step {step} at {where} does not match the config: it has "
        f"{'; '.join(differing[:4])}. The checkpoint is intact and was left in place; train "
        "with the config it was written with (--config=configs/workdir.py:WORKDIR) or use "
        "another --workdir"
    )

  def _saved_part(self, abstract_state: Any) -> tuple[Any, Any]:
    """(what a step's `state` item holds, the frozen base's part or None) of a state."""
    if self.base is None:
      return abstract_state, None
    return frozen_base.split_state(abstract_state, self.lora)

  def _restore_step(self, step: int, abstract_state: Any, data_iter: Any) -> Any:
    abstract_state, abstract_frozen = self._saved_part(abstract_state)
    state_args = ocp.args.PyTreeRestore(
        item=abstract_state,
        restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_state),
    )
    items = {"state": state_args, "meta": ocp.args.JsonRestore()}
    if data_iter is not None:
      items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
    restored = self.manager.restore(step, args=ocp.args.Composite(**items))
    state, meta = restored["state"], restored["meta"]
    sums, finite = checksums.fingerprint(state)
    if meta["step"] != step or [int(s) for s in sums] != meta["fingerprints"]:
      raise CheckpointError("restored values do not match the fingerprints saved with them")
    if not finite:
      raise CheckpointError("restored state holds a NaN or Inf")
    expected = meta.get("data_fingerprints")
    if data_iter is not None and expected is not None:
      if len(expected) != jax.process_count():
        raise CheckpointMismatchError(
            f"checkpoint step {step} holds the data state of {len(expected)} processes; this "
            f"run has {jax.process_count()}"
        )
      if data_fingerprint(data_iter.get_state()) != expected[jax.process_index()]:
        raise CheckpointError(
            "the data iterator state does not match the fingerprint saved with it"
        )
    if abstract_frozen is None:
      return state
    where = self.directory / str(step)
    return frozen_base.combine_state(state, frozen_base.restore_for(where, meta, abstract_frozen))

  def restore_latest(self, abstract_state: Any, data_iter: Any = None) -> tuple[Any, int] | None:
    """(state, step) from the newest good checkpoint, or None when there is none.

    `abstract_state` is a pytree of jax.ShapeDtypeStruct with shardings; `data_iter` (a
    grain iterator) has its state set in place. Damaged steps are reported by number.
    """
    self.manager.reload()
    steps = sorted(self.manager.all_steps(), reverse=True)
    for step in steps:
      stop = None
      try:
        self._check_items(step, with_data=data_iter is not None)
        # A mismatch is the config's fault, a bad frozen base is shared by every step: no fallback.
        self._check_match(step, self._saved_part(abstract_state)[0])
        return self._restore_step(step, abstract_state, data_iter), step
      except (CheckpointMismatchError, FrozenBaseError):
        raise
      except ValueError as e:
        if checkpoint_errors.MISMATCH.search(str(e)):  # Orbax: the tree is not the config's
          raise CheckpointMismatchError(
              f"checkpoint step {step} at {self.directory / str(step)} does not match the "
              f"config ({str(e).splitlines()[0][:200]}); it was left in place: train with the "
              "config it was written with (--config=configs/workdir.py:WORKDIR) or use another "
              "--workdir"
          ) from e
        stop = self._damaged(step, e)
      except (OSError, CheckpointError) as e:  # missing files or items; failed fingerprints
        stop = self._damaged(step, e)
      except KeyError as e:  # Orbax: 'Item "state" was not found in the checkpoint'
        if "not found in the checkpoint" not in str(e):
          raise
        stop = self._damaged(step, e)
      except Exception as e:  # noqa: BLE001
        # Orbax reports an array it cannot read (a truncated or garbled file) as a bare
        # Exception. Anything more specific is a bug or a wrong setup, not damage: it
        # propagates and the step stays where it is.
        if type(e) is not Exception:
          raise
        stop = self._damaged(step, e)
      if stop is not None:  # raised here, not in the except: no chain to Orbax's internals
        raise stop
    if steps:
      raise CheckpointError(f"every checkpoint in {self.directory} (steps {steps}) is damaged")
    return None

  def _check_items(self, step: int, with_data: bool) -> None:
    """Raises CheckpointError naming the items step lacks (Orbax's KeyError names no step)."""
    wanted = {"state": "the train state", "meta": "the fingerprints"}
    if with_data:
      wanted["data"] = "the data iterator's position"
    where = self.directory / str(step)
    missing = [f"{k}/, {v}" for k, v in wanted.items() if not (where / k).is_dir()]
    if missing:
      raise CheckpointError(f"missing {', and '.join(missing)}")

  def _damaged(self, step: int, error: Exception) -> CheckpointError | None:
    """The error that stops the run, naming the damaged step; or None once the step is
    moved aside, so that the caller falls back."""
    reason = checkpoint_errors.reason(error)
    where = self.directory / str(step)
    if self.cfg.on_corrupt == "stop":
      return CheckpointError(
          f"checkpoint step {step} at {where} is damaged ({reason}); stopping because "
          "config.checkpoint.on_corrupt='stop'. Move that step away to resume from an "
          "older one, or set --config.checkpoint.on_corrupt=fallback."
      )
    logging.warning(
        "checkpoint step %d at %s is damaged (%s); moving it to %s and "
        "falling back to the previous checkpoint",
        step,
        where,
        reason,
        self._quarantine(step),
    )
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

  # --- failed saves: the run stops at the next step boundary, naming the last good step ---
  def save_failed(self) -> bool:
    """Whether a save failed; cheap while a save is in flight or none is (once per step)."""
    if self._failure is None and self._saving is not None:
      if not self.manager.is_saving_in_progress():
        try:
          self.wait()
        except CheckpointSaveError:
          pass  # recorded in self._failure
    return self._failure is not None

  def check_saves(self) -> None:
    """Raises CheckpointSaveError when a save has failed (see save_failed)."""
    if self.save_failed():
      raise self._failure

  def raise_save_failure(self) -> None:
    """Raises this process's CheckpointSaveError, or one naming another process's failure."""
    if self._failure is not None:
      raise self._failure
    raise CheckpointSaveError(
        f"another process could not save checkpoint step {self._saving} in {self.directory}; "
        f"its error line names the cause. The last good checkpoint is step "
        f"{self._last_good(self._saving)}"
    )

  def wait(self) -> None:
    """Blocks until pending asynchronous saves are on disk; CheckpointSaveError if one failed."""
    if self._failure is not None:
      raise self._failure
    step = self._saving
    try:
      self.manager.wait_until_finished()
    except checkpoint_errors.WRITE_ERRORS as e:
      raise self._save_failed(step, e) from e
    self._saving = None

  def _last_good(self, failed: int | None) -> int | None:
    return max((s for s in self.manager.all_steps() if s != failed), default=None)

  def _save_failed(self, step: int | None, error: BaseException) -> CheckpointSaveError:
    """Records a failed write (re-raising anything else) and removes its unfinished folder."""
    cause = checkpoint_errors.write_cause(error)
    if cause is None:  # not a failed write: a bug or a wrong setup, reported as it is
      raise error
    if jax.process_index() == 0:
      for unfinished in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
        # What cannot be removed now, the next run's manager removes (cleanup_tmp_directories).
        shutil.rmtree(unfinished, ignore_errors=True)
    last = self._last_good(step)
    resume = (
        f"the last good checkpoint is step {last}. Free space (or fix the cause) and rerun the "
        f"same command to resume from step {last}"
        if last is not None
        else "no checkpoint was saved before it. Free space (or fix the cause) and rerun the "
        "same command to start again"
    )
    self._orbax_error = error
    self._failure = CheckpointSaveError(
        f"could not save checkpoint step {step} in {self.directory / str(step)}: {cause}; "
        f"{resume}"
    )
    return self._failure

  def close(self) -> None:
    """Finishes pending saves (CheckpointSaveError if one failed) and releases the manager."""
    try:
      if self._failure is None:
        self.wait()
    finally:
      try:
        self.manager.close()
      except checkpoint_errors.WRITE_ERRORS as e:
        if self._failure is None or e is not self._orbax_error:
          raise  # Orbax re-raises a failed save's error on every wait; it was reported


def _all_processes(value: int) -> list[int]:
  """`value` of every process, in process order (each process fingerprints its own data)."""
  if jax.process_count() == 1:
    return [int(value)]
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  gathered = multihost_utils.process_allgather(np.array(value, np.uint32))
  return [int(v) for v in np.asarray(gathered).reshape(-1)]


def abstract_with_shardings(state: Any, shardings: Any) -> Any:
  """jax.ShapeDtypeStruct leaves carrying the shardings to restore onto."""
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
  )


def np_tree(tree: Any) -> Any:
  """Host numpy copy of a pytree (for tests and comparisons)."""
  return jax.tree.map(np.asarray, jax.device_get(tree))
