"""Cached decoding of the real model families equals the uncached argmax loop.

The reference runs each row alone, without padding and without a cache: the
whole sequence so far through `module.apply`, argmax of the last logits. The
decoder under test runs a ragged batch (left-padded prompts, right-padded
sources) through the KV cache inside one jitted `lax.while_loop`.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import gpt, t5, transformer
from tx_jax import decode, models
from tx_jax.decode import chunked_cache
from tests.tiers import slow_except

N_NEW = 7
PROMPTS = [[5, 9, 3, 7, 2], [11], [4, 4, 8]]
SOURCES = [[6, 3, 9, 12, 2], [8, 2], [7, 7, 7, 5]]


def shrink(config, **overrides):
  m = config.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 40, 32, 2, 4, 4
  m.head_dim, m.mlp_dim, m.max_len = 8, 64, 32
  if m.family == "encdec":
    m.num_decoder_layers = 2
  m.dropout_rate = m.attention_dropout_rate = m.mlp_inner_dropout_rate = 0.0
  for key, value in overrides.items():
    setattr(m, key, value)
  return m


DECODERS = {
    "gpt2-learned": lambda: shrink(gpt.get_config("tiny")),
    "llama-rope-gqa": lambda: shrink(gpt.get_config("llama-tiny"), num_kv_heads=2),
    "sinusoidal-mqa": lambda: shrink(
        gpt.get_config("tiny"), positions="sinusoidal", num_kv_heads=1
    ),
    "t5-relative": lambda: shrink(
        gpt.get_config("tiny"), positions="relative", relative_max_distance=16
    ),
    "alibi": lambda: shrink(gpt.get_config("tiny"), positions="alibi"),
}
ENCDECS = {
    "transformer-sinusoidal": lambda: shrink(transformer.get_config("tiny")),
    "t5-relative": lambda: shrink(t5.get_config("tiny"), relative_max_distance=16),
    "learned-gqa": lambda: shrink(
        transformer.get_config("tiny"), positions="learned", num_kv_heads=2, pre_norm=True
    ),
}


def build(model_cfg, *example_inputs):
  module = models.build(model_cfg)
  init = jax.jit(lambda key: module.init(key, *example_inputs, train=False)["params"])
  params = init(jax.random.key(1))
  # Random init gives nearly flat logits; sharpen them so argmax is not a float tie.
  return module, jax.tree.map(lambda x: x * 3.0, nn.meta.unbox(params))


def reference_decoder(module, params, prompts, n, eos_id=None):
  """Rows right-padded to a fixed width, full causal forward every step, no cache."""
  forward = jax.jit(lambda p, x: module.apply({"params": p}, x))
  seqs = [list(p) for p in prompts]
  done = [False] * len(seqs)
  width = max(map(len, prompts)) + n
  for _ in range(n):
    buf = np.zeros((len(seqs), width), np.int32)
    for i, s in enumerate(seqs):
      buf[i, : len(s)] = s
    logits = np.asarray(forward(params, buf))
    for i, s in enumerate(seqs):
      if not done[i]:
        s.append(int(np.argmax(logits[i, len(s) - 1])))
        done[i] = s[-1] == eos_id
  return [s[len(p) :] for s, p in zip(seqs, prompts)]


def reference_encdec(module, params, sources, n, start_id):
  """Full encoder-decoder forward on right-padded rows every step, no cache."""
  forward = jax.jit(
      lambda p, src, seg, dec: module.apply({"params": p}, src, dec, encoder_segment_ids=seg)
  )
  src, seg = right_pad(sources)
  dec = np.zeros((len(sources), n + 1), np.int32)
  dec[:, 0] = start_id
  for t in range(n):
    logits = np.asarray(forward(params, src, seg, dec))
    dec[:, t + 1] = np.argmax(logits[:, t], axis=-1)
  return [list(map(int, row[1:])) for row in dec]


def right_pad(rows):
  width = max(map(len, rows))
  tokens = np.zeros((len(rows), width), np.int32)
  for i, r in enumerate(rows):
    tokens[i, : len(r)] = r
  return tokens, (tokens > 0).astype(np.int32)


def assert_rows_equal(result, expected_rows):
  for b, want in enumerate(expected_rows):
    got = [int(t) for t in result.tokens[b, : int(result.lengths[b])]]
    assert got == want, (b, got, want)


@functools.lru_cache(maxsize=None)
def decoder(name):
  """(module, params, reference greedy continuations of PROMPTS), built once per test run."""
  module, params = build(DECODERS[name](), jnp.zeros((1, 8), jnp.int32))
  return module, params, reference_decoder(module, params, PROMPTS, N_NEW)


@functools.lru_cache(maxsize=None)
def encdec(name):
  module, params = build(
      ENCDECS[name](), jnp.zeros((1, 6), jnp.int32), jnp.zeros((1, 4), jnp.int32)
  )
  return module, params, reference_encdec(module, params, SOURCES, N_NEW, start_id=1)


# The default chunk (one chunk for N_NEW tokens), a chunk of 2 (the recent buffer is
# flushed into the long cache three times) and no chunking (the cache written every step).
CHUNKS = [decode.CACHE_CHUNK, 2, 0]


@pytest.mark.slow  # every decoder family x chunking; test_kv_cache keeps the mechanics fast
@pytest.mark.parametrize("cache_chunk", CHUNKS)
@pytest.mark.parametrize("name", sorted(DECODERS))
def test_cached_greedy_equals_uncached_argmax_loop(name, cache_chunk):
  module, params, expected = decoder(name)
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=N_NEW, max_len=module.config.max_len)
  out = decode.generate(
      module,
      params,
      prompt,
      decode.Strategy("greedy", max_new_tokens=N_NEW),
      eos_id=None,
      cache_chunk=cache_chunk,
  )
  assert_rows_equal(out, expected)


@pytest.mark.parametrize(
    "name", slow_except(["gpt2-learned", "sinusoidal-mqa", "t5-relative"], "gpt2-learned")
)
def test_chunked_decode_up_to_max_len(name):
  """A decode near model.max_len, whose chunk-padded cache is longer than max_len."""
  module, params, _ = decoder(name)
  max_len = module.config.max_len
  prompts = [[5, 9, 3], [7]]
  n = max_len - 3  # the reference's buffer holds prompt + n = max_len tokens
  assert chunked_cache.padded_length(3, n, 8) > max_len
  want = reference_decoder(module, params, prompts, n)
  prompt = decode.make_prompt(prompts, max_new_tokens=n, max_len=max_len)
  out = decode.generate(
      module, params, prompt, decode.Strategy("greedy", max_new_tokens=n), eos_id=None,
      cache_chunk=8,
  )
  assert_rows_equal(out, want)


@pytest.mark.slow  # the fast tier keeps chunked greedy decoding (above)
def test_chunked_sampling_equals_unchunked():
  """Same key, same tokens: chunking changes where K/V are stored, not what is sampled."""
  module, params, _ = decoder("llama-rope-gqa")
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=9)
  strategy = decode.Strategy("sample", max_new_tokens=9, temperature=1.5, top_p=0.9)
  runs = [
      decode.generate(
          module, params, prompt, strategy, eos_id=None, rng=jax.random.key(4), cache_chunk=c
      )
      for c in (0, 3)
  ]
  np.testing.assert_array_equal(runs[0].tokens, runs[1].tokens)


def test_bad_cache_chunk_is_refused():
  module, params, _ = decoder("gpt2-learned")
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=3)
  with pytest.raises(ValueError, match="cache_chunk=-1 must be an int >= 0"):
    decode.generate(
        module, params, prompt, decode.Strategy("greedy", max_new_tokens=3), eos_id=None,
        cache_chunk=-1,
    )


@pytest.mark.parametrize("name", ["gpt2-learned", "llama-rope-gqa"])
def test_recompute_decoding_equals_uncached_argmax_loop(name):
  module, params, expected = decoder(name)
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=N_NEW)
  out = decode.generate(
      module,
      params,
      prompt,
      decode.Strategy("greedy", max_new_tokens=N_NEW),
      eos_id=None,
      use_cache=False,
  )
  assert_rows_equal(out, expected)


def test_eos_stops_rows():
  module, params, expected = decoder("gpt2-learned")
  eos = expected[0][2]  # row 0 emits it at step 3
  want = reference_decoder(module, params, PROMPTS, N_NEW, eos_id=eos)
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=N_NEW)
  out = decode.generate(
      module, params, prompt, decode.Strategy("greedy", max_new_tokens=N_NEW), eos_id=eos
  )
  assert_rows_equal(out, want)
  assert int(out.lengths[0]) <= 3


@pytest.mark.slow  # every encdec family x chunking
@pytest.mark.parametrize("cache_chunk", CHUNKS)
@pytest.mark.parametrize("name", sorted(ENCDECS))
def test_cached_greedy_translate_equals_uncached_argmax_loop(name, cache_chunk):
  module, params, expected = encdec(name)
  tokens, segments = right_pad(SOURCES)
  out = decode.translate(
      module,
      params,
      tokens,
      segments,
      decode.Strategy("greedy", max_new_tokens=N_NEW),
      eos_id=None,
      decoder_start_id=1,
      cache_chunk=cache_chunk,
  )
  assert_rows_equal(out, expected)


@pytest.mark.slow  # an encoder-decoder's beam and greedy programs (~11 s)
def test_beam_1_equals_greedy_on_encdec():
  module, params, expected = encdec("t5-relative")
  tokens, segments = right_pad(SOURCES)
  out = decode.translate(
      module,
      params,
      tokens,
      segments,
      decode.Strategy("beam", max_new_tokens=N_NEW, beam_size=1, alpha=0.0),
      eos_id=None,
      decoder_start_id=1,
  )
  assert_rows_equal(decode.best(out), expected)


def test_beam_scores_match_full_forward():
  """Beam hypotheses of a real cached decoder re-scored by full forward passes."""
  module, params, _ = decoder("llama-rope-gqa")
  eos = 3
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=5)
  out = decode.generate(
      module,
      params,
      prompt,
      decode.Strategy("beam", max_new_tokens=5, beam_size=3, alpha=0.6),
      eos_id=eos,
  )
  # Re-score every hypothesis with one full forward over right-padded rows.
  rows = [
      (b, w, PROMPTS[b], [int(t) for t in out.tokens[b, w, : int(out.lengths[b, w])]])
      for b in range(len(PROMPTS))
      for w in range(3)
  ]
  buf, _ = right_pad([p + seq for _, _, p, seq in rows])
  logp = np.asarray(jax.nn.log_softmax(jax.jit(module.apply)({"params": params}, buf)))
  for i, (b, w, p, seq) in enumerate(rows):
    total = sum(logp[i, len(p) - 1 + j, t] for j, t in enumerate(seq))
    np.testing.assert_allclose(float(out.log_probs[b, w]), total, rtol=1e-4, atol=1e-4)
    lp = ((5 + len(seq)) / 6) ** 0.6
    np.testing.assert_allclose(float(out.scores[b, w]), total / lp, rtol=1e-4, atol=1e-4)
  assert any(r[3][-1] == eos for r in rows), "no hypothesis finished with EOS"


@pytest.mark.slow  # the fast tier has top-k 1 = greedy on a toy model (test_sampling.py)
def test_sampling_top_k_1_equals_greedy_on_a_real_model():
  module, params, expected = decoder("sinusoidal-mqa")
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=N_NEW)
  out = decode.generate(
      module,
      params,
      prompt,
      decode.Strategy("sample", max_new_tokens=N_NEW, top_k=1, temperature=0.5),
      eos_id=None,
      rng=jax.random.key(3),
  )
  assert_rows_equal(out, expected)


def test_model_level_errors():
  module, params, _ = decoder("gpt2-learned")
  prompt = decode.make_prompt([[3] * 30], max_new_tokens=8)
  with pytest.raises(ValueError, match="model.max_len=32"):
    decode.generate(
        module, params, prompt, decode.Strategy("greedy", max_new_tokens=8), eos_id=None
    )
  with pytest.raises(ValueError, match="strategy='topk'"):
    decode.Strategy("topk").validate()
  with pytest.raises(ValueError, match=r"top_p=0 must lie in \(0, 1\]"):
    decode.Strategy("sample", top_p=0).validate()


@pytest.mark.slow  # whole-model sharding
def test_sharded_decode_equals_single_device():
  """Prompts sharded over 8 devices on the batch axis, params replicated: same tokens."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  module, params, _ = decoder("gpt2-learned")
  prompts = [PROMPTS[i % 3][: 1 + i % 4] + [i + 2] for i in range(8)]
  prompt = decode.make_prompt(prompts, max_new_tokens=5)
  strategy = decode.Strategy("beam", max_new_tokens=5, beam_size=2)
  want = decode.generate(module, params, prompt, strategy, eos_id=3)
  mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
  rows = NamedSharding(mesh, PartitionSpec("data"))
  sharded = decode.Prompt(*(jax.device_put(np.asarray(x), rows) for x in prompt))
  params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
  got = decode.generate(module, params, sharded, strategy, eos_id=3)
  assert len(got.tokens.sharding.device_set) == 8
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5)
  greedy = decode.Strategy("greedy", max_new_tokens=5)
  want = decode.generate(module, params, prompt, greedy, eos_id=3, cache_chunk=2)
  got = decode.generate(module, params, sharded, greedy, eos_id=3, cache_chunk=2)
  assert len(got.tokens.sharding.device_set) == 8
  np.testing.assert_array_equal(got.tokens, want.tokens)
