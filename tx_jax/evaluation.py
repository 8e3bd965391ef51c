"""Evaluation: sacreBLEU, perplexity, text translation and the trainer's held-out evaluator.

BLEU is scored by sacrebleu on detokenized text (its own 13a tokenization), so
numbers compare with published sacreBLEU scores; never on model token ids.
Perplexity is exp(total NLL / total target tokens) over the weighted targets of
the batch contract (padding has weight 0 and does not count). Decoded metrics
(`eval_exact_match`, `eval_bleu`) decode with `tx_jax.decode`, cached, with the
strategy `config.train.decode_strategy` names (greedy or beam search).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import sacrebleu

from tx_jax import data, models, sharding
from tx_jax import decode

DECODE_METRICS = ("exact_match", "bleu")
DECODE_STRATEGIES = ("greedy", "beam")  # sampling would make eval metrics random


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
    strategy: decode.Strategy,
    *,
    source_len: int,
    batch_size: int = 64,
    sharding: jax.sharding.Sharding | None = None,
) -> list[str]:
  """Detokenized outputs of an encoder-decoder for source texts (sources cut at source_len)."""
  rows = decode.encode_sources(tokenizer, sources, append_eos=True, max_len=source_len)
  outputs = decode.decode_batches(
      module,
      params,
      rows,
      strategy,
      eos_id=tokenizer.eos_id,
      decoder_start_id=tokenizer.decoder_start_id,
      batch_size=batch_size,
      width=source_len,
      sharding=sharding,
  )
  return [tokenizer.decode(ids) for ids in outputs]


def validate(config: ml_collections.ConfigDict) -> None:
  """Checks the decode fields of config.train before anything is built, naming the bad field."""
  t = config.train
  unknown = set(t.decode_metrics) - set(DECODE_METRICS)
  if unknown:
    raise ValueError(
        f"config.train.decode_metrics has {sorted(unknown)}; accepted: {DECODE_METRICS}"
    )
  if t.decode_metrics and config.model.family != "encdec":
    raise ValueError(
        f"config.train.decode_metrics={tuple(t.decode_metrics)} needs an "
        f"encdec model, not config.model.family={config.model.family!r}"
    )
  if t.decode_strategy not in DECODE_STRATEGIES:
    raise ValueError(
        f"config.train.decode_strategy={t.decode_strategy!r}: accepted {DECODE_STRATEGIES}"
    )
  if isinstance(t.beam_size, bool) or not isinstance(t.beam_size, int) or t.beam_size < 1:
    raise ValueError(f"config.train.beam_size={t.beam_size!r}: must be an int >= 1")
  if not isinstance(t.alpha, (int, float)) or not math.isfinite(t.alpha) or t.alpha < 0:
    raise ValueError(f"config.train.alpha={t.alpha!r}: must be a finite number >= 0 (paper: 0.6)")
  for name in ("decode_examples", "decode_max_len"):
    if t[name] < 1:
      raise ValueError(f"config.train.{name}={t[name]}: must be >= 1")
  if t.decode_metrics and t.decode_max_len > config.model.max_len:
    raise ValueError(
        f"config.train.decode_max_len={t.decode_max_len}: must be <= "
        f"config.model.max_len={config.model.max_len} (decoder positions)"
    )


def decode_strategy(train_cfg: ml_collections.ConfigDict) -> decode.Strategy:
  """The Strategy of the trainer's decode metrics (config.train.decode_*, beam_size, alpha)."""
  return decode.Strategy(
      train_cfg.decode_strategy,
      max_new_tokens=train_cfg.decode_max_len,
      beam_size=train_cfg.beam_size,
      alpha=float(train_cfg.alpha),
  ).validate()


class Evaluator:
  """Evaluates params on `config.data.eval_split`; eval data are read once, on first use."""

  def __init__(
      self,
      config: ml_collections.ConfigDict,
      module: Any,
      eval_step: Callable[[Any, dict], dict],
      to_global: Callable[[dict], dict],
      replicated: jax.sharding.Sharding,
  ):
    self.config = config
    self.module = module
    self.eval_step = eval_step
    self.to_global = to_global
    self.replicated = replicated
    self.tokenizer = data.build_tokenizer(config.data)
    self.strategy = decode_strategy(config.train)
    self._batches = None
    self._pairs = None

  def _eval_batches(self) -> list[dict]:
    if self._batches is None:
      batches = data.build_eval_batches(self.config, self.config.train.eval_split)
      limit = self.config.train.eval_batches
      self._batches = batches[:limit] if limit else batches
    return self._batches

  def _decode_pairs(self) -> list[tuple[str, str]]:
    if self._pairs is None:
      pairs = data.eval_examples(self.config, self.config.train.eval_split)
      self._pairs = pairs[: self.config.train.decode_examples]
    return self._pairs

  def evaluate(self, params: Any) -> dict[str, float]:
    """eval_loss (plain NLL), eval_accuracy and, when configured, the decode metrics."""
    totals = {}
    batches = self._eval_batches()
    # Dispatch a group of batches, then pull their sums, so the host prepares batch i+1 while
    # the device runs batch i. A group stays within XLA:CPU's limit on programs with
    # collectives in flight; the host adds the sums in batch order.
    group = sharding.MAX_COLLECTIVE_PROGRAMS_IN_FLIGHT
    for start in range(0, len(batches), group):
      pending = [self.eval_step(params, self.to_global(b)) for b in batches[start : start + group]]
      for sums in jax.device_get(pending):
        for k, v in sums.items():
          totals[k] = totals.get(k, 0.0) + float(v)
    weight = max(totals["weight_sum"], 1e-9)
    result = {
        "eval_loss": totals["nll_sum"] / weight,
        "eval_accuracy": totals["correct_sum"] / weight,
    }
    if self.config.data.task == "lm":
      bits = result["eval_loss"] / math.log(2)
      name = "eval_bits_per_byte" if self.config.data.tokenizer == "byte" else "eval_bits_per_token"
      result[name] = bits
    metrics = tuple(self.config.train.decode_metrics)
    if metrics:
      pairs = self._decode_pairs()
      outputs = self.translate(params, [src for src, _ in pairs])
      refs = [ref for _, ref in pairs]
      if "exact_match" in metrics:
        result["eval_exact_match"] = float(np.mean([o == r for o, r in zip(outputs, refs)]))
      if "bleu" in metrics:
        result["eval_bleu"] = bleu(outputs, refs).score
    return result

  def translate(self, params: Any, sources: list[str]) -> list[str]:
    """Outputs for source texts, decoded with the configured strategy, detokenized."""
    d = self.config.data
    module, params = decode.decoding_module(self.module.config, params)
    return translate_texts(
        module,
        params,
        self.tokenizer,
        sources,
        self.strategy,
        source_len=d.source_len,
        batch_size=d.eval_global_batch_size,
        sharding=self.replicated,
    )

  def examples(self, params: Any, n: int) -> list[tuple[str, str, str]]:
    """(source, output, reference) for the first n held-out examples."""
    pairs = self._decode_pairs()[:n]
    outputs = self.translate(params, [src for src, _ in pairs])
    return [(src, out, ref) for (src, ref), out in zip(pairs, outputs)]
