"""Load a model to decode from: a trainer workdir or a HuggingFace model directory.

A trainer workdir holds `config.json` and Orbax checkpoints under `checkpoints/`
(tx_jax.checkpoint); only the `params` of the newest (or a given) step's `state`
item are read, never the optimizer state. A directory whose config.json names
HF `architectures` is converted through `tx_jax.hf`.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from tx_jax import data, models
from tx_jax.decode import models as dm
from tx_jax.decode.models import decoding_module
from tx_jax.decode.prompts import make_prompt, strip_generated


def load(
    workdir: str | pathlib.Path, step: int | None = None
) -> tuple[ml_collections.ConfigDict, Any, Any, int | None]:
  """(config, module, params, step) ready for `tx_jax.decode.models` (layers unrolled)."""
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


def decode_inputs(
    module: Any,
    params: Any,
    inputs: list[list[int]],
    strategy: Any,
    *,
    eos_id: int | None,
    decoder_start_id: int,
    rng: jax.Array | None,
    batch_size: int,
) -> list[list[int]]:
  """Generated ids (EOS stripped) per input: prompts for a decoder, sources for an encdec."""
  config = module.config
  outputs: list[list[int]] = []
  for begin in range(0, len(inputs), batch_size):
    chunk = inputs[begin : begin + batch_size]
    # Filler rows keep one compiled shape per batch; widths round up to 16 for the same reason.
    rows = chunk + [[chunk[0][-1] if chunk[0] else 1]] * (batch_size - len(chunk))
    width = -(-max(len(r) for r in rows) // 16) * 16
    if rng is not None:
      rng, key = jax.random.split(rng)
    else:
      key = None
    if config.family == "decoder":
      prompt = make_prompt(
          rows,
          max_new_tokens=strategy.max_new_tokens,
          max_len=config.max_len,
          pad_to=min(width, config.max_len - strategy.max_new_tokens + 1),
      )
      result = dm.generate(module, params, prompt, strategy, eos_id=eos_id, rng=key)
    else:
      for i, row in enumerate(chunk):
        if not row:
          raise ValueError(f"input {begin + i} is empty; every source needs a token")
      ids = np.zeros((batch_size, min(width, config.max_len)), np.int32)
      for i, row in enumerate(rows):
        if len(row) > config.max_len:
          raise ValueError(
              f"input {begin + i} has {len(row)} tokens, longer than "
              f"model.max_len={config.max_len}"
          )
        ids[i, : len(row)] = row
      result = dm.translate(
          module,
          params,
          ids,
          (ids != 0).astype(np.int32),
          strategy,
          eos_id=eos_id,
          decoder_start_id=decoder_start_id,
          rng=key,
      )
    best = dm.best(result)
    tokens, lengths = jax.device_get((best.tokens, best.lengths))
    outputs += [strip_generated(tokens[i], int(lengths[i]), eos_id) for i in range(len(chunk))]
  return outputs
