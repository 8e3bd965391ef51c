"""`attention`: peak memory and time of causal self-attention, forward + backward, vs length.

One attention call (B=1, 8 heads of 64, float32, causal) and its gradient w.r.t. q, k, v,
jitted alone, per backend and sequence length 512 -> 16k. Peak bytes are XLA's own
accounting of the compiled program (arguments + outputs + temporaries, minus aliases):
on CPU there is no device allocator to ask. A program whose predicted peak exceeds
MEMORY_FRACTION of the machine's available memory is not run (time_ms and peak_bytes
null, predicted_bytes kept): on a machine shared with others an out-of-memory kill
would take the whole benchmark down.
"""

from __future__ import annotations

import time

from tx_jax.benchmarks import common
from tx_jax.benchmarks.common import Options

BATCH, HEADS, HEAD_DIM = 1, 8, 64
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
CPU_BACKENDS = ("dense", "blockwise")
MEMORY_FRACTION = 0.5


def available_bytes() -> int:
  """MemAvailable from /proc/meminfo (0 when unknown: nothing large is run then)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 0


def attention_fn(backend: str, causal: bool = True, block: int | None = None):
  """(q_BTNH, k_BSNH, v_BSNH) -> out_BTNH through tx_jax's `backend`, causal by index;
  `block`: blockwise's query and key block (None: its default)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from tx_jax.layers.attention import backends as attention_backends  # pylint: disable=g-import-not-at-top
  from tx_jax.layers.attention import AttentionSpec  # pylint: disable=g-import-not-at-top

  blocks = {} if block is None else {"block_q": block, "block_k": block}
  attend = attention_backends.get_backend(backend, **blocks)

  def call(q, k, v):
    # The description, not a [T, S] mask: each backend materialises only what it needs.
    segment_ids_BT = jnp.ones(q.shape[:2], jnp.int32)
    # One segment per row, no padding: unpacked, so `cudnn` takes it as lengths.
    spec = AttentionSpec.self_attention(segment_ids_BT, causal=causal, packed=False)
    return attend(q, k, v, spec, scale=q.shape[-1] ** -0.5)

  return call


def measure(
    backend: str,
    seq_len: int,
    dtype: str,
    repeats: int,
    heads: int,
    head_dim: int,
    block: int | None = None,
) -> dict:
  """One row: compile, check the predicted peak against the memory budget, time fwd+bwd."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp

  row = {"backend": backend, "seq_len": seq_len, "time_ms": None, "peak_bytes": None}
  if block is not None:
    row["block"] = block
  attend = attention_fn(backend, block=block)
  loss = lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32))  # noqa: E731
  grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
  shape = jax.ShapeDtypeStruct((BATCH, seq_len, heads, head_dim), jnp.dtype(dtype))
  try:
    compiled = grad.lower(shape, shape, shape).compile()
  except Exception as e:  # pylint: disable=broad-except  # e.g. a GPU-only backend on CPU
    row["note"] = f"does not compile here: {type(e).__name__}: {str(e)[:200]}"
    return row
  stats = compiled.memory_analysis()
  predicted = None
  if stats is not None:
    predicted = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )
  row["predicted_bytes"] = predicted
  budget = MEMORY_FRACTION * available_bytes() if jax.default_backend() == "cpu" else None
  if predicted is not None and budget is not None and predicted > budget:
    row["note"] = f"not run: needs {predicted / 2**30:.1f} GiB > {budget / 2**30:.1f} GiB budget"
    return row
  keys = jax.random.split(jax.random.key(seq_len), 3)
  q, k, v = (jax.random.normal(key, shape.shape, shape.dtype) for key in keys)
  try:
    jax.block_until_ready(compiled(q, k, v))
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(compiled(q, k, v))
      times.append(time.perf_counter() - start)
  except Exception as e:  # pylint: disable=broad-except  # out of device memory
    row["note"] = f"failed to run: {type(e).__name__}: {str(e)[:200]}"
    return row
  row["time_ms"] = 1e3 * common.median(times)
  row["peak_bytes"] = predicted
  return row


def sweep(backends, lengths, dtype: str, repeats: int, heads: int, head_dim: int) -> dict:
  """Rows for every backend x length, plus the targets' ratios."""
  rows = [measure(b, t, dtype, repeats, heads, head_dim) for t in lengths for b in backends]
  by = {(r["backend"], r["seq_len"]): r for r in rows}
  result = {
      "batch": BATCH,
      "heads": heads,
      "head_dim": head_dim,
      "dtype": dtype,
      "causal": True,
      "rows": rows,
  }
  if "dense" in backends and "blockwise" in backends:
    longest, at_2k = max(lengths), min(lengths, key=lambda t: abs(t - 2048))
    dense_long, block_long = by[("dense", longest)], by[("blockwise", longest)]
    result["ratios"] = {
        "seq_len_memory": longest,
        "blockwise_over_dense_peak_bytes": common.ratio(
            block_long["peak_bytes"], dense_long["peak_bytes"] or dense_long.get("predicted_bytes")
        ),
        "dense_ran_at_longest": dense_long["time_ms"] is not None,
        "seq_len_time": at_2k,
        "blockwise_over_dense_time": common.ratio(
            by[("blockwise", at_2k)]["time_ms"], by[("dense", at_2k)]["time_ms"]
        ),
    }
  return result


def run(options: Options) -> dict:
  """The `attention` section's JSON (CPU: dense and blockwise, float32, 512 -> 16k)."""
  from tx_jax.layers.attention import backends as attention_backends  # pylint: disable=g-import-not-at-top

  backends = [b for b in CPU_BACKENDS if b in attention_backends.BACKENDS]
  if options.smoke:
    return sweep(backends, (32, 48), "float32", 1, heads=2, head_dim=8)
  result = sweep(backends, LENGTHS, "float32", 2, HEADS, HEAD_DIM)
  missing = sorted(set(CPU_BACKENDS) - set(backends))
  if missing:
    result["note"] = f"backends {missing} are not in tx_jax.layers.attention.backends yet"
  return result


def plot(result: dict, path) -> None:
  """Time and peak memory against sequence length, one line per backend."""
  plt = common.pyplot()
  fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
  for backend in sorted({r["backend"] for r in result["rows"]}):
    rows = [r for r in result["rows"] if r["backend"] == backend]
    ran = [r for r in rows if r["time_ms"] is not None]
    ax_t.plot([r["seq_len"] for r in ran], [r["time_ms"] for r in ran], marker="o", label=backend)
    # Log axes: a toy size whose temporaries XLA puts at 0 bytes has no point to draw.
    measured = [r for r in ran if r["peak_bytes"]]
    ax_m.plot(
        [r["seq_len"] for r in measured],
        [r["peak_bytes"] / 2**20 for r in measured],
        marker="o",
        label=backend,
    )
    skipped = [r for r in rows if r["time_ms"] is None and r.get("predicted_bytes")]
    if skipped:
      ax_m.plot(
          [r["seq_len"] for r in skipped],
          [r["predicted_bytes"] / 2**20 for r in skipped],
          marker="x",
          linestyle="none",
          label=f"{backend}: predicted, not run",
      )
  for ax, label in ((ax_t, "fwd+bwd ms"), (ax_m, "peak MiB")):
    ax.set(xlabel="sequence length", ylabel=label)
    if ax.has_data():  # log scale needs a positive value (toy sizes may have none)
      ax.set(xscale="log", yscale="log")
    ax.legend()
  ax_t.set_title(f"attention, causal, {result['heads']} heads x {result['head_dim']}, {result['dtype']}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
