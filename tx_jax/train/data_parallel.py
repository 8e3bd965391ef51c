"""Data-parallel gradients summed across devices as one flat buffer per dtype, on CPU.

Why: under jit's automatic partitioning, the gradient's sum over the data shards is one
all-reduce per parameter leaf. XLA combines them into one tuple all-reduce, but XLA:CPU's
in-process collectives still meet at a rendezvous for every buffer in it: 57 per step for
the benchmark's `small` GPT. Each one waits for the slower device and wakes a sleeping
thread. Summed as one flat buffer per dtype, the step has one rendezvous: `small`'s trainer
step 37.2 -> 33.9 ms on 2 devices (1.11-1.12x, Intel Xeon VM); the tiny-shakespeare shape,
28 leaves, is unchanged (docs/performance_xeon.md).

`flat_all_reduce(fn, mesh)` runs fn(params, batch, rng) -> (sums, grads) on each device's
rows of the batch (shard_map over the batch axes). It sums the result across devices with
one psum per dtype. Most leaves come out as the very bits the partitioner's step computes;
where the partitioner reduces a leaf's terms separately (a tied embedding's two uses) or
restructures a dot, the additions come in another order, and the step agrees to float
rounding (tests/train/test_data_parallel.py).

`unsupported(...)` says when this path must not be used, and the trainer then leaves the
gradient to jit's partitioner:
- A platform other than CPU. GPU and TPU collectives take one combined buffer already, and
  XLA overlaps each layer's all-reduce with the backward pass of the layers below it. One
  psum at the end would give up that overlap.
- Mesh axes other than the batch's (sequence, tensor), or parameters sharded over any axis
  (fsdp). Their work is split inside the model, and gradients are reduce-scattered layer by
  layer, not summed whole.
- Dropout in training. Inside shard_map each device would draw masks for its own rows,
  not its slice of the global batch's masks, so the step would no longer equal the
  single-device step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from tx_jax import sharding
from tx_jax.train.steps import GradSumsFn

DROPOUT_FIELDS = ("dropout_rate", "attention_dropout_rate", "mlp_inner_dropout_rate")


def unsupported(mesh: Mesh, param_shardings: Any, model_cfg: Any) -> str | None:
  """Why flat_all_reduce does not apply to this run, or None when it does."""
  platform = mesh.devices.flat[0].platform
  if platform != "cpu":
    return f"platform {platform}: its collectives combine buffers and overlap the backward pass"
  batch_devices = int(np.prod([mesh.shape[a] for a in sharding.BATCH_AXES]))
  if batch_devices == 1:
    return "one device per batch: nothing to sum"
  split = [f"{a}={n}" for a, n in mesh.shape.items() if a not in sharding.BATCH_AXES and n > 1]
  if split:
    return f"mesh axes {', '.join(split)} split the model's work, not the batch"
  leaves = jax.tree.leaves(param_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
  if not all(s.is_fully_replicated for s in leaves):
    return "parameters are sharded over the batch devices (an fsdp axis)"
  rates = {f: float(model_cfg.get(f, 0.0) or 0.0) for f in DROPOUT_FIELDS}
  if any(rates.values()):
    drawn = ", ".join(f"model.{f}={r}" for f, r in rates.items() if r)
    return f"dropout in training ({drawn}): each device would draw its own masks"
  return None


def flat_all_reduce(fn: GradSumsFn, mesh: Mesh) -> GradSumsFn:
  """fn run on each device's rows of the batch, its outputs summed over the batch axes."""
  axes = sharding.BATCH_AXES

  def local(params, batch, rng):
    return psum_flat(fn(params, batch, rng), axes)

  return jax.shard_map(
      local,
      mesh=mesh,
      in_specs=(PartitionSpec(), PartitionSpec(axes), PartitionSpec()),
      out_specs=PartitionSpec(),
      # Unchecked replication: with the check on, JAX types the replicated params as
      # invariant, and its autodiff would psum every leaf's gradient by itself (and our
      # custom VJPs, whose cotangents vary per device, would not type-check). Here each
      # device's gradient stays local until psum_flat sums it.
      check_vma=False,
  )


def psum_flat(tree: Any, axes: tuple[str, ...]) -> Any:
  """jax.lax.psum of tree's leaves, concatenated into one vector per dtype and split back."""
  leaves, treedef = jax.tree.flatten(tree)
  groups: dict[Any, list[int]] = {}
  for i, leaf in enumerate(leaves):
    groups.setdefault(jnp.result_type(leaf), []).append(i)
  summed = list(leaves)
  for indices in groups.values():
    flat = jax.lax.psum(jnp.concatenate([jnp.ravel(leaves[i]) for i in indices]), axes)
    start = 0
    for i in indices:
      end = start + leaves[i].size
      summed[i] = flat[start:end].reshape(leaves[i].shape)
      start = end
  return jax.tree.unflatten(treedef, summed)
