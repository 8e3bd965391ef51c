"""Pytree paths as strings, for parameter names in masks, tables and error messages."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def path_str(path: Sequence[Any]) -> str:
  """A tree path as "a/b/c" (dict keys, attribute names, sequence indices)."""
  parts = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        parts.append(str(getattr(entry, attr)))
        break
    else:
      parts.append(str(entry))
  return "/".join(parts)
