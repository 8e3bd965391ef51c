"""Held-out evaluation: exact weighted loss/accuracy sums, and greedy-decoded exact match / BLEU."""

import math
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
import sacrebleu

from tx_jax import data
from tx_jax.data import tasks
from tx_jax.train import greedy

DECODE_METRICS = ("exact_match", "bleu")


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
    for batch in self._eval_batches():
      sums = jax.device_get(self.eval_step(params, self.to_global(batch)))
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
        result["eval_bleu"] = sacrebleu.corpus_bleu(outputs, [refs]).score
    return result

  def translate(self, params: Any, sources: list[str]) -> list[str]:
    """Greedy encoder-decoder outputs for source texts, detokenized."""
    tok, d = self.tokenizer, self.config.data
    rows = [tasks.truncate_eos(tok.encode(s), d.source_len, tok.eos_id) for s in sources]
    size = d.eval_global_batch_size
    outputs = []
    for begin in range(0, len(rows), size):
      chunk = rows[begin : begin + size]
      ids = np.zeros((size, d.source_len), np.int32)
      for i, row in enumerate(chunk):
        ids[i, : len(row)] = row
      ids[len(chunk) :, 0] = tok.eos_id  # filler rows need one real token; they are discarded
      put = lambda x: jax.device_put(x, self.replicated)  # noqa: E731
      out = greedy.greedy_encdec(
          self.module,
          params,
          put(ids),
          put((ids != 0).astype(np.int32)),
          max_len=self.config.train.decode_max_len,
          start_id=tok.decoder_start_id,
          eos_id=tok.eos_id,
      )
      out = np.asarray(jax.device_get(out))
      outputs += [tok.decode(greedy.strip(out[i], tok.eos_id)) for i in range(len(chunk))]
    return outputs

  def examples(self, params: Any, n: int) -> list[tuple[str, str, str]]:
    """(source, output, reference) for the first n held-out examples."""
    pairs = self._decode_pairs()[:n]
    outputs = self.translate(params, [src for src, _ in pairs])
    return [(src, out, ref) for (src, ref), out in zip(pairs, outputs)]
