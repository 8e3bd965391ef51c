"""Rows of a stream of per-record row lists, shuffled within windows, with exact restore.

It stands where grain's FlatMapIterDataset + WindowShuffleIterDataset stood, for the same
reason (a document's chunks would otherwise arrive in text order) and with the same kind
of state (where the window started, which window, how far into it). It exists because
grain 0.2's window shuffle computes each element's position with its own `index_shuffle`
call and wraps every element of the flat map, and on a small CPU the loop's host time is
taken from XLA's threads. Here a window is permuted by one numpy call and a row costs a
list pop.

The order is a pure function of the seed: window w of the stream is permuted by
numpy.random.default_rng([seed, w]). Windows span record and epoch boundaries.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np


class WindowShuffleRows(grain.IterDataset):
  """`parent` yields a list of rows per record; this yields the rows, window-shuffled."""

  def __init__(self, parent: grain.IterDataset, *, window_size: int, seed: int):
    super().__init__(parent)
    if window_size <= 0:
      raise ValueError(f"window_size={window_size} must be > 0")
    self._window_size, self._seed = window_size, seed

  def __iter__(self) -> grain.DatasetIterator:
    return _WindowShuffleRowsIterator(
        self._parent.__iter__(), window_size=self._window_size, seed=self._seed
    )

  def __str__(self) -> str:
    return f"WindowShuffleRows(window_size={self._window_size}, seed={self._seed})"


class _WindowShuffleRowsIterator(grain.DatasetIterator):
  """A position in the stream of rows is (the parent's state before a record, how many of
  that record's rows come before the position). The state is the current window's start
  position, its index and how many of its rows were emitted; restoring re-reads the
  window from its start and drops those."""

  def __init__(self, parent: grain.DatasetIterator, *, window_size: int, seed: int):
    super().__init__(parent)
    self._window_size, self._seed = window_size, seed
    self._record_state = copy.deepcopy(parent.get_state())  # the parent before _record_rows
    self._record_rows: Sequence[Any] = ()
    self._record_offset = 0  # rows of _record_rows already placed in windows
    self._window: list[Any] = []  # the rest of the current window, next row last
    self._window_start: tuple[Any, int] | None = None  # its position; set when filled
    self._window_index = 0
    self._pos_in_window = 0
    self._exhausted = False

  def _position(self) -> tuple[Any, int]:
    """Where the next window would start: (parent state before a record, rows to skip)."""
    if self._record_offset < len(self._record_rows):
      return copy.deepcopy(self._record_state), self._record_offset
    return copy.deepcopy(self._parent.get_state()), 0

  def _seek(self, position: tuple[Any, int]) -> None:
    state, offset = position
    self._parent.set_state(copy.deepcopy(state))
    self._record_state, self._record_rows, self._record_offset = copy.deepcopy(state), (), 0
    self._exhausted = False
    if offset:
      if not self._next_record() or offset > len(self._record_rows):
        raise ValueError(f"window shuffle state {position} lies past its parent's records")
      self._record_offset = offset

  def _next_record(self) -> bool:
    """Moves to the parent's next record; False at its end."""
    state = copy.deepcopy(self._parent.get_state())
    try:
      rows = next(self._parent)
    except StopIteration:
      self._exhausted = True
      return False
    self._record_state, self._record_rows, self._record_offset = state, rows, 0
    return True

  def _fill_window(self) -> None:
    self._window_start = self._position()
    window: list[Any] = []
    while len(window) < self._window_size:
      if self._record_offset >= len(self._record_rows) and not self._next_record():
        break
      end = self._record_offset + self._window_size - len(window)
      take = self._record_rows[self._record_offset : end]
      window.extend(take)
      self._record_offset += len(take)
    order = np.random.default_rng([self._seed, self._window_index]).permutation(len(window))
    self._window = [window[i] for i in order[::-1]]
    self._pos_in_window = 0

  def __next__(self) -> Any:
    if not self._window:
      if self._exhausted:
        raise StopIteration
      self._fill_window()
      if not self._window:
        raise StopIteration
    self._pos_in_window += 1
    row = self._window.pop()
    if not self._window:
      self._window_index += 1
    return row

  def get_state(self) -> dict[str, Any]:
    if self._window:
      (state, offset), pos = self._window_start, self._pos_in_window
    else:  # between windows: the next one starts at the current position
      (state, offset), pos = self._position(), 0
    return {
        "parent_record_state": copy.deepcopy(state),
        "record_offset": offset,
        "window_index": self._window_index,
        "pos_in_window": pos,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    self._seek((state["parent_record_state"], state["record_offset"]))
    self._window_index, self._window = state["window_index"], []
    if state["pos_in_window"]:
      self._fill_window()
      del self._window[len(self._window) - state["pos_in_window"] :]
      self._pos_in_window = state["pos_in_window"]
