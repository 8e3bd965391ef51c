"""Holds back what Orbax's worker threads print when a checkpoint read or write fails.

Why: when one array of a restore fails to read (a truncated or garbled file) or one write
of a save fails (no space left on the device), Orbax stops its event loop while TensorStore
still has the sibling reads or writes in flight. Each of them ends in the interpreter's
unraisable hook ("Event loop is closed", the coroutine's own exception), in asyncio's
"exception was never retrieved" log lines or in "coroutine ... was never awaited" warnings,
and Orbax logs every failed thread's traceback at ERROR: ~14,000 lines for a truncated
array of `configs/gpt.py:tiny`, ~1,300 for a full disk under the tiny Transformer, around
the one line that matters (`checkpoint.Checkpointer` names the damaged step, or the step
that could not be saved and the last good one).

The library leaves the process's hooks alone, so only entry points use this
(`cli.run`, unless `--verbose`): `HeldBack()` is a context manager that, while open, keeps
exactly those reports in memory instead of printing them; anything else reaches the hooks
that were there before. `write(path)` puts them in a file for a bug report.
"""

from __future__ import annotations

import gc
import inspect
import logging
import pathlib
import sys
import threading
import time
import traceback
import warnings

# After a failed read or write, TensorStore's callbacks keep arriving for a few milliseconds.
SETTLE_SECONDS = 0.2  # quiet for this long: the failed operation's noise is over
MAX_WAIT_SECONDS = 2.0
MAX_KEPT = 500  # reports kept for the log file; later ones are only counted


def _is_noise(unraisable) -> bool:
  error = unraisable.exc_value
  if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
    return True  # a TensorStore read or write finished after Orbax's event loop had stopped
  obj = unraisable.object
  return inspect.iscoroutine(obj) and "orbax" in obj.cr_code.co_filename


_FORMAT = logging.Formatter("%(levelname)s %(pathname)s:%(lineno)d %(message)s")


def _from_orbax(record: logging.LogRecord) -> bool:
  """An ERROR that Orbax logs from a worker thread, with the thread's traceback."""
  return record.levelno >= logging.ERROR and "/orbax/" in record.pathname.replace("\\", "/")


class _Filter(logging.Filter):
  """Holds the records `wanted` picks instead of letting the logger emit them."""

  def __init__(self, wanted, hold):
    super().__init__()
    self.wanted, self.hold = wanted, hold

  def filter(self, record: logging.LogRecord) -> bool:
    if self.wanted(record):
      self.hold(_FORMAT.format(record))
      return False
    return True


class HeldBack:
  """Keeps Orbax's worker-thread noise out of stderr while open (see the module docstring)."""

  def __init__(self):
    self.count = 0  # reports held back
    self.kept: list[str] = []  # the first MAX_KEPT of them, formatted
    self._last = 0.0  # monotonic time of the newest held report
    self._lock = threading.Lock()

  def _hold(self, text: str) -> None:
    with self._lock:
      self.count += 1
      self._last = time.monotonic()
      if len(self.kept) < MAX_KEPT:
        self.kept.append(text)

  def _unraisable(self, unraisable) -> None:
    if _is_noise(unraisable):
      self._hold(
          "".join(
              traceback.format_exception(
                  unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback
              )
          )
      )
    else:
      self._previous_hook(unraisable)

  def __enter__(self) -> "HeldBack":
    self._previous_hook = sys.unraisablehook
    sys.unraisablehook = self._unraisable
    never_retrieved = lambda r: "exception was never retrieved" in str(r.msg)  # noqa: E731
    self._filters = {
        "asyncio": _Filter(never_retrieved, self._hold),
        "absl": _Filter(_from_orbax, self._hold),  # Orbax logs through absl
    }
    for name, log_filter in self._filters.items():
      logging.getLogger(name).addFilter(log_filter)
    self._warnings = warnings.catch_warnings()
    self._warnings.__enter__()
    warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
    return self

  def __exit__(self, error_type, error, tb) -> None:
    try:
      if self.count:  # the abandoned siblings finish (and are collected) shortly
        self.settle()
    finally:
      self._warnings.__exit__(None, None, None)
      for name, log_filter in self._filters.items():
        logging.getLogger(name).removeFilter(log_filter)
      sys.unraisablehook = self._previous_hook

  def settle(self) -> None:
    """Finalises abandoned coroutines, then waits until the late callbacks stop."""
    with self._lock:  # quiet is counted from now: the operation itself may take longer
      self._last = time.monotonic()
    deadline = self._last + MAX_WAIT_SECONDS
    while True:
      gc.collect()
      with self._lock:
        quiet_since = self._last
      now = time.monotonic()
      if now - quiet_since >= SETTLE_SECONDS or now >= deadline:
        return
      time.sleep(SETTLE_SECONDS / 4)

  def write(self, path: pathlib.Path) -> None:
    """Writes the held reports to `path` (an OSError if it cannot)."""
    with self._lock:
      kept, count = list(self.kept), self.count
    more = f"\n... and {count - len(kept)} more\n" if count > len(kept) else ""
    head = f"{count} reports of Orbax's worker threads, held back:\n\n"
    path.write_text(head + "\n".join(kept) + more)
