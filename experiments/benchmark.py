r"""One benchmark command: python -m experiments.benchmark --out DIR [--only SECTION ...].

Sections (tx_jax/benchmarks/): train, small, time_to_loss, attention, decode, data, compile,
context (ring attention vs the sequence axis, in an 8-device child process);
several are named comma-separated (--only train,small) or by repeating --only.
Writes DIR/benchmark.json (a top-level key per section) and DIR/<section>.png.
--preset h200 runs the bf16 GPU presets instead (train: GPT-2-medium and LLaMA-1B steps,
MFU vs 989 TFLOP/s; attention: cudnn / pallas / blockwise at 4k-32k). --smoke runs every
section at toy sizes (a check of the code path, not a measurement).
"""

import os

from absl import app, flags, logging

from tx_jax import cli

_OUT = flags.DEFINE_string("out", "bench_out", "Directory for benchmark.json and the PNGs.")
_ONLY = flags.DEFINE_multi_string("only", [], "Section(s) to run (repeat or comma-separate).")
_PRESET = flags.DEFINE_enum("preset", "cpu", ["cpu", "h200"], "cpu comparisons or h200 GPU.")
_SMOKE = flags.DEFINE_bool("smoke", False, "Toy sizes: checks the code path in seconds.")
_KERNELS = flags.DEFINE_list(
    "kernels", ["plain"], "config.model.kernels to run tx_jax with, e.g. plain,cpu: each "
    "section once per setting, keyed <section>.<kernels> beside the plain run."
)
_ROUNDS = flags.DEFINE_integer(
    "rounds", 5, "Interleaved timing rounds (medians reported).", lower_bound=1
)
_DATA_DIR = flags.DEFINE_string(
    "data_dir",
    os.environ.get("TX_JAX_DATA_DIR") or "data",
    "Offline data folder holding tinyshakespeare/input.txt ($TX_JAX_DATA_DIR, else ./data).",
)


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  logging.set_verbosity(logging.ERROR)
  from tx_jax.benchmarks import common, runner  # pylint: disable=g-import-not-at-top

  only = [s for value in _ONLY.value for s in value.split(",") if s]
  options = common.Options(
      smoke=_SMOKE.value,
      preset=_PRESET.value,
      data_dir=os.path.abspath(_DATA_DIR.value),
      rounds=2 if _SMOKE.value else _ROUNDS.value,
  )
  from tx_jax.layers import ops  # pylint: disable=g-import-not-at-top

  unknown = [k for k in _KERNELS.value if k not in ops.names()]
  if unknown:
    raise app.UsageError(f"--kernels={unknown}: accepted {list(ops.names())}")
  report = runner.run(_OUT.value, only, options, _KERNELS.value)
  failed = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
  print(f"wrote {os.path.join(_OUT.value, 'benchmark.json')}" + (f"; failed: {failed}" if failed else ""))
  return 1 if failed else 0


if __name__ == "__main__":
  cli.run(main)
