"""LoRA's frozen base, saved once per workdir beside the step checkpoints.

With LoRA on (`config.model.lora.rank > 0`) a step checkpoint holds the TrainState without
its frozen params: the adapters, `lora.also_train`'s params, their optimizer state, the step,
the rng and the skip count. The frozen params (what `layers.lora.trainable_mask` leaves out)
are written once, as their own Orbax checkpoint in WORKDIR/frozen_base/, a sibling of
checkpoints/ because the CheckpointManager owns that folder. Every step's meta records the
base's place and per-leaf fingerprints (tx_jax.checksums), checked whenever the two combine.

Saved once rather than kept as a reference to the converted workdir it came from: the run's
workdir stays self-contained and can be moved or copied; a base from a random init, or from
a converted workdir since deleted or edited, still resumes; and each step writes only the
adapters and their Adam moments instead of the whole model again.

Orbax writes the base to a temporary folder and renames it into place, so a crash leaves no
half base that looks finished. A base that is missing, damaged or not the one a step was
trained on raises FrozenBaseError naming its path; the steps themselves are fine, so nothing
is moved aside. A save whose frozen params differ from the written base is refused: the base
is never overwritten.
"""

import json
import pathlib
import shutil
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import traverse_util

from tx_jax import checkpoint_errors, checksums
from tx_jax.layers.lora import trainable_mask

DIRNAME = "frozen_base"  # inside the workdir, beside checkpoints/
FrozenBaseError = checkpoint_errors.FrozenBaseError


def enabled(lora: Any) -> bool:
  """Whether a run with `config.model.lora` (or None) saves its base apart from its steps."""
  return lora is not None and lora.rank > 0


def split_params(params: Any, lora: Any) -> tuple[dict, dict]:
  """(trainable, frozen) nested dicts of `params`, by `layers.lora.trainable_mask`."""
  trains = traverse_util.flatten_dict(trainable_mask(params, lora))
  flat = traverse_util.flatten_dict(params)
  trainable = {k: v for k, v in flat.items() if trains[k]}
  frozen = {k: v for k, v in flat.items() if not trains[k]}
  return traverse_util.unflatten_dict(trainable), traverse_util.unflatten_dict(frozen)


def combine_params(trainable: Any, frozen: Any) -> dict:
  """The whole params tree again from `split_params`'s two halves."""
  flat = traverse_util.flatten_dict(trainable)
  flat.update(traverse_util.flatten_dict(frozen))
  return traverse_util.unflatten_dict(flat)


def split_state(state: Any, lora: Any) -> tuple[Any, dict]:
  """(the TrainState with only its trainable params, the frozen params)."""
  trainable, frozen = split_params(state.params, lora)
  return state.replace(params=trainable), frozen


def combine_state(state: Any, frozen: Any) -> Any:
  """The whole TrainState from `split_state`'s two halves."""
  return state.replace(params=combine_params(state.params, frozen))


def _paths(tree: Any) -> list[str]:
  return ["/".join(k) for k in traverse_util.flatten_dict(tree)]


def _shapes(tree: Any) -> dict[tuple, tuple]:
  """Path -> shape of every leaf of a params tree, arrays or Orbax's metadata alike."""
  flat = traverse_util.flatten_dict(tree)
  return {k: tuple(getattr(v, "shape", ())) for k, v in flat.items()}


def _first_difference(tree: Any, ours: list[int], theirs: list[int]) -> str:
  """The path of the first leaf whose fingerprint differs ('the leaf count' if they differ)."""
  if len(ours) != len(theirs):
    return f"the leaf count ({len(ours)} against {len(theirs)})"
  # jax flattens nested dicts in sorted key order, as flatten_dict + sorted does.
  paths = sorted(traverse_util.flatten_dict(tree))
  return next(("/".join(p) for p, a, b in zip(paths, ours, theirs) if a != b), "no leaf")


class FrozenBase:
  """The frozen params of one workdir: written once to `directory`, checked at every use."""

  def __init__(self, directory: str | pathlib.Path):
    self.directory = pathlib.Path(directory).absolute()

  def _checkpointer(self) -> ocp.Checkpointer:
    # Orbax's default pytree handler: the base is written once, so its save cost is moot.
    handler = ocp.CompositeCheckpointHandler(
        params=ocp.PyTreeCheckpointHandler(), meta=ocp.JsonCheckpointHandler()
    )
    return ocp.Checkpointer(handler)

  def saved_fingerprints(self) -> list[int]:
    """The per-leaf fingerprints the base was written with (FrozenBaseError if unreadable)."""
    meta = self.directory / "meta" / "metadata"
    try:
      return [int(s) for s in json.loads(meta.read_text())["fingerprints"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise FrozenBaseError(
          f"the frozen base at {self.directory} is damaged ({checkpoint_errors.reason(e)}). "
          f"{self._advice()}"
      ) from None

  def record(self, frozen: Any) -> dict[str, Any]:
    """Writes `frozen` on first use, else checks it is the written base; a step's meta entry.

    Raises FrozenBaseError when the written base holds other values (it is never
    overwritten), and lets a failed write's OSError or ValueError through to the caller.
    """
    if not jax.tree.leaves(frozen):  # also_train takes every param: there is no base
      return {"path": DIRNAME, "fingerprints": []}
    sums, finite = checksums.fingerprint(frozen)
    live = [int(s) for s in sums]
    if not finite:
      raise FrozenBaseError(f"refusing to save the frozen base at {self.directory}: NaN or Inf")
    if not self.directory.is_dir():
      self._write(frozen, live)
    else:
      saved = self.saved_fingerprints()
      if saved != live:
        raise FrozenBaseError(
            f"this run's frozen params differ from the frozen base at {self.directory} (at "
            f"{_first_difference(frozen, live, saved)}); refusing to overwrite it. A LoRA "
            "run's base never changes: resume with the config it was written with, or train "
            f"in another --workdir (or move {self.directory} away to start over)"
        )
    return {"path": DIRNAME, "fingerprints": live}

  def _write(self, frozen: Any, fingerprints: list[int]) -> None:
    if jax.process_index() == 0:  # an earlier write a crash interrupted
      for unfinished in self.directory.parent.glob(f"{self.directory.name}.orbax-checkpoint-tmp*"):
        shutil.rmtree(unfinished, ignore_errors=True)
    checkpointer = self._checkpointer()
    try:
      checkpointer.save(
          self.directory,
          args=ocp.args.Composite(
              params=ocp.args.PyTreeSave(frozen),
              meta=ocp.args.JsonSave({"fingerprints": fingerprints, "leaves": _paths(frozen)}),
          ),
      )
    finally:
      checkpointer.close()

  def restore(self, abstract_frozen: Any, recorded: list[int], step_dir: pathlib.Path) -> Any:
    """The base onto `abstract_frozen`'s shardings, checked against a step's `recorded`
    fingerprints; FrozenBaseError naming the base when it is missing, damaged or another."""
    if not recorded and not jax.tree.leaves(abstract_frozen):
      return abstract_frozen  # nothing frozen, nothing written (`record`)
    if not self.directory.is_dir():
      raise FrozenBaseError(
          f"the frozen base at {self.directory}, which checkpoint {step_dir} needs, is missing. "
          f"{self._advice()}"
      )
    saved = self.saved_fingerprints()
    self._check_shapes(abstract_frozen)
    if saved != recorded:
      raise FrozenBaseError(
          f"the frozen base at {self.directory} is not the one {step_dir} was trained on (at "
          f"{_first_difference(abstract_frozen, saved, recorded)}). {self._advice()}"
      )
    checkpointer = self._checkpointer()
    try:
      restored = checkpointer.restore(
          self.directory,
          args=ocp.args.Composite(
              params=ocp.args.PyTreeRestore(
                  item=abstract_frozen,
                  restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_frozen),
              )
          ),
      )["params"]
    except Exception as e:  # noqa: BLE001
      # Orbax reports an unreadable array as a bare Exception and missing or garbled files as
      # OSError / ValueError / KeyError; anything else is a bug, not damage, and propagates.
      if type(e) is not Exception and not isinstance(e, (OSError, ValueError, KeyError)):
        raise
      raise FrozenBaseError(
          f"the frozen base at {self.directory} could not be read "
          f"({checkpoint_errors.reason(e)}). {self._advice()}"
      ) from None
    finally:
      checkpointer.close()
    sums, _ = checksums.fingerprint(restored)
    values = [int(s) for s in sums]
    if values != saved:
      raise FrozenBaseError(
          f"the frozen base at {self.directory} is damaged: "
          f"{_first_difference(abstract_frozen, values, saved)} does not match the fingerprint "
          f"saved with it. {self._advice()}"
      )
    return restored

  def _check_shapes(self, abstract_frozen: Any) -> None:
    """CheckpointMismatchError when the base is not of the config's shapes (the config's fault)."""
    try:
      tree = ocp.StandardCheckpointHandler().metadata(self.directory / "params").tree
    except (OSError, ValueError):  # unreadable metadata is damage; the restore says so
      return
    saved, wanted = _shapes(tree), _shapes(abstract_frozen)
    if saved == wanted:
      return
    differing = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))[0]
    raise checkpoint_errors.CheckpointMismatchError(
        f"the frozen base at {self.directory} does not match the config: "
        f"{'/'.join(differing)} is {saved.get(differing)} there and {wanted.get(differing)} in "
        "the config (None: absent). It was left in place; train with the config it was written "
        "with (--config=configs/workdir.py:WORKDIR) or use another --workdir"
    )

  def _advice(self) -> str:
    return (
        "The step checkpoints hold only what trains (adapters, their optimizer state) and were "
        f"left in place: put back {self.directory.name}/ from a copy of this workdir to resume "
        "or export them"
    )


def restore_for(step_dir: pathlib.Path, meta: dict, abstract_frozen: Any) -> Any:
  """The frozen base the step at `step_dir` was saved with (its `meta` records where)."""
  if "frozen_base" not in meta:
    raise checkpoint_errors.CheckpointMismatchError(
        f"checkpoint {step_dir} holds no record of a LoRA frozen base: it was not written by a "
        "LoRA run. Train with the config it was written with "
        "(--config=configs/workdir.py:WORKDIR) or use another --workdir"
    )
  record = meta["frozen_base"]
  base = FrozenBase(step_dir.parent.parent / record["path"])
  return base.restore(abstract_frozen, record["fingerprints"], step_dir)
