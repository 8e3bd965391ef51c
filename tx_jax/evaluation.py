"""Evaluation of generated text and of language models: sacreBLEU and perplexity.

BLEU is scored by sacrebleu on detokenized text (its own 13a tokenization), so
numbers compare with published sacreBLEU scores; never on model token ids.
Perplexity is exp(total NLL / total target tokens) over the weighted targets of
the batch contract (padding has weight 0 and does not count).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from tx_jax import models
from tx_jax.decode import models as decode_models
from tx_jax.decode.prompts import strip_generated


def bleu(
    hypotheses: Sequence[str],
    references: Sequence[str] | Sequence[Sequence[str]],
    *,
    tokenize: str = "13a",
    lowercase: bool = False,
) -> sacrebleu.metrics.bleu.BLEUScore:
  """Corpus sacreBLEU of detokenized hypotheses; `.score` is BLEU in [0, 100]."""
  if len(hypotheses) == 0:
    raise ValueError("hypotheses is empty: BLEU needs at least one sentence")
  if references and isinstance(references[0], str):
    references = [references]
  for i, refs in enumerate(references):
    if len(refs) != len(hypotheses):
      raise ValueError(
          f"reference set {i} has {len(refs)} sentences for "
          f"{len(hypotheses)} hypotheses; they must match line for line"
      )
  return sacrebleu.corpus_bleu(
      list(hypotheses), [list(r) for r in references], tokenize=tokenize, lowercase=lowercase
  )


def perplexity(nll_sum: float, token_count: float) -> float:
  """exp(mean NLL per token)."""
  if token_count <= 0:
    raise ValueError(f"token_count={token_count} must be > 0 (no weighted targets)")
  return math.exp(nll_sum / token_count)


@functools.partial(jax.jit, static_argnames=("module",))
def _nll_sums(module: nn.Module, params: Any, batch: dict) -> tuple[jax.Array, jax.Array]:
  args, kwargs = models.model_inputs(module.config, batch)
  logits_BTV = module.apply({"params": params}, *args, **kwargs, train=False)
  logp_BTV = jax.nn.log_softmax(logits_BTV.astype(jnp.float32))
  nll_BT = -jnp.take_along_axis(logp_BTV, batch["targets"][..., None], axis=-1)[..., 0]
  weights_BT = batch["weights"].astype(jnp.float32)
  return jnp.sum(nll_BT * weights_BT), jnp.sum(weights_BT)


def lm_perplexity(module: nn.Module, params: Any, batches: Iterable[dict]) -> dict[str, float]:
  """Perplexity of a decoder (or an encdec on its targets) over batch-contract batches."""
  if module.config.family == "encoder":
    raise ValueError(
        "lm_perplexity needs a 'decoder' or 'encdec' model; an encoder "
        "(BERT) has no left-to-right likelihood"
    )
  nll, tokens = 0.0, 0.0
  for batch in batches:
    keys = ("targets", "weights")
    missing = [k for k in keys if k not in batch]
    if missing:
      raise KeyError(f"batch lacks {missing}; perplexity reads targets and weights")
    s, w = jax.device_get(_nll_sums(module, params, dict(batch)))
    nll, tokens = nll + float(s), tokens + float(w)
  return {
      "nll_sum": nll,
      "tokens": tokens,
      "loss": nll / max(tokens, 1e-9),
      "perplexity": perplexity(nll, tokens),
      "bits_per_token": nll / max(tokens, 1e-9) / math.log(2),
  }


def translate_texts(
    module: nn.Module,
    params: Any,
    tokenizer: Any,
    sources: Sequence[str],
    strategy: decode_models.Strategy,
    *,
    source_len: int,
    batch_size: int = 64,
) -> list[str]:
  """Detokenized outputs of an encoder-decoder for source texts (sources cut at source_len)."""
  outputs: list[str] = []
  for begin in range(0, len(sources), batch_size):
    chunk = sources[begin : begin + batch_size]
    ids = np.zeros((batch_size, source_len), np.int32)
    for i, text in enumerate(chunk):
      row = list(tokenizer.encode(text))[: source_len - 1] + [tokenizer.eos_id]
      ids[i, : len(row)] = row
    ids[len(chunk) :, 0] = tokenizer.eos_id  # filler rows need a token; they are dropped
    result = decode_models.best(
        decode_models.translate(
            module,
            params,
            ids,
            (ids != 0).astype(np.int32),
            strategy,
            eos_id=tokenizer.eos_id,
            decoder_start_id=tokenizer.decoder_start_id,
        )
    )
    tokens, lengths = jax.device_get((result.tokens, result.lengths))
    outputs += [
        tokenizer.decode(strip_generated(tokens[i], int(lengths[i]), tokenizer.eos_id))
        for i in range(len(chunk))
    ]
  return outputs
