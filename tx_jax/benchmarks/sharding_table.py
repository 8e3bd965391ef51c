"""The mesh x family equivalence table of tests/test_sharded_steps.py, as markdown.

The sharded-step tests record, per (family, mesh), the largest relative difference of
loss, parameters and updates from a single-device step; with TX_JAX_SHARDING_TABLE=FILE
the test module writes this table there when it finishes (a report, not a test).
"""

from __future__ import annotations

import pathlib


def equivalence_table(deltas: dict[tuple[str, tuple], tuple[float, float, float]]) -> str:
  """Markdown rows: family, mesh (data, fsdp, tensor), rel. delta loss / params / updates."""
  lines = [
      "| family | mesh (data,fsdp,tensor) | rel. delta loss | rel. delta params | "
      "rel. delta updates |",
      "| --- | --- | --- | --- | --- |",
  ]
  for (family, mesh_shape), (loss, params, updates) in sorted(deltas.items()):
    lines.append(f"| {family} | {mesh_shape} | {loss:.1e} | {params:.1e} | {updates:.1e} |")
  return "\n".join(lines) + "\n"


def write(deltas: dict, path: str | pathlib.Path) -> None:
  """Writes equivalence_table(deltas) to path."""
  pathlib.Path(path).write_text(equivalence_table(deltas))
