"""Cross-field checks that run before any data is read, anything compiles or a step trains.

Each check names the field, its value, what is accepted and, where it helps, the fix.
`train_config` serves experiments.train (via `tx_jax.train.loop.validate`) and
experiments.convert; `decode_flags` / `prompt_ids` serve experiments.decode. Checks that a
single section can make on its own live beside that section (`ModelConfig.validate`,
`tx_jax.data.validate`, `tx_jax.sharding.validate`); this module runs them all, then the
checks that need two sections at once.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any, Sequence

import ml_collections

# config.data.task values each model family can train on, the first being the usual one.
FAMILY_TASKS = {
    "decoder": ("lm",),
    "encoder": ("mlm", "classification"),
    "encdec": ("seq2seq", "span_corruption"),
}
# config.model.head an encoder needs for each task.
ENCODER_HEADS = {"mlm": "mlm", "classification": "classification"}
# Position schemes with a longest sequence (config.model.max_len).
BOUNDED_POSITIONS = ("learned", "sinusoidal")
NONFINITE = ("skip", "abort")  # config.train.nonfinite
ON_CORRUPT = ("fallback", "stop")  # config.checkpoint.on_corrupt


def train_section(config: ml_collections.ConfigDict) -> None:
  """The train / checkpoint sections on their own."""
  t = config.train
  for name in ("steps", "log_every", "grad_accum_steps"):
    if t[name] < 1:
      raise ValueError(f"config.train.{name}={t[name]}: must be >= 1")
  for name, value in (
      ("train.eval_every", t.eval_every),
      ("checkpoint.every", config.checkpoint.every),
  ):
    if value < 0:
      raise ValueError(f"config.{name}={value}: must be >= 0 (0 = only at the end)")
  if t.nonfinite not in NONFINITE:
    raise ValueError(f"config.train.nonfinite={t.nonfinite!r}: expected one of {NONFINITE}")
  from tx_jax import evaluation  # pylint: disable=g-import-not-at-top

  evaluation.validate(config)  # the decode fields: metrics, strategy, beam size, alpha
  if config.data.global_batch_size % t.grad_accum_steps:
    raise ValueError(
        f"config.data.global_batch_size={config.data.global_batch_size} is not "
        f"divisible by config.train.grad_accum_steps={t.grad_accum_steps}"
    )
  checkpoint_section(config.checkpoint)


def checkpoint_section(c: ml_collections.ConfigDict) -> None:
  """The checkpoint section on its own (tx_jax.checkpoint.Checkpointer checks it too)."""
  if c.on_corrupt not in ON_CORRUPT:
    raise ValueError(f"config.checkpoint.on_corrupt={c.on_corrupt!r}: expected one of {ON_CORRUPT}")
  if c.keep < 1:
    raise ValueError(f"config.checkpoint.keep={c.keep}: must be >= 1")
  if c.best_mode not in ("min", "max"):
    raise ValueError(f"config.checkpoint.best_mode={c.best_mode!r}: expected 'min' or 'max'")


def family_and_task(config: ml_collections.ConfigDict) -> None:
  """The data task must give the batches the model family reads (ARCHITECTURE.md's contract)."""
  family, task, head = config.model.family, config.data.task, config.model.head
  accepted = FAMILY_TASKS.get(family)
  if accepted is None:
    return  # ModelConfig.validate names an unknown family
  if task not in accepted:
    raise ValueError(
        f"config.data.task={task!r} gives batches a config.model.family={family!r} model cannot "
        f"read; accepted for {family!r}: {list(accepted)} (e.g. --config.data.task={accepted[0]})"
    )
  if family == "encoder" and head != ENCODER_HEADS[task]:
    raise ValueError(
        f"config.data.task={task!r} needs config.model.head={ENCODER_HEADS[task]!r}, "
        f"not {head!r}"
        + ("; 'none' has no loss to train" if head == "none" else "")
    )
  if config.train.decode_metrics and family != "encdec":
    raise ValueError(
        f"config.train.decode_metrics={tuple(config.train.decode_metrics)} needs an "
        f"encdec model, not config.model.family={family!r}; set --config.train.decode_metrics=()"
    )


def lengths_fit(config: ml_collections.ConfigDict) -> None:
  """Sequence lengths within model.max_len for learned / sinusoidal positions."""
  m, d = config.model, config.data
  if m.positions not in BOUNDED_POSITIONS:
    return
  fields = ("source_len", "target_len") if m.family == "encdec" else ("seq_len",)
  for field in fields:
    if d[field] > m.max_len:
      raise ValueError(
          f"config.data.{field}={d[field]} is longer than config.model.max_len={m.max_len} "
          f"({m.positions!r} positions have no row past max_len - 1); lower data.{field} or "
          f"raise model.max_len"
      )
  if config.train.decode_metrics and config.train.decode_max_len > m.max_len:
    raise ValueError(
        f"config.train.decode_max_len={config.train.decode_max_len} is longer than "
        f"config.model.max_len={m.max_len}; lower it or raise model.max_len"
    )


def vocabulary_fits(config: ml_collections.ConfigDict) -> None:
  """Every id the tokenizer and task can produce is a row of the model's embedding."""
  from tx_jax.data import pipeline  # pylint: disable=g-import-not-at-top

  pipeline.check_vocab(config)  # only span corruption emits the sentinels on top


def attention_backend_supported(config: ml_collections.ConfigDict) -> None:
  """The model's features against config.model.attention_backend's, on any machine.

  The backends raise the same at trace time, after the workdir is written: checked here
  first, from the limits `layers.attention.backends` declares.
  """
  from tx_jax.layers.attention import backends as ab  # pylint: disable=g-import-not-at-top

  m = config.model
  backend = m.attention_backend
  where = f"config.model.attention_backend={backend!r}"
  if backend in ab.NO_DROPOUT_BACKENDS and m.attention_dropout_rate > 0:
    raise ValueError(
        f"{where} has no attention dropout, but config.model.attention_dropout_rate="
        f"{m.attention_dropout_rate}; set it to 0 or use 'dense'"
    )
  if backend == "cudnn" and m.dtype not in ab.CUDNN_DTYPES:
    raise ValueError(
        f"{where} computes in bfloat16 or float16, but config.model.dtype={m.dtype!r}; "
        "set config.model.dtype='bfloat16' or use 'dense' / 'blockwise'"
    )
  if backend in ab.NO_BIAS_BACKENDS and m.positions in ("relative", "alibi"):
    raise ValueError(
        f"{where} takes no additive bias, but config.model.positions={m.positions!r} "
        "adds one; use 'cudnn', 'blockwise' or 'dense'"
    )
  if backend == "pallas" and m.family == "encdec":
    raise ValueError(
        f"{where} has no cross-attention, which config.model.family='encdec' needs; "
        "use 'cudnn', 'blockwise' or 'dense'"
    )
  if config.data.pack and not m.packed_inputs:
    raise ValueError(
        "config.data.pack=True packs several examples per row, but config.model."
        "packed_inputs=False tells the attention there is one; set it to True"
    )
  if backend in ab.UNPACKED_ONLY_BACKENDS and m.packed_inputs:
    raise ValueError(
        f"{where} takes padding as sequence lengths and needs one segment per row, but "
        f"config.model.packed_inputs=True (config.data.pack={config.data.pack}); set "
        "data.pack=False, or use 'pallas' (GPU) or 'blockwise' for packed rows"
    )


def attention_backend_runs_here(config: ml_collections.ConfigDict, platform: str) -> None:
  """GPU- and TPU-only backends refused on another platform (JAX's default backend name),
  and backends whose kernel this JAX does not ship."""
  from tx_jax.layers.attention import backends as ab  # pylint: disable=g-import-not-at-top

  backend = config.model.attention_backend
  if backend in ab.GPU_ONLY_BACKENDS and platform != "gpu":
    raise ValueError(
        f"config.model.attention_backend={backend!r} needs an NVIDIA GPU, but JAX runs on "
        f"{platform!r}; use 'dense' or 'blockwise' here"
    )
  if backend in ab.TPU_ONLY_BACKENDS and platform != "tpu":
    raise ValueError(
        f"config.model.attention_backend={backend!r} needs a TPU, but JAX runs on "
        f"{platform!r}; use 'dense' or 'blockwise' here"
    )
  missing = ab.missing_kernel(backend)
  if missing is not None:
    import jax  # pylint: disable=g-import-not-at-top

    raise ValueError(
        f"config.model.attention_backend={backend!r} needs {missing}, which jax "
        f"{jax.__version__} does not ship; use 'cudnn' or 'blockwise', or a jax that has it "
        "(the Pallas GPU attention: jax <= 0.12.0)"
    )


def eval_metric_names(config: ml_collections.ConfigDict) -> list[str]:
  """The metrics one evaluation produces (tx_jax.evaluation.Evaluator.evaluate)."""
  names = ["eval_loss", "eval_accuracy"]
  if config.data.task == "lm":
    names.append(
        "eval_bits_per_byte" if config.data.tokenizer == "byte" else "eval_bits_per_token"
    )
  names += [f"eval_{m}" for m in config.train.decode_metrics]
  return names


def best_metric_exists(config: ml_collections.ConfigDict) -> None:
  """checkpoint.best_metric is a metric the eval will produce (else the final save fails)."""
  name = config.checkpoint.best_metric
  produced = eval_metric_names(config)
  if name and name not in produced:
    raise ValueError(
        f"config.checkpoint.best_metric={name!r} is not a metric this run's eval produces; "
        f"accepted: {produced} or '' (off)"
    )


def context_parallel_supported(config: ml_collections.ConfigDict) -> None:
  """A mesh that splits the sequence runs self-attention as ring attention
  (`layers/attention/ring.py`), which has no attention dropout: refused before any work."""
  m = config.model
  if config.mesh.sequence > 1 and m.attention_dropout_rate > 0:
    raise ValueError(
        f"config.mesh.sequence={config.mesh.sequence} runs self-attention context-parallel, "
        f"which has no attention dropout, but config.model.attention_dropout_rate="
        f"{m.attention_dropout_rate}; set it to 0 or use config.mesh.sequence=1"
    )


def train_config(
    config: ml_collections.ConfigDict,
    num_devices: int | None = None,
    num_processes: int | None = None,
) -> None:
  """Every check a training run needs, before data loading, compilation or training.

  `num_devices` / `num_processes` default to JAX's; the mesh is checked against them.
  """
  import jax  # pylint: disable=g-import-not-at-top

  from tx_jax import data, lora, models, sharding  # pylint: disable=g-import-not-at-top
  from tx_jax.train import optimizers  # pylint: disable=g-import-not-at-top

  train_section(config)
  optimizers.validate(config.optimizer)
  models.ModelConfig.from_config(config.model)  # validates every model field
  lora.check_targets(config.model)
  num_processes = jax.process_count() if num_processes is None else num_processes
  data.validate(config.data, num_processes)
  family_and_task(config)
  lengths_fit(config)
  best_metric_exists(config)
  vocabulary_fits(config)
  attention_backend_supported(config)
  attention_backend_runs_here(config, jax.default_backend())
  context_parallel_supported(config)
  sharding.validate(
      config,
      len(sharding.run_devices(config.mesh)) if num_devices is None else num_devices,
      num_processes,
  )


# ----------------------------------------------------------------------------- decode


def decode_flags(
    *,
    strategy: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    beam_size: int,
    alpha: float,
    batch_size: int,
    input_file: str | None,
) -> None:
  """Every flag of experiments.decode, whatever the strategy, before the model is loaded."""

  def bad(flag: str, value: Any, accepted: str) -> ValueError:
    return ValueError(f"--{flag}={value!r} {accepted}")

  if strategy not in ("greedy", "sample", "beam"):
    raise bad("strategy", strategy, "is not one of greedy, sample, beam")
  if max_new_tokens < 1:
    raise bad("max_new_tokens", max_new_tokens, "must be >= 1")
  if not math.isfinite(temperature) or temperature < 0:
    raise bad("temperature", temperature, "must be a finite number >= 0")
  if strategy == "sample" and temperature == 0:
    raise bad("temperature", temperature, "must be > 0 to sample; use --strategy=greedy")
  if top_k < 0:
    raise bad("top_k", top_k, "must be >= 0 (0 = all tokens)")
  if not (math.isfinite(top_p) and 0 < top_p <= 1):
    raise bad("top_p", top_p, "must lie in (0, 1] (1 = all tokens)")
  if beam_size < 1:
    raise bad("beam_size", beam_size, "must be >= 1")
  if not math.isfinite(alpha) or alpha < 0:
    raise bad("alpha", alpha, "must be a finite number >= 0 (the paper: 0.6)")
  if batch_size < 1:
    raise bad("batch_size", batch_size, "must be >= 1")
  if input_file is not None:
    path = pathlib.Path(input_file)
    if not path.is_file():
      raise FileNotFoundError(f"--input_file={input_file}: no such file")
    if not path.read_text(encoding="utf-8").strip():
      raise ValueError(f"--input_file={input_file} is empty; give one input text per line")


def prompt_ids(text: str, vocab_size: int) -> list[int]:
  """--prompt_ids "1,2,3" as ids, each within [0, vocab_size)."""
  try:
    ids = [int(t) for t in text.split(",") if t.strip()]
  except ValueError:
    raise ValueError(
        f"--prompt_ids={text!r}: expected comma-separated integers, e.g. 1,2,3"
    ) from None
  if not ids:
    raise ValueError(f"--prompt_ids={text!r} holds no id; give at least one, e.g. 1,2,3")
  outside = [i for i in ids if not 0 <= i < vocab_size]
  if outside:
    raise ValueError(
        f"--prompt_ids has {outside[:5]} outside the model's vocabulary [0, {vocab_size}) "
        "(model.vocab_size)"
    )
  return ids


def prompt_text(text: str) -> str:
  """--prompt, which must hold something to encode."""
  if not text.strip():
    raise ValueError(f"--prompt={text!r} is empty; give text to continue or translate")
  return text


def texts_not_empty(texts: Sequence[str], where: str) -> None:
  """Every input text holds something to encode."""
  empty = [i + 1 for i, t in enumerate(texts) if not t.strip()]
  if empty:
    raise ValueError(f"{where}: line {empty[0]} is empty; every input needs text")


# ----------------------------------------------------------------------------- workdirs

# config.model fields that change the parameter tree or a parameter's shape.
SHAPE_FIELDS = (
    "family", "vocab_size", "d_model", "num_layers", "num_decoder_layers", "num_heads",
    "num_kv_heads", "head_dim", "mlp_dim", "gated_mlp", "norm", "norm_bias", "embed_norm",
    "positions", "relative_buckets", "tie_embeddings", "attention_bias", "mlp_bias",
    "type_vocab_size", "pooler", "head", "num_classes", "scan_layers", "fused_qkv",
)  # fmt: skip


def read_json(path: pathlib.Path, what: str) -> dict:
  """A JSON file's object, or a ValueError naming the file and the position of the fault."""
  import json  # pylint: disable=g-import-not-at-top

  try:
    values = json.loads(path.read_text(encoding="utf-8"))
  except json.JSONDecodeError as e:
    raise ValueError(
        f"{path} ({what}) is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
    ) from None
  if not isinstance(values, dict):
    raise ValueError(f"{path} ({what}) holds a JSON {type(values).__name__}, not an object")
  return values


def workdir_matches(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> None:
  """A workdir with checkpoints resumes only under a config of the same model shape.

  Checked before the run writes its config.json over the one the checkpoints were made with.
  """
  workdir = pathlib.Path(workdir)
  ckpt_dir, config_file = workdir / "checkpoints", workdir / "config.json"
  if not config.checkpoint.resume or not config_file.is_file() or not ckpt_dir.is_dir():
    return
  if not any(p.name.isdigit() for p in ckpt_dir.iterdir()):
    return
  saved = read_json(config_file, "the config its checkpoints were written with").get("model", {})
  fields = [f for f in SHAPE_FIELDS if f in saved and saved[f] != config.model[f]]
  if config.model.positions == "learned" and saved.get("max_len", config.model.max_len) != (
      config.model.max_len
  ):
    fields.append("max_len")
  differences = [f"model.{f}={saved[f]!r}, the config says {config.model[f]!r}" for f in fields]
  lora, saved_lora = config.model.lora, saved.get("lora", {})
  for f in ("rank", "targets") if lora.rank > 0 or saved_lora.get("rank", 0) > 0 else ():
    ours, theirs = lora[f], saved_lora.get(f)
    if (list(ours) if f == "targets" else ours) != theirs:  # JSON holds the tuple as a list
      differences.append(f"model.lora.{f}={theirs!r}, the config says {ours!r}")
  if differences:
    differences = "; ".join(differences[:4])
    raise ValueError(
        f"--workdir={workdir} holds checkpoints of another model ({differences}); resume it "
        f"with --config=configs/workdir.py:{workdir}, or train this config in another --workdir"
    )
