"""`context`: per-device peak memory and time of context-parallel attention, fwd + bwd, as
the `sequence` mesh axis grows (1, 2, 4, 8 CPU devices) at T = 8k, 32k, 128k.

One causal self-attention call (B=1, 8 heads of 64, float32) and its gradient w.r.t. q, k,
v, jitted on a mesh of `sequence` devices with q, k, v split along their length, for three
variants: "ring" and "all_gather" (tx_jax.layers.attention.ring; rows in zig-zag order with
their natural indices, as the trainer hands them over: context_load_balance="data") and
"gspmd", what a model did before: the dense backend with the keys' layout left to the
compiler (queries split, keys replicated, as the act_kv_len rule says). Peak bytes are XLA's
compiled memory analysis of one device's program (arguments + outputs + temporaries -
aliases), so they exist for every case, run or not. A case is timed only when it fits
MEMORY_FRACTION of the available memory and its length is at most TIME_MAX_LEN (on a
2-core machine a 32k causal fwd+bwd takes minutes per call); otherwise time_ms is null and
the row's note says why.

The section runs in a child process split into 8 CPU devices, whatever the parent has, and
without XLA:CPU's per-heap split of temporaries (tx_jax.host_memory), which would pad the
peaks with host-allocator slack.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tx_jax.benchmarks import attention, common
from tx_jax.benchmarks.common import Options

BATCH, HEADS, HEAD_DIM = 1, 8, 64
LENGTHS = (8192, 32768, 131072)
SEQUENCES = (1, 2, 4, 8)
VARIANTS = ("ring", "all_gather", "gspmd")
TIME_MAX_LEN = 8192
DEVICES = 8
COMMAND = "python -m experiments.benchmark --only context"


def _attend(variant: str, axis: str, load_balance: str):
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp

  from tx_jax.layers.attention import AttentionSpec  # pylint: disable=g-import-not-at-top
  from tx_jax.layers.attention.dense import dense  # pylint: disable=g-import-not-at-top
  from tx_jax.layers.attention.ring import context_parallel_attention  # pylint: disable=g-import-not-at-top

  def call(q, k, v, index):
    # Under "data" the rows arrive in zig-zag order and `index` holds each token's natural
    # index, as the trainer hands them over; else `index` is the natural order.
    segments = jnp.ones(q.shape[:2], jnp.int32)
    spec = AttentionSpec.self_attention(segments, causal=True, index_BT=index)
    scale = q.shape[-1] ** -0.5
    if variant == "gspmd":
      split, whole = jax.sharding.PartitionSpec(None, axis), jax.sharding.PartitionSpec()
      q = jax.lax.with_sharding_constraint(q, split)
      k, v = (jax.lax.with_sharding_constraint(x, whole) for x in (k, v))
      return jax.lax.with_sharding_constraint(dense(q, k, v, spec, scale=scale), split)
    return context_parallel_attention(
        q, k, v, spec, scale=scale, axis_name=axis, variant=variant,
        reorder=load_balance == "attention",
    )

  return call


def measure(variant: str, sequence: int, seq_len: int, heads: int, head_dim: int,
            time_max_len: int, repeats: int, load_balance: str = "data") -> dict:
  """One row: compile on `sequence` devices, read the per-device peak, maybe time it.

  load_balance as config.model.context_load_balance: "data" (rows arrive in zig-zag order,
  what the trainer does), "attention" (reordered inside attention) or "none".
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import numpy as np

  from tx_jax.data.context_order import zigzag_permutation  # pylint: disable=g-import-not-at-top

  row = {"variant": variant, "sequence": sequence, "seq_len": seq_len, "time_ms": None,
         "peak_bytes": None}
  mesh = jax.make_mesh((sequence,), ("sequence",), devices=jax.devices()[:sequence],
                       axis_types=(jax.sharding.AxisType.Auto,))
  in_data_order = load_balance == "data" and variant != "gspmd" and sequence > 1
  order = zigzag_permutation(seq_len, sequence) if in_data_order else np.arange(seq_len)
  attend = _attend(variant, "sequence", load_balance)
  loss = lambda q, k, v, index: jnp.sum(attend(q, k, v, index))  # noqa: E731
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "sequence"))
  shape = jax.ShapeDtypeStruct((BATCH, seq_len, heads, head_dim), jnp.float32)
  index_shape = jax.ShapeDtypeStruct((BATCH, seq_len), jnp.int32)
  try:
    with jax.set_mesh(mesh):
      grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_shardings=split)
      compiled = grad.lower(shape, shape, shape, index_shape).compile()
  except Exception as e:  # pylint: disable=broad-except  # report it, measure the next
    row["note"] = f"does not compile: {type(e).__name__}: {str(e)[:200]}"
    return row
  stats = compiled.memory_analysis()
  row["peak_bytes"] = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                       + stats.temp_size_in_bytes - stats.alias_size_in_bytes)
  budget = attention.MEMORY_FRACTION * attention.available_bytes()
  if row["peak_bytes"] * sequence > budget:
    row["note"] = (f"not run: {sequence} devices x {row['peak_bytes'] / 2**30:.1f} GiB > "
                   f"{budget / 2**30:.1f} GiB budget")
    return row
  if seq_len > time_max_len:
    row["note"] = f"not timed: lengths over {time_max_len} take minutes per call on this CPU"
    return row
  keys = jax.random.split(jax.random.key(seq_len), 3)
  q, k, v = (jax.device_put(jax.random.normal(key, shape.shape), split) for key in keys)
  index = jax.device_put(np.broadcast_to(order.astype(np.int32), index_shape.shape), split)
  jax.block_until_ready(compiled(q, k, v, index))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v, index))
    times.append(time.perf_counter() - start)
  row["time_ms"] = 1e3 * common.median(times)
  return row


def sweep(lengths, heads: int, head_dim: int, time_max_len: int, repeats: int) -> dict:
  """Every variant x sequence x length, the memory ratio the issue targets, the work balance."""
  from tx_jax.data.context_order import causal_work, zigzag_permutation  # pylint: disable=g-import-not-at-top

  rows = [measure(variant, sequence, t, heads, head_dim, time_max_len, repeats)
          for t in lengths for sequence in SEQUENCES for variant in VARIANTS]
  by = {(r["variant"], r["sequence"], r["seq_len"]): r for r in rows}
  at = min(lengths, key=lambda t: abs(t - 32768))
  ratios = {
      f"{v}_seq8_over_seq1_peak_at_{at}": common.ratio(
          by[(v, 8, at)]["peak_bytes"], by[(v, 1, at)]["peak_bytes"])
      for v in VARIANTS
  }
  # The other two settings of config.model.context_load_balance, for the ring: reordering
  # inside attention keeps reordered copies of q, k, v and the output; natural order is
  # unbalanced. Same memory as "data" would mean the copies cost nothing.
  for balance in ("attention", "none"):
    seq8 = measure("ring", 8, at, heads, head_dim, 0, repeats, load_balance=balance)
    ratios[f"ring_{balance}_order_seq8_over_seq1_peak_at_{at}"] = common.ratio(
        seq8["peak_bytes"], by[("ring", 1, at)]["peak_bytes"])
  balance = {}
  for sequence in SEQUENCES[1:]:
    for name, order in (("zigzag", zigzag_permutation(at, sequence)), ("plain", range(at))):
      work = causal_work(list(order), sequence)
      balance[f"{name}_seq{sequence}_max_over_mean"] = max(work) * sequence / sum(work)
  return {
      "batch": BATCH, "heads": heads, "head_dim": head_dim, "dtype": "float32", "causal": True,
      "rows": rows, "ratios": ratios, "causal_work_balance": balance,
  }


def _child(smoke: bool) -> dict:
  if smoke:
    return sweep((64,), heads=2, head_dim=8, time_max_len=64, repeats=1)
  return sweep(LENGTHS, HEADS, HEAD_DIM, TIME_MAX_LEN, repeats=2)


def run(options: Options) -> dict:
  """The `context` section's JSON, measured in a child process of 8 CPU devices."""
  env = dict(os.environ)
  # The program's own peak, not the CPU host allocator's: the 60 MiB heap split that the
  # experiments.* commands add (tx_jax.host_memory) pads every heap, which GPUs never see.
  flags = [f for f in env.get("XLA_FLAGS", "").split()
           if not f.startswith(("--xla_multiheap_size_constraint_per_heap",
                                "--xla_force_host_platform_device_count"))]
  env["XLA_FLAGS"] = " ".join(flags + [
      "--xla_multiheap_size_constraint_per_heap=-1",
      f"--xla_force_host_platform_device_count={DEVICES}",
  ])
  env["JAX_PLATFORMS"] = "cpu"
  done = subprocess.run(
      [sys.executable, "-m", "tx_jax.benchmarks.context", json.dumps(options.smoke)],
      env=env, capture_output=True, text=True, check=False,
  )
  if done.returncode != 0:
    raise RuntimeError(f"context benchmark child failed: {done.stderr[-2000:]}")
  result = json.loads(done.stdout.strip().splitlines()[-1])
  result["note"] = (
      f"{COMMAND}: per-device peak bytes from XLA's compiled memory analysis on 1-8 of "
      f"{DEVICES} CPU devices; time_ms null where a row's note says why. "
      + "; ".join(f"{k} = {v:.3f}" for k, v in result["ratios"].items() if v is not None)
  )
  return result


def plot(result: dict, path) -> None:
  """Per-device peak memory against the sequence axis, one line per variant and length; and
  time where it ran."""
  plt = common.pyplot()
  fig, (ax_m, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
  for variant in VARIANTS:
    for t in sorted({r["seq_len"] for r in result["rows"]}):
      rows = [r for r in result["rows"] if r["variant"] == variant and r["seq_len"] == t]
      mem = [r for r in rows if r["peak_bytes"]]
      ax_m.plot([r["sequence"] for r in mem], [r["peak_bytes"] / 2**20 for r in mem],
                marker="o", label=f"{variant} T={t}")
      ran = [r for r in rows if r["time_ms"] is not None]
      if ran:
        ax_t.plot([r["sequence"] for r in ran], [r["time_ms"] for r in ran], marker="o",
                  label=f"{variant} T={t}")
  for ax, label in ((ax_m, "per-device peak MiB"), (ax_t, "fwd+bwd ms")):
    ax.set(xlabel="sequence devices", ylabel=label, xscale="log")
    ax.set_xticks(SEQUENCES, [str(s) for s in SEQUENCES])
    ax.tick_params(axis="x", which="minor", labelbottom=False)
    if ax.has_data():
      ax.set(yscale="log")
      ax.legend(fontsize=6)
  ax_m.set_title(f"context-parallel causal attention, {result['heads']} x {result['head_dim']}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  print(json.dumps(_child(json.loads(sys.argv[1]))))
