r"""Run the sweep beside a config: python -m experiments.sweep --config=FILE:PRESET --workdir=DIR.

The config file's `sweep(add)` lists the runs; `--config.a.b=v` applies to every run. Each
run trains in DIR/<name> (config.json, command.sh, status.json, train.log, metrics.jsonl);
DIR gets summary.csv, summary.md and curves.png. Relaunching skips finished runs and
resumes unfinished ones; `--summarize` only rebuilds the summary.
"""

from absl import app
from absl import flags
from ml_collections import config_flags

from tx_jax import cli
from tx_jax.sweep import launch, slurm, summary

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file:preset.", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Sweep directory; one subdirectory per run.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "Runs at once (disjoint CPU cores / GPUs each).")
_PIN = flags.DEFINE_bool("pin", True, "With --parallel: disjoint CPU cores per run, pools sized.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "List the runs and their overrides; run nothing.")
_SUMMARIZE = flags.DEFINE_bool("summarize", False, "Only rebuild DIR's summary from its runs.")
_RETRY = flags.DEFINE_bool("retry_failed", False, "Rerun runs that failed before.")
_METRIC = flags.DEFINE_string("metric", "", "Sort by; default checkpoint.best_metric or eval_loss.")
_MODE = flags.DEFINE_enum("metric_mode", "", ["", "min", "max"], "Best: min or max; '' = by name.")
_LAUNCHER = flags.DEFINE_enum("launcher", "local", list(launch.LAUNCHERS), "Where runs execute.")
_PARTITION = flags.DEFINE_string("partition", "", "SLURM partition; '' = the cluster's default.")
_GPUS = flags.DEFINE_integer("gpus_per_node", 0, "SLURM: GPUs on each node of a run.")
_NODES = flags.DEFINE_integer("nodes_per_run", 1, "SLURM: nodes per run (multi-host when > 1).")
_TIME = flags.DEFINE_integer("time_min", 60, "SLURM: time limit per run in minutes.")
_CPUS = flags.DEFINE_integer("cpus_per_task", 0, "SLURM: CPU cores per node; 0 = default.")
flags.mark_flag_as_required("workdir")


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if _SUMMARIZE.value:
    summary.summarize(_WORKDIR.value, _METRIC.value, _MODE.value)
    print(open(f"{_WORKDIR.value}/summary.md").read())
    return 0
  if _CONFIG.value is None:
    raise app.UsageError("--config=FILE:PRESET is required (except with --summarize)")
  options = slurm.SlurmOptions(
      _PARTITION.value, _GPUS.value, _NODES.value, _TIME.value, _CPUS.value, _PARALLEL.value
  )
  # A SweepError is a ValueError: cli.run prints it as one line and exits 2.
  return launch.launch(
      flags.FLAGS["config"].config_filename,
      flags.FLAGS["config"].override_values,
      _WORKDIR.value,
      parallel=_PARALLEL.value if _LAUNCHER.value == "local" else 1,
      pin=_PIN.value,
      dry_run=_DRY_RUN.value,
      retry_failed=_RETRY.value,
      metric=_METRIC.value,
      metric_mode=_MODE.value,
      launcher=_LAUNCHER.value,
      slurm_options=options,
  )


if __name__ == "__main__":
  cli.run(main)
