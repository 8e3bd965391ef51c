"""Holds back what Orbax leaves behind when one array of a restore fails to read.

Why: a truncated or garbled array file makes one of Orbax's shard-reading coroutines fail.
Orbax then stops its event loop while TensorStore still has the sibling reads in flight,
and each of them ends in the interpreter's unraisable hook ("Event loop is closed", the
coroutine's own exception), in asyncio's "exception was never retrieved" log lines, and in
"coroutine ... was never awaited" warnings: ~14,000 lines for the 4-layer `configs/gpt.py:tiny`, around the
one line that matters (`checkpoint.Checkpointer` names the damaged step and falls back).

`HeldBack()` is a context manager around a restore (with its fallbacks). While it is
open, and once a read has failed until that noise has died down, it drops exactly those
three kinds of report; anything else reaches the hooks that were there before.
"""

from __future__ import annotations

import gc
import inspect
import logging
import sys
import threading
import time
import warnings

# After a failed read, TensorStore's callbacks keep arriving for a few milliseconds.
SETTLE_SECONDS = 0.2  # quiet for this long: the failed restore's noise is over
MAX_WAIT_SECONDS = 2.0


def _is_noise(unraisable) -> bool:
  error = unraisable.exc_value
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return True  # a TensorStore read finished after Orbax's event loop had stopped
  obj = unraisable.object
  return inspect.iscoroutine(obj) and "orbax" in obj.cr_code.co_filename


class _Unretrieved(logging.Filter):
  """asyncio's "Task/Future exception was never retrieved" for the failed reads."""

  def __init__(self, on_drop):
    super().__init__()
    self.on_drop = on_drop

  def filter(self, record: logging.LogRecord) -> bool:
    if "exception was never retrieved" in str(record.msg):
      self.on_drop()
      return False
    return True


class HeldBack:
  """Drops the noise of a failed Orbax read (see the module docstring)."""

  def __init__(self):
    self._failed = False
    self._last_drop = 0.0  # monotonic time of the newest dropped report
    self._lock = threading.Lock()

  def _drop(self) -> None:
    with self._lock:
      self._last_drop = time.monotonic()

  def read_failed(self) -> None:
    """The caller caught a failed read: on exit, wait for its abandoned siblings."""
    self._failed = True

  def _unraisable(self, unraisable) -> None:
    if _is_noise(unraisable):
      self._drop()
    else:
      self._previous_hook(unraisable)

  def __enter__(self) -> "HeldBack":
    self._previous_hook = sys.unraisablehook
    sys.unraisablehook = self._unraisable
    self._filter = _Unretrieved(self._drop)
    logging.getLogger("asyncio").addFilter(self._filter)
    self._warnings = warnings.catch_warnings()
    self._warnings.__enter__()
    warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
    return self

  def __exit__(self, error_type, error, traceback) -> None:
    try:
      if self._failed:  # the siblings finish (and are collected) shortly
        self._settle()
    finally:
      self._warnings.__exit__(None, None, None)
      logging.getLogger("asyncio").removeFilter(self._filter)
      sys.unraisablehook = self._previous_hook

  def _settle(self) -> None:
    """Finalises the abandoned coroutines, then waits until the late callbacks stop."""
    with self._lock:  # quiet is counted from now: the restore itself may take longer
      self._last_drop = time.monotonic()
    deadline = self._last_drop + MAX_WAIT_SECONDS
    while True:
      gc.collect()
      with self._lock:
        quiet_since = self._last_drop
      now = time.monotonic()
      if now - quiet_since >= SETTLE_SECONDS or now >= deadline:
        return
      time.sleep(SETTLE_SECONDS / 4)
