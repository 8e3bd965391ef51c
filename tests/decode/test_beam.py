"""Beam search against the toy model of conftest.py: exhaustive search, numpy scores, greedy."""

import itertools

import numpy as np

from tx_jax import decode

PROMPTS = [[3, 2, 4], [2], [4, 4, 2, 3, 2], [3, 3]]


def test_beam_1_alpha_0_equals_greedy(toy):
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=10)
  want = toy.greedy(toy.params, prompt, 10, toy.eos)
  got = toy.beam(toy.params, prompt, 1, 0.0, 10, toy.eos)
  np.testing.assert_array_equal(got.tokens[:, 0], want.tokens)
  np.testing.assert_array_equal(got.lengths[:, 0], want.lengths)


def exhaustive(toy, params, prompt, vocab, n, alpha, eos_id):
  """Every hypothesis: ends in EOS at any length <= n, or stops at length n."""
  hyps = []
  for length in range(1, n + 1):
    for seq in itertools.product(vocab, repeat=length):
      if eos_id in seq[:-1] or (length < n and seq[-1] != eos_id):
        continue
      hyps.append((toy.np_score(params, prompt, list(seq), alpha)[0], list(seq)))
  return sorted(hyps, key=lambda h: -h[0])


def test_beam_search_equals_exhaustive_search(toy):
  """With the beam as wide as the search tree, beam search is exhaustive search."""
  vocab, n, eos = 3, 4, 1
  rng = np.random.default_rng(1)
  # Logits only on ids < 3 so the tree is 3-ary; EOS made rarer so lengths compete.
  table = np.full((toy.states, toy.vocab), -1e9, np.float32)
  table[:, :vocab] = rng.normal(size=(toy.states, vocab)) * 1.5
  table[:, eos] -= 1.5
  params = toy.table_params(table)
  prompts = [[2, 2], [2]]
  width = (vocab - 1) ** (n - 1) * vocab  # every candidate of the last step
  for alpha in (0.0, 0.6, 2.0):
    out = toy.beam(params, decode.make_prompt(prompts, max_new_tokens=n), width, alpha, n, eos)
    for b, p in enumerate(prompts):
      hyps = exhaustive(toy, params, p, range(vocab), n, alpha, eos)
      for w, (score, seq) in enumerate(hyps[:width]):
        got = list(np.asarray(out.tokens[b, w, : int(out.lengths[b, w])]))
        assert got == seq, (alpha, b, w)
        np.testing.assert_allclose(float(out.scores[b, w]), score, rtol=1e-5, atol=1e-5)
  # Each alpha has its own winner here, or the test would not test the length penalty.
  winners = {
      str(exhaustive(toy, params, prompts[1], range(3), n, a, eos)[0][1]) for a in (0, 0.6, 2)
  }
  assert len(winners) == 3


def test_beam_4_scores_match_numpy(toy):
  """Returned scores and log-probs recomputed from the returned ids; best first."""
  prompt = decode.make_prompt(PROMPTS, max_new_tokens=8)
  params, eos = toy.params, toy.eos
  out = toy.beam(params, prompt, 4, 0.6, 8, eos)
  for b, p in enumerate(PROMPTS):
    scores = np.asarray(out.scores[b])
    assert np.all(np.diff(scores) <= 0)
    for w in range(4):
      seq = [int(t) for t in out.tokens[b, w, : int(out.lengths[b, w])]]
      assert eos not in seq[:-1] and not np.any(np.asarray(out.tokens[b, w, len(seq) :]))
      score, logp = toy.np_score(params, p, seq, 0.6)
      np.testing.assert_allclose(float(out.scores[b, w]), score, rtol=1e-5)
      np.testing.assert_allclose(float(out.log_probs[b, w]), logp, rtol=1e-5)
    # Beam search optimises the score, so it beats (or ties) greedy's hypothesis.
    greedy_seq = toy.np_greedy(params, p, 8, eos)
    assert scores[0] >= toy.np_score(params, p, greedy_seq, 0.6)[0] - 1e-5


def test_ragged_batch_equals_one_prompt_at_a_time(toy):
  batch = decode.make_prompt(PROMPTS, max_new_tokens=6)
  together = toy.beam(toy.params, batch, 3, 0.6, 6, toy.eos)
  for b, p in enumerate(PROMPTS):
    alone = toy.beam(toy.params, decode.make_prompt([p], max_new_tokens=6), 3, 0.6, 6, toy.eos)
    np.testing.assert_array_equal(together.tokens[b], alone.tokens[0])
    np.testing.assert_allclose(together.scores[b], alone.scores[0], rtol=1e-6)
