r"""Decode throughput: tx_jax with and without the KV cache vs transformers' generate.

  python -m experiments.benchmark_decode --out_dir bench_out/decode

One GPT-2-shaped model (default: configs/gpt.py:tiny with max_len raised to fit) is
randomly initialised, written as an HF directory with tx_jax.hf and loaded by
`transformers.GPT2LMHeadModel`, so both sides run the same weights. Every run is greedy
with EOS off, so each produces exactly `new` tokens per row. Reported: median tokens/s
over --repeats timed runs after one untimed (compiling) run, per batch size and new
length, and ms per new token. Next to it, the bytes one cached step must read: the weights
and the KV cache (all allocated slots, K and V, every layer). At this tiny width the cache
outgrows the weights, so a step's cost follows the cache bytes; on 2 CPU cores a step
reads at memory bandwidth once no step copies the cache (tx_jax.decode.chunked_cache).

Without the cache every step re-runs the whole fixed-size buffer (prompt + new), so each
step costs the same; its tokens/s is timed over --nocache_steps steps of the jitted
step, not the whole loop, which at 1024 new tokens would take hours on 2 cores.
Writes decode_benchmark.json and decode_benchmark.png.
"""

import json
import pathlib
import statistics
import tempfile
import time

from absl import flags, logging

from tx_jax import cli

_OUT_DIR = flags.DEFINE_string("out_dir", "bench_out/decode", "Where JSON + PNG go.")
_PRESET = flags.DEFINE_string("preset", "tiny", "configs/gpt.py preset (a GPT-2 shape).")
_NEW = flags.DEFINE_list("new_tokens", ["64", "256", "1024"], "New lengths to measure.")
_BATCH = flags.DEFINE_list("batch", ["1", "8"], "Batch sizes to measure.")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 16, "Prompt tokens per row.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed runs per setting (median reported).")
_NOCACHE_STEPS = flags.DEFINE_integer("nocache_steps", 8, "Timed steps without the cache.")
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "Do not measure transformers.")
# On a loaded 2-core machine torch's OpenMP pool oversubscribes: 2 threads ran generate
# ~6x slower than 1 here, so 1 is transformers' best case; recorded in the JSON.
_TORCH_THREADS = flags.DEFINE_integer("torch_threads", 1, "torch.set_num_threads for HF.")


def _median_time(fn, repeats: int) -> float:
  fn()  # compile / warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def main(argv) -> None:
  del argv
  logging.set_verbosity(logging.ERROR)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import numpy as np

  from configs import gpt
  from tx_jax import decode, hf, models
  from tx_jax.decode import chunked_cache
  from tx_jax.decode.generate import recompute_buffers, recompute_step_fn

  news, batches = [int(n) for n in _NEW.value], [int(b) for b in _BATCH.value]
  config = gpt.get_config(_PRESET.value)
  config.model.max_len = max(config.model.max_len, _PROMPT_LEN.value + max(news))
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  module = models.build(config.model)
  params = jax.jit(lambda k: module.init(k, jnp.zeros((1, 8), jnp.int32))["params"])(
      jax.random.key(0)
  )
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  params = nn.meta.unbox(params)
  weights_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 1e6
  rng = np.random.default_rng(0)
  results = {
      "preset": _PRESET.value,
      "model": config.model.to_dict(),
      "prompt_len": _PROMPT_LEN.value,
      "devices": str(jax.devices()),
      "runs": [],
  }

  hf_model = None
  if not _SKIP_HF.value:
    import torch  # pylint: disable=g-import-not-at-top
    import transformers

    torch.set_num_threads(_TORCH_THREADS.value)
    hf_dir = tempfile.mkdtemp()
    hf.to_pretrained(config, params, hf_dir)
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
    results["torch_threads"] = torch.get_num_threads()

  for batch in batches:
    prompts = rng.integers(4, config.model.vocab_size, (batch, _PROMPT_LEN.value)).tolist()
    for new in news:
      row = {"batch": batch, "new_tokens": new}
      prompt = decode.make_prompt(prompts, max_new_tokens=new, max_len=config.model.max_len)
      strategy = decode.Strategy("greedy", max_new_tokens=new)
      run = lambda: jax.block_until_ready(  # noqa: E731
          decode.generate(module, params, prompt, strategy, eos_id=None).tokens
      )
      t = _median_time(run, _REPEATS.value)
      row["cache_tokens_per_s"] = batch * new / t
      row["cache_ms_per_token"] = 1e3 * t / new
      slots = chunked_cache.padded_length(_PROMPT_LEN.value, new, decode.CACHE_CHUNK)
      m = config.model
      row["kv_cache_mb_per_step"] = (
          2 * m.num_layers * batch * m.num_kv_heads * slots * m.head_dim * 4 / 1e6
      )
      row["weights_mb_per_step"] = weights_mb

      step = recompute_step_fn(module)
      buffers = recompute_buffers(batch, _PROMPT_LEN.value + new - 1)
      one = jnp.ones((batch, 1), jnp.int32)
      step_jit = jax.jit(lambda p, b: step(p, one, one, one, b)[0])
      steps = lambda: [
          jax.block_until_ready(step_jit(params, buffers))  # noqa: E731
          for _ in range(_NOCACHE_STEPS.value)
      ]
      t_step = _median_time(steps, _REPEATS.value) / _NOCACHE_STEPS.value
      row["nocache_tokens_per_s"] = batch / t_step
      row["nocache_ms_per_token"] = 1e3 * t_step

      if hf_model is not None:
        ids = torch.tensor(prompts)
        gen = lambda: hf_model.generate(  # noqa: E731
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            num_beams=1,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
            use_cache=True,
        )
        with torch.no_grad():
          t_hf = _median_time(gen, _REPEATS.value)
        row["hf_tokens_per_s"] = batch * new / t_hf
        row["ratio_cache_vs_hf"] = row["cache_tokens_per_s"] / row["hf_tokens_per_s"]
      results["runs"].append(row)
      print(json.dumps(row), flush=True)

  out = pathlib.Path(_OUT_DIR.value)
  out.mkdir(parents=True, exist_ok=True)
  (out / "decode_benchmark.json").write_text(json.dumps(results, indent=2) + "\n")
  _plot(results, out / "decode_benchmark.png")
  print(f"wrote {out / 'decode_benchmark.json'} and {out / 'decode_benchmark.png'}")


def _plot(results: dict, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  batches = sorted({r["batch"] for r in results["runs"]})
  fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
  for ax, batch in zip(axes[0], batches):
    runs = [r for r in results["runs"] if r["batch"] == batch]
    news = [r["new_tokens"] for r in runs]
    for key, label in (
        ("cache_tokens_per_s", "tx_jax, KV cache"),
        ("nocache_tokens_per_s", "tx_jax, no cache"),
        ("hf_tokens_per_s", "transformers generate"),
    ):
      if key in runs[0]:
        ax.plot(news, [r[key] for r in runs], marker="o", label=label)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="new tokens",
        ylabel="tokens / s",
        title=f"greedy decode, batch {batch}",
    )
    ax.set_xticks(news, [str(n) for n in news])
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


if __name__ == "__main__":
  cli.run(main)
