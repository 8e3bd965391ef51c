"""Shared toy "model" for the strategy tests: a numpy table as the next-token law.

The toy model hashes the token history into a state kept in its cache (so a beam
search that gathers the cache wrongly changes the logits) and adds a per-position
row (so wrong positions change them too). The `np_*` references recompute
everything from the full token history in numpy, independently of tx_jax.decode.
"""

import functools

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


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "eos_id"))
def _greedy(params, prompt, max_new_tokens, eos_id):
  batch = prompt.tokens.shape[0]
  return decode.greedy(
      toy_step, params, toy_cache(batch), prompt, max_new_tokens=max_new_tokens, eos_id=eos_id
  )


@functools.partial(
    jax.jit, static_argnames=("max_new_tokens", "eos_id", "temperature", "top_k", "top_p")
)
def _sample(params, prompt, rng, max_new_tokens, eos_id, temperature, top_k, top_p):
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
def _beam(params, prompt, beam_size, alpha, max_new_tokens, eos_id):
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


def np_greedy(params, prompt, max_new_tokens, eos_id):
  out = []
  for _ in range(max_new_tokens):
    tok = int(np.argmax(np_logits(params, prompt + out, len(prompt) + len(out))))
    out.append(tok)
    if tok == eos_id:
      break
  return out


def np_score(params, prompt, seq, alpha):
  """(log P / GNMT penalty, log P) of generated `seq` after `prompt`."""
  logp = sum(
      np_log_softmax(np_logits(params, prompt + seq[:i], len(prompt) + i))[seq[i]]
      for i in range(len(seq))
  )
  return logp / ((5 + len(seq)) / 6) ** alpha, logp


class Toy:
  """The toy model, its jitted strategies and its numpy references (one per session)."""

  vocab, states, max_pos, eos = V, M, MAX_POS, EOS
  step, cache = staticmethod(toy_step), staticmethod(toy_cache)
  greedy, sample, beam = staticmethod(_greedy), staticmethod(_sample), staticmethod(_beam)
  np_logits, np_greedy, np_score = (
      staticmethod(np_logits),
      staticmethod(np_greedy),
      staticmethod(np_score),
  )

  def __init__(self):
    rng = np.random.default_rng(0)
    self.params = (
        jnp.asarray(rng.normal(size=(M, V)) * 2, jnp.float32),
        jnp.asarray(rng.normal(size=(MAX_POS, V)), jnp.float32),
    )

  def table_params(self, table_MV):
    """Params with the given [M, V] table and no position term."""
    return (jnp.asarray(table_MV, jnp.float32), jnp.zeros((MAX_POS, V), jnp.float32))


@pytest.fixture(scope="session")
def toy() -> Toy:
  """The toy model with its default random tables in `toy.params`."""
  return Toy()
