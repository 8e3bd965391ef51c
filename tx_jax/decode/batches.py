"""Texts to ids to decoded ids, in fixed-shape batches: the one path every caller shares.

The trainer's decode metrics and `tx_jax.evaluation.translate_texts` (through
`tx_jax.evaluation.Evaluator`) and `experiments/decode.py` all call `encode_sources`,
then `decode_batches`:

- encode: a source for an encoder-decoder ends with EOS, cut as the seq2seq task cuts
  training sources (`tx_jax.data.tasks.truncate_eos`); a decoder prompt is the text's ids;
- batch: every batch has the same rows (filler rows repeat the first input and are
  dropped) and the same width, so a decode compiles once per shape;
- decode: `generate` (left-padded prompts) or `translate` (right-padded sources), any
  `Strategy`; the best hypothesis of a beam search;
- strip: each row's generated ids up to its EOS, without the EOS.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from tx_jax.data import tasks
from tx_jax.decode.generate import Strategy, best, generate, translate
from tx_jax.decode.prompts import make_prompt, strip_generated

# Without a fixed width, inputs are padded to a multiple of this, so a file of mixed
# lengths compiles a few shapes rather than one per length.
WIDTH_MULTIPLE = 16


def encode_sources(
    tokenizer: Any, texts: Sequence[str], *, append_eos: bool, max_len: int | None = None
) -> list[list[int]]:
  """Token ids per text; append_eos for encoder-decoder sources (EOS kept when cut to max_len).

  Without append_eos (decoder prompts) a text longer than max_len keeps its last tokens,
  the ones a continuation follows. max_len=None cuts nothing.
  """
  rows = []
  for text in texts:
    ids = [int(t) for t in tokenizer.encode(text)]
    if append_eos:
      ids = tasks.truncate_eos(ids, max_len or len(ids) + 1, tokenizer.eos_id)
    elif max_len:
      ids = ids[-max_len:]
    rows.append(ids)
  return rows


def decode_batches(
    module: Any,
    params: Any,
    inputs: Sequence[Sequence[int]],
    strategy: Strategy,
    *,
    eos_id: int | None,
    decoder_start_id: int,
    batch_size: int,
    width: int | None = None,
    rng: jax.Array | None = None,
    sharding: jax.sharding.Sharding | None = None,
) -> list[list[int]]:
  """Generated ids (EOS stripped) per input: prompts for a decoder, sources for an encdec.

  width: every batch's padded input length (None: the longest input rounded up to
  WIDTH_MULTIPLE); rng: the sampling key, split per batch; sharding: where the batch
  arrays are placed (None: left to jit, as for numpy inputs).
  """
  if not isinstance(batch_size, int) or batch_size < 1:
    raise ValueError(f"batch_size={batch_size!r} must be an int >= 1")
  config = module.config
  for i, row in enumerate(inputs):
    if not row:
      raise ValueError(f"input {i} is empty (0 tokens); every input needs a token, e.g. EOS")
    if len(row) > config.max_len:
      raise ValueError(
          f"input {i} has {len(row)} tokens, longer than model.max_len={config.max_len}"
      )
  if width is not None and inputs and width < max(map(len, inputs)):
    raise ValueError(f"width={width} is shorter than the longest input ({max(map(len, inputs))})")
  if not inputs:
    return []
  batch_size = min(batch_size, len(inputs))
  put = (lambda x: x) if sharding is None else (lambda x: jax.device_put(x, sharding))  # noqa: E731
  outputs: list[list[int]] = []
  for begin in range(0, len(inputs), batch_size):
    chunk = [list(r) for r in inputs[begin : begin + batch_size]]
    rows = chunk + chunk[:1] * (batch_size - len(chunk))
    pad_to = width or -(-max(map(len, rows)) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    key = None
    if rng is not None:
      rng, key = jax.random.split(rng)
    if config.family == "decoder":
      prompt = make_prompt(
          rows,
          max_new_tokens=strategy.max_new_tokens,
          max_len=config.max_len,
          pad_to=min(pad_to, config.max_len - strategy.max_new_tokens + 1),
      )
      prompt = type(prompt)(*(put(x) for x in prompt))
      result = generate(module, params, prompt, strategy, eos_id=eos_id, rng=key)
    else:
      ids = np.zeros((batch_size, min(pad_to, config.max_len)), np.int32)
      for i, row in enumerate(rows):
        ids[i, : len(row)] = row
      result = translate(
          module,
          params,
          put(ids),
          put((ids != 0).astype(np.int32)),
          strategy,
          eos_id=eos_id,
          decoder_start_id=decoder_start_id,
          rng=key,
      )
    top = best(result)
    tokens, lengths = jax.device_get((top.tokens, top.lengths))
    outputs += [strip_generated(tokens[i], int(lengths[i]), eos_id) for i in range(len(chunk))]
  return outputs
