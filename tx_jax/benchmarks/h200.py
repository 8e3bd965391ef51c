"""`--preset h200`: bf16 train steps of GPT-2-medium and a LLaMA-style 1B, MFU vs 989 TFLOP/s,
the GPU attention backends at 4k-32k, and `blockwise` at several block sizes (`blocks`).

Compute in bfloat16 with float32 parameters and AdamW state (the usual mixed precision),
attention through `ATTENTION_BACKEND` where the GPU has it. Under `smoke` the same code
runs tiny shapes on whatever device is present (the CPU test exercises it).
"""

from __future__ import annotations

import time

from tx_jax.benchmarks import attention, common, models, train
from tx_jax.benchmarks.common import Options

PEAK_BF16_FLOPS = 989e12  # H200 SXM dense bf16 tensor-core peak
ATTENTION_BACKEND = "cudnn"
TRAIN_TARGETS = (  # (preset, batch, seq_len)
    ("gpt2-medium", 16, 1024),
    ("llama-1b", 8, 2048),
)
GPU_BACKENDS = ("cudnn", "pallas", "blockwise", "dense")
GPU_LENGTHS = (4096, 8192, 16384, 32768)
# Does a larger blockwise block help on a GPU (model.blockwise_block_q/_k)? dense and cudnn
# at the same lengths are the yardsticks.
BLOCKWISE_BLOCKS = (256, 512, 1024, 2048)
BLOCK_LENGTHS = (8192, 16384)
TIMED_STEPS = 5


def _config(preset: str, batch: int, seq_len: int, backend: str):
  gpt = common.preset_module("gpt")

  config = gpt.get_config(preset)
  m = config.model
  m.dtype, m.param_dtype = "bfloat16", "float32"
  m.dropout_rate = m.attention_dropout_rate = 0.0
  m.attention_backend = backend
  config.data.seq_len, config.data.global_batch_size = seq_len, batch
  return config


def _step_row(name: str, config, steps: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top

  m = config.model
  shape = common.Shape(m.num_layers, m.d_model, m.num_heads, config.data.seq_len, config.data.global_batch_size, m.vocab_size)
  row = {"model": name, "batch": shape.batch, "seq_len": shape.seq_len, "dtype": m.dtype, "attention_backend": m.attention_backend}
  try:
    run_step = models.jax_step(config, models.random_batch(shape))
    start = time.perf_counter()
    run_step()
    row["first_step_s"] = time.perf_counter() - start
    times = []
    for _ in range(steps):
      start = time.perf_counter()
      run_step()
      times.append(time.perf_counter() - start)
  except Exception as e:  # pylint: disable=broad-except  # e.g. out of memory: report, go on
    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return row
  flops = train.flops_per_token(config)
  row["step_ms"] = 1e3 * common.median(times)
  row["tokens_per_sec"] = shape.tokens / common.median(times)
  row["flops_per_token"] = flops
  row["mfu"] = row["tokens_per_sec"] * flops / PEAK_BF16_FLOPS
  row["device"] = str(jax.devices()[0])
  return row


def run_train(options: Options) -> dict:
  """bf16 train steps with MFU against 989 TFLOP/s."""
  import jax  # pylint: disable=g-import-not-at-top

  from tx_jax.layers.attention import backends as attention_backends  # pylint: disable=g-import-not-at-top

  on_gpu = jax.default_backend() == "gpu"
  backend = ATTENTION_BACKEND if on_gpu and ATTENTION_BACKEND in attention_backends.BACKENDS else "dense"
  rows = []
  if options.smoke:
    for preset in ("tiny", "llama-tiny"):
      rows.append(_step_row(preset, _config(preset, 2, 32, backend), 1))
  else:
    for preset, batch, seq_len in TRAIN_TARGETS:
      rows.append(_step_row(preset, _config(preset, batch, seq_len, backend), TIMED_STEPS))
  return {"peak_flops": PEAK_BF16_FLOPS, "on_gpu": on_gpu, "rows": rows}


def run_attention(options: Options) -> dict:
  """cudnn / pallas / blockwise (and dense, where it fits) attention, bf16, 4k-32k."""
  from tx_jax.layers.attention import backends as attention_backends  # pylint: disable=g-import-not-at-top

  backends = [b for b in GPU_BACKENDS if b in attention_backends.BACKENDS]
  if options.smoke:
    backends = [b for b in backends if b in attention.CPU_BACKENDS]
    return attention.sweep(backends, (32, 64), "bfloat16", 1, heads=2, head_dim=8)
  result = attention.sweep(backends, GPU_LENGTHS, "bfloat16", 5, heads=16, head_dim=128)
  result["missing_backends"] = sorted(set(GPU_BACKENDS) - set(backends))
  return result


def run_blocks(options: Options) -> dict:
  """blockwise fwd+bwd time per block size, bf16, beside dense and cudnn at the same lengths."""
  import jax  # pylint: disable=g-import-not-at-top

  if options.smoke:
    blocks, lengths, repeats, heads, head_dim = (16, 32), (64,), 1, 2, 8
  else:
    blocks, lengths, repeats, heads, head_dim = BLOCKWISE_BLOCKS, BLOCK_LENGTHS, 3, 16, 128
  yardsticks = ("dense", "cudnn") if jax.default_backend() == "gpu" else ("dense",)
  rows = []
  for seq_len in lengths:
    for backend in yardsticks:
      rows.append(attention.measure(backend, seq_len, "bfloat16", repeats, heads, head_dim))
    for block in blocks:
      rows.append(
          attention.measure("blockwise", seq_len, "bfloat16", repeats, heads, head_dim, block)
      )
  return {"dtype": "bfloat16", "heads": heads, "head_dim": head_dim, "rows": rows}


def plot_blocks(result: dict, path) -> None:
  """blockwise time against block size, one line per length; yardsticks as dashed lines."""
  plt = common.pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for seq_len in sorted({r["seq_len"] for r in result["rows"]}):
    rows = [r for r in result["rows"] if r["seq_len"] == seq_len and r["time_ms"] is not None]
    blocks = [r for r in rows if r["backend"] == "blockwise"]
    line = ax.plot([r["block"] for r in blocks], [r["time_ms"] for r in blocks], marker="o")
    for r in rows:
      if r["backend"] != "blockwise":
        ax.axhline(r["time_ms"], color=line[0].get_color(), linestyle="--", linewidth=0.8)
    line[0].set_label(f"T={seq_len} (dashed: dense, cudnn)")
  ax.set(xscale="log", xlabel="blockwise block", ylabel="fwd+bwd ms", title="blockwise blocks")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def plot_train(result: dict, path) -> None:
  """MFU per model."""
  plt = common.pyplot()
  rows = [r for r in result["rows"] if "mfu" in r]
  fig, ax = plt.subplots(figsize=(6, 3))
  ax.barh([r["model"] for r in rows], [100 * r["mfu"] for r in rows])
  ax.set(xlabel=f"MFU % of {result['peak_flops'] / 1e12:.0f} TFLOP/s", title="bf16 train step")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
