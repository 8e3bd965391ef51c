"""Decoding: greedy, sampling (temperature / top-k / top-p) and beam search over a KV cache.

The strategies (`sampling.py`, `beam.py`) run against any step function
`step_fn(params, tokens_BT, positions_BT, segment_ids_BT, cache) -> (logits_BTV, cache)`
inside `lax.while_loop`s; `generate.py` builds such functions from tx_jax models and
holds the entry points `generate` (decoder-only) and `translate` (encoder-decoder);
`batches.py` runs them over lists of inputs (`encode_sources`, `decode_batches`).
"""

from tx_jax.decode.beam import BeamResult, beam_search, gather_cache, length_penalty, repeat_cache
from tx_jax.decode.generate import (
    CACHE_CHUNK,
    STRATEGIES,
    Strategy,
    best,
    decoding_module,
    generate,
    translate,
)
from tx_jax.decode.batches import decode_batches, encode_sources
from tx_jax.decode.prompts import (
    Prompt,
    check_beam,
    check_max_new_tokens,
    check_sampling,
    make_prompt,
    strip_generated,
)
from tx_jax.decode.sampling import DecodeResult, StepFn, greedy, process_logits, sample

__all__ = [
    "BeamResult",
    "CACHE_CHUNK",
    "DecodeResult",
    "Prompt",
    "STRATEGIES",
    "StepFn",
    "Strategy",
    "beam_search",
    "best",
    "check_beam",
    "check_max_new_tokens",
    "check_sampling",
    "decode_batches",
    "decoding_module",
    "encode_sources",
    "gather_cache",
    "generate",
    "greedy",
    "length_penalty",
    "make_prompt",
    "process_logits",
    "repeat_cache",
    "sample",
    "strip_generated",
    "translate",
]
