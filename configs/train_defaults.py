"""Default `train`, `optimizer`, `schedule`, `loss` and `checkpoint` config sections.

configs/common.py assembles these into every family config; family files override the
fields their paper sets. Every field has a value and a one-line comment: library code
reads `config.x` and never falls back to a default of its own.
"""

import os

import ml_collections


def train_config() -> ml_collections.ConfigDict:
  """The `config.train` section: step counts, evaluation, accumulation, robustness."""
  c = ml_collections.ConfigDict()
  c.steps = 1000  # total optimizer steps (batches consumed) of the run
  c.log_every = 50  # write a metrics.jsonl / TensorBoard line every this many steps
  c.eval_every = 500  # evaluate every this many steps (and at the end); 0 = only at the end
  c.eval_split = "validation"  # data split the eval_* metrics are computed on
  c.eval_batches = 0  # eval batches per evaluation; 0 = the whole split
  c.decode_metrics = ()  # held-out metrics that need decoding: "exact_match", "bleu"
  c.decode_examples = 256  # held-out examples decoded for each decode metric
  c.decode_max_len = 64  # generated tokens per example at most (EOS stops earlier)
  c.decode_strategy = "greedy"  # how decode metrics decode (tx_jax.decode): "greedy" or "beam"
  c.beam_size = 4  # beam: hypotheses kept per example (the Transformer paper: 4)
  c.alpha = 0.6  # beam: GNMT length penalty ((5 + |y|) / 6) ** alpha (the paper: 0.6)
  c.print_examples = 3  # source -> output pairs printed at the end (decode tasks only)
  c.grad_accum_steps = 1  # micro-batches per step; the global batch must divide by it
  c.nonfinite = "skip"  # on a NaN/Inf loss or gradient: "skip" the update or "abort" the run
  c.peak_flops = 0.0  # device peak FLOP/s for MFU; 0 = measure a matmul once in-process
  c.progress = "auto"  # "auto" (bar on a TTY, log lines otherwise), "bar" or "log"
  c.plot = True  # write curves.png at the end of the run
  return c


def optimizer_config() -> ml_collections.ConfigDict:
  """The `config.optimizer` section: optax AdamW or Adafactor, clipping, weight-decay mask."""
  c = ml_collections.ConfigDict()
  c.name = "adamw"  # "adamw" (Adam when weight_decay == 0) or "adafactor"
  c.learning_rate = (
      1e-3  # peak learning rate; a multiplier of the formula for "paper"/"inverse_sqrt"
  )
  c.b1 = 0.9  # AdamW first-moment decay
  c.b2 = 0.999  # AdamW second-moment decay
  c.eps = 1e-8  # AdamW denominator epsilon
  c.weight_decay = 0.0  # decoupled weight decay (AdamW) / weight_decay_rate (Adafactor)
  c.no_decay = ("bias", "scale", "embedding")  # regexes on "a/b/c" param paths never decayed
  c.grad_clip_norm = 1.0  # clip gradients to this global L2 norm; 0 = no clipping
  c.adafactor_decay_rate = 0.8  # Adafactor second-moment decay exponent (T5: 0.8)
  c.adafactor_clipping_threshold = 1.0  # Adafactor update clipping (T5: 1.0)
  c.adafactor_factored = True  # Adafactor factored second moments
  c.adafactor_param_scale = True  # Adafactor: scale updates by parameter RMS (T5: True)
  return c


def schedule_config() -> ml_collections.ConfigDict:
  """The `config.schedule` section: the learning-rate schedule."""
  c = ml_collections.ConfigDict()
  c.name = "warmup_cosine"  # constant|paper (reads model.d_model)|inverse_sqrt|warmup_cosine|warmup_linear
  c.warmup_steps = 100  # linear warm-up steps (the paper's and inverse_sqrt's warmup too)
  c.decay_steps = 0  # steps of warm-up + decay for cosine/linear; 0 = train.steps
  c.end_factor = 0.0  # final lr as a fraction of the peak (cosine / linear decay)
  return c


def loss_config() -> ml_collections.ConfigDict:
  """The `config.loss` section."""
  c = ml_collections.ConfigDict()
  c.label_smoothing = 0.0  # epsilon of uniform label smoothing (Transformer paper: 0.1)
  c.z_loss = 0.0  # coefficient of log(Z)^2 (PaLM uses 1e-4); 0 = off
  return c


def checkpoint_config() -> ml_collections.ConfigDict:
  """The `config.checkpoint` section: one async Orbax CheckpointManager."""
  c = ml_collections.ConfigDict()
  c.every = 500  # save every this many steps (and always at the end and on SIGTERM/SIGINT)
  c.keep = 3  # keep the latest this many checkpoints
  c.best_metric = (
      ""  # also keep the best checkpoint by this eval metric, e.g. "eval_loss"; "" = off
  )
  c.best_mode = "min"  # "min" or "max": which value of best_metric is best
  c.async_save = True  # save in a background thread while training continues
  c.on_corrupt = "fallback"  # damaged newest checkpoint: "fallback" to an older one or "stop"
  c.resume = True  # resume from the latest checkpoint in the workdir if there is one
  return c


def data_dir() -> str:
  """The offline data sets' folder: $TX_JAX_DATA_DIR, else ./data where the command runs.

  Never a folder outside the checkout: when the data is not there, the run stops with one
  line naming the missing folder and $TX_JAX_DATA_DIR (tx_jax.data.sources.check_manual_dir).
  """
  return os.path.abspath(os.environ.get("TX_JAX_DATA_DIR") or "data")


def tiny_shakespeare(config: ml_collections.ConfigDict, task: str) -> None:
  """Points `config.data` at Tiny Shakespeare through TFDS's own builder, offline.

  The raw file comes from data_dir()/tinyshakespeare, the very file TFDS downloads.
  Get it: curl -o $TX_JAX_DATA_DIR/tinyshakespeare/input.txt --create-dirs
  https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt
  """
  root = data_dir()
  d = config.data
  d.source, d.task, d.tfds_name, d.text_key = "tfds", task, "tiny_shakespeare", "text"
  d.manual_dir = os.path.join(root, "tinyshakespeare")
  d.train_split = "train"
  config.train.eval_split = "validation"
