"""Load a model to decode from: a trainer workdir or a HuggingFace model directory.

A trainer workdir holds `config.json` and Orbax checkpoints under `checkpoints/`
(tx_jax.checkpoint); only the `params` of the newest (or a given) step's `state`
item are read, never the optimizer state. A directory whose config.json names
HF `architectures` is converted through `tx_jax.hf`. Decoding itself is
`tx_jax.decode.batches`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from tx_jax import data, models
from tx_jax.decode.generate import decoding_module


def load(
    workdir: str | pathlib.Path, step: int | None = None
) -> tuple[ml_collections.ConfigDict, Any, Any, int | None]:
  """(config, module, params, step) ready for `tx_jax.decode` (layers unrolled)."""
  workdir = pathlib.Path(workdir)
  config_file = workdir / "config.json"
  if not config_file.is_file():
    raise FileNotFoundError(
        f"--workdir={workdir} has no config.json; expected a trainer "
        "workdir (config.json + checkpoints/) or a HuggingFace model "
        "directory"
    )
  values = json.loads(config_file.read_text())
  if "architectures" in values:
    from tx_jax import hf  # only HF directories need the interop

    config, _, params = hf.from_pretrained(workdir)
    module, params = decoding_module(config.model, params)
    return config, module, params, None
  config = ml_collections.ConfigDict(values)
  params, step = restore_params(workdir / "checkpoints", config.model, step)
  module, params = decoding_module(config.model, params)
  return config, module, params, step


def restore_params(
    directory: pathlib.Path, model_cfg: Any, step: int | None = None
) -> tuple[Any, int]:
  """The params of a checkpoint step (default: the newest), placed on the first device."""
  if not directory.is_dir():
    raise FileNotFoundError(
        f"no checkpoints/ directory in {directory.parent}; train first "
        "(python -m experiments.train --workdir ...)"
    )
  manager = ocp.CheckpointManager(
      directory.absolute(),
      item_names=("state",),
      options=ocp.CheckpointManagerOptions(create=False, read_only=True),
  )
  steps = sorted(manager.all_steps())
  if not steps:
    raise FileNotFoundError(f"{directory} holds no finished checkpoint")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ValueError(f"checkpoint step {step} is not in {directory}; available: {steps}")
  abstract = models.abstract_params(model_cfg)
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  item = {
      "params": jax.tree.map(
          lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), abstract
      )
  }
  restore_args = ocp.checkpoint_utils.construct_restore_args(item)
  restored = manager.restore(
      step,
      args=ocp.args.Composite(
          state=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
      ),
  )
  manager.close()
  return restored["state"]["params"], step


def special_ids(
    config: ml_collections.ConfigDict, workdir: str | pathlib.Path, tokenizer: Any
) -> tuple[int | None, int]:
  """(eos_id, decoder_start_id): the tokenizer's, else those an HF config.json names."""
  if tokenizer is not None:
    return tokenizer.eos_id, tokenizer.decoder_start_id
  values = json.loads((pathlib.Path(workdir) / "config.json").read_text())
  eos = values.get("eos_token_id")
  eos = eos[0] if isinstance(eos, list) else eos
  start = values.get("decoder_start_token_id")
  return eos, 0 if start is None else start


def build_tokenizer(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> Any:
  """The workdir's tokenizer, or None (an HF model without a SentencePiece vocabulary)."""
  hf_dir = "architectures" in json.loads((pathlib.Path(workdir) / "config.json").read_text())
  if hf_dir and config.data.tokenizer != "sentencepiece":
    return None  # e.g. GPT-2's byte-level BPE, which tx_jax does not implement
  return data.build_tokenizer(config.data)
