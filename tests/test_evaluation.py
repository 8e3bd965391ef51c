"""tx_jax.evaluation: BLEU against a hand-written BLEU, perplexity against exact values,
greedy / beam translation of text against an uncached argmax loop and full-forward scores,
and the trainer's Evaluator decoding with the strategy its config names."""

import collections
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import gpt, transformer
from tx_jax import decode, evaluation, models


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


class IdTokenizer:
  """Text "5 9 12" <-> ids [5, 9, 12]: invertible, so decoded texts can be re-scored."""

  eos_id, decoder_start_id = 2, 1

  def encode(self, text):
    return [int(w) for w in text.split()]

  def encode_input(self, text, *, encoder):
    return self.encode(text) + ([self.eos_id] if encoder else [])

  def decode(self, ids):
    return " ".join(map(str, ids))


SOURCES = ["5 9 3 7", "11", "4 4 8 20", "6 30 17 9", "13 13", "25 3 8"]
N_NEW = 6


def tiny_config():
  """The default experiment's config with a smaller model."""
  config = transformer.get_config("tiny")
  m = config.model
  m.vocab_size, m.d_model, m.num_layers, m.num_decoder_layers = 40, 32, 1, 1
  m.num_heads = m.num_kv_heads = 2
  m.head_dim, m.mlp_dim, m.max_len, m.dropout_rate = 16, 64, 32, 0.0
  return config


def tiny_encdec():
  module = models.build(tiny_config().model)
  ids = jnp.zeros((1, 8), jnp.int32)
  params = jax.jit(module.init)(jax.random.key(2), ids, ids)["params"]
  return module, jax.tree.map(lambda x: x * 2.0, nn.meta.unbox(params))


@pytest.fixture(scope="module")
def model():
  return tiny_encdec()


@functools.partial(jax.jit, static_argnames=("module",))
def _forward(module, params, src, dec):
  return module.apply({"params": params}, src, dec, encoder_segment_ids=(src > 0).astype(jnp.int32))


def forward_log_probs(module, params, source, targets):
  """log_softmax of a full forward pass: [len(targets) + 1, V] for decoder inputs start+targets.

  Source and decoder rows are padded to fixed widths (one compile); causal masking and
  the encoder's segment ids keep the padding out of every position that is read.
  """
  src = np.zeros((1, 8), np.int32)
  src[0, : len(source)] = source
  dec = np.zeros((1, N_NEW + 1), np.int32)
  dec[0, : len(targets) + 1] = [IdTokenizer.decoder_start_id] + targets
  logits = _forward(module, params, src, dec)[0, : len(targets) + 1]
  return np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)), np.float64)


def reference_greedy(module, params, source, n, eos):
  """Argmax of a full forward pass over everything so far, every step; no cache, no batch."""
  out = []
  while len(out) < n and (not out or out[-1] != eos):
    out.append(int(np.argmax(forward_log_probs(module, params, source, out)[len(out)])))
  return out


def gnmt_score(module, params, source, generated, alpha):
  """log P(generated) / ((5 + |y|) / 6) ** alpha from one full forward pass."""
  logp = forward_log_probs(module, params, source, generated[:-1])
  total = sum(logp[i, t] for i, t in enumerate(generated))
  return total / ((5 + len(generated)) / 6) ** alpha


@pytest.mark.slow  # the fast tier checks the evaluator's decoding below
def test_translate_texts_greedy_and_beam_1_equal_an_uncached_argmax_loop(model):
  module, params = model
  tok = IdTokenizer()
  want = []
  for text in SOURCES:
    ids = reference_greedy(module, params, tok.encode(text) + [tok.eos_id], N_NEW, tok.eos_id)
    want.append(tok.decode(ids[:-1] if ids[-1] == tok.eos_id else ids))
  assert any(len(w.split()) < N_NEW - 1 for w in want), "no row stopped at EOS"
  for strategy in (
      decode.Strategy("greedy", max_new_tokens=N_NEW),
      decode.Strategy("beam", max_new_tokens=N_NEW, beam_size=1, alpha=0.0),
  ):
    got = evaluation.translate_texts(
        module, params, tok, SOURCES, strategy, source_len=8, batch_size=4
    )
    assert got == want, strategy.name


@pytest.mark.slow  # the fast tier decodes with beam 4 through the evaluator below
def test_translate_texts_beam_4_outscores_greedy(model):
  """Beam 4's hypothesis scores at least greedy's under the GNMT penalty, and differs somewhere."""
  module, params = model
  tok = IdTokenizer()
  beam = decode.Strategy("beam", max_new_tokens=N_NEW, beam_size=4, alpha=0.6)
  got = evaluation.translate_texts(module, params, tok, SOURCES, beam, source_len=8, batch_size=4)
  differs = 0
  for text, out in zip(SOURCES, got):
    source = tok.encode(text) + [tok.eos_id]
    greedy = reference_greedy(module, params, source, N_NEW, tok.eos_id)
    ids = tok.encode(out)
    # The text drops a final EOS; beam hypotheses shorter than N_NEW ended with one.
    hyp = ids + [tok.eos_id] if len(ids) < N_NEW else ids
    assert tok.eos_id not in ids
    beam_score = gnmt_score(module, params, source, hyp, 0.6)
    assert beam_score >= gnmt_score(module, params, source, greedy, 0.6) - 1e-4, text
    differs += hyp != greedy
  assert differs, "beam 4 equals greedy on every source; the test would not see a beam"


@pytest.mark.parametrize("name", ["greedy", "beam"])
def test_evaluator_decodes_with_the_configured_strategy(model, name):
  module, params = model
  config = tiny_config()
  config.data.source_len, config.data.eval_global_batch_size = 8, 4
  config.train.update(decode_strategy=name, beam_size=3, alpha=0.6, decode_max_len=N_NEW)
  evaluator = evaluation.Evaluator(
      config, module, None, None, jax.sharding.SingleDeviceSharding(jax.devices()[0])
  )
  evaluator.tokenizer = IdTokenizer()
  strategy = decode.Strategy(name, max_new_tokens=N_NEW, beam_size=3, alpha=0.6)
  want = evaluation.translate_texts(
      module, params, IdTokenizer(), SOURCES, strategy, source_len=8, batch_size=4
  )
  assert evaluator.translate(params, SOURCES) == want


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("decode_strategy", "sample", r"config.train.decode_strategy='sample': accepted"),
        ("beam_size", 0, "config.train.beam_size=0: must be an int >= 1"),
        ("alpha", -0.5, "config.train.alpha=-0.5: must be a finite number >= 0"),
        ("decode_metrics", ("rouge",), r"config.train.decode_metrics has \['rouge'\]"),
        ("decode_max_len", 33, "decode_max_len=33: must be <= config.model.max_len=32"),
    ],
)
def test_validate_names_the_decode_field(field, value, message):
  config = tiny_config()
  config.train[field] = value
  with pytest.raises(ValueError, match=message):
    evaluation.validate(config)


def test_translation_presets_report_beam_bleu_like_the_paper():
  for preset in ("base", "big", "multi30k"):
    t = transformer.get_config(preset).train
    assert "bleu" in t.decode_metrics, preset
    assert (t.decode_strategy, t.beam_size, t.alpha) == ("beam", 4, 0.6), preset
    evaluation.validate(transformer.get_config(preset))


def test_evaluator_pulls_sums_in_bounded_groups_and_adds_them_in_order(monkeypatch):
  """40 batches: 3 pulls of <= MAX_COLLECTIVE_PROGRAMS_IN_FLIGHT steps; totals as per batch."""
  rng = np.random.default_rng(0)
  batches = [{"nll": rng.uniform(0, 9), "weight": float(rng.integers(1, 50))} for _ in range(40)]
  config = tiny_config()
  config.train.decode_metrics = ()
  monkeypatch.setattr(evaluation.data, "build_eval_batches", lambda config, split: batches)
  in_flight, groups = [0], []

  def eval_step(params, batch):
    in_flight[0] += 1
    return {
        "nll_sum": jnp.float32(batch["nll"]),
        "correct_sum": jnp.float32(1.0),
        "weight_sum": jnp.float32(batch["weight"]),
    }

  device_get = jax.device_get

  def counting_get(tree):
    groups.append(in_flight[0])
    in_flight[0] = 0
    return device_get(tree)

  monkeypatch.setattr(jax, "device_get", counting_get)
  evaluator = evaluation.Evaluator(config, None, eval_step, lambda b: b, None)
  got = evaluator.evaluate(params=None)
  limit = evaluation.sharding.MAX_COLLECTIVE_PROGRAMS_IN_FLIGHT
  assert groups == [limit, limit, 40 - 2 * limit]
  nll = weight = 0.0
  for b in batches:  # the host's float64 sums of the float32 values, in batch order
    nll, weight = nll + float(np.float32(b["nll"])), weight + float(np.float32(b["weight"]))
  assert got["eval_loss"] == nll / weight
  assert got["eval_accuracy"] == 40 / weight
