"""The original Transformer (Vaswani et al. 2017): post-LN encoder-decoder, sinusoidal
positions, ReLU, source/target/pre-softmax embeddings shared and scaled by sqrt(d_model).

Usage: --config=configs/transformer.py (the default experiment), :base, :big, :tiny.
`base` is Table 3's base model with a shared 37,000-token vocabulary.
"""

import os

import ml_collections

try:  # imported as tx_jax.configs (installed) or configs (a checkout)
  from . import common, train_defaults
except ImportError:  # loaded by path, as --config=configs/<file>.py:<preset> does
  from configs import common, train_defaults


def _transformer(
    d_model: int, num_heads: int, mlp_dim: int, dropout: float, num_layers: int = 6
) -> ml_collections.ConfigDict:
  config = common.base_config()
  m = config.model
  m.family = "encdec"
  m.vocab_size = 37000
  m.d_model, m.num_layers, m.num_decoder_layers = d_model, num_layers, num_layers
  m.num_heads = m.num_kv_heads = num_heads
  m.head_dim, m.mlp_dim = d_model // num_heads, mlp_dim
  m.mlp_activation, m.gated_mlp = "relu", False
  m.norm, m.norm_eps, m.pre_norm = "layernorm", 1e-6, False
  m.positions, m.max_len = "sinusoidal", 512
  m.embed_scale = True
  m.tie_embeddings = True
  m.attention_bias, m.mlp_bias = False, True  # the paper's FFN has biases, W^Q/K/V/O none
  m.dropout_rate = dropout
  m.attention_dropout_rate = 0.0
  m.init = "xavier_uniform"
  _paper_training(config)
  config.data.source_len = config.data.target_len = 256  # WMT sentences fit
  return config


# --- training setups (owned by the trainer; see configs/train_defaults.py) ---
def _paper_training(config: ml_collections.ConfigDict) -> None:
  """Section 5.3-5.4: Adam(0.9, 0.98, 1e-9), lr = d^-0.5 min(s^-0.5, s w^-1.5), w = 4000,
  label smoothing 0.1, no weight decay or clipping; 100k steps (base)."""
  o, s = config.optimizer, config.schedule
  o.name, o.b1, o.b2, o.eps, o.weight_decay, o.grad_clip_norm = "adamw", 0.9, 0.98, 1e-9, 0.0, 0.0
  o.learning_rate = 1.0  # multiplier of the paper's formula
  s.name, s.warmup_steps = "paper", 4000
  config.loss.label_smoothing = 0.1
  t = config.train
  t.steps = 100_000
  # Section 6.1: BLEU by beam search, beam 4, length penalty alpha 0.6.
  t.decode_metrics, t.decode_strategy, t.beam_size, t.alpha = ("bleu",), "beam", 4, 0.6


def tiny() -> ml_collections.ConfigDict:
  """A byte-level Transformer small enough for 2 CPU cores."""
  config = _transformer(d_model=128, num_heads=4, mlp_dim=512, dropout=0.0, num_layers=2)
  config.model.vocab_size = 360  # byte tokenizer: 4 specials + 256 bytes + 100 sentinels
  config.data.source_len = config.data.target_len = 16  # reversal strings: <= 12 bytes + EOS
  _cpu_training(config)
  return config


def _cpu_training(config: ml_collections.ConfigDict) -> None:
  """The paper's Adam and label smoothing, with a short warm-up + cosine schedule, so the
  default experiment (string reversal, data defaults) passes 95% exact match in minutes."""
  o, s, t = config.optimizer, config.schedule, config.train
  o.learning_rate, o.grad_clip_norm = 2e-3, 1.0
  s.name, s.warmup_steps, s.end_factor = "warmup_cosine", 50, 0.0
  t.steps, t.log_every, t.eval_every = 400, 50, 100
  t.decode_metrics, t.decode_examples, t.decode_max_len = ("exact_match",), 256, 16
  t.decode_strategy = "greedy"  # exact match of a reversal; beam search only adds time
  config.checkpoint.every = 200
  config.checkpoint.best_metric, config.checkpoint.best_mode = "eval_exact_match", "max"


def multi30k() -> ml_collections.ConfigDict:
  """tiny on Multi30k de->en with a shared 8k SentencePiece vocabulary (README: BLEU).

  First: python -m experiments.train_tokenizer --config=configs/transformer.py:multi30k
  (writes data.spm_model_path). Raw files from $TX_JAX_DATA_DIR/multi30k (manual_dir): the
  six .gz files of https://github.com/multi30k/dataset/tree/master/data/task1/raw.
  """
  config = tiny()
  d, m = config.data, config.model
  d.source, d.manual_dir = "multi30k", os.path.join(train_defaults.data_dir(), "multi30k")
  d.source_key, d.target_key = "de", "en"
  d.tokenizer, d.spm_model_path, d.vocab_size = "sentencepiece", "runs/multi30k_spm8k.model", 8000
  d.num_sentinels = 0
  d.source_len = d.target_len = 48
  d.pack, d.global_batch_size = True, 64
  m.vocab_size, m.dropout_rate = 8000, 0.1
  config.optimizer.learning_rate = 2e-3
  config.schedule.warmup_steps = 150
  t = config.train
  t.steps, t.eval_every, t.log_every = 1500, 500, 100
  t.decode_metrics, t.decode_examples, t.decode_max_len = ("bleu",), 200, 40
  t.decode_strategy, t.beam_size, t.alpha = "beam", 4, 0.6  # as the paper reports BLEU
  config.checkpoint.every = 250
  config.checkpoint.best_metric = ""
  return config


PRESETS = {
    "base": lambda: _transformer(512, 8, 2048, dropout=0.1),
    "big": lambda: _transformer(1024, 16, 4096, dropout=0.3),
    "tiny": tiny,
    "default": tiny,  # the default experiment: tiny on the synthetic translation task
    "multi30k": multi30k,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return common.get_preset(PRESETS, arg, "default", "transformer.py")()


def sweep(add) -> None:
  """Peak learning rate x seed (4 runs) on the default string-reversal task:
  python -m experiments.sweep --config=configs/transformer.py:tiny --workdir=runs/tx_lr
  """
  for learning_rate in (1e-3, 3e-3):
    for seed in (0, 1):
      add({"optimizer.learning_rate": learning_rate, "seed": seed})
