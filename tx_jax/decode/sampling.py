"""Greedy decoding and sampling (temperature, top-k, top-p) under jit, in `lax.while_loop`s.

Everything here is written against a step function,

    step_fn(params, tokens_BT, positions_BT, segment_ids_BT, cache) -> (logits_BTV, cache)

which runs the model on T >= 1 new tokens, writes them into the cache and returns
their next-token logits. An optional `prefill_fn` of the same signature replaces
it on the first call (encoder-decoders pass the encoder output there only). A tx_jax
model with a KV cache is one such function (`tx_jax.decode.generate`), a model without
one is another (it keeps the tokens as its "cache" and recomputes), and the tests use
numpy Markov tables. Call the
functions below under `jax.jit` with the step function static; the prefill is one
call on the whole left-padded prompt, then one call per new token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tx_jax.decode import chunked_cache
from tx_jax.decode.prompts import Prompt, check_max_new_tokens, check_sampling

StepFn = Callable[[Any, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


class DecodeResult(NamedTuple):
  """Generated ids: `tokens[b, :lengths[b]]` ends with EOS if one was produced; 0 after."""

  tokens: jax.Array  # [B, Y] int32
  lengths: jax.Array  # [B] int32, generated tokens including the EOS


def process_logits(
    logits_BV: jax.Array, *, temperature: float, top_k: int, top_p: float
) -> jax.Array:
  """Scaled logits with -inf outside the top-k / nucleus set, in HF's order (T, k, p)."""
  logits_BV = logits_BV.astype(jnp.float32) / temperature
  rows_B1 = jnp.arange(logits_BV.shape[0])[:, None]
  if top_k > 0 and top_k < logits_BV.shape[-1]:
    # Keep by index, not by a threshold value, so ties cannot widen the set
    # and top_k=1 picks exactly argmax's token (both prefer the lower index).
    _, idx_BE = jax.lax.top_k(logits_BV, top_k)
    keep_BV = jnp.zeros(logits_BV.shape, bool).at[rows_B1, idx_BE].set(True)
    logits_BV = jnp.where(keep_BV, logits_BV, -jnp.inf)
  if top_p < 1.0:
    order_BV = jnp.argsort(-logits_BV, axis=-1, stable=True)
    sorted_BV = jnp.take_along_axis(logits_BV, order_BV, axis=-1)
    probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
    mass_before_BV = jnp.cumsum(probs_BV, axis=-1) - probs_BV
    # The nucleus is the shortest prefix of the sorted vocabulary whose mass
    # reaches top_p; the most likely token is always in it.
    keep_sorted_BV = (mass_before_BV < top_p).at[:, 0].set(True)
    keep_BV = jnp.zeros(logits_BV.shape, bool).at[rows_B1, order_BV].set(keep_sorted_BV)
    logits_BV = jnp.where(keep_BV, logits_BV, -jnp.inf)
  return logits_BV


def _select(
    logits_BV: jax.Array, rng: jax.Array, greedy: bool, temperature: float, top_k: int, top_p: float
) -> jax.Array:
  if greedy:
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
  logits_BV = process_logits(logits_BV, temperature=temperature, top_k=top_k, top_p=top_p)
  return jax.random.categorical(rng, logits_BV, axis=-1).astype(jnp.int32)


def prefill(step_fn: StepFn, params: Any, cache: Any, prompt: Prompt) -> tuple[jax.Array, Any]:
  """Runs the whole prompt through the model; returns the last column's logits and the cache."""
  logits_BPV, cache = step_fn(
      params,
      jnp.asarray(prompt.tokens, jnp.int32),
      jnp.asarray(prompt.positions, jnp.int32),
      jnp.asarray(prompt.segment_ids, jnp.int32),
      cache,
  )
  # Left padding puts every row's last real token in the last column.
  return logits_BPV[:, -1].astype(jnp.float32), cache


def generated_lengths(tokens_BY: jax.Array, eos_id: int | None) -> jax.Array:
  """Tokens up to and including the first EOS, else N."""
  n = tokens_BY.shape[-1]
  if eos_id is None:
    return jnp.full(tokens_BY.shape[:-1], n, jnp.int32)
  is_eos = tokens_BY == eos_id
  first = jnp.argmax(is_eos, axis=-1)
  return jnp.where(is_eos.any(axis=-1), first + 1, n).astype(jnp.int32)


def sample(
    step_fn: StepFn,
    params: Any,
    cache: Any,
    prompt: Prompt,
    *,
    max_new_tokens: int,
    eos_id: int | None,
    rng: jax.Array | None = None,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    prefill_fn: StepFn | None = None,
    cache_chunk: int = 0,
) -> DecodeResult:
  """Generates up to max_new_tokens per row, stopping rows at EOS; greedy=True takes argmax.

  cache_chunk > 0 decodes on a chunked KV cache (`chunked_cache`) flushed every
  cache_chunk steps; the cache must then have `chunked_cache.padded_length` slots.
  """
  check_max_new_tokens(max_new_tokens)
  if not greedy:
    check_sampling(temperature, top_k, top_p)
  if rng is None:
    if not greedy:
      raise ValueError("rng is None: sampling (greedy=False) needs a jax.random key")
    rng = jax.random.key(0)
  batch = prompt.tokens.shape[0]
  lengths_B = jnp.asarray(prompt.lengths, jnp.int32)

  logits_BV, cache = prefill(prefill_fn or step_fn, params, cache, prompt)
  rng, key = jax.random.split(rng)
  token_B = _select(logits_BV, key, greedy, temperature, top_k, top_p)
  tokens_BY = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(token_B)
  done_B = token_B == eos_id if eos_id is not None else jnp.zeros((batch,), bool)

  # With cache_chunk, the steps of a chunk only read the long KV cache (closed over,
  # not carried), and it is written once per chunk; see chunked_cache.
  frozen, live = chunked_cache.start(cache, cache_chunk) if cache_chunk else ({}, cache)
  chunk = cache_chunk or max_new_tokens
  live_part = (lambda c: chunked_cache.split(c)[1]) if cache_chunk else (lambda c: c)  # noqa: E731

  def running(i, done_B, end):
    return (i < end) & ~jnp.all(done_B)

  def decode_chunk(outer):
    i, tokens_BY, token_B, done_B, frozen, live, rng = outer
    end = jnp.minimum(i + chunk, max_new_tokens)

    def step(state):
      i, tokens_BY, token_B, done_B, live, rng = state
      # Token i-1 sits at position prompt_length + i - 1 of its row.
      positions_B1 = (lengths_B + i - 1)[:, None]
      logits_B1V, cache = step_fn(
          params,
          token_B[:, None],
          positions_B1,
          jnp.ones((batch, 1), jnp.int32),
          chunked_cache.merge(frozen, live),
      )
      rng, key = jax.random.split(rng)
      new_B = _select(logits_B1V[:, 0].astype(jnp.float32), key, greedy, temperature, top_k, top_p)
      new_B = jnp.where(done_B, 0, new_B)
      tokens_BY = jax.lax.dynamic_update_slice(tokens_BY, new_B[:, None], (0, i))
      if eos_id is not None:
        done_B = done_B | (new_B == eos_id)
      return i + 1, tokens_BY, new_B, done_B, live_part(cache), rng

    state = jax.lax.while_loop(
        lambda s: running(s[0], s[3], end), step, (i, tokens_BY, token_B, done_B, live, rng)
    )
    i, tokens_BY, token_B, done_B, live, rng = state
    frozen, live = chunked_cache.flush(frozen, live)
    return i, tokens_BY, token_B, done_B, frozen, live, rng

  state = (jnp.int32(1), tokens_BY, token_B, done_B, frozen, live, rng)
  state = jax.lax.while_loop(lambda s: running(s[0], s[3], max_new_tokens), decode_chunk, state)
  tokens_BY = state[1]
  return DecodeResult(tokens_BY, generated_lengths(tokens_BY, eos_id))


def greedy(
    step_fn: StepFn,
    params: Any,
    cache: Any,
    prompt: Prompt,
    *,
    max_new_tokens: int,
    eos_id: int | None,
    prefill_fn: StepFn | None = None,
    cache_chunk: int = 0,
) -> DecodeResult:
  """Argmax decoding; see `sample`."""
  return sample(
      step_fn,
      params,
      cache,
      prompt,
      max_new_tokens=max_new_tokens,
      eos_id=eos_id,
      greedy=True,
      prefill_fn=prefill_fn,
      cache_chunk=cache_chunk,
  )
