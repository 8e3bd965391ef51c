"""A GEMM alone on one core, XLA vs torch, in a child process pinned to one CPU.

When XLA's GEMM trails torch's on all cores but not on one, the gap is in how XLA:CPU
splits a small GEMM over threads, not in its kernel. XLA sizes its thread
pool when the backend starts, and no flag changes it, so the one-core number needs a
process whose CPU affinity is one core before JAX starts: this module run as a script.

    python -m tx_jax.benchmarks.gemm_one_core ROUNDS M K N [M K N ...]   # one JSON line
"""

from __future__ import annotations

import json
import os
import subprocess
import sys


def measure(shapes: list[tuple[int, int, int]], rounds: int) -> list[dict]:
  """`common.gemm_times` of each [m, k] @ [k, n] in one child pinned to one CPU, each row
  with `cpus` (the child's affinity) and `torch_threads`."""
  args = [str(d) for shape in shapes for d in shape]
  out = subprocess.run(
      [sys.executable, "-m", __name__, str(rounds), *args],
      check=True,
      capture_output=True,
      text=True,
  )
  return json.loads(out.stdout.strip().splitlines()[-1])


USAGE = "usage: python -m tx_jax.benchmarks.gemm_one_core ROUNDS M K N [M K N ...]"


def _parse(argv: list[str]) -> tuple[int, list[int]]:
  """(rounds, dims), or SystemExit(2) after one `error:` line naming what is wrong."""
  try:
    numbers = [int(a) for a in argv]
  except ValueError:
    numbers = []
  if len(numbers) < 4 or (len(numbers) - 1) % 3 or min(numbers) < 1:
    print(f"error: got {argv}; expected positive integers ROUNDS then M K N triples ({USAGE})",
          file=sys.stderr)
    raise SystemExit(2)
  return numbers[0], numbers[1:]


def main(argv: list[str]) -> None:
  rounds, dims = _parse(argv)
  os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before JAX or torch start
  import torch  # pylint: disable=g-import-not-at-top

  from tx_jax.benchmarks import common  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(1)
  rows = [common.gemm_times(*dims[i : i + 3], rounds) for i in range(0, len(dims), 3)]
  for row in rows:
    row.update(cpus=len(os.sched_getaffinity(0)), torch_threads=torch.get_num_threads())
  print(json.dumps(rows))


if __name__ == "__main__":
  main(sys.argv[1:])
