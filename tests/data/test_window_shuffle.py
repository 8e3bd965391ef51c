"""WindowShuffleRows: each window is a permutation of the stream's next rows; exact restore."""

import json

import grain
import numpy as np
import pytest

from tx_jax.data.window_shuffle import WindowShuffleRows

# Records of 0..9 rows: empty ones, ones shorter and longer than a window.
RECORDS = [[f"r{r}c{c}" for c in range((3 * r + 1) % 10)] for r in range(23)]


def _rows(window_size, seed=0, epochs=1, records=RECORDS):
  ds = grain.MapDataset.source(records).repeat(epochs).to_iter_dataset()
  return WindowShuffleRows(ds, window_size=window_size, seed=seed)


def test_each_window_permutes_the_next_rows_of_the_stream():
  flat = [row for record in RECORDS for row in record]
  for window in (1, 4, 7, 1000):
    got = list(_rows(window))
    assert len(got) == len(flat)
    for start in range(0, len(flat), window):
      assert sorted(got[start : start + window]) == sorted(flat[start : start + window])
    if window == 1:
      assert got == flat
    else:
      assert got != flat


def test_order_is_a_function_of_the_seed():
  assert list(_rows(7, seed=3)) == list(_rows(7, seed=3))
  assert list(_rows(7, seed=3)) != list(_rows(7, seed=4))


def test_epochs_reshuffle_across_the_boundary():
  flat = [row for record in RECORDS for row in record]
  got = list(_rows(7, epochs=3))
  assert len(got) == 3 * len(flat) and sorted(got) == sorted(flat * 3)


@pytest.mark.parametrize("window", [1, 4, 7, 1000])
def test_restore_at_every_position_equals_continuing(window):
  continuous = list(_rows(window, epochs=2))
  for taken in [*range(0, len(continuous), 3), len(continuous) - 1, len(continuous)]:
    it = iter(_rows(window, epochs=2))
    for _ in range(taken):
      next(it)
    state = json.loads(json.dumps(it.get_state()))  # the trainer stores it as JSON
    again = iter(_rows(window, epochs=2))
    again.set_state(state)
    assert list(again) == continuous[taken:], taken


def test_restore_into_a_used_iterator():
  it = iter(_rows(7))
  for _ in range(10):
    next(it)
  state = it.get_state()
  rest = list(it)
  other = iter(_rows(7))
  for _ in range(30):
    next(other)
  other.set_state(state)
  assert list(other) == rest


def test_bad_window_size():
  with pytest.raises(ValueError, match="window_size=0"):
    _rows(0)
