"""Decoding strategies against toy "models" whose next-token law is a numpy table.

The toy model hashes the token history into a state kept in its cache (so a
beam search that gathers the cache wrongly changes the logits) and adds a
per-position row (so wrong positions change them too). The references below
recompute everything from the full token history in numpy.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax import decode

V, M, MAX_POS, EOS = 5, 97, 32, 1


def toy_step(params, tokens_BT, positions_BT, segment_ids_BT, cache):
  """History-hash Markov model; pads (segment 0) leave the state untouched."""
  table_MV, pos_table_PV = params
  h_B = cache["h"]
  logits = []
  for t in range(tokens_BT.shape[1]):
    real_B = segment_ids_BT[:, t] > 0
    h_B = jnp.where(real_B, (h_B * V + tokens_BT[:, t]) % M, h_B)
    logits.append(table_MV[h_B] + pos_table_PV[positions_BT[:, t]])
  cache = {"h": h_B, "cache_index": cache["cache_index"] + tokens_BT.shape[1]}
  return jnp.stack(logits, axis=1), cache


def toy_cache(batch):
  return {"h": jnp.zeros((batch,), jnp.int32), "cache_index": jnp.int32(0)}


def np_logits(params, history, position):
  """Next-token logits after `history` (prompt + generated), the next token at `position`."""
  table, pos_table = (np.asarray(p) for p in params)
  h = 0
  for tok in history:
    h = (h * V + tok) % M
  return table[h] + pos_table[position - 1]


def np_log_softmax(x):
  x = x - x.max()
  return x - np.log(np.exp(x).sum())


@pytest.fixture(scope="module")
def params():
  rng = np.random.default_rng(0)
  return (
      jnp.asarray(rng.normal(size=(M, V)) * 2, jnp.float32),
      jnp.asarray(rng.normal(size=(MAX_POS, V)), jnp.float32),
  )


PROMPTS = [[3, 2, 4], [2], [4, 4, 2, 3, 2], [3, 3]]


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "eos_id"))
def jit_greedy(params, prompt, max_new_tokens, eos_id):
  batch = prompt.tokens.shape[0]
  return decode.greedy(
      toy_step, params, toy_cache(batch), prompt, max_new_tokens=max_new_tokens, eos_id=eos_id
  )


@functools.partial(
    jax.jit, static_argnames=("max_new_tokens", "eos_id", "temperature", "top_k", "top_p")
)
def jit_sample(params, prompt, rng, max_new_tokens, eos_id, temperature, top_k, top_p):
  batch = prompt.tokens.shape[0]
  return decode.sample(
      toy_step,
      params,
      toy_cache(batch),
      prompt,
      rng=rng,
      max_new_tokens=max_new_tokens,
      eos_id=eos_id,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
  )


@functools.partial(jax.jit, static_argnames=("beam_size", "alpha", "max_new_tokens", "eos_id"))
def jit_beam(params, prompt, beam_size, alpha, max_new_tokens, eos_id):
  batch = prompt.tokens.shape[0]
  return decode.beam_search(
      toy_step,
      params,
      toy_cache(batch),
      prompt,
      beam_size=beam_size,
      alpha=alpha,
      max_new_tokens=max_new_tokens,
      eos_id=eos_id,
  )


def np_greedy(params, prompt, max_new_tokens, eos_id):
  out = []
  for _ in range(max_new_tokens):
    tok = int(np.argmax(np_logits(params, prompt + out, len(prompt) + len(out))))
    out.append(tok)
    if tok == eos_id:
      break
  return out


def test_make_prompt_left_pads():
  p = decode.make_prompt([[5, 6, 7], [8]], max_new_tokens=2)
  np.testing.assert_array_equal(p.tokens, [[5, 6, 7], [0, 0, 8]])
  np.testing.assert_array_equal(p.segment_ids, [[1, 1, 1], [0, 0, 1]])
  np.testing.assert_array_equal(p.positions, [[0, 1, 2], [0, 0, 0]])
  np.testing.assert_array_equal(p.lengths, [3, 1])


@pytest.mark.parametrize("eos_id", [EOS, None])
def test_greedy_matches_numpy_reference_with_ragged_prompts(params, eos_id):
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=12)
  out = jit_greedy(params, prompt, 12, eos_id)
  for b, p in enumerate(PROMPTS):
    expected = np_greedy(params, p, 12, eos_id)
    assert int(out.lengths[b]) == len(expected)
    np.testing.assert_array_equal(out.tokens[b, : len(expected)], expected)
    assert not np.any(np.asarray(out.tokens[b, len(expected) :]))
  if eos_id is not None:  # the example must actually exercise EOS stopping
    assert int(out.lengths.min()) < 12


def test_top_k_1_equals_greedy(params):
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=10)
  want = jit_greedy(params, prompt, 10, EOS)
  for seed in range(3):
    got = jit_sample(params, prompt, jax.random.key(seed), 10, EOS, 0.7, 1, 1.0)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_tiny_top_p_equals_greedy(params):
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=10)
  want = jit_greedy(params, prompt, 10, EOS)
  got = jit_sample(params, prompt, jax.random.key(1), 10, EOS, 1.0, 0, 1e-6)
  np.testing.assert_array_equal(got.tokens, want.tokens)


def test_beam_1_alpha_0_equals_greedy(params):
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=10)
  want = jit_greedy(params, prompt, 10, EOS)
  got = jit_beam(params, prompt, 1, 0.0, 10, EOS)
  np.testing.assert_array_equal(got.tokens[:, 0], want.tokens)
  np.testing.assert_array_equal(got.lengths[:, 0], want.lengths)


def np_score(params, prompt, seq, alpha):
  logp = sum(
      np_log_softmax(np_logits(params, prompt + seq[:i], len(prompt) + i))[seq[i]]
      for i in range(len(seq))
  )
  return logp / ((5 + len(seq)) / 6) ** alpha, logp


def exhaustive(params, prompt, vocab, n, alpha, eos_id):
  """Every hypothesis: ends in EOS at any length <= n, or stops at length n."""
  hyps = []
  for length in range(1, n + 1):
    for seq in itertools.product(vocab, repeat=length):
      if eos_id in seq[:-1] or (length < n and seq[-1] != eos_id):
        continue
      hyps.append((np_score(params, prompt, list(seq), alpha)[0], list(seq)))
  return sorted(hyps, key=lambda h: -h[0])


def test_beam_search_equals_exhaustive_search():
  """With the beam as wide as the search tree, beam search is exhaustive search."""
  vocab, n, eos = 3, 4, 1
  rng = np.random.default_rng(1)
  # Logits only on ids < 3 so the tree is 3-ary; EOS made rarer so lengths compete.
  table = np.full((M, V), -1e9, np.float32)
  table[:, :vocab] = rng.normal(size=(M, vocab)) * 1.5
  table[:, eos] -= 1.5
  params = (jnp.asarray(table), jnp.zeros((MAX_POS, V), jnp.float32))
  prompts = [[2, 2], [2]]
  width = (vocab - 1) ** (n - 1) * vocab  # every candidate of the last step
  for alpha in (0.0, 0.6, 2.0):
    out = jit_beam(params, decode.make_prompt(prompts, max_new_tokens=n), width, alpha, n, eos)
    for b, p in enumerate(prompts):
      hyps = exhaustive(params, p, range(vocab), n, alpha, eos)
      for w, (score, seq) in enumerate(hyps[:width]):
        got = list(np.asarray(out.tokens[b, w, : int(out.lengths[b, w])]))
        assert got == seq, (alpha, b, w)
        np.testing.assert_allclose(float(out.scores[b, w]), score, rtol=1e-5, atol=1e-5)
  # Each alpha has its own winner here, or the test would not test the length penalty.
  winners = {str(exhaustive(params, prompts[1], range(3), n, a, eos)[0][1]) for a in (0, 0.6, 2)}
  assert len(winners) == 3


def test_beam_4_scores_match_numpy(params):
  """Returned scores and log-probs recomputed from the returned ids; best first."""
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=8)
  out = jit_beam(params, prompt, 4, 0.6, 8, EOS)
  for b, p in enumerate(PROMPTS):
    scores = np.asarray(out.scores[b])
    assert np.all(np.diff(scores) <= 0)
    for w in range(4):
      seq = [int(t) for t in out.tokens[b, w, : int(out.lengths[b, w])]]
      assert EOS not in seq[:-1] and not np.any(np.asarray(out.tokens[b, w, len(seq) :]))
      score, logp = np_score(params, p, seq, 0.6)
      np.testing.assert_allclose(float(out.scores[b, w]), score, rtol=1e-5)
      np.testing.assert_allclose(float(out.log_probs[b, w]), logp, rtol=1e-5)
    # Beam search optimises the score, so it beats (or ties) greedy's hypothesis.
    greedy_seq = np_greedy(params, p, 8, EOS)
    assert scores[0] >= np_score(params, p, greedy_seq, 0.6)[0] - 1e-5


def test_ragged_batch_equals_one_prompt_at_a_time(params):
  batch = decode.make_prompt(PROMPTS, max_new_tokens=6)
  together = jit_beam(params, batch, 3, 0.6, 6, EOS)
  for b, p in enumerate(PROMPTS):
    alone = jit_beam(params, decode.make_prompt([p], max_new_tokens=6), 3, 0.6, 6, EOS)
    np.testing.assert_array_equal(together.tokens[b], alone.tokens[0])
    np.testing.assert_allclose(together.scores[b], alone.scores[0], rtol=1e-6)


# --- sampling statistics on a fixed distribution ---------------------------------------

PROBS = np.array([0.07, 0.25, 0.02, 0.3, 0.08, 0.2, 0.03, 0.05])


def const_step(params, tokens_BT, positions_BT, segment_ids_BT, cache):
  batch, t = tokens_BT.shape
  return jnp.broadcast_to(params, (batch, t, params.shape[-1])), cache


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def const_samples(rng, temperature, top_k, top_p):
  prompt = decode.Prompt(*(jnp.ones((2048, 1), jnp.int32),) * 3, jnp.ones((2048,), jnp.int32))
  logits = jnp.log(jnp.asarray(PROBS, jnp.float32))
  return decode.sample(
      const_step,
      logits,
      jnp.zeros((2048,)),
      prompt,
      rng=rng,
      max_new_tokens=8,
      eos_id=None,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
  ).tokens


def check_frequencies(samples, allowed, expected_probs):
  counts = np.bincount(np.asarray(samples).ravel(), minlength=len(PROBS))
  assert counts[~allowed].sum() == 0, f"sampled outside the allowed set: {counts}"
  n = counts.sum()
  freq = counts / n
  sigma = np.sqrt(expected_probs * (1 - expected_probs) / n)
  # 5 sigma per token: a wrong distribution (e.g. not renormalised) fails by far more.
  assert np.all(np.abs(freq - expected_probs) <= 5 * sigma + 1e-12), (freq, expected_probs)


@pytest.mark.parametrize("top_p", [0.5, 0.75, 0.76, 1.0])
def test_top_p_never_samples_outside_the_nucleus(top_p):
  order = np.argsort(-PROBS, kind="stable")
  mass_before = np.cumsum(PROBS[order]) - PROBS[order]
  nucleus = np.zeros(len(PROBS), bool)
  nucleus[order[mass_before < top_p]] = True
  assert 1 < nucleus.sum() < len(PROBS) or top_p == 1.0
  samples = const_samples(jax.random.key(7), 1.0, 0, top_p)
  check_frequencies(samples, nucleus, np.where(nucleus, PROBS, 0) / PROBS[nucleus].sum())


def test_top_k_and_temperature_distribution():
  keep = np.zeros(len(PROBS), bool)
  keep[np.argsort(-PROBS)[:3]] = True
  samples = const_samples(jax.random.key(8), 2.0, 3, 1.0)
  tempered = np.where(keep, PROBS**0.5, 0)  # p ** (1 / T)
  check_frequencies(samples, keep, tempered / tempered.sum())


# --- bad input ---------------------------------------------------------------------


def test_empty_prompt_is_an_error():
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    decode.make_prompt([[3, 4], []], max_new_tokens=4)


def test_prompt_longer_than_max_len_is_an_error():
  with pytest.raises(ValueError, match=r"prompt 0 has 9 tokens.*max_len=8"):
    decode.make_prompt([list(range(2, 11))], max_new_tokens=1, max_len=8)
  with pytest.raises(ValueError, match=r"max_new_tokens=6 .*max_len=8.*<= 5"):
    decode.make_prompt([[2, 3, 4, 5]], max_new_tokens=6, max_len=8)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, float("nan")])
def test_top_p_outside_unit_interval_is_an_error(top_p):
  with pytest.raises(ValueError, match=r"top_p=.* must lie in \(0, 1\]"):
    decode.check_sampling(1.0, 0, top_p)
  with pytest.raises(ValueError, match="top_p="):
    const_samples(jax.random.key(0), 1.0, 0, top_p)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=0.0, top_k=0, top_p=1.0), "temperature=0.0"),
        (dict(temperature=1.0, top_k=-1, top_p=1.0), "top_k=-1"),
    ],
)
def test_bad_sampling_arguments(kwargs, message):
  with pytest.raises(ValueError, match=message):
    decode.check_sampling(**kwargs)


def test_bad_beam_arguments():
  with pytest.raises(ValueError, match="beam_size=0"):
    decode.check_beam(0, 0.6)
  with pytest.raises(ValueError, match="alpha=-1"):
    decode.check_beam(4, -1.0)
  with pytest.raises(ValueError, match="max_new_tokens=0"):
    decode.make_prompt([[2]], max_new_tokens=0)
