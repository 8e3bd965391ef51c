"""What a checkpoint failure is: tx_jax's exception types, and how Orbax's errors read.

Orbax and TensorStore raise plain ValueErrors and OSErrors for very different things: a
tree that is not the config's (a mismatch: the config is wrong), a file that cannot be
written (a full disk: the run must stop), a bug. `checkpoint.Checkpointer` sorts them here.
"""

import os
import re


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or restored; the message says which and why."""


class CheckpointMismatchError(CheckpointError, ValueError):
  """A good checkpoint written for another model config: the config is wrong, not the file.

  A ValueError too, so entry points report it as a config error (exit 2).
  """


class CheckpointSaveError(CheckpointError):
  """A checkpoint could not be written: the run must stop before it trains what it cannot keep."""


class FrozenBaseError(CheckpointError):
  """LoRA's frozen base (tx_jax.frozen_base) is missing, damaged or another: no older step
  would restore either, so no step is set aside."""


def reason(error: BaseException) -> str:
  """The innermost cause's first line, typed ("OSError: ..."); a CheckpointError's own words."""
  e = error
  while e.__cause__ is not None:  # Orbax wraps the reader's own message ("OUT_OF_RANGE: ...")
    e = e.__cause__
  first = str(e).splitlines()[0] if str(e) else ""
  return (first if type(e) is CheckpointError else f"{type(e).__name__}: {first}")[:300]


# Orbax's words for an on-disk tree that differs from the requested one.
MISMATCH = re.compile(
    r"tree structure|structures do not match|shape|Missing keys|not found in", re.I
)


# TensorStore reports a failed write as a ValueError ("RESOURCE_EXHAUSTED: Error writing ...
# [os_error_code='28']"); Python's own file operations (grain's, Orbax's) as an OSError.
WRITE_ERRORS = (OSError, ValueError)
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_WRITE_WORDS = re.compile(r"Error writing|Failed writing|Failed to write|RESOURCE_EXHAUSTED")


def write_cause(error: BaseException) -> str | None:
  """The system's words for why a write failed ("No space left on device"), or None when
  `error` is not a failed write."""
  seen = set()
  e = error
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError):
      return e.strerror or (str(e).splitlines() or [type(e).__name__])[0][:200]
    text = str(e)
    code = _OS_ERROR_CODE.search(text)
    if code:
      return os.strerror(int(code.group(1)))
    if isinstance(e, ValueError) and _WRITE_WORDS.search(text):
      return text.splitlines()[0][:200]
    e = e.__cause__ or e.__context__
  return None
