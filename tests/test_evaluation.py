"""tx_jax.evaluation: BLEU against a hand-written BLEU, perplexity against exact values,
beam/greedy translation of text against the trainer's own uncached greedy decoder."""

import collections
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import gpt, transformer
from tx_jax import evaluation, models
from tx_jax.data.tokenizers import ByteTokenizer
from tx_jax.decode import models as decode_models
from tx_jax.train import greedy as trainer_greedy


def reference_bleu(hyps, refs):
  """Papineni et al. 2002 corpus BLEU on whitespace tokens (all n-gram counts > 0 here)."""
  matches, totals, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
  for h, r in zip(hyps, refs):
    h, r = h.split(), r.split()
    hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
    for n in range(1, 5):
      hc = collections.Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
      rc = collections.Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
      matches[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
      totals[n - 1] += max(len(h) - n + 1, 0)
  log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
  brevity = min(0.0, 1 - ref_len / hyp_len)
  return 100 * math.exp(log_precision + brevity)


def test_bleu_equals_the_formula():
  hyps = ["a man rides a red bike down the street", "two dogs play in the snow"]
  refs = ["a man rides a bike down the busy street", "two dogs are playing in the snow"]
  got = evaluation.bleu(hyps, refs, tokenize="none").score
  assert got == pytest.approx(reference_bleu(hyps, refs), rel=1e-9)
  assert 0 < got < 100
  assert evaluation.bleu(refs, refs).score == pytest.approx(100.0)


def test_bleu_detokenized_text_is_tokenized_by_sacrebleu():
  # 13a splits the full stop, so "street." and "street ." score the same.
  assert evaluation.bleu(["A man on the street."], ["A man on the street ."]).score == (
      pytest.approx(100.0)
  )


def test_bleu_errors():
  with pytest.raises(ValueError, match="reference set 0 has 1 sentences for 2 hypotheses"):
    evaluation.bleu(["a", "b"], ["a"])
  with pytest.raises(ValueError, match="hypotheses is empty"):
    evaluation.bleu([], [])


def tiny_decoder(vocab=24):
  m = gpt.get_config("tiny").model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = vocab, 16, 1, 2, 2
  m.head_dim, m.mlp_dim, m.max_len = 8, 32, 16
  return models.build(m)


def lm_batch(inputs, weights):
  inputs = np.asarray(inputs, np.int32)
  return {
      "inputs": inputs,
      "targets": np.roll(inputs, -1, axis=1),
      "weights": np.asarray(weights, np.float32),
      "segment_ids": np.ones_like(inputs),
      "positions": np.broadcast_to(np.arange(inputs.shape[1], dtype=np.int32), inputs.shape),
  }


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
  module = tiny_decoder(vocab=24)
  shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32)))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), nn.meta.unbox(shapes["params"]))
  batch = lm_batch([[5, 6, 7, 8], [9, 3, 0, 0]], [[1, 1, 1, 0], [1, 0, 0, 0]])
  out = evaluation.lm_perplexity(module, zeros, [batch])
  assert out["tokens"] == 4
  assert out["perplexity"] == pytest.approx(24.0, rel=1e-5)
  assert out["bits_per_token"] == pytest.approx(math.log2(24), rel=1e-5)


def test_perplexity_counts_only_weighted_targets():
  module = tiny_decoder()
  params = jax.jit(module.init)(jax.random.key(1), jnp.zeros((1, 4), jnp.int32))["params"]
  batch = lm_batch([[5, 6, 7, 8], [9, 3, 4, 2]], [[1, 1, 1, 0], [1, 1, 0, 0]])
  logits = np.asarray(module.apply({"params": params}, batch["inputs"]), np.float64)
  logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  nll = [
      -logp[b, t, batch["targets"][b, t]]
      for b in range(2)
      for t in range(4)
      if batch["weights"][b, t]
  ]
  # Two batches of one row each must give the corpus value, not a mean of batch means.
  halves = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
  out = evaluation.lm_perplexity(module, params, halves)
  assert out["perplexity"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-5)
  with pytest.raises(ValueError, match="token_count=0"):
    evaluation.perplexity(1.0, 0)


def test_translate_texts_greedy_equals_the_trainers_decoder():
  m = transformer.get_config("tiny").model
  m.vocab_size, m.d_model, m.num_layers, m.num_decoder_layers = 260, 32, 1, 1
  m.num_heads = m.num_kv_heads = 2
  m.head_dim, m.mlp_dim, m.max_len = 16, 64, 32
  module = models.build(m)
  params = jax.jit(module.init)(
      jax.random.key(2), jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32)
  )["params"]
  params = jax.tree.map(lambda x: x * 2.0, params)
  tok = ByteTokenizer(num_sentinels=0)
  sources = ["ein Hund", "zwei Katzen spielen", "x"]
  strategy = decode_models.Strategy("greedy", max_new_tokens=10)
  got = evaluation.translate_texts(
      module, params, tok, sources, strategy, source_len=24, batch_size=4
  )
  ids = np.zeros((3, 24), np.int32)
  for i, s in enumerate(sources):
    row = tok.encode(s) + [tok.eos_id]
    ids[i, : len(row)] = row
  want = trainer_greedy.greedy_encdec(
      module,
      params,
      ids,
      (ids != 0).astype(np.int32),
      max_len=10,
      start_id=tok.decoder_start_id,
      eos_id=tok.eos_id,
  )
  want = [tok.decode(trainer_greedy.strip(np.asarray(r), tok.eos_id)) for r in want]
  assert got == want
  beam = evaluation.translate_texts(
      module,
      params,
      tok,
      sources,
      decode_models.Strategy("beam", max_new_tokens=10, beam_size=2),
      source_len=24,
      batch_size=4,
  )
  assert len(beam) == 3 and all(isinstance(b, str) for b in beam)
