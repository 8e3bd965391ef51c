"""Meshes, logical-axis rules and shardings: one config runs on a CPU, a GPU node or a pod slice.

Mesh axes, outermost (cheapest network) first:
  data      data parallelism: the batch is split, parameters are replicated.
  fsdp      ZeRO-3: the batch is split and so are parameters and optimizer state.
  sequence  optional sequence parallelism: activations split along their length.
  tensor    Megatron tensor parallelism: heads, mlp width and vocabulary split.
Models name every axis logically (tx_jax/layers/axes.py); `config.sharding.rules` maps
those names onto these mesh axes. This file knows no model and no trainer.

Typical use (eval_shape, then shardings, then a sharded init; no full copy on one device):

  mesh = sharding.make_mesh(config.mesh)
  rules = sharding.logical_rules(config)
  boxed = jax.eval_shape(module.init, key, *args)["params"]
  p_shardings = sharding.param_shardings(boxed, mesh, rules)
  params = jax.jit(lambda k: nn.meta.unbox(module.init(k, *args)["params"]),
                   out_shardings=p_shardings)(key)
  step = jax.jit(sharding.with_rules(train_step, mesh, rules), in_shardings=..., ...)
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from tx_jax.layers import axes
from tx_jax.pytree import path_str

MESH_AXES = ("data", "fsdp", "sequence", "tensor")  # outermost (cheapest network) first
BATCH_AXES = ("data", "fsdp")  # mesh axes that split the global batch

Rules = tuple[tuple[str, "str | tuple[str, ...] | None"], ...]

# (config.model field, logical axis it sizes): checked for divisibility by validate().
_MODEL_DIMS = (
    ("num_heads", axes.HEADS),
    ("num_kv_heads", axes.KV_HEADS),
    ("mlp_dim", axes.MLP),
    ("vocab_size", axes.VOCAB),
    ("d_model", axes.EMBED),
)
_SEQ2SEQ_TASKS = ("seq2seq", "span_corruption")  # config.data.task values with two lengths


# ----------------------------------------------------------------------------- mesh


# XLA:CPU (jax 0.10) with several devices hangs once more than ~33 programs with
# collectives are in flight, until its rendezvous timeout aborts the process. Code that
# dispatches many such programs waits after this many.
MAX_COLLECTIVE_PROGRAMS_IN_FLIGHT = 16

def mesh_shape(mesh_cfg: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
  """Axis sizes of `config.mesh` with the one -1 filled; the product must be `num_devices`."""
  sizes = {axis: mesh_cfg[axis] for axis in MESH_AXES}
  for axis, size in sizes.items():
    if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
      raise ValueError(
          f"config.mesh.{axis}={size!r}: expected a positive int or -1 (fill the devices left)"
      )
  fill = [axis for axis, size in sizes.items() if size == -1]
  if len(fill) > 1:
    raise ValueError(
        f"config.mesh: only one axis may be -1 (fill), got {', '.join(fill)} = -1; set all but one"
    )
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if fill:
    if num_devices % fixed:
      raise ValueError(
          f"config.mesh.{fill[0]}=-1 cannot fill {num_devices} devices: the other axes "
          f"({_fmt(sizes)}) multiply to {fixed}, which does not divide {num_devices}"
      )
    sizes[fill[0]] = num_devices // fixed
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(
        f"config.mesh: {_fmt(sizes)} multiply to {math.prod(sizes.values())} but there are "
        f"{num_devices} devices; make the product {num_devices} or set one axis to -1"
    )
  return sizes


def cpu_device_count(mesh_cfg: ml_collections.ConfigDict) -> int:
  """config.mesh.cpu_devices, checked: an int >= 0 (absent in old workdir configs: 0)."""
  count = mesh_cfg.get("cpu_devices", 0)
  if not isinstance(count, int) or isinstance(count, bool) or count < 0:
    raise ValueError(
        f"config.mesh.cpu_devices={count!r}: expected an int >= 0 (0 keeps JAX's default of "
        "one CPU device per process)"
    )
  return count


def use_cpu_devices(mesh_cfg: ml_collections.ConfigDict) -> None:
  """Makes `config.mesh.cpu_devices` CPU devices available to the run (0: JAX's default).

  Why: one XLA:CPU device runs one op at a time over every core, and most of a small
  model's ~1,000 ops per step are too small to split well. With 2 devices on 2 cores and
  the batch split over them (config.mesh.data=-1 fills them), one device's op runs while
  the other's leaves a core idle. Below ~2k tokens per step the collectives cost more than
  that gains (measured on 2-core VMs, docs/performance.md). Before JAX starts its backend
  this splits the process into that
  many devices; a single process that already has more uses the first `cpu_devices`
  (`run_devices`), fewer is an error. Accelerator runs are unaffected.

  A limit of XLA:CPU (jax 0.10) to know: with several devices, more than ~33 programs with
  collectives in flight hang until a 40 s rendezvous timeout aborts the process. The
  trainer never runs more than MAX_COLLECTIVE_PROGRAMS_IN_FLIGHT steps ahead, and its
  evaluator and the checkpoint fingerprints wait after as many batches or leaves.
  """
  count = cpu_device_count(mesh_cfg)
  if count == 0:
    return
  try:
    jax.config.update("jax_num_cpu_devices", count)  # a no-op when it already holds `count`
    return
  except RuntimeError:  # the backend is running: check what it has
    pass
  if jax.default_backend() != "cpu":
    return
  have = jax.local_device_count()
  if have < count or (have > count and jax.process_count() > 1):
    raise ValueError(
        f"config.mesh.cpu_devices={count}, but JAX's CPU backend already runs with {have} "
        "devices in this process; the count can only be chosen before any JAX work (the "
        "experiments.* commands set it first). Set config.mesh.cpu_devices=0 to use the "
        "devices there are."
    )


def run_devices(mesh_cfg: ml_collections.ConfigDict) -> list[Any]:
  """The devices a run of this config uses: all of them, or on one CPU process with
  config.mesh.cpu_devices set, the first cpu_devices (use_cpu_devices checked there are)."""
  devices = jax.devices()
  count = cpu_device_count(mesh_cfg)
  if count and jax.default_backend() == "cpu" and jax.process_count() == 1:
    return devices[:count]
  return devices


def make_mesh(mesh_cfg: ml_collections.ConfigDict, devices: Sequence[Any] | None = None) -> Mesh:
  """The device mesh of `config.mesh` over `devices` (default: `run_devices`, every device of
  every process unless config.mesh.cpu_devices picks fewer CPU devices).

  Across hosts (several processes on GPU/CPU, or several TPU slices) the outer axes (data
  first, then fsdp, ...) absorb the host count, so tensor and fsdp collectives stay on the
  fast intra-host network and only the outer axes cross the slower one.
  """
  devices = list(run_devices(mesh_cfg) if devices is None else devices)
  sizes = [mesh_shape(mesh_cfg, len(devices))[axis] for axis in MESH_AXES]
  axis_types = (AxisType.Auto,) * len(MESH_AXES)
  granule_attr, granules = _granules(devices)
  if granules > 1:
    dcn = _split_outer(sizes, granules)
    if dcn is None and granule_attr == "slice_index":
      raise ValueError(
          f"config.mesh: {dict(zip(MESH_AXES, sizes))} cannot be split over {granules} TPU "
          f"slices: the product of leading axes must be a multiple of {granules}"
      )
    if dcn is not None:
      ici = [size // d for size, d in zip(sizes, dcn)]
      array = mesh_utils.create_hybrid_device_mesh(
          ici, dcn, devices, process_is_granule=granule_attr == "process_index"
      )
      return Mesh(array, MESH_AXES, axis_types=axis_types)
  return jax.make_mesh(sizes, MESH_AXES, axis_types=axis_types, devices=devices)


def _granules(devices: Sequence[Any]) -> tuple[str, int]:
  """The slow-network unit the devices span: TPU slices, else processes (GPU/CPU hosts)."""
  slices = {getattr(d, "slice_index", 0) for d in devices}
  if len(slices) > 1:
    return "slice_index", len(slices)
  processes = {d.process_index for d in devices}
  per_process = {sum(d.process_index == p for d in devices) for p in processes}
  # A TPU pod slice is one ICI network however many hosts drive it: jax.make_mesh knows it.
  if devices[0].platform != "tpu" and len(processes) > 1 and len(per_process) == 1:
    return "process_index", len(processes)
  return "", 1


def _split_outer(sizes: Sequence[int], granules: int) -> list[int] | None:
  """Per-axis counts of granules, taken greedily from the outermost axes; None if impossible."""
  dcn, left = [], granules
  for size in sizes:
    take = math.gcd(size, left)
    dcn.append(take)
    left //= take
  return dcn if left == 1 else None


def _fmt(sizes: dict[str, int]) -> str:
  return ", ".join(f"{axis}={size}" for axis, size in sizes.items())


# ----------------------------------------------------------------------------- rules


def logical_rules(config: ml_collections.ConfigDict) -> Rules:
  """`config.sharding.rules` as flax logical-axis rules, checked against the mesh axis names."""
  rules = []
  for i, rule in enumerate(config.sharding.rules):
    if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
      raise ValueError(
          f"config.sharding.rules[{i}]={rule!r}: expected a (logical axis, mesh axes) pair"
      )
    logical, target = rule
    if isinstance(target, (tuple, list)):
      target = tuple(target)  # config.json round trips turn tuples into lists
    for axis in target if isinstance(target, tuple) else (target,):
      if axis is not None and axis not in MESH_AXES:
        raise ValueError(
            f"config.sharding.rules[{i}]=({logical!r}, {rule[1]!r}): unknown mesh axis "
            f"{axis!r}; accepted: {', '.join(MESH_AXES)} or None"
        )
    rules.append((logical, target))
  return tuple(rules)


def mesh_axes_of(logical: str, rules: Rules) -> tuple[str, ...]:
  """The mesh axes the first rule for `logical` maps it to (empty when unsharded)."""
  for name, target in rules:
    if name == logical:
      if target is None:
        return ()
      return target if isinstance(target, tuple) else (target,)
  return ()


def with_rules(fn: Callable[..., Any], mesh: Mesh, rules: Rules) -> Callable[..., Any]:
  """`fn` traced under `mesh` and `rules`, so its activation constraints apply wherever it is jitted.

  For steps (apply with unboxed params). Do not wrap `module.init`: flax 0.12's DenseGeneral
  unboxes its flattened [in, N*H] kernel under the rules, a rank mismatch with the kernel's
  3 logical names. An init needs no rules: `jax.jit(init, out_shardings=...)` places it.
  """

  @functools.wraps(fn)
  def wrapped(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(rules):
      return fn(*args, **kwargs)

  return wrapped


# ----------------------------------------------------------------------------- shardings


def _is_box(x: Any) -> bool:
  return isinstance(x, nn.meta.AxisMetadata)


def _key_str(entry: Any) -> str | None:
  """The name in a pytree path entry that belongs to a params dict (dict keys only)."""
  if isinstance(entry, jax.tree_util.DictKey):
    return str(entry.key)
  return None


def _mesh_spec(names: Sequence[str | None], rules: Rules) -> PartitionSpec:
  return nn.logical_to_mesh_axes(tuple(names), rules)


def _check_divisible(
    what: str,
    shape: Sequence[int],
    spec: PartitionSpec,
    mesh: Mesh,
    names: Sequence[str | None] | None = None,
) -> None:
  for dim, (size, mesh_axes) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
    if mesh_axes is None:
      continue
    mesh_axes = mesh_axes if isinstance(mesh_axes, tuple) else (mesh_axes,)
    shards = math.prod(mesh.shape[a] for a in mesh_axes)
    if size % shards:
      logical = f" ({names[dim]!r})" if names else ""
      raise ValueError(
          f"{what}: dim {dim}{logical} of size {size} is not divisible by mesh axes "
          f"{'x'.join(mesh_axes)} = {shards}; change config.mesh or map "
          f"{names[dim] if names else 'it'} to other mesh axes in config.sharding.rules"
      )


def param_shardings(abstract_params: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for a tree of flax-boxed (nn.Partitioned / LogicallyPartitioned) params.

  The result has the unboxed tree's structure. Leaves without logical names are replicated.
  """

  def one(path, leaf):
    if not _is_box(leaf):
      return NamedSharding(mesh, PartitionSpec())
    names = tuple(leaf.names)
    spec = (
        _mesh_spec(names, rules)
        if isinstance(leaf, nn.LogicallyPartitioned)
        else (leaf.get_partition_spec())
    )
    _check_divisible(f"param {path_str(path)}", leaf.value.shape, spec, mesh, names)
    return NamedSharding(mesh, spec)

  return jax.tree_util.tree_map_with_path(one, abstract_params, is_leaf=_is_box)


def _param_table(abstract_params: Any, mesh: Mesh, rules: Rules) -> dict[tuple[str, ...], Any]:
  """Map each param's dict-key path (without a leading 'params') -> (shape, its sharding)."""
  boxed = jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=_is_box)[0]
  shardings = jax.tree_util.tree_leaves(
      param_shardings(abstract_params, mesh, rules), is_leaf=lambda x: isinstance(x, NamedSharding)
  )
  table = {}
  for (path, leaf), sharding in zip(boxed, shardings):
    keys = tuple(k for k in map(_key_str, path) if k is not None)
    if keys and keys[0] == "params":
      keys = keys[1:]
    value = leaf.value if _is_box(leaf) else leaf
    table[keys] = (tuple(value.shape), sharding)
  return table


def state_shardings(abstract_state: Any, abstract_params: Any, mesh: Mesh, rules: Rules) -> Any:
  """NamedShardings for any state tree whose leaves are params or per-param statistics.

  Each leaf is matched to the parameter whose key path it contains (the longest such path),
  so the params inside a TrainState and the optimizer's moments (same shape) take that
  parameter's sharding: ZeRO-3 when `embed` maps to fsdp. A factored statistic (Adafactor's
  row/column second moments, one dim fewer) keeps the sharding of the dims it kept. Anything
  else (step counts, rng keys, scalars) is replicated.
  """
  table = _param_table(abstract_params, mesh, rules)
  replicated_ = replicated(mesh)

  def one(path, leaf):
    leaf_shape = tuple(getattr(leaf, "shape", ()))
    if not leaf_shape:
      return replicated_
    keys = tuple(k for k in map(_key_str, path) if k is not None)
    match = _longest_contained(keys, table)
    if match is None:
      return replicated_
    shape, sharding = table[match]
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    if leaf_shape == shape:
      return NamedSharding(mesh, PartitionSpec(*spec))
    if len(leaf_shape) == len(shape) - 1:
      for dropped in reversed(range(len(shape))):
        if shape[:dropped] + shape[dropped + 1 :] == leaf_shape:
          return NamedSharding(mesh, PartitionSpec(*(spec[:dropped] + spec[dropped + 1 :])))
    return replicated_

  return jax.tree_util.tree_map_with_path(one, nn.meta.unbox(abstract_state))


def _longest_contained(keys: tuple[str, ...], table: dict) -> tuple[str, ...] | None:
  """The longest contiguous run of `keys` that is a key of `table`."""
  for length in range(len(keys), 0, -1):
    for start in range(len(keys) - length + 1):
      if keys[start : start + length] in table:
        return keys[start : start + length]
  return None


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Sharding of every batch array: leading (batch) axis split over data and fsdp."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES))


def replicated(mesh: Mesh) -> NamedSharding:
  """A full copy on every device (scalars, rng keys, metrics)."""
  return NamedSharding(mesh, PartitionSpec())


def per_device_bytes(abstract_tree: Any, shardings: Any) -> int:
  """Bytes one device holds of `abstract_tree` laid out as `shardings` (the largest shard)."""
  leaves = jax.tree_util.tree_leaves(nn.meta.unbox(abstract_tree))
  sh = jax.tree_util.tree_leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  if len(leaves) != len(sh):
    raise ValueError(f"per_device_bytes: {len(leaves)} arrays but {len(sh)} shardings")
  return sum(
      math.prod(s.shard_shape(tuple(x.shape))) * np.dtype(x.dtype).itemsize
      for x, s in zip(leaves, sh)
  )


def total_bytes(abstract_tree: Any) -> int:
  """Bytes of `abstract_tree` unsharded."""
  return sum(
      math.prod(x.shape) * np.dtype(x.dtype).itemsize
      for x in jax.tree_util.tree_leaves(nn.meta.unbox(abstract_tree))
  )


# ----------------------------------------------------------------------------- validation


def validate(config: ml_collections.ConfigDict, num_devices: int, num_processes: int = 1) -> None:
  """Fail before any compile when the mesh, the model or the batch cannot be sharded as asked.

  Checks: the mesh product equals `num_devices`; every model width that the rules shard
  (heads, kv heads, mlp, vocab, d_model) divides by its mesh axes; the global train and eval
  batches (and each gradient-accumulation micro-batch) divide by the batch axes; sequence
  lengths divide by the sequence axis; across processes, the batch axes split evenly over
  the processes so that each process feeds only its own rows.
  """
  sizes = mesh_shape(config.mesh, num_devices)
  cpu_device_count(config.mesh)
  rules = logical_rules(config)

  def shards(mesh_axes: Sequence[str]) -> tuple[int, str]:
    mesh_axes = [a for a in mesh_axes if a in sizes]
    return math.prod(sizes[a] for a in mesh_axes), " x ".join(
        f"config.mesh.{a}={sizes[a]}" for a in mesh_axes
    )

  for field, logical in _MODEL_DIMS:
    if field not in config.model or not isinstance(config.model[field], int):
      continue
    size = config.model[field]
    n, named = shards(mesh_axes_of(logical, rules))
    if n > 1 and size % n:
      raise ValueError(
          f"config.model.{field}={size} is not divisible by {named} = {n} (config.sharding.rules "
          f"maps {logical!r} there); pick mesh sizes that divide {size}, or map {logical!r} to "
          "None in config.sharding.rules"
      )

  n, named = shards(mesh_axes_of(axes.ACT_BATCH, rules))
  accum = config.train.grad_accum_steps
  for field in ("global_batch_size", "eval_global_batch_size"):
    batch = config.data[field]
    if batch % n:
      raise ValueError(
          f"config.data.{field}={batch} is not divisible by the batch axes {named} = {n}; "
          f"use a multiple of {n}"
      )
  batch = config.data.global_batch_size
  if accum > 1 and (batch % accum or (batch // accum) % n):
    raise ValueError(
        f"config.data.global_batch_size={batch} / config.train.grad_accum_steps={accum} must be "
        f"a whole micro-batch divisible by the batch axes {named} = {n}; use a multiple of "
        f"{n * accum}"
    )
  if num_processes > 1 and n % num_processes:
    raise ValueError(
        f"the batch axes {named} = {n} do not split over {num_processes} processes, so a process "
        f"cannot feed only its own rows; make their product a multiple of {num_processes}"
    )
  n, named = shards(mesh_axes_of(axes.ACT_LEN, rules))
  lengths = ("source_len", "target_len") if config.data.task in _SEQ2SEQ_TASKS else ("seq_len",)
  for field in lengths if n > 1 else ():
    if config.data[field] % n:
      raise ValueError(
          f"config.data.{field}={config.data[field]} is not divisible by the sequence axes "
          f"{named} = {n}; use a multiple of {n}"
      )


# ----------------------------------------------------------------------------- dry run


def describe_shardings(
    abstract_params: Any, mesh: Mesh, rules: Rules, abstract_opt_state: Any = None
) -> str:
  """A table of every parameter's PartitionSpec and the per-device param / optimizer bytes."""
  p_shardings = param_shardings(abstract_params, mesh, rules)
  boxed = jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=_is_box)[0]
  flat_sh = jax.tree_util.tree_leaves(p_shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  rows = [("param", "shape", "logical axes", "PartitionSpec", "per-device shape")]
  for (path, leaf), sh in zip(boxed, flat_sh):
    value = leaf.value if _is_box(leaf) else leaf
    names = tuple(leaf.names) if _is_box(leaf) else ()
    rows.append(
        (
            path_str(path),
            str(tuple(value.shape)),
            "(" + ", ".join(map(str, names)) + ")",
            str(sh.spec),
            str(sh.shard_shape(tuple(value.shape))),
        )
    )
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  lines = [f"mesh: {_fmt(dict(mesh.shape))} ({mesh.size} devices)"]
  lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
  p_total = total_bytes(abstract_params)
  p_device = per_device_bytes(abstract_params, p_shardings)
  lines.append(f"param bytes: {p_total:,} total, {p_device:,} per device")
  if abstract_opt_state is not None:
    o_shardings = state_shardings(abstract_opt_state, abstract_params, mesh, rules)
    o_total = total_bytes(abstract_opt_state)
    o_device = per_device_bytes(abstract_opt_state, o_shardings)
    lines.append(f"optimizer state bytes: {o_total:,} total, {o_device:,} per device")
  return "\n".join(lines)
