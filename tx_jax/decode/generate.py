"""tx_jax models as step functions, and one jitted entry point per model kind.

`tx_jax.decode` re-exports `generate`, `translate` and `Strategy`, so the package
attribute `tx_jax.decode.generate` is the function; import other names from this
module with `from tx_jax.decode.generate import ...`.

- decoder-only: `generate(module, params, prompt, strategy, ...)` prefills the
  left-padded prompt into the KV cache, then feeds one token per step;
  `use_cache=False` recomputes the whole (fixed-size) sequence every step instead,
  the baseline the benchmark compares against.
- encoder-decoder: `translate(module, params, encoder_inputs, ...)` encodes once;
  the prefill call (the decoder start token) passes the encoder output, which
  caches the cross-attention K/V; later steps pass `encoded=None`.

The cache is allocated inside the jitted function (zeros of the shapes
`module.init` would create), as long as the decode needs: prompt + max_new_tokens - 1
slots (the last new token is never fed back), rounded up to whole chunks when greedy
and sampling decode on a chunked cache (`cache_chunk`, default `CACHE_CHUNK`; see
`chunked_cache`). Beam search reorders the whole cache every step anyway and decodes
on the plain one.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tx_jax import models
from tx_jax.decode import chunked_cache
from tx_jax.decode.beam import BeamResult, beam_search
from tx_jax.decode.prompts import Prompt, check_beam, check_max_new_tokens, check_sampling
from tx_jax.decode.sampling import DecodeResult, StepFn, sample
from tx_jax.models.config import ModelConfig

STRATEGIES = ("greedy", "sample", "beam")
# Steps between writes into the long KV cache (chunked_cache). Measured on 2 CPU cores
# (the benchmark's decode section, tiny GPT): 16-64 decode within a few percent of each other.
CACHE_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class Strategy:
  """How tokens are chosen (the flags of experiments/decode.py); hashable, so jit-static."""

  name: str = "greedy"  # "greedy", "sample" or "beam"
  max_new_tokens: int = 32  # tokens generated per row, EOS included
  temperature: float = 1.0  # sample: logits / temperature
  top_k: int = 0  # sample: keep the k most likely tokens (0 = all)
  top_p: float = 1.0  # sample: keep the smallest set with mass >= top_p (1.0 = all)
  beam_size: int = 4  # beam: hypotheses kept (the paper: 4)
  alpha: float = 0.6  # beam: GNMT length penalty exponent (the paper: 0.6)

  def validate(self) -> "Strategy":
    """Raises ValueError naming the bad field; returns self."""
    if self.name not in STRATEGIES:
      raise ValueError(f"strategy={self.name!r} is not one of {list(STRATEGIES)}")
    check_max_new_tokens(self.max_new_tokens)
    if self.name == "sample":
      check_sampling(self.temperature, self.top_k, self.top_p)
    if self.name == "beam":
      check_beam(self.beam_size, self.alpha)
    return self


def decoding_module(model_cfg: Any, params: Any) -> tuple[nn.Module, Any]:
  """(module, params) ready for cached decoding: layers unrolled, params unstacked if scanned."""
  config = model_cfg if isinstance(model_cfg, ModelConfig) else ModelConfig.from_config(model_cfg)
  params = nn.meta.unbox(params)
  if config.scan_layers:
    params = models.unstack_layers(params)
  config = dataclasses.replace(config, scan_layers=False, remat_policy="none")
  return models.build(config), params


def init_cache(
    module: nn.Module, decoder_len: int, batch: int, encoder_len: int | None = None
) -> Any:
  """Zeros in the shapes of the module's "cache" collection (nothing is computed)."""
  dec = jnp.zeros((batch, decoder_len), jnp.int32)
  if encoder_len is None:
    init = functools.partial(module.init, jax.random.key(0), dec, decode=True)
  else:
    enc = jnp.zeros((batch, encoder_len), jnp.int32)
    init = functools.partial(module.init, jax.random.key(0), enc, dec, decode=True)
  shapes = jax.eval_shape(init)["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def decoder_step_fn(module: nn.Module) -> StepFn:
  """The KV-cached decoder step: T new tokens in, their logits out."""

  def step(params, tokens_BT, positions_BT, segment_ids_BT, cache):
    logits_BTV, mutated = module.apply(
        {"params": params, "cache": cache},
        tokens_BT,
        positions=positions_BT,
        segment_ids=segment_ids_BT,
        decode=True,
        mutable=["cache"],
    )
    return logits_BTV, mutated["cache"]

  return step


def recompute_step_fn(module: nn.Module) -> StepFn:
  """A decoder step without a KV cache: the "cache" is the token buffer, re-run in full."""

  def step(params, tokens_BT, positions_BT, segment_ids_BT, buffers):
    index = buffers["index"]
    new = {}
    for key, value in (
        ("tokens", tokens_BT),
        ("positions", positions_BT),
        ("segment_ids", segment_ids_BT),
    ):
      new[key] = jax.lax.dynamic_update_slice_in_dim(buffers[key], value, index, axis=1)
    # Unwritten slots have segment id 0, so no real token attends to them.
    logits_BLV = module.apply(
        {"params": params},
        new["tokens"],
        positions=new["positions"],
        segment_ids=new["segment_ids"],
    )
    new["index"] = index + tokens_BT.shape[1]
    return jax.lax.dynamic_slice_in_dim(logits_BLV, index, tokens_BT.shape[1], axis=1), new

  return step


def recompute_buffers(batch: int, length: int) -> dict[str, jax.Array]:
  """The empty token buffers `recompute_step_fn` decodes into."""
  zeros = jnp.zeros((batch, length), jnp.int32)
  return {"tokens": zeros, "positions": zeros, "segment_ids": zeros, "index": jnp.int32(0)}


def encdec_step_fns(module: nn.Module) -> tuple[StepFn, StepFn]:
  """(prefill_fn, step_fn) for encoder-decoders; params = (model params, encoded, enc segs)."""

  def call(params, encoded, tokens_BT, positions_BT, segment_ids_BT, cache, encoder_segments):
    logits_BTV, mutated = module.apply(
        {"params": params, "cache": cache},
        encoded,
        tokens_BT,
        encoder_segment_ids=encoder_segments,
        decoder_segment_ids=segment_ids_BT,
        decoder_positions=positions_BT,
        decode=True,
        mutable=["cache"],
        method="decode",
    )
    return logits_BTV, mutated["cache"]

  def prefill_fn(params, tokens_BT, positions_BT, segment_ids_BT, cache):
    model_params, encoded_BSD, encoder_segment_ids_BS = params
    return call(
        model_params,
        encoded_BSD,
        tokens_BT,
        positions_BT,
        segment_ids_BT,
        cache,
        encoder_segment_ids_BS,
    )

  def step_fn(params, tokens_BT, positions_BT, segment_ids_BT, cache):
    # The encoder output is not needed any more: cross K/V and padding are cached.
    return call(params[0], None, tokens_BT, positions_BT, segment_ids_BT, cache, None)

  return prefill_fn, step_fn


def _run(
    strategy: Strategy,
    step_fn: StepFn,
    params: Any,
    cache: Any,
    prompt: Prompt,
    eos_id: int | None,
    rng: jax.Array | None,
    prefill_fn: StepFn | None = None,
    cache_chunk: int = 0,
):
  s = strategy
  if s.name == "beam":
    return beam_search(
        step_fn,
        params,
        cache,
        prompt,
        beam_size=s.beam_size,
        alpha=s.alpha,
        max_new_tokens=s.max_new_tokens,
        eos_id=eos_id,
        prefill_fn=prefill_fn,
    )
  return sample(
      step_fn,
      params,
      cache,
      prompt,
      max_new_tokens=s.max_new_tokens,
      eos_id=eos_id,
      rng=rng,
      greedy=s.name == "greedy",
      temperature=s.temperature,
      top_k=s.top_k,
      top_p=s.top_p,
      prefill_fn=prefill_fn,
      cache_chunk=cache_chunk,
  )


def _cache_plan(strategy: Strategy, prompt_len: int, cache_chunk: int) -> tuple[int, int]:
  """(cache slots, chunk) for a decode: chunked unless beam search or cache_chunk=0."""
  chunk = 0 if strategy.name == "beam" else cache_chunk
  if chunk:
    return chunked_cache.padded_length(prompt_len, strategy.max_new_tokens, chunk), chunk
  return prompt_len + strategy.max_new_tokens - 1, 0


@functools.partial(
    jax.jit, static_argnames=("module", "strategy", "eos_id", "use_cache", "cache_chunk")
)
def _generate(module, params, prompt, rng, *, strategy, eos_id, use_cache, cache_chunk):
  batch, width = prompt.tokens.shape
  if use_cache:
    length, chunk = _cache_plan(strategy, width, cache_chunk)
    return _run(
        strategy,
        decoder_step_fn(module),
        params,
        init_cache(module, length, batch),
        prompt,
        eos_id,
        rng,
        cache_chunk=chunk,
    )
  return _run(
      strategy,
      recompute_step_fn(module),
      params,
      recompute_buffers(batch, width + strategy.max_new_tokens - 1),
      prompt,
      eos_id,
      rng,
  )


def generate(
    module: nn.Module,
    params: Any,
    prompt: Prompt,
    strategy: Strategy,
    *,
    eos_id: int | None,
    rng: jax.Array | None = None,
    use_cache: bool = True,
    cache_chunk: int = CACHE_CHUNK,
) -> DecodeResult | BeamResult:
  """Continues each left-padded prompt row with a decoder-only model.

  cache_chunk: steps between writes into the long KV cache (0 = write every step).
  """
  strategy.validate()
  if module.config.family != "decoder":
    raise ValueError(
        f"generate() needs a decoder-only model, got family "
        f"{module.config.family!r}; use translate() for 'encdec'"
    )
  _check_fits(module.config, prompt.tokens.shape[1], strategy.max_new_tokens)
  if strategy.name == "sample" and rng is None:
    raise ValueError("strategy 'sample' needs rng (a jax.random key)")
  _check_chunk(cache_chunk)
  return _generate(
      module,
      params,
      prompt,
      rng,
      strategy=strategy,
      eos_id=eos_id,
      use_cache=use_cache,
      cache_chunk=cache_chunk,
  )


@functools.partial(
    jax.jit, static_argnames=("module", "strategy", "eos_id", "decoder_start_id", "cache_chunk")
)
def _translate(
    module,
    params,
    encoder_inputs,
    encoder_segment_ids,
    rng,
    *,
    strategy,
    eos_id,
    decoder_start_id,
    cache_chunk,
):
  batch, source_len = encoder_inputs.shape
  encoded_BSD = module.apply(
      {"params": params}, encoder_inputs, encoder_segment_ids=encoder_segment_ids, method="encode"
  )
  ones = jnp.ones((batch, 1), jnp.int32)
  prompt = Prompt(ones * decoder_start_id, ones, ones * 0, ones[:, 0])
  length, chunk = _cache_plan(strategy, 1, cache_chunk)
  cache = init_cache(module, length, batch, source_len)
  prefill_fn, step_fn = encdec_step_fns(module)
  return _run(
      strategy,
      step_fn,
      (params, encoded_BSD, encoder_segment_ids),
      cache,
      prompt,
      eos_id,
      rng,
      prefill_fn=prefill_fn,
      cache_chunk=chunk,
  )


def translate(
    module: nn.Module,
    params: Any,
    encoder_inputs: jax.Array,
    encoder_segment_ids: jax.Array,
    strategy: Strategy,
    *,
    eos_id: int | None,
    decoder_start_id: int,
    rng: jax.Array | None = None,
    cache_chunk: int = CACHE_CHUNK,
) -> DecodeResult | BeamResult:
  """Decodes targets for right-padded source rows [B, S] with an encoder-decoder."""
  strategy.validate()
  if module.config.family != "encdec":
    raise ValueError(
        f"translate() needs an 'encdec' model, got family " f"{module.config.family!r}"
    )
  if encoder_inputs.shape[1] == 0 or not bool(jnp.all(jnp.any(encoder_segment_ids > 0, 1))):
    raise ValueError(
        "encoder_inputs holds an empty source row (no segment id > 0); every "
        "source needs at least one token, e.g. EOS"
    )
  _check_fits(module.config, encoder_inputs.shape[1], 1)
  _check_fits(module.config, 1, strategy.max_new_tokens)
  if strategy.name == "sample" and rng is None:
    raise ValueError("strategy 'sample' needs rng (a jax.random key)")
  _check_chunk(cache_chunk)
  return _translate(
      module,
      params,
      jnp.asarray(encoder_inputs, jnp.int32),
      jnp.asarray(encoder_segment_ids, jnp.int32),
      rng,
      strategy=strategy,
      eos_id=eos_id,
      decoder_start_id=decoder_start_id,
      cache_chunk=cache_chunk,
  )


def _check_chunk(cache_chunk: int) -> None:
  if not isinstance(cache_chunk, int) or cache_chunk < 0:
    raise ValueError(f"cache_chunk={cache_chunk!r} must be an int >= 0 (0 = no chunking)")


def _check_fits(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
  if prompt_len + max_new_tokens - 1 > config.max_len:
    raise ValueError(
        f"a {prompt_len}-token input with max_new_tokens={max_new_tokens} needs "
        f"{prompt_len + max_new_tokens - 1} positions, more than model.max_len="
        f"{config.max_len}"
    )


def best(result: DecodeResult | BeamResult) -> DecodeResult:
  """The top hypothesis of a beam result (a sampling result as it is)."""
  if isinstance(result, BeamResult):
    return DecodeResult(result.tokens[:, 0], result.lengths[:, 0])
  return result
