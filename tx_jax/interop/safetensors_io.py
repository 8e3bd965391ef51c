"""Reading and writing HuggingFace weight files: safetensors only, never pickles.

A model directory holds `model.safetensors`, or shards listed by
`model.safetensors.index.json` ({"weight_map": {tensor name: shard file}}).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from tx_jax.interop.rules import ConversionError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")


def read_weights(directory: str | pathlib.Path) -> dict[str, np.ndarray]:
  """Every tensor of a HuggingFace model directory, by state-dict name (numpy, any dtype)."""
  directory = pathlib.Path(directory)
  if (directory / INDEX).is_file():
    weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
  elif (directory / SINGLE).is_file():
    files = [SINGLE]
  else:
    others = [name for name in PICKLES if (directory / name).exists()]
    hint = (
        (
            f"; it holds {others}, which tx_jax never unpickles: convert them to safetensors "
            "first (in Python with transformers: AutoModel.from_pretrained(dir)"
            ".save_pretrained(out_dir), which writes safetensors)"
        )
        if others
        else ""
    )
    raise ConversionError(f"{directory} has neither {SINGLE} nor {INDEX}{hint}")
  tensors: dict[str, np.ndarray] = {}
  for name in files:
    try:
      with safe_open(str(directory / name), framework="np") as f:
        for key in f.keys():
          tensors[key] = f.get_tensor(key)
    # The library's errors name no file. Header damage raises SafetensorError, an unreadable
    # path OSError, and a dtype numpy lacks (bfloat16 without ml_dtypes) TypeError.
    except (SafetensorError, OSError, TypeError) as e:
      raise ConversionError(f"{directory / name} cannot be read as safetensors: {e}") from e
  return tensors


def write_weights(
    directory: str | pathlib.Path, tensors: dict[str, np.ndarray], max_shard_bytes: int
) -> list[str]:
  """Writes `tensors` as one file, or as shards of at most `max_shard_bytes` plus an index.

  Returns the names of the files written. A tensor larger than the limit gets a shard
  of its own.
  """
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for key in sorted(tensors):
    nbytes = tensors[key].nbytes
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][key] = np.ascontiguousarray(tensors[key])
    size += nbytes
  # transformers only accepts safetensors files that declare their format.
  metadata = {"format": "pt"}
  if len(shards) == 1:
    save_file(shards[0], str(directory / SINGLE), metadata=metadata)
    return [SINGLE]
  names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
  weight_map = {}
  for name, shard in zip(names, shards):
    save_file(shard, str(directory / name), metadata=metadata)
    weight_map.update({key: name for key in shard})
  total = int(sum(t.nbytes for t in tensors.values()))
  (directory / INDEX).write_text(
      json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
  )
  return names + [INDEX]
