"""Runs the benchmark sections and writes DIR/benchmark.json plus one PNG per section."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
import traceback
from typing import Callable

from tx_jax.benchmarks import common
from tx_jax.benchmarks.common import Options


def _sections(preset: str) -> dict[str, tuple[Callable, Callable]]:
  """name -> (run(options) -> dict, plot(result, path)); imported lazily, per preset."""
  from tx_jax.benchmarks import attention, compile_time, context, data, decode, time_to_loss, train  # pylint: disable=g-import-not-at-top

  if preset == "h200":
    from tx_jax.benchmarks import h200  # pylint: disable=g-import-not-at-top

    return {
        "train": (h200.run_train, h200.plot_train),
        "attention": (h200.run_attention, attention.plot),
        "blocks": (h200.run_blocks, h200.plot_blocks),
    }
  return {
      "train": (train.run_train, lambda r, p: train.plot(r, p, "train: bench config")),
      "small": (train.run_small, lambda r, p: train.plot(r, p, "small: 4 layers, d 128")),
      "time_to_loss": (time_to_loss.run, time_to_loss.plot),
      "attention": (attention.run, attention.plot),
      "decode": (decode.run, decode.plot),
      "data": (data.run, data.plot),
      "compile": (compile_time.run, compile_time.plot),
      "context": (context.run, context.plot),
  }


SECTIONS = ("train", "small", "time_to_loss", "attention", "decode", "data", "compile", "context")
PRESETS = ("cpu", "h200")
DATA_SECTIONS = ("train", "small", "time_to_loss", "data")  # read Tiny Shakespeare


def check_data(options: Options) -> None:
  """Finds Tiny Shakespeare (preparing it from options.data_dir if TFDS has not) before any
  section runs, so that a wrong --data_dir is one error at the start, not a failed section
  after minutes of others."""
  from tx_jax import data  # pylint: disable=g-import-not-at-top
  from tx_jax.benchmarks import models  # pylint: disable=g-import-not-at-top
  from tx_jax.data import sources  # pylint: disable=g-import-not-at-top

  data_config = models.jax_config(common.SMOKE, options.data_dir).data
  try:
    data.build_source(data_config, data_config.train_split)
  except sources.MissingDataError as e:
    raise sources.MissingDataError(f"--data_dir={options.data_dir}: {e}") from e


def run(
    out_dir: str | pathlib.Path, only: list[str], options: Options, kernels: list[str] = ("plain",)
) -> dict:
  """Runs `only` (all of the preset's sections when empty) once for each of `kernels`;
  returns benchmark.json's content.

  A section's key is its name for the "plain" kernels and `<name>.<kernels>` for another
  set (`train.cpu`), so one run holds both settings side by side.

  An existing benchmark.json in out_dir is updated section by section (a rerun of one
  section keeps the others), and rewritten after each section, so a crash keeps the rest.
  A section that raises is recorded as {"error": ...} and the others still run.
  """
  if options.preset not in PRESETS:
    raise ValueError(f"--preset={options.preset!r}; accepted: {PRESETS}")
  sections = _sections(options.preset)
  unknown = [s for s in only if s not in sections]
  if unknown:
    raise ValueError(
        f"--only {unknown}: not a section of preset {options.preset!r}; accepted: {list(sections)}"
    )
  if options.preset == "cpu":
    # Before anything starts JAX: the process gets the CPU presets' devices, so the trainer
    # and the bare step run as configs/gpt.py:tiny-shakespeare ships (sharding.use_cpu_devices).
    import ml_collections  # pylint: disable=g-import-not-at-top

    gpt = common.preset_module("gpt")
    from tx_jax import sharding  # pylint: disable=g-import-not-at-top

    sharding.use_cpu_devices(ml_collections.ConfigDict({"cpu_devices": gpt.CPU_DEVICES}))
    if any(name in DATA_SECTIONS for name in only or sections):
      check_data(options)
  # Compiles are part of what is measured (`compile`, `time_to_loss`): never from a cache
  # that the environment (JAX_COMPILATION_CACHE_DIR) may name. --smoke times nothing, so
  # there such a cache (the test session's) may serve the programs that sections share.
  from tx_jax import compile_cache  # pylint: disable=g-import-not-at-top

  if not options.smoke:
    compile_cache.disable()
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  path = out / "benchmark.json"
  report = json.loads(path.read_text()) if path.exists() else {}
  report["machine"] = common.machine()
  report["options"] = dict(options.__dict__)
  runs = [(name, kernel_set) for name in only or list(sections) for kernel_set in kernels]
  for section, kernel_set in runs:
    run_fn, plot_fn = sections[section]
    name = section if kernel_set == "plain" else f"{section}.{kernel_set}"
    print(f"[benchmark] {name} ... (loadavg {os.getloadavg()[0]:.2f})", flush=True)
    start, load = time.perf_counter(), os.getloadavg()
    try:
      result = run_fn(dataclasses.replace(options, kernels=kernel_set))
      plot_fn(result, out / f"{name}.png")
    except Exception as e:  # pylint: disable=broad-except  # report it, run the next section
      traceback.print_exc()
      result = {"error": f"{type(e).__name__}: {e}"}
    result["seconds"] = time.perf_counter() - start
    result["loadavg_before"], result["loadavg_after"] = list(load), list(os.getloadavg())
    report[name] = result
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"[benchmark] {name} done in {result['seconds']:.0f} s", flush=True)
  return report
