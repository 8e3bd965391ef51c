"""`decode`: greedy tokens/s with and without the KV cache vs transformers' generate.

One GPT-2-shaped model (configs/gpt.py:tiny, max_len raised to fit) is randomly
initialised, written as an HF directory with tx_jax.hf and loaded by
`transformers.GPT2LMHeadModel`, so both sides run the same weights. Every run is greedy
with EOS off, so each produces exactly `new` tokens per row. Reported: median tokens/s
after one untimed (compiling) run, per batch size and new length, and ms per new token,
next to the bytes one cached step must read (weights and the allocated K/V cache).

Without the cache every step re-runs the whole fixed-size buffer (prompt + new), so each
step costs the same; its tokens/s is timed over a few steps of the jitted step, not the
whole loop, which at 1024 new tokens would take hours on 2 cores.
"""

from __future__ import annotations

import importlib
import tempfile

from tx_jax.benchmarks import common
from tx_jax.benchmarks.common import Options

PROMPT_LEN = 16
NOCACHE_STEPS = 2
# On a loaded 2-core machine torch's OpenMP pool oversubscribes: 2 threads ran generate
# ~6x slower than 1, so 1 is transformers' best case here; recorded in the JSON.
TORCH_THREADS = 1


def _median_time(fn, repeats: int) -> float:
  import time  # pylint: disable=g-import-not-at-top

  fn()  # compile / warm up
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return common.median(times)


def run(options: Options) -> dict:
  """The `decode` section's JSON: one row per (batch, new tokens)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers

  gpt = common.preset_module("gpt")
  from tx_jax import decode, hf, models
  from tx_jax.decode import chunked_cache

  # The package exports the function `generate`, which hides the module of that name.
  dm = importlib.import_module("tx_jax.decode.generate")

  news, batches, repeats = ([4], [1], 1) if options.smoke else ([64, 256, 1024], [1, 8], 3)
  config = gpt.get_config("tiny")
  config.model.max_len = max(config.model.max_len, PROMPT_LEN + max(news))
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  module = models.build(config.model)
  params = jax.jit(lambda k: module.init(k, jnp.zeros((1, 8), jnp.int32))["params"])(
      jax.random.key(0)
  )
  params = nn.meta.unbox(params)
  weights_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)) / 1e6
  rng = np.random.default_rng(0)
  previous_threads = torch.get_num_threads()
  torch.set_num_threads(TORCH_THREADS)
  hf_dir = tempfile.mkdtemp()
  hf.to_pretrained(config, params, hf_dir)
  hf_model = transformers.GPT2LMHeadModel.from_pretrained(hf_dir).eval()
  results = {"preset": "tiny", "prompt_len": PROMPT_LEN, "torch_threads": TORCH_THREADS, "runs": []}
  m = config.model
  try:
    for batch in batches:
      prompts = rng.integers(4, m.vocab_size, (batch, PROMPT_LEN)).tolist()
      for new in news:
        row = {"batch": batch, "new_tokens": new}
        prompt = decode.make_prompt(prompts, max_new_tokens=new, max_len=m.max_len)
        strategy = dm.Strategy("greedy", max_new_tokens=new)
        cached = lambda: jax.block_until_ready(  # noqa: E731
            dm.generate(module, params, prompt, strategy, eos_id=None).tokens
        )
        t = _median_time(cached, repeats)
        row["cache_tokens_per_s"] = batch * new / t
        row["cache_ms_per_token"] = 1e3 * t / new
        slots = chunked_cache.padded_length(PROMPT_LEN, new, dm.CACHE_CHUNK)
        row["kv_cache_mb_per_step"] = 2 * m.num_layers * batch * m.num_kv_heads * slots * m.head_dim * 4 / 1e6
        row["weights_mb_per_step"] = weights_mb

        step = dm.recompute_step_fn(module)
        buffers = dm.recompute_buffers(batch, PROMPT_LEN + new - 1)
        one = jnp.ones((batch, 1), jnp.int32)
        step_jit = jax.jit(lambda p, b: step(p, one, one, one, b)[0])  # pylint: disable=cell-var-from-loop
        steps = lambda: [  # noqa: E731
            jax.block_until_ready(step_jit(params, buffers)) for _ in range(NOCACHE_STEPS)  # pylint: disable=cell-var-from-loop
        ]
        t_step = _median_time(steps, repeats) / NOCACHE_STEPS
        row["nocache_tokens_per_s"] = batch / t_step
        row["nocache_ms_per_token"] = 1e3 * t_step

        ids = torch.tensor(prompts)
        generate = lambda: hf_model.generate(  # noqa: E731
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
          t_hf = _median_time(generate, repeats)
        row["hf_tokens_per_s"] = batch * new / t_hf
        row["ratio_cache_vs_hf"] = row["cache_tokens_per_s"] / row["hf_tokens_per_s"]
        results["runs"].append(row)
  finally:
    torch.set_num_threads(previous_threads)
  return results


def plot(results: dict, path) -> None:
  """tokens/s against new tokens, one panel per batch size."""
  plt = common.pyplot()
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
      ax.plot(news, [r[key] for r in runs], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="new tokens", ylabel="tokens / s")
    ax.set_title(f"greedy decode, batch {batch}")
    ax.set_xticks(news, [str(n) for n in news])
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
