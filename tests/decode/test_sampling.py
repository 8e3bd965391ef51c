"""Greedy decoding and sampling against the toy model of conftest.py and fixed distributions.

Greedy is checked token for token against a numpy argmax over the full history;
sampling by its frequencies on a fixed distribution (5 sigma per token).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tx_jax import decode

PROMPTS = [[3, 2, 4], [2], [4, 4, 2, 3, 2], [3, 3]]


@pytest.mark.parametrize("eos_id", [1, None])
def test_greedy_matches_numpy_reference_with_ragged_prompts(toy, eos_id):
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=12)
  out = toy.greedy(toy.params, prompt, 12, eos_id)
  for b, p in enumerate(PROMPTS):
    expected = toy.np_greedy(toy.params, p, 12, eos_id)
    assert int(out.lengths[b]) == len(expected)
    np.testing.assert_array_equal(out.tokens[b, : len(expected)], expected)
    assert not np.any(np.asarray(out.tokens[b, len(expected) :]))
  if eos_id is not None:  # the example must actually exercise EOS stopping
    assert int(out.lengths.min()) < 12


def test_top_k_1_equals_greedy(toy):
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=10)
  want = toy.greedy(toy.params, prompt, 10, toy.eos)
  for seed in range(3):
    got = toy.sample(toy.params, prompt, jax.random.key(seed), 10, toy.eos, 0.7, 1, 1.0)
    np.testing.assert_array_equal(got.tokens, want.tokens)


def test_tiny_top_p_equals_greedy(toy):
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=10)
  want = toy.greedy(toy.params, prompt, 10, toy.eos)
  got = toy.sample(toy.params, prompt, jax.random.key(1), 10, toy.eos, 1.0, 0, 1e-6)
  np.testing.assert_array_equal(got.tokens, want.tokens)


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


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, float("nan")])
def test_top_p_outside_unit_interval_is_an_error(top_p):
  with pytest.raises(ValueError, match=r"top_p=.* must lie in \(0, 1\]"):
    decode.check_sampling(1.0, 0, top_p)
  with pytest.raises(ValueError, match="top_p="):
    const_samples(jax.random.key(0), 1.0, 0, top_p)
