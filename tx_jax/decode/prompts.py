"""Prompt batches (left-padded) and validation of decoding arguments.

Prompts of different lengths share one batch by padding on the left: the last
column is then every row's last real token, so one prefill call yields every
row's next-token logits in `logits_BPV[:, -1]`, and every row writes its new
tokens into the same cache slot. Pads carry id 0 and segment id 0 (the batch
contract); positions start at 0 on each row's first real token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class Prompt(NamedTuple):
  """A left-padded prompt batch (numpy or jax arrays)."""

  tokens: np.ndarray  # [B, P] int32, 0 on pads
  segment_ids: np.ndarray  # [B, P] int32, 0 on pads, 1 on real tokens
  positions: np.ndarray  # [B, P] int32, 0 on the first real token (and on pads)
  lengths: np.ndarray  # [B] int32, real tokens per row


def make_prompt(
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    max_len: int | None = None,
    pad_to: int | None = None,
) -> Prompt:
  """Left-pads token-id prompts into a `Prompt`, checking lengths against `max_len`."""
  check_max_new_tokens(max_new_tokens)
  if len(prompts) == 0:
    raise ValueError("prompts is empty: give at least one prompt (a list of token ids)")
  rows = [list(map(int, p)) for p in prompts]
  for i, row in enumerate(rows):
    if not row:
      raise ValueError(
          f"prompt {i} is empty (0 tokens); every prompt needs at least one token, " "e.g. a BOS id"
      )
    if min(row) < 0:
      raise ValueError(f"prompt {i} holds a negative token id {min(row)}; ids must be >= 0")
  longest = max(len(r) for r in rows)
  if max_len is not None:
    for i, row in enumerate(rows):
      if len(row) > max_len:
        raise ValueError(
            f"prompt {i} has {len(row)} tokens, longer than the maximum length "
            f"max_len={max_len}; shorten it to at most {max_len} tokens"
        )
    # The last generated token is never fed back, so it needs no cache slot.
    if longest + max_new_tokens - 1 > max_len:
      raise ValueError(
          f"max_new_tokens={max_new_tokens} after a {longest}-token prompt needs "
          f"{longest + max_new_tokens - 1} positions, more than max_len={max_len}; "
          f"use max_new_tokens <= {max_len - longest + 1}"
      )
  width = longest if pad_to is None else pad_to
  if width < longest:
    raise ValueError(f"pad_to={pad_to} is shorter than the longest prompt ({longest} tokens)")
  batch = len(rows)
  tokens = np.zeros((batch, width), np.int32)
  segment_ids = np.zeros((batch, width), np.int32)
  positions = np.zeros((batch, width), np.int32)
  for i, row in enumerate(rows):
    n = len(row)
    tokens[i, width - n :] = row
    segment_ids[i, width - n :] = 1
    positions[i, width - n :] = np.arange(n)
  lengths = np.array([len(r) for r in rows], np.int32)
  return Prompt(tokens, segment_ids, positions, lengths)


def strip_generated(tokens_Y: Sequence[int], length: int, eos_id: int | None) -> list[int]:
  """The first `length` generated ids without a trailing EOS (for detokenizing)."""
  out = [int(t) for t in tokens_Y[:length]]
  if eos_id is not None and out and out[-1] == eos_id:
    out = out[:-1]
  return out


def check_max_new_tokens(max_new_tokens: int) -> None:
  """Raises unless max_new_tokens is a positive int."""
  if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
  """Raises unless temperature > 0, top_k >= 0 (0 = off) and top_p in (0, 1]."""
  if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or (
      temperature <= 0
  ):
    raise ValueError(
        f"temperature={temperature!r} must be a finite number > 0 "
        "(use the greedy strategy for temperature 0)"
    )
  if not isinstance(top_k, (int, np.integer)) or top_k < 0:
    raise ValueError(f"top_k={top_k!r} must be an int >= 0 (0 turns top-k off)")
  if not isinstance(top_p, (int, float)) or not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p!r} must lie in (0, 1] (1.0 turns nucleus sampling off)")


def check_beam(beam_size: int, alpha: float) -> None:
  """Raises unless beam_size >= 1 and alpha >= 0."""
  if not isinstance(beam_size, (int, np.integer)) or beam_size < 1:
    raise ValueError(f"beam_size={beam_size!r} must be an int >= 1")
  # alpha >= 0 keeps the early-stopping bound exact (see beam.py).
  if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha < 0:
    raise ValueError(f"alpha={alpha!r} must be a finite number >= 0 (the paper used 0.6)")
