"""Decoding: greedy, sampling (temperature / top-k / top-p) and beam search over a KV cache.

The strategies (`sampling.py`, `beam.py`) run against any step function
`step_fn(params, tokens_BT, positions_BT, segment_ids_BT, cache) -> (logits_BTV, cache)`
inside one `lax.while_loop`; `models.py` builds such functions from tx_jax models.
"""

from tx_jax.decode.beam import BeamResult, beam_search, gather_cache, length_penalty, repeat_cache
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
    "DecodeResult",
    "Prompt",
    "StepFn",
    "beam_search",
    "check_beam",
    "check_max_new_tokens",
    "check_sampling",
    "gather_cache",
    "greedy",
    "length_penalty",
    "make_prompt",
    "process_logits",
    "repeat_cache",
    "sample",
    "strip_generated",
]
