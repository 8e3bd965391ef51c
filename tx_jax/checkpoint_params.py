"""The params of a saved TrainState, read alone (decoding, export, fine-tuning from a workdir).

The optimizer state is not read. The params' own fingerprints, saved in the step's `meta`
beside the whole state's, are checked, so a damaged checkpoint is never decoded from.
"""

import pathlib
from typing import Any

import orbax.checkpoint as ocp

from tx_jax import checksums, frozen_base
from tx_jax.checkpoint_errors import CheckpointError


def restore_params(
    directory: str | pathlib.Path, abstract_params: Any, step: int | None = None, lora: Any = None
) -> tuple[Any, int]:
  """(params, step) of a saved TrainState, the newest step by default; nothing else is read.

  `abstract_params` holds jax.ShapeDtypeStruct leaves with shardings. The params' own
  fingerprints (saved in `meta`) are checked, so a damaged checkpoint is not decoded from.
  With `lora` (config.model.lora) on, the frozen base saved beside the steps fills them in.
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
    missing = [k for k in ("state", "meta") if not (directory / str(step) / k).is_dir()]
    if missing:
      raise CheckpointError(
          f"checkpoint step {step} at {directory / str(step)} is damaged: missing "
          f"{' and '.join(k + '/' for k in missing)}"
      )
    abstract_frozen = None
    if frozen_base.enabled(lora):
      abstract_params, abstract_frozen = frozen_base.split_params(abstract_params, lora)
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
  sums, _ = checksums.fingerprint(params)
  saved = restored["meta"]["fingerprints"][1 : 1 + len(sums)]
  if [int(s) for s in sums] != saved:
    raise CheckpointError(
        f"checkpoint step {step} at {directory / str(step)}: restored params do not match the "
        "fingerprints saved with them (damaged checkpoint)"
    )
  if abstract_frozen is not None:
    frozen = frozen_base.restore_for(directory / str(step), restored["meta"], abstract_frozen)
    params = frozen_base.combine_params(params, frozen)
  return params, step
