"""From `--config=FILE:ARG` plus overrides to validated runs, each with the command that runs it.

Every run's config is resolved by parsing its own trainer command line through the same
`config_flags.DEFINE_config_file(lock_config=True)` flag as `experiments/train.py`, so a
sweep override and `--config.a.b=v` mean exactly the same thing, and whatever the trainer
would reject (unknown key, wrong type) is rejected here, before any run starts.
"""

import copy
import dataclasses
import difflib
import importlib.util
import json
import pathlib
import shlex
import sys
from typing import Any, Callable

from absl import flags
import ml_collections
from ml_collections import config_flags

from tx_jax.sweep import grid
from tx_jax.sweep.grid import Overrides, SweepError

TRAINER_MODULE = "experiments.train"


@dataclasses.dataclass
class Run:
  """One run of a sweep: its name, its own overrides, its resolved config and its command."""

  name: str
  overrides: Overrides  # the sweep's overrides for this run (command-line ones not included)
  flags: list[str]  # --config.a.b=v for the command-line overrides, then the run's own
  config: ml_collections.ConfigDict
  workdir: pathlib.Path

  def command(self, config_arg: str, python: str = sys.executable) -> list[str]:
    """The trainer command that runs (or resumes) this run alone."""
    return [
        python,
        "-m",
        TRAINER_MODULE,
        f"--config={config_arg}",
        f"--workdir={self.workdir}",
        *self.flags,
    ]


def parse_config(config_arg: str, flag_args: list[str]) -> ml_collections.ConfigDict:
  """The locked config that `experiments.train --config=config_arg *flag_args` would get."""
  argv = ["train", f"--config={config_arg}", *flag_args]
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, flag_values=values, sys_argv=argv)
  values(argv)
  return values["config"].value


def load_sweep_fn(config_arg: str) -> Callable[[Callable[..., None]], None]:
  """The `sweep(add)` function of the config file named by `--config=FILE[:ARG]`."""
  path = pathlib.Path(config_arg.split(":", 1)[0])
  spec = importlib.util.spec_from_file_location(f"sweep_config_{path.stem}", path)
  if spec is None or not path.is_file():
    raise SweepError(f"--config={config_arg}: no config file at {path}")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  sweep_fn = getattr(module, "sweep", None)
  if sweep_fn is None:
    raise SweepError(f"{path} has no `def sweep(add): ...`; add one beside get_config()")
  return sweep_fn


def _field(config: ml_collections.ConfigDict, key: str, run: str) -> Any:
  """The current value at dotted `key`, or a SweepError naming the run and the field."""
  node: Any = config
  parts = key.split(".")
  for depth, part in enumerate(parts):
    section = ".".join(["config", *parts[:depth]])
    if not isinstance(node, ml_collections.ConfigDict):
      raise SweepError(f"run {run}: unknown key {key!r}: {section} is not a section")
    if part not in node:
      close = difflib.get_close_matches(part, list(node.keys()), n=3)
      hint = f" (did you mean {', '.join(close)}?)" if close else ""
      raise SweepError(
          f"run {run}: unknown key {key!r}: {section} has no field {part!r}{hint}"
      )
    node = node[part]
  if isinstance(node, ml_collections.ConfigDict):
    raise SweepError(f"run {run}: key {key!r} is a whole section; override its fields")
  return node


def _check_type(key: str, current: Any, value: Any, run: str) -> None:
  """Same rules as the command line: ints widen to float; bool, int, str, tuple stay apart."""
  if current is None:
    return
  kind = type(current)
  ok = isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)
  if kind is float and isinstance(value, int) and not isinstance(value, bool):
    ok = True
  if kind is tuple and isinstance(value, list):
    ok = True
  if not ok:
    raise SweepError(
        f"run {run}: {key}={value!r} is a {type(value).__name__}; "
        f"config.{key} is a {kind.__name__} (currently {current!r})"
    )


def _to_flags(overrides: Overrides) -> list[str]:
  return [f"--config.{k}={grid.format_value(v)}" for k, v in overrides.items()]


def plan_runs(
    config_arg: str,
    cli_overrides: Overrides,
    workdir: str | pathlib.Path,
    sweep_overrides: list[Overrides],
) -> list[Run]:
  """Names, validates and resolves every run; raises SweepError before anything runs."""
  workdir = pathlib.Path(workdir)
  names = grid.run_names(sweep_overrides)
  base = parse_config(config_arg, _to_flags(cli_overrides))
  runs = []
  for name, overrides in zip(names, sweep_overrides):
    both = sorted(set(overrides) & set(cli_overrides))
    if both:
      raise SweepError(
          f"run {name}: {both} are swept and also set on the command line; drop one of them"
      )
    expected = copy.deepcopy(base)
    for key, value in overrides.items():
      _check_type(key, _field(base, key, name), value, name)
      parent, _, leaf = key.rpartition(".")
      (expected[parent] if parent else expected)[leaf] = value
    run_flags = _to_flags(cli_overrides) + _to_flags(overrides)
    try:
      config = parse_config(config_arg, run_flags)
    except (flags.Error, ValueError, KeyError, AttributeError, TypeError) as e:
      raise SweepError(f"run {name}: its command line does not parse: {e}") from None
    if config.to_dict() != expected.to_dict():
      bad = [k for k in overrides if _field(config, k, name) != _field(expected, k, name)]
      raise SweepError(
          f"run {name}: {bad} do not survive the command line "
          f"({[grid.format_value(overrides[k]) for k in bad]}); use plain values"
      )
    runs.append(Run(name, overrides, run_flags, config, workdir / name))
  return runs


def semantic_check(runs: list[Run]) -> None:
  """The trainer's own early checks on every run, before any run starts.

  Everything in tx_jax.validation.train_config except the mesh against the device count:
  each trainer checks that against the devices it is given, and asking JAX for devices here
  would claim the GPUs the runs need.
  """
  # pylint: disable=g-import-not-at-top  # these import JAX
  from tx_jax import data, models, validation

  for run in runs:
    config = run.config
    try:
      validation.train_section(config)
      models.ModelConfig.from_config(config.model)
      data.validate(config.data, 1)
      validation.family_and_task(config)
      validation.lengths_fit(config)
      validation.best_metric_exists(config)
      validation.vocabulary_fits(config)
      validation.attention_backend_supported(config)
    except (ValueError, TypeError, OSError) as e:
      raise SweepError(f"run {run.name}: {e}") from None


def shell_command(command: list[str], cwd: str | pathlib.Path) -> str:
  """A copy-pasteable shell line: cd to the sweep's directory, then the trainer command."""
  return f"cd {shlex.quote(str(cwd))} && {shlex.join(command)}"


def jsonable(overrides: Overrides) -> dict[str, Any]:
  """Overrides as JSON values (tuples become lists)."""
  return json.loads(json.dumps(overrides, default=list))
