"""grain pipelines: records -> tokens -> task examples -> packed or padded batches.

Train order is a pure function of `data.shuffle_seed` (per-epoch reshuffled
records, seeded chunk windows, per-element masking seeds), so an iterator's
`get_state()` restored with `set_state()` yields exactly the batches the
uninterrupted one would have, across epoch boundaries too.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import grain
import jax
import ml_collections
import numpy as np

from tx_jax.data import sources, tasks, tokenizers, window_shuffle

# Tasks whose documents are cut into chunks (many examples per record).
_CHUNKED = ("lm", "mlm", "span_corruption")
# grain's packing names -> the batch contract's (ARCHITECTURE.md); other packing extras dropped.
_PACKED_NAMES = {
    "inputs_segment_ids": "segment_ids",
    "inputs_positions": "positions",
    "encoder_inputs_segment_ids": "encoder_segment_ids",
    "encoder_inputs_positions": "encoder_positions",
    "decoder_inputs_segment_ids": "decoder_segment_ids",
    "decoder_inputs_positions": "decoder_positions",
}


def validate(data_cfg: ml_collections.ConfigDict, process_count: int = 1) -> None:
  """Fails before any reading on a config field that cannot work, naming it."""
  if data_cfg.task not in tasks.TASKS:
    raise ValueError(f"data.task={data_cfg.task!r}; accepted: {', '.join(tasks.TASKS)}")
  if data_cfg.source not in sources.SOURCES:
    raise ValueError(f"data.source={data_cfg.source!r}; accepted: {', '.join(sources.SOURCES)}")
  length_fields = (
      ("source_len", "target_len")
      if data_cfg.task in ("seq2seq", "span_corruption")
      else ("seq_len",)
  )
  for field in length_fields:
    if data_cfg[field] <= 0:
      raise ValueError(f"data.{field}={data_cfg[field]} must be > 0")
  for field in ("global_batch_size", "eval_global_batch_size"):
    if data_cfg[field] <= 0 or data_cfg[field] % process_count:
      raise ValueError(
          f"data.{field}={data_cfg[field]} must be a positive multiple of the "
          f"process count {process_count}"
      )
  num_shards = input_shards(data_cfg, process_count)
  if num_shards <= 0 or num_shards % process_count or data_cfg.global_batch_size % num_shards:
    raise ValueError(
        f"data.num_shards={data_cfg.num_shards} gives {num_shards} input shards; "
        f"accepted: -1 (one per process) or a positive multiple of the process "
        f"count {process_count} that divides data.global_batch_size="
        f"{data_cfg.global_batch_size}"
    )
  if data_cfg.num_epochs is not None and data_cfg.num_epochs <= 0:
    raise ValueError(f"data.num_epochs={data_cfg.num_epochs}; accepted: None (repeat) or > 0")
  if not 0 <= data_cfg.shuffle_seed < 2**32:
    raise ValueError(f"data.shuffle_seed={data_cfg.shuffle_seed} must be in [0, 2**32)")
  for field in ("lm_shuffle_window", "prefetch_buffer_size"):
    if data_cfg[field] <= 0:
      raise ValueError(f"data.{field}={data_cfg[field]} must be > 0")
  for field in ("worker_count", "read_threads"):
    if data_cfg[field] < 0:
      raise ValueError(f"data.{field}={data_cfg[field]} must be >= 0")
  if data_cfg.task == "mlm":
    if data_cfg.seq_len < 3:
      raise ValueError(
          f"data.seq_len={data_cfg.seq_len} leaves no room for MLM text " "after [CLS]/[SEP]"
      )
    fractions = (data_cfg.mlm_probability, data_cfg.mlm_mask_fraction, data_cfg.mlm_random_fraction)
    if not (0 < fractions[0] <= 1 and min(fractions[1:]) >= 0 and sum(fractions[1:]) <= 1):
      raise ValueError(
          f"data.mlm_probability / mlm_mask_fraction / mlm_random_fraction={fractions}"
          "; need 0 < p <= 1, fractions >= 0 summing to <= 1"
      )
  if data_cfg.task == "span_corruption":
    if not 0 < data_cfg.noise_density < 1 or data_cfg.mean_noise_span_length < 1:
      raise ValueError(
          f"data.noise_density={data_cfg.noise_density} must be in (0, 1) and "
          f"data.mean_noise_span_length={data_cfg.mean_noise_span_length} >= 1"
      )
    _, needed = tasks.span_corruption_lengths(
        data_cfg.source_len, data_cfg.noise_density, data_cfg.mean_noise_span_length
    )
    if needed > data_cfg.target_len:
      raise ValueError(
          f"data.target_len={data_cfg.target_len} is shorter than the {needed} "
          f"targets that data.source_len={data_cfg.source_len} corrupts into"
      )


def check_vocab(config: ml_collections.ConfigDict) -> None:
  """The tokenizer's ids fit config.model.vocab_size (when the config has a model section)."""
  if "model" in config:
    tokenizers.check_fits(
        tokenizers.build_tokenizer(config.data),
        config.model.vocab_size,
        with_sentinels=config.data.task == "span_corruption",
    )


def lengths(data_cfg: ml_collections.ConfigDict) -> dict[str, int]:
  """Row length of every sequence feature the task produces."""
  if data_cfg.task in ("seq2seq", "span_corruption"):
    return {
        "encoder_inputs": data_cfg.source_len,
        "decoder_inputs": data_cfg.target_len,
        "targets": data_cfg.target_len,
        "weights": data_cfg.target_len,
    }
  names = {
      "lm": ("inputs", "targets", "weights"),
      "mlm": ("inputs", "targets", "weights", "token_type_ids"),
      "classification": ("inputs", "token_type_ids"),
  }[data_cfg.task]
  return {name: data_cfg.seq_len for name in names}


def record_to_examples(
    record: dict, *, data_cfg: ml_collections.ConfigDict, tok: tokenizers.Tokenizer
) -> list[dict[str, Any]]:
  """One record -> its deterministic task examples (mlm / span keep raw ids for the random step)."""
  task = data_cfg.task
  if task == "lm":
    return tasks.lm_examples(tok.encode(record["text"]) + [tok.eos_id], data_cfg.seq_len)
  if task == "mlm":
    pieces = tasks.chunk(tok.encode(record["text"]), data_cfg.seq_len - 2)
    return [
        {"ids": np.concatenate([[tok.cls_id], p, [tok.sep_id]]).astype(np.int32)}
        for p in pieces
        if len(p)
    ]
  if task == "span_corruption":
    raw_len, _ = tasks.span_corruption_lengths(
        data_cfg.source_len, data_cfg.noise_density, data_cfg.mean_noise_span_length
    )
    return [{"ids": p} for p in tasks.chunk(tok.encode(record["text"]), raw_len) if len(p)]
  if task == "seq2seq":
    src = tasks.truncate_eos(tok.encode(record["source"]), data_cfg.source_len, tok.eos_id)
    tgt = tasks.truncate_eos(tok.encode(record["target"]), data_cfg.target_len, tok.eos_id)
    return [tasks.seq2seq_example(src, tgt, tok.decoder_start_id)]
  pair = tok.encode(record["text_pair"]) if "text_pair" in record else None
  return [
      tasks.classification_example(
          tok.encode(record["text"]),
          pair,
          record["label"],
          seq_len=data_cfg.seq_len,
          cls_id=tok.cls_id,
          sep_id=tok.sep_id,
      )
  ]


def random_step(
    example: dict,
    rng: np.random.Generator,
    *,
    data_cfg: ml_collections.ConfigDict,
    tok: tokenizers.Tokenizer,
    regular_ids: np.ndarray,
) -> dict[str, np.ndarray]:
  """The seeded part of a task: MLM masking or span corruption; identity otherwise."""
  if data_cfg.task == "mlm":
    return tasks.mlm_example(
        example["ids"],
        rng,
        mask_id=tok.mask_id,
        special_ids=tok.special_ids,
        regular_ids=regular_ids,
        probability=data_cfg.mlm_probability,
        mask_fraction=data_cfg.mlm_mask_fraction,
        random_fraction=data_cfg.mlm_random_fraction,
    )
  if data_cfg.task == "span_corruption":
    return tasks.span_corruption_example(
        example["ids"],
        rng,
        noise_density=data_cfg.noise_density,
        mean_noise_span_length=data_cfg.mean_noise_span_length,
        sentinel_ids=[tok.sentinel_id(i) for i in range(tok.num_sentinels)],
        eos_id=tok.eos_id,
        decoder_start_id=tok.decoder_start_id,
    )
  return example


def _segment_names(feature: str) -> tuple[str, str] | None:
  """(segment_ids key, positions key) derived from a feature, or None if it derives none."""
  for packed, name in _PACKED_NAMES.items():
    if packed == f"{feature}_segment_ids":
      return name, _PACKED_NAMES[f"{feature}_positions"]
  return None


def pad_batch(examples: Sequence[dict], row_lengths: dict[str, int]) -> dict[str, np.ndarray]:
  """Unpacked examples -> one batch: rows padded to length, segment id 1 and positions on
  real tokens, per-row scalars (labels, classification weights) stacked.

  The training pipeline pads here, once per batch, rather than per example: each grain map
  stage costs per element, and on a small CPU the loop's host time is taken from XLA's
  threads.
  """
  out = {}
  for key, first in examples[0].items():
    if key not in row_lengths:
      out[key] = np.stack([ex[key] for ex in examples])
      continue
    width = row_lengths[key]
    rows = np.zeros((len(examples), width), first.dtype)
    real = np.empty(len(examples), np.int64)
    for i, ex in enumerate(examples):
      real[i] = len(ex[key])
      rows[i, : real[i]] = ex[key]
    out[key] = rows
    names = _segment_names(key)
    if names:
      segment = (np.arange(width) < real[:, None]).astype(np.int32)
      out[names[0]] = segment
      out[names[1]] = np.where(segment > 0, np.arange(width), 0).astype(np.int32)
  return out


def pad_example(example: dict, row_lengths: dict[str, int]) -> dict[str, np.ndarray]:
  """One unpacked example as a padded row (pad_batch of one)."""
  return {k: v[0] for k, v in pad_batch([example], row_lengths).items()}


def _rename_packed(row: dict) -> dict:
  return {
      _PACKED_NAMES.get(k, k): v
      for k, v in row.items()
      if k in _PACKED_NAMES or not k.endswith(("_segment_ids", "_positions"))
  }


def _regular_ids(data_cfg, tok) -> np.ndarray:
  if data_cfg.task == "mlm" and tok.mask_id is None:
    raise ValueError(
        f"data.task='mlm' needs a [MASK] id but the data.tokenizer={data_cfg.tokenizer!r} "
        f"vocabulary (data.spm_model_path={data_cfg.spm_model_path!r}, data.tokenizer_path="
        f"{data_cfg.tokenizer_path!r}) has no '[MASK]' / '<mask>' token"
    )
  return tok.regular_ids() if data_cfg.task == "mlm" else np.zeros(0, np.int32)


def _process(process_index, process_count) -> tuple[int, int]:
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} outside [0, process_count={process_count})")
  return process_index, process_count


def input_shards(data_cfg: ml_collections.ConfigDict, process_count: int) -> int:
  """How many independent input streams make up the global batch (data.num_shards)."""
  return process_count if data_cfg.num_shards == -1 else data_cfg.num_shards


def build_train_iterator(
    config: ml_collections.ConfigDict,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> grain.DatasetIterator:
  """This process's infinite (or num_epochs) iterator of training batches; checkpointable state.

  The global batch is the concatenation of `data.num_shards` independent streams, stream s
  reading records s, s + num_shards, ... Each process builds and reads only its own streams,
  so with a fixed num_shards every global batch is the same whatever the process count.
  """
  data_cfg = config.data
  process_index, process_count = _process(process_index, process_count)
  validate(data_cfg, process_count)
  check_vocab(config)
  num_shards = input_shards(data_cfg, process_count)
  records = sources.build_source(data_cfg, data_cfg.train_split)
  if len(records) < num_shards:
    raise ValueError(
        f"split {data_cfg.train_split!r} (data.train_split) has {len(records)} "
        f"records, fewer than the {num_shards} input shards reading it"
    )
  per_process = num_shards // process_count
  mine = range(process_index * per_process, (process_index + 1) * per_process)
  streams = [_shard_stream(data_cfg, records, s, num_shards) for s in mine]
  ds = (
      streams[0]
      if len(streams) == 1
      else grain.experimental.ZipIterDataset(streams).map(
          lambda batches: {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
      )
  )
  if data_cfg.worker_count > 0:
    ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=data_cfg.worker_count))
  return iter(ds)


def _shard_stream(
    data_cfg: ml_collections.ConfigDict, records, shard: int, num_shards: int
) -> grain.IterDataset:
  """Batches of global_batch_size / num_shards rows from records[shard::num_shards]."""
  tok = tokenizers.build_tokenizer(data_cfg)
  regular_ids = _regular_ids(data_cfg, tok)
  shard_batch = data_cfg.global_batch_size // num_shards
  seed = data_cfg.shuffle_seed

  ds = grain.MapDataset.source(records)[shard::num_shards]
  ds = ds.shuffle(seed=seed).repeat(data_cfg.num_epochs)  # reshuffled every epoch
  to_examples = functools.partial(record_to_examples, data_cfg=data_cfg, tok=tok)
  chunked = data_cfg.task in _CHUNKED
  ds = ds.map(to_examples if chunked else lambda record: to_examples(record)[0])
  ds = ds.to_iter_dataset(
      grain.ReadOptions(
          num_threads=data_cfg.read_threads, prefetch_buffer_size=data_cfg.prefetch_buffer_size
      )
  )
  if chunked:  # a document's chunks, window-shuffled: they would otherwise arrive in text order
    ds = window_shuffle.WindowShuffleRows(ds, window_size=data_cfg.lm_shuffle_window, seed=seed)
  if data_cfg.task in ("mlm", "span_corruption"):
    ds = ds.random_map(
        functools.partial(random_step, data_cfg=data_cfg, tok=tok, regular_ids=regular_ids),
        seed=seed,
    )
  row_lengths = lengths(data_cfg)
  if data_cfg.pack and data_cfg.task != "classification":
    ds = grain.experimental.FirstFitPackIterDataset(
        ds, length_struct=row_lengths, num_packing_bins=shard_batch, shuffle_bins=False
    )
    ds = ds.map(_rename_packed)
    return ds.batch(shard_batch, drop_remainder=True)
  pad = functools.partial(pad_batch, row_lengths=row_lengths)
  return ds.batch(shard_batch, drop_remainder=True, batch_fn=pad)


def _eval_rows(data_cfg, split: str) -> list[dict[str, np.ndarray]]:
  """Every row of an eval split, unpacked, in source order; masking seeded per row."""
  tok = tokenizers.build_tokenizer(data_cfg)
  regular_ids = _regular_ids(data_cfg, tok)
  records = sources.build_source(data_cfg, split)
  ds = grain.MapDataset.source(records).map(
      functools.partial(record_to_examples, data_cfg=data_cfg, tok=tok)
  )
  examples = [ex for exs in ds for ex in exs]
  row_lengths = lengths(data_cfg)
  rows = []
  for i, ex in enumerate(examples):
    rng = np.random.default_rng([data_cfg.shuffle_seed, i])
    ex = random_step(ex, rng, data_cfg=data_cfg, tok=tok, regular_ids=regular_ids)
    rows.append(pad_example(ex, row_lengths))
  if not rows:
    raise ValueError(f"eval split {split!r} of data.source={data_cfg.source!r} gives no examples")
  return rows


def build_eval_batches(
    config: ml_collections.ConfigDict,
    split: str,
    *,
    process_index: int | None = None,
    process_count: int | None = None,
) -> list[dict[str, np.ndarray]]:
  """This process's finite, deterministic eval batches; padding rows have weights 0.

  Rows are the split's examples in source order, unpacked; process p takes rows
  p, p + P, ... and every process gets the same number of batches.
  """
  data_cfg = config.data
  process_index, process_count = _process(process_index, process_count)
  validate(data_cfg, process_count)
  check_vocab(config)
  rows = _eval_rows(data_cfg, split)
  local_batch = data_cfg.eval_global_batch_size // process_count
  per_process = math.ceil(len(rows) / process_count)
  num_batches = math.ceil(per_process / local_batch)
  mine = rows[process_index::process_count]
  blank = jax.tree.map(np.zeros_like, rows[0])  # weight 0, segment 0: counts for nothing
  mine += [blank] * (num_batches * local_batch - len(mine))
  return [
      jax.tree.map(lambda *xs: np.stack(xs), *mine[b * local_batch : (b + 1) * local_batch])
      for b in range(num_batches)
  ]


def eval_examples(config: ml_collections.ConfigDict, split: str) -> list[tuple[str, str]]:
  """The split's raw (source_text, target_text) pairs in source order, for exact match / BLEU.

  seq2seq: (source, target); classification: (text, label as str); text tasks: (text, text).
  """
  data_cfg = config.data
  validate(data_cfg)
  records = sources.build_source(data_cfg, split)
  if data_cfg.task == "seq2seq":
    return [(r["source"], r["target"]) for r in records]
  if data_cfg.task == "classification":
    return [(r["text"], str(r["label"])) for r in records]
  return [(r["text"], r["text"]) for r in records]


def check_global_rows(
    local_batch: dict, mesh: jax.sharding.Mesh, data_axes: str | Sequence[str]
) -> jax.sharding.NamedSharding:
  """The batch sharding over `data_axes`, once the global row count divides over them."""
  axes = (data_axes,) if isinstance(data_axes, str) else tuple(data_axes)
  global_rows = next(iter(jax.tree.leaves(local_batch))).shape[0] * jax.process_count()
  return _rows_sharding(global_rows, mesh, axes)


@functools.lru_cache(maxsize=64)  # the loop asks for every batch; the answer never changes
def _rows_sharding(
    global_rows: int, mesh: jax.sharding.Mesh, axes: tuple[str, ...]
) -> jax.sharding.NamedSharding:
  unknown = [a for a in axes if a not in mesh.shape]
  if unknown:
    raise ValueError(f"data axes {unknown} are not mesh axes {tuple(mesh.shape)}")
  shards = math.prod(mesh.shape[a] for a in axes)
  if global_rows % shards:
    raise ValueError(
        f"global batch {global_rows} rows does not divide over data axes {axes} "
        f"({shards} shards); change data.global_batch_size"
    )
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axes))


def make_global_batch(
    local_batch: dict, mesh: jax.sharding.Mesh, data_axes: str | Sequence[str]
) -> dict[str, jax.Array]:
  """Per-process batches -> global jax.Arrays, leading axis sharded over the mesh's data axes."""
  sharding = check_global_rows(local_batch, mesh, data_axes)
  return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), local_batch)
