"""Sweep grids: `sweep(add)` collection, product / zip helpers and readable run names.

A sweep is a list of override dicts keyed by the command line's dotted names
(`{"optimizer.learning_rate": 1e-3, "seed": 0}`). Nothing here imports JAX.
"""

import itertools
import math
import re
from typing import Any, Callable, Iterable

Overrides = dict[str, Any]


class SweepError(ValueError):
  """A sweep that cannot run as written (bad key, wrong type, name collision, ...)."""


def _axes(axes: Overrides) -> tuple[dict[str, list], Overrides]:
  """Splits a dict into swept axes (list values) and fixed values (anything else)."""
  swept = {k: v for k, v in axes.items() if isinstance(v, list)}
  fixed = {k: v for k, v in axes.items() if not isinstance(v, list)}
  for key, values in swept.items():
    if not values:
      raise SweepError(f"sweep axis {key!r} has no values: give a non-empty list")
  return swept, fixed


def product(axes: Overrides | None = None, /, **more: Any) -> list[Overrides]:
  """Every combination of the list-valued entries; other values (tuples too) are fixed.

  product({"optimizer.learning_rate": [1e-3, 3e-3], "seed": [0, 1], "train.steps": 100})
  gives 4 runs, all with train.steps=100. The last key varies fastest.
  """
  swept, fixed = _axes({**(axes or {}), **more})
  combos = itertools.product(*swept.values())
  return [{**fixed, **dict(zip(swept, combo))} for combo in combos]


def zipped(axes: Overrides | None = None, /, **more: Any) -> list[Overrides]:
  """Run i takes element i of every list-valued entry (equal lengths); others are fixed."""
  swept, fixed = _axes({**(axes or {}), **more})
  lengths = {k: len(v) for k, v in swept.items()}
  if len(set(lengths.values())) > 1:
    raise SweepError(f"zipped() needs lists of one length, got {lengths}")
  count = next(iter(lengths.values()), 1)
  return [{**fixed, **{k: v[i] for k, v in swept.items()}} for i in range(count)]


def cross(*groups: Iterable[Overrides]) -> list[Overrides]:
  """The product of several run lists, merged: cross(zipped(...), product(seed=[0, 1]))."""
  runs = []
  for parts in itertools.product(*[list(g) for g in groups]):
    merged: Overrides = {}
    for part in parts:
      shared = sorted(set(merged) & set(part))
      if shared:
        raise SweepError(f"cross(): keys {shared} appear in more than one group")
      merged.update(part)
    runs.append(merged)
  return runs


def collect(sweep_fn: Callable[[Callable[..., None]], None]) -> list[Overrides]:
  """Calls `sweep_fn(add)`; each `add(overrides_dict, **overrides)` call is one run."""
  runs: list[Overrides] = []

  def add(overrides: Overrides | None = None, /, **more: Any) -> None:
    if overrides is not None and not isinstance(overrides, dict):
      raise SweepError(
          f"add() takes a dict of dotted overrides and/or keywords, got {overrides!r}"
      )
    shared = sorted(set(overrides or {}) & set(more))
    if shared:
      raise SweepError(f"add(): keys {shared} given both in the dict and as keywords")
    runs.append({**(overrides or {}), **more})

  sweep_fn(add)
  if not runs:
    raise SweepError("the sweep added no runs: call add(...) at least once in sweep(add)")
  return runs


def format_value(value: Any) -> str:
  """A value as the command line writes it, parsed back to the same value by config_flags."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, float):
    return repr(value) if math.isfinite(value) else str(value)
  if isinstance(value, (tuple, list)):
    return repr(tuple(value))
  return str(value)


def _name_part(value: Any) -> str:
  values = value if isinstance(value, tuple) else (value,)
  text = ",".join(format_value(v) for v in values)
  # Keep names usable as one path component and one shell word without quoting.
  return re.sub(r"[^A-Za-z0-9._+-]", "_", text) or "_"


def _short_keys(keys: list[str]) -> dict[str, str]:
  """The last dotted component of each key, or the whole key where two would clash."""
  last = {k: k.rsplit(".", 1)[-1] for k in keys}
  counts: dict[str, int] = {}
  for short in last.values():
    counts[short] = counts.get(short, 0) + 1
  return {k: (last[k] if counts[last[k]] == 1 else k) for k in keys}


def swept_keys(runs: list[Overrides]) -> list[str]:
  """Keys whose value differs between runs (or that some runs leave unset), in first-seen order."""
  keys: list[str] = []
  for run in runs:
    keys.extend(k for k in run if k not in keys)
  missing = object()
  return [k for k in keys if len({repr(run.get(k, missing)) for run in runs}) > 1]


def run_names(runs: list[Overrides]) -> list[str]:
  """One readable, unique name per run from its swept values: "learning_rate=0.001,seed=1".

  Raises SweepError naming both runs when two runs get the same name.
  """
  keys = swept_keys(runs) if len(runs) > 1 else list(runs[0])
  short = _short_keys(keys)
  names = []
  for run in runs:
    parts = [f"{short[k]}={_name_part(run[k])}" for k in keys if k in run]
    names.append(",".join(parts) or "base")
  seen: dict[str, int] = {}
  for i, name in enumerate(names):
    if name in seen:
      j = seen[name]
      raise SweepError(
          f"runs {j} ({runs[j]}) and {i} ({runs[i]}) are both named {name!r}: "
          "make their overrides differ"
      )
    seen[name] = i
  return names
