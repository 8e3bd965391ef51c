"""A sweep's summary from its runs' files: summary.csv, summary.md and curves.png.

Everything is read back from disk (DIR/sweep.json, each run's metrics.jsonl and
status.json), so `--summarize` rebuilds the same files without running anything.
"""

import csv
import json
import math
import pathlib
from typing import Any

from tx_jax.sweep import grid
from tx_jax.sweep import runner

SWEEP_FILE = "sweep.json"
HIGHER_IS_BETTER = ("accuracy", "bleu", "exact_match", "f1")


def metric_mode(metric: str, best_metric: str = "", best_mode: str = "min") -> str:
  """"min" or "max": the config's checkpoint.best_mode for its own metric, else by name."""
  if metric == best_metric:
    return best_mode
  return "max" if any(word in metric for word in HIGHER_IS_BETTER) else "min"


def read_metrics(workdir: pathlib.Path) -> list[dict[str, Any]]:
  """A run's metrics.jsonl lines; [] before its first line."""
  path = workdir / "metrics.jsonl"
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _curve(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
  return [
      (r["step"], r[key])
      for r in rows
      if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])
  ]


def run_row(
    name: str, overrides: dict, workdir: pathlib.Path, keys: list[str], metric: str, mode: str
) -> dict[str, Any]:
  """One summary row: name, status, workdir, swept values, steps, final and best evals."""
  rows = read_metrics(workdir)
  status = runner.read_status(workdir)
  row: dict[str, Any] = {"name": name, "status": status["status"], "workdir": str(workdir)}
  for key in keys:
    row[key] = grid.format_value(overrides[key]) if key in overrides else ""
  row["steps"] = max((r["step"] for r in rows), default=0)
  evals = sorted({k for r in rows for k in r if k.startswith("eval_")})
  if metric not in evals:
    evals.insert(0, metric)
  for key in evals:
    points = [v for _, v in _curve(rows, key)]
    better = max if metric_mode(key, metric, mode) == "max" else min
    row[f"final_{key}"] = points[-1] if points else None
    row[f"best_{key}"] = better(points) if points else None
  row["wall_time_sec"] = round(status.get("wall_time_sec", 0.0), 1)
  row["error"] = status["error"][-1] if status.get("error") else ""
  return row


def build_rows(sweep_dir: pathlib.Path, metric: str, mode: str) -> list[dict[str, Any]]:
  """Every run of DIR/sweep.json as a row, best `metric` first (runs without it last)."""
  spec = json.loads((sweep_dir / SWEEP_FILE).read_text())
  keys = spec["swept_keys"]
  rows = [
      run_row(r["name"], r["overrides"], sweep_dir / r["name"], keys, metric, mode)
      for r in spec["runs"]
  ]
  sign = -1.0 if mode == "max" else 1.0
  best = f"best_{metric}"
  rows.sort(key=lambda r: (r[best] is None, sign * r[best] if r[best] is not None else 0.0))
  return rows


def _cell(value: Any) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value).replace("|", "\\|")


def write_csv(rows: list[dict[str, Any]], path: pathlib.Path) -> None:
  """summary.csv: every column of every row (a metric a run lacks stays empty)."""
  columns: list[str] = []
  for row in rows:
    columns.extend(k for k in row if k not in columns)
  with path.open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=columns, restval="")
    writer.writeheader()
    for row in rows:
      writer.writerow({k: "" if v is None else v for k, v in row.items()})


def write_markdown(
    rows: list[dict[str, Any]], spec: dict, metric: str, mode: str, path: pathlib.Path
) -> None:
  """summary.md: the swept values, status, steps and final / best evals, best run first."""
  keys = spec["swept_keys"]
  evals = [k for k in rows[0] if k.startswith("final_eval_")] if rows else []
  columns = (
      ["name", *keys, "status", "steps", f"best_{metric}", f"final_{metric}"]
      + [k for k in evals if k != f"final_{metric}"]
      + ["wall_time_sec"]
  )
  counts = {s: sum(r["status"] == s for r in rows) for s in runner.STATUSES}
  fixed = ", ".join(f"{k}={v}" for k, v in spec["cli_overrides"].items()) or "none"
  lines = [
      f"# Sweep: {spec['config']}",
      "",
      f"{len(rows)} runs: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) + ". "
      f"Sorted by best {metric} ({mode}). Command-line overrides: {fixed}.",
      "",
      "| " + " | ".join(columns) + " |",
      "| " + " | ".join("---" for _ in columns) + " |",
  ]
  lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
  failed = [r for r in rows if r["status"] == "failed"]
  if failed:
    lines += ["", "Failed runs (last line of train.log):", ""]
    lines += [f"- {r['name']}: `{r['error']}`" for r in failed]
  lines += ["", "Curves: curves.png. Each run's command: <workdir>/command.sh.", ""]
  path.write_text("\n".join(lines))


def plot_curves(sweep_dir: pathlib.Path, spec: dict, metric: str, path: pathlib.Path) -> None:
  """curves.png: every run's `metric` curve and training loss, labelled by its overrides."""
  import matplotlib  # pylint: disable=g-import-not-at-top

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
  for run in spec["runs"]:
    rows = read_metrics(sweep_dir / run["name"])
    for ax, key in zip(axes, (metric, "loss")):
      points = _curve(rows, key)
      if points:
        ax.plot(*zip(*points), marker="." if key != "loss" else None, label=run["name"])
  for ax, key in zip(axes, (metric, "training loss")):
    ax.set_title(key)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  if axes[0].get_legend_handles_labels()[0]:
    axes[0].legend(fontsize=7)
  fig.suptitle(spec["config"])
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def summarize(sweep_dir: str | pathlib.Path, metric: str = "", mode: str = "") -> list[dict]:
  """Writes DIR/summary.csv, summary.md and curves.png; returns the rows (best first)."""
  sweep_dir = pathlib.Path(sweep_dir)
  spec = json.loads((sweep_dir / SWEEP_FILE).read_text())
  metric = metric or spec["metric"]
  mode = mode or metric_mode(metric, spec["metric"], spec["metric_mode"])
  rows = build_rows(sweep_dir, metric, mode)
  write_csv(rows, sweep_dir / "summary.csv")
  write_markdown(rows, spec, metric, mode, sweep_dir / "summary.md")
  plot_curves(sweep_dir, spec, metric, sweep_dir / "curves.png")
  return rows
