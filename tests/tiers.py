"""The two tiers: `pytest -m "not slow"` while working (under 5 minutes on 2 cores), and
the whole suite (CI, and before a change lands).

A parametrized property keeps its cheapest representative cases in the fast tier and runs
every case in the whole suite, so the fast tier still covers each property once.
"""

import pytest


def slow_except(values, *fast):
  """`values` as parametrize cases, each marked slow except those named in `fast`."""
  unknown = [v for v in fast if v not in values]
  if unknown:
    raise ValueError(f"fast cases {unknown} are not among {values}")
  return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]
