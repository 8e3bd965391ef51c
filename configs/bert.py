"""BERT presets (Devlin et al. 2019): post-LN encoder, learned positions, token types.

Usage: --config=configs/bert.py:base (large, tiny). Presets carry the MLM head and train
with MLM (data.task="mlm") on the offline synthetic strings as shipped; tiny-mlm reads Tiny
Shakespeare from $TX_JAX_DATA_DIR; tiny-sst2 classifies TFDS glue/sst2, which must be
downloaded and prepared once, online (TFDS does it on first use). The `params:` figure of
the dry run counts the encoder + pooler, as HF's BertModel does.
"""

import ml_collections

try:  # imported as tx_jax.configs (installed) or configs (a checkout)
  from . import common, train_defaults
except ImportError:  # loaded by path, as --config=configs/<file>.py:<preset> does
  from configs import common, train_defaults


def _bert(d_model: int, num_layers: int, num_heads: int) -> ml_collections.ConfigDict:
  config = common.base_config()
  m = config.model
  m.family = "encoder"
  m.vocab_size = 30522
  m.d_model, m.num_layers, m.num_heads = d_model, num_layers, num_heads
  m.num_kv_heads, m.head_dim, m.mlp_dim = num_heads, d_model // num_heads, 4 * d_model
  m.mlp_activation = "gelu"
  m.norm, m.norm_eps, m.pre_norm, m.embed_norm = "layernorm", 1e-12, False, True
  m.positions, m.max_len = "learned", 512
  m.type_vocab_size = 2
  m.pooler = True
  m.head = "mlm"
  m.tie_embeddings = True
  m.attention_bias = m.mlp_bias = True
  m.dropout_rate = m.attention_dropout_rate = 0.1
  m.init_std = 0.02
  _bert_training(config)
  config.data.task = "mlm"  # pre-training; tiny-sst2 switches to classification
  config.data.seq_len = 512  # the published maximum length
  return config


# --- training setups (owned by the trainer; see configs/train_defaults.py) ---
def _bert_training(config: ml_collections.ConfigDict) -> None:
  """Devlin et al. A.2: Adam lr 1e-4, (0.9, 0.999), wd 0.01 except LayerNorm and biases,
  warm-up 10k steps then linear decay over 1M steps; clip 1.0 (the reference code)."""
  o, s = config.optimizer, config.schedule
  o.name, o.learning_rate, o.b1, o.b2, o.eps = "adamw", 1e-4, 0.9, 0.999, 1e-6
  o.weight_decay, o.grad_clip_norm, o.no_decay = 0.01, 1.0, ("bias", "scale")
  s.name, s.warmup_steps, s.end_factor = "warmup_linear", 10_000, 0.0
  config.train.steps = 1_000_000


def _cpu_training(config: ml_collections.ConfigDict) -> None:
  """The BERT recipe scaled to minutes on 2 CPU cores."""
  o, s, t = config.optimizer, config.schedule, config.train
  o.learning_rate = 1e-3
  s.warmup_steps = 100
  t.steps, t.log_every, t.eval_every, t.eval_batches = 600, 50, 200, 16
  config.data.seq_len, config.data.global_batch_size = 128, 16
  config.data.eval_global_batch_size = 32
  config.checkpoint.every = 500


def tiny_mlm() -> ml_collections.ConfigDict:
  """tiny pre-trained with MLM on Tiny Shakespeare; eval_accuracy is masked-token accuracy."""
  config = tiny()
  train_defaults.tiny_shakespeare(config, task="mlm")
  return config


def tiny_sst2() -> ml_collections.ConfigDict:
  """tiny fine-tuned for sentence classification on TFDS glue/sst2 (Devlin et al. 4.1:
  lr 2e-5..5e-5, batch 32, 3 epochs; here a CPU-sized lr and step count). Data: TFDS
  downloads and prepares glue/sst2 on first use (online once; then --config.data.tfds_data_dir)."""
  config = tiny()
  m, d, o, s, t = config.model, config.data, config.optimizer, config.schedule, config.train
  m.head, m.num_classes = "classification", 2
  d.source, d.task, d.tfds_name = "tfds", "classification", "glue/sst2"
  d.text_key, d.label_key, d.text_pair_key = "sentence", "label", ""
  d.seq_len = 64
  o.learning_rate, o.weight_decay = 5e-4, 0.01
  s.name, s.warmup_steps = "warmup_linear", 100
  t.steps, t.eval_every = 1000, 250
  t.eval_split = "validation"
  return config


def tiny() -> ml_collections.ConfigDict:
  """A byte-level BERT that trains on 2 CPU cores in minutes."""
  config = _bert(d_model=128, num_layers=4, num_heads=4)
  config.model.vocab_size = 360  # byte tokenizer: 4 specials + 256 bytes + 100 sentinels
  config.model.max_len = 256
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  _cpu_training(config)
  return config


PRESETS = {
    "base": lambda: _bert(768, 12, 12),
    "large": lambda: _bert(1024, 24, 16),
    "tiny": tiny,
    "tiny-mlm": tiny_mlm,
    "tiny-sst2": tiny_sst2,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return common.get_preset(PRESETS, arg, "tiny", "bert.py")()


def sweep(add) -> None:
  """Model width and heads together (zipped), each at two learning rates (4 runs):
  python -m experiments.sweep --config=configs/bert.py:tiny-mlm --workdir=runs/bert_width
  """
  from tx_jax.sweep import cross, product, zipped  # pylint: disable=g-import-not-at-top

  heads = [2, 4]
  widths = zipped(
      {"model.d_model": [64, 128], "model.num_heads": heads, "model.num_kv_heads": heads}
  )
  for overrides in cross(widths, product({"optimizer.learning_rate": [5e-4, 1e-3]})):
    add(overrides)
