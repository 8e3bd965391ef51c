"""Beam search with the GNMT length penalty, in one `lax.while_loop`.

Hypotheses are ranked by log P(y) / lp(y) with lp(y) = ((5 + |y|) / 6) ** alpha
(Wu et al. 2016, eq. 14), |y| counting the generated tokens including the EOS;
the Transformer paper used beam 4 and alpha 0.6. Each step expands the W alive
beams to W * V candidates and keeps the best E = 2W:

- an EOS candidate is finished only if it ranks among the best W (as in
  fairseq), so beam 1 with alpha 0 is exactly greedy decoding;
- the best W candidates that do not end in EOS stay alive, so the beam stays
  full while others finish;
- at the last step (max_new_tokens) every top-W candidate is finished, scored
  at that length (as `transformers` does), so a beam that never emits EOS can
  still win.

The search stops early for a batch row only when its W-th best finished score
beats the best score any alive beam could still reach, logP_alive / lp(N):
log-probs only fall and, for alpha >= 0, lp(N) is the largest divisor. So early
stopping never changes the result. The model is the step function of
`sampling.py`; its cache leaves with a leading batch axis are repeated to B * W
after the prefill and gathered by parent beam every step (scalars untouched).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from tx_jax.decode.prompts import Prompt, check_beam, check_max_new_tokens
from tx_jax.decode.sampling import StepFn, generated_lengths, prefill

# Finite so that arithmetic on dead beams never makes NaN (no inf - inf).
NEG_INF = -1.0e7


class BeamResult(NamedTuple):
  """W hypotheses per row, best first; ids are 0 after each hypothesis' EOS."""

  tokens: jax.Array  # [B, W, Y] int32
  scores: jax.Array  # [B, W] float32, log P / lp(length); NEG_INF on empty slots
  log_probs: jax.Array  # [B, W] float32, log P of the generated tokens
  lengths: jax.Array  # [B, W] int32, generated tokens including the EOS


def length_penalty(length: jax.Array | int, alpha: float) -> jax.Array:
  """GNMT length penalty ((5 + length) / 6) ** alpha."""
  return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


class _Beams(NamedTuple):
  i: jax.Array  # index of the next token to generate
  alive_BWY: jax.Array
  alive_logp_BW: jax.Array
  fin_BWY: jax.Array
  fin_scores_BW: jax.Array
  fin_logp_BW: jax.Array
  cache: Any


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x[b, idx[b, j]] for x [B, I, ...] and idx [B, J]: per-row gathers with any trailing axes."""
  return jax.vmap(lambda x, i: x[i])(x, idx)


def gather_cache(cache: Any, flat_index: jax.Array) -> Any:
  """Reorders every cache leaf with a leading batch axis; scalars (cache_index) stay."""
  return jax.tree.map(lambda x: x[flat_index] if x.ndim else x, cache)


def repeat_cache(cache: Any, beam_size: int) -> Any:
  """Repeats every leaf with a leading batch axis beam_size times (row b -> rows bW..bW+W-1)."""
  return jax.tree.map(lambda x: jnp.repeat(x, beam_size, axis=0) if x.ndim else x, cache)


def _update(
    s: _Beams, logp_BWV: jax.Array, *, beam_size: int, alpha: float, eos_id: int | None, n: int
) -> tuple[_Beams, jax.Array]:
  """Extends the beams by one token given each alive beam's next-token log-probs."""
  batch, w, vocab = logp_BWV.shape
  cand_BWV = s.alive_logp_BW[:, :, None] + logp_BWV
  k2 = min(2 * w, w * vocab)
  top_logp_BE, top_idx_BE = jax.lax.top_k(cand_BWV.reshape(batch, w * vocab), k2)
  parent_BE = top_idx_BE // vocab
  token_BE = (top_idx_BE % vocab).astype(jnp.int32)
  seqs_BEY = _take(s.alive_BWY, parent_BE)
  seqs_BEY = jax.lax.dynamic_update_slice_in_dim(seqs_BEY, token_BE[:, :, None], s.i, axis=2)
  is_eos_BE = token_BE == eos_id if eos_id is not None else jnp.zeros_like(token_BE, bool)
  real_BE = top_logp_BE > NEG_INF / 2  # candidates grown from real (not padding) beams
  in_top_w_E = jnp.arange(k2) < w
  finishes_BE = (is_eos_BE | (s.i == n - 1)) & in_top_w_E & real_BE

  alive_logp_BW, keep_BW = jax.lax.top_k(jnp.where(is_eos_BE, NEG_INF, top_logp_BE), w)
  alive_BWY = _take(seqs_BEY, keep_BW)
  parent_BW = _take(parent_BE, keep_BW)

  scores_BE = jnp.where(finishes_BE, top_logp_BE / length_penalty(s.i + 1, alpha), NEG_INF)
  all_scores = jnp.concatenate([s.fin_scores_BW, scores_BE], axis=1)
  all_logp = jnp.concatenate([s.fin_logp_BW, top_logp_BE], axis=1)
  all_seqs = jnp.concatenate([s.fin_BWY, seqs_BEY], axis=1)
  # Earlier finished hypotheses come first, so ties keep them (top_k prefers lower indices).
  fin_scores_BW, best_BW = jax.lax.top_k(all_scores, w)
  fin_logp_BW = _take(all_logp, best_BW)
  fin_BWY = _take(all_seqs, best_BW)

  flat = (jnp.arange(batch)[:, None] * w + parent_BW).reshape(-1)
  cache = gather_cache(s.cache, flat)
  # The best score an alive beam can still reach (exact bound for alpha >= 0).
  bound_B = alive_logp_BW[:, 0] / length_penalty(n, alpha)
  done_B = fin_scores_BW[:, -1] > bound_B
  new = _Beams(s.i + 1, alive_BWY, alive_logp_BW, fin_BWY, fin_scores_BW, fin_logp_BW, cache)
  return new, done_B


def beam_search(
    step_fn: StepFn,
    params: Any,
    cache: Any,
    prompt: Prompt,
    *,
    beam_size: int,
    alpha: float,
    max_new_tokens: int,
    eos_id: int | None,
    prefill_fn: StepFn | None = None,
) -> BeamResult:
  """Beam search for the best log P / lp hypotheses; `cache` is allocated for batch B."""
  check_beam(beam_size, alpha)
  check_max_new_tokens(max_new_tokens)
  batch = prompt.tokens.shape[0]
  w, n = beam_size, max_new_tokens
  update = lambda s, logp: _update(s, logp, beam_size=w, alpha=alpha, eos_id=eos_id, n=n)  # noqa: E731

  logits_BV, cache = prefill(prefill_fn or step_fn, params, cache, prompt)
  logp_BWV = jnp.broadcast_to(
      jax.nn.log_softmax(logits_BV)[:, None], (batch, w, logits_BV.shape[-1])
  )
  # Only beam 0 is real at the start; the others would duplicate it.
  alive_logp_BW = jnp.full((batch, w), NEG_INF, jnp.float32).at[:, 0].set(0.0)
  zeros_BWY = jnp.zeros((batch, w, n), jnp.int32)
  state = _Beams(
      jnp.int32(0),
      zeros_BWY,
      alive_logp_BW,
      zeros_BWY,
      jnp.full((batch, w), NEG_INF, jnp.float32),
      jnp.full((batch, w), NEG_INF, jnp.float32),
      repeat_cache(cache, w),
  )
  state, done_B = update(state, logp_BWV)
  positions_BW = jnp.repeat(jnp.asarray(prompt.lengths, jnp.int32), w)

  def cond(carry):
    s, done_B = carry
    return (s.i < n) & ~jnp.all(done_B)

  def body(carry):
    s, _ = carry
    last_BW1 = jax.lax.dynamic_slice_in_dim(s.alive_BWY, s.i - 1, 1, axis=2)
    logits_BT1V, cache = step_fn(
        params,
        last_BW1.reshape(batch * w, 1),
        (positions_BW + s.i - 1)[:, None],
        jnp.ones((batch * w, 1), jnp.int32),
        s.cache,
    )
    logp_BWV = jax.nn.log_softmax(logits_BT1V[:, 0].astype(jnp.float32)).reshape(batch, w, -1)
    return update(s._replace(cache=cache), logp_BWV)

  state, _ = jax.lax.while_loop(cond, body, (state, done_B))
  lengths_BW = generated_lengths(state.fin_BWY, eos_id)
  return BeamResult(state.fin_BWY, state.fin_scores_BW, state.fin_logp_BW, lengths_BW)
