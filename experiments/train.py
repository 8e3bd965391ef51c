r"""Train a tx_jax model: python -m experiments.train --config=configs/<family>.py:<preset>.

With no flags it runs the default experiment (a tiny Transformer learning to reverse
strings). Outputs in --workdir: config.json, metrics.jsonl, tensorboard/, checkpoints/,
curves.png. Rerunning the same command resumes from the newest checkpoint.
Every config is checked before any work (tx_jax.validation); a bad flag or config prints
one `error: ...` line and exits 2, a failure while training exits 1 (tx_jax.cli).
"""

from absl import app
from absl import flags
from absl import logging

from tx_jax import cli

_CONFIG = cli.define_config_file(
    name="config",
    default="configs/transformer.py",
    help_string="Config file[:preset].",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Output directory; resumed if present.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Describe the model and its sharding, then exit.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in a multi-host run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_COMPILATION_CACHE_DIR = cli.define_compilation_cache_dir()


def main(argv) -> int:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:  # library INFO lines (Orbax) drown the progress
    logging.set_verbosity(logging.WARNING)
  from tx_jax import multihost, sharding  # pylint: disable=g-import-not-at-top

  config = _CONFIG.value
  sharding.use_cpu_devices(config.mesh)  # before anything starts JAX's backend
  multihost.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  from tx_jax import compile_cache, validation  # pylint: disable=g-import-not-at-top
  from tx_jax.train import loop  # pylint: disable=g-import-not-at-top

  loop.validate(config)
  if _DRY_RUN.value:
    print(loop.dry_run_report(config))
    return 0
  validation.workdir_matches(config, _WORKDIR.value)
  compile_cache.enable(_COMPILATION_CACHE_DIR.value)  # before the first compile
  result = loop.train_and_evaluate(config, _WORKDIR.value)
  shown = {k: v for k, v in result.items() if k.startswith("eval_") or k in ("step", "loss")}
  print(
      "done:",
      "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()),
  )
  return 0


if __name__ == "__main__":
  cli.run(main)
