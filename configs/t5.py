"""T5 presets (Raffel et al. 2020): v1.0 (ReLU, tied, d_model^-0.5 rescale) and v1.1
(gated GELU, untied). Pre-RMSNorm without bias, relative position bias, no absolute
positions, unscaled attention logits. Usage: --config=configs/t5.py:t5-small.

Every preset pre-trains with span corruption (data.task="span_corruption"); as shipped on
the offline synthetic strings, tiny-span on Tiny Shakespeare from $TX_JAX_DATA_DIR. A
fine-tune on pairs sets data.task="seq2seq" and a source with columns.
"""

import ml_collections

try:  # imported as tx_jax.configs (installed) or configs (a checkout)
  from . import common, train_defaults
except ImportError:  # loaded by path, as --config=configs/<file>.py:<preset> does
  from configs import common, train_defaults


def _t5(
    d_model: int, num_layers: int, num_heads: int, mlp_dim: int, v1_1: bool
) -> ml_collections.ConfigDict:
  config = common.base_config()
  m = config.model
  m.family = "encdec"
  m.vocab_size = 32128
  m.d_model, m.num_layers, m.num_decoder_layers = d_model, num_layers, num_layers
  m.num_heads = m.num_kv_heads = num_heads
  m.head_dim, m.mlp_dim = 64, mlp_dim
  m.norm, m.norm_eps, m.norm_bias, m.pre_norm = "rmsnorm", 1e-6, False, True
  m.positions, m.relative_buckets, m.relative_max_distance = "relative", 32, 128
  m.attention_bias = m.mlp_bias = False
  m.scale_attention = False
  if v1_1:
    m.mlp_activation, m.gated_mlp = "gelu_tanh", True
    m.tie_embeddings, m.tied_output_rescale = False, False
    m.dropout_rate = m.mlp_inner_dropout_rate = 0.0  # v1.1 pre-trains without dropout
  else:
    m.mlp_activation, m.gated_mlp = "relu", False
    m.tie_embeddings, m.tied_output_rescale = True, True
    m.dropout_rate = m.mlp_inner_dropout_rate = m.attention_dropout_rate = 0.1
  m.init_std = 1.0 / d_model**0.5
  _t5_training(config)
  config.data.task = "span_corruption"  # the paper's pre-training objective
  config.data.source_len, config.data.target_len = 512, 114  # the paper's pre-training lengths
  return config


# --- training setups (owned by the trainer; see configs/train_defaults.py) ---
def _t5_training(config: ml_collections.ConfigDict) -> None:
  """Raffel et al. 3.1.2: Adafactor, lr = 1/sqrt(max(step, 10^4)), no clipping beyond
  Adafactor's own update clipping, no weight decay; 2^19 pre-training steps."""
  o, s = config.optimizer, config.schedule
  o.name, o.learning_rate, o.weight_decay, o.grad_clip_norm = "adafactor", 1.0, 0.0, 0.0
  o.adafactor_decay_rate, o.adafactor_clipping_threshold = 0.8, 1.0
  o.adafactor_factored, o.adafactor_param_scale = True, True
  s.name, s.warmup_steps = "inverse_sqrt", 10_000
  config.train.steps = 2**19


def _cpu_training(config: ml_collections.ConfigDict) -> None:
  """The T5 recipe scaled to minutes on 2 CPU cores: inverse sqrt with a 100-step plateau."""
  s, t = config.schedule, config.train
  s.warmup_steps = 100
  t.steps, t.log_every, t.eval_every, t.eval_batches = 600, 50, 200, 16
  config.data.global_batch_size, config.data.eval_global_batch_size = 16, 32
  config.checkpoint.every = 500


def tiny_span() -> ml_collections.ConfigDict:
  """tiny pre-trained with span corruption (density 0.15, mean span 3) on Tiny Shakespeare."""
  config = tiny()
  train_defaults.tiny_shakespeare(config, task="span_corruption")
  config.data.source_len, config.data.target_len = 128, 32
  return config


def tiny() -> ml_collections.ConfigDict:
  """A byte-level T5 v1.1-style model that trains on 2 CPU cores in minutes."""
  config = _t5(d_model=128, num_layers=2, num_heads=4, mlp_dim=256, v1_1=True)
  config.model.vocab_size = 360  # byte tokenizer: 4 specials + 256 bytes + 100 sentinels
  config.model.head_dim = 32
  config.data.source_len, config.data.target_len = 128, 32  # short texts: little padding
  _cpu_training(config)
  return config


PRESETS = {
    "t5-small": lambda: _t5(512, 6, 8, 2048, v1_1=False),
    "t5-base": lambda: _t5(768, 12, 12, 3072, v1_1=False),
    "t5-large": lambda: _t5(1024, 24, 16, 4096, v1_1=False),
    "t5.1.1-small": lambda: _t5(512, 8, 6, 1024, v1_1=True),
    "t5.1.1-base": lambda: _t5(768, 12, 12, 2048, v1_1=True),
    "tiny": tiny,
    "tiny-span": tiny_span,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return common.get_preset(PRESETS, arg, "tiny", "t5.py")()


def sweep(add) -> None:
  """Adafactor's learning-rate multiplier x seed (4 runs), e.g. for tiny-span:
  python -m experiments.sweep --config=configs/t5.py:tiny-span --workdir=runs/t5_lr
  """
  from tx_jax.sweep import product  # pylint: disable=g-import-not-at-top

  for overrides in product({"optimizer.learning_rate": [0.5, 1.0], "seed": [0, 1]}):
    add(overrides)
