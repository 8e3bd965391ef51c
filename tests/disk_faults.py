"""A checkpoint write that fails as on a full disk (ENOSPC), for the failed-save tests.

Orbax writes the `meta` item (a JSON file) from a commit thread, beside TensorStore's writes
of the state: making that write raise exercises the real path of a failed save (Orbax's
background thread, the Checkpointer, the loop, the entry point) on any filesystem. A real
full disk (a small tmpfs) is tested in tests/train/test_full_disk.py where root may mount one.
"""

from __future__ import annotations

import errno
import os
import threading

from orbax.checkpoint._src.handlers import json_checkpoint_handler

HANDLER = json_checkpoint_handler.JsonCheckpointHandler


def failing_save_fn(step: int, raised: threading.Event | None = None):
  """A `JsonCheckpointHandler._save_fn` that raises ENOSPC for `step`'s unfinished folder."""
  original = HANDLER._save_fn  # pylint: disable=protected-access

  async def save_fn(self, x, directory):
    if str(directory).split("/")[-2].startswith(f"{step}.orbax-checkpoint-tmp"):
      if raised is not None:
        raised.set()
      path = str(directory / "metadata")
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    return await original(self, x, directory)

  return save_fn


def install(step: int) -> None:
  """Makes every later save of `step` fail (for a forked child; tests use monkeypatch)."""
  HANDLER._save_fn = failing_save_fn(step)  # pylint: disable=protected-access
