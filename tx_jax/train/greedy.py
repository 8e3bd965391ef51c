"""A plain, uncached greedy decoder for encoder-decoder evaluation inside the trainer.

Small on purpose: it re-runs the decoder on the whole fixed-size target buffer at every
step (causal masking makes later slots irrelevant), which is plenty for the short held-out
strings the trainer scores. `tx_jax.decode` has the cached strategies for real decoding.
"""

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np


@functools.partial(jax.jit, static_argnames=("module", "max_len", "start_id", "eos_id"))
def greedy_encdec(
    module: nn.Module,
    params: Any,
    encoder_inputs: jax.Array,
    encoder_segment_ids: jax.Array,
    *,
    max_len: int,
    start_id: int,
    eos_id: int,
) -> jax.Array:
  """Argmax target ids [B, max_len] for source ids [B, S]; 0 after each row's EOS."""
  variables = {"params": params}
  encoded = module.apply(
      variables, encoder_inputs, encoder_segment_ids=encoder_segment_ids, method="encode"
  )
  batch = encoder_inputs.shape[0]
  # Column 0 holds the start id; column i + 1 receives the token predicted at step i.
  tokens = jnp.zeros((batch, max_len + 1), jnp.int32).at[:, 0].set(start_id)
  segments = jnp.ones((batch, max_len), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (batch, max_len))

  def body(i, carry):
    tokens, done = carry
    logits = module.apply(
        variables,
        encoded,
        tokens[:, :max_len],
        encoder_segment_ids=encoder_segment_ids,
        decoder_segment_ids=segments,
        decoder_positions=positions,
        method="decode",
    )
    nxt = jnp.argmax(logits[:, i], axis=-1).astype(jnp.int32)
    nxt = jnp.where(done, 0, nxt)
    return tokens.at[:, i + 1].set(nxt), done | (nxt == eos_id)

  tokens, _ = jax.lax.fori_loop(0, max_len, body, (tokens, jnp.zeros((batch,), bool)))
  return tokens[:, 1:]


def strip(ids: np.ndarray, eos_id: int) -> list[int]:
  """Ids up to (not including) the first EOS or padding."""
  out = []
  for i in ids.tolist():
    if i in (eos_id, 0):
      break
    out.append(i)
  return out
