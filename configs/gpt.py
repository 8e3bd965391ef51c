"""GPT-2 and LLaMA-style decoder-only presets.

Usage: --config=configs/gpt.py:gpt2-small (gpt2-medium, gpt2-large, gpt2-xl, llama-1b,
llama-tiny, tiny). GPT-2 shapes follow Radford et al. 2019 / HF `gpt2*`; llama-1b is the
TinyLlama-1.1B shape (LLaMA-2 architecture, GQA with 4 KV heads).

Every preset is a causal LM (data.task="lm"). As shipped they read the synthetic strings
(offline, byte-level), so each trains out of the box; tiny-shakespeare reads Tiny
Shakespeare from $TX_JAX_DATA_DIR/tinyshakespeare/input.txt. For real pre-training point
config.data at a corpus (data.source="tfds" / "text_files") and a matching tokenizer.
"""

import ml_collections

try:  # imported as tx_jax.configs (installed) or configs (a checkout)
  from . import common, train_defaults
except ImportError:  # loaded by path, as --config=configs/<file>.py:<preset> does
  from configs import common, train_defaults

CPU_DEVICES = 2  # the CPU presets' config.mesh.cpu_devices, measured on 2 cores


def _gpt2(d_model: int, num_layers: int, num_heads: int) -> ml_collections.ConfigDict:
  config = common.base_config()
  m = config.model
  m.family = "decoder"
  m.vocab_size = 50257
  m.d_model, m.num_layers, m.num_heads = d_model, num_layers, num_heads
  m.num_kv_heads, m.head_dim, m.mlp_dim = num_heads, d_model // num_heads, 4 * d_model
  m.mlp_activation = "gelu_tanh"
  m.norm, m.norm_eps, m.pre_norm = "layernorm", 1e-5, True
  m.positions, m.max_len = "learned", 1024
  m.tie_embeddings = True
  m.attention_bias = m.mlp_bias = True
  m.fused_qkv = True  # as GPT-2's c_attn: one projection instead of three
  m.dropout_rate = m.attention_dropout_rate = 0.1
  m.init_std = 0.02
  _decoder_training(config)
  _lm_data(config)
  return config


def _lm_data(config: ml_collections.ConfigDict) -> None:
  """A decoder learns next-token prediction: the LM task, at the published context length."""
  config.data.task = "lm"
  config.data.seq_len = config.model.max_len


def _llama(
    vocab_size: int,
    d_model: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    mlp_dim: int,
    max_len: int,
    tie: bool,
) -> ml_collections.ConfigDict:
  config = common.base_config()
  m = config.model
  m.family = "decoder"
  m.vocab_size, m.d_model, m.num_layers = vocab_size, d_model, num_layers
  m.num_heads, m.num_kv_heads, m.head_dim = num_heads, num_kv_heads, d_model // num_heads
  m.mlp_dim, m.mlp_activation, m.gated_mlp = mlp_dim, "silu", True
  m.norm, m.norm_eps, m.norm_bias, m.pre_norm = "rmsnorm", 1e-5, False, True
  m.positions, m.rope_theta, m.max_len = "rope", 10000.0, max_len
  m.tie_embeddings = tie
  m.attention_bias = m.mlp_bias = False
  m.fused_qkv = True  # q alone, k and v from one [D, 2, K, H] kernel: one projection fewer
  m.dropout_rate = m.attention_dropout_rate = 0.0
  _decoder_training(config)
  _lm_data(config)
  return config


# --- training setups (owned by the trainer; see configs/train_defaults.py) ---
def _decoder_training(config: ml_collections.ConfigDict) -> None:
  """AdamW(0.9, 0.95), wd 0.1 on matrices only, warm-up 2000 then cosine to 10%, clip 1.0:
  the GPT-2/3 recipe as nanoGPT reproduces it, and LLaMA's (Touvron et al. 2023, 2.2)."""
  o, s = config.optimizer, config.schedule
  o.name, o.learning_rate, o.b1, o.b2, o.eps = "adamw", 6e-4, 0.9, 0.95, 1e-8
  o.weight_decay, o.grad_clip_norm = 0.1, 1.0
  o.no_decay = ("bias", "scale", "embedding")
  s.name, s.warmup_steps, s.end_factor = "warmup_cosine", 2000, 0.1
  config.train.steps = 600_000


def _cpu_lm_training(config: ml_collections.ConfigDict) -> None:
  """The GPT-2 recipe scaled to minutes on 2 CPU cores."""
  o, s, t = config.optimizer, config.schedule, config.train
  o.learning_rate, o.b2 = 2e-3, 0.99
  s.warmup_steps = 50
  t.steps, t.log_every, t.eval_every, t.eval_batches = 600, 50, 200, 16
  config.data.seq_len, config.data.global_batch_size = 128, 16
  config.data.eval_global_batch_size = 32
  config.checkpoint.every = 500


def tiny_shakespeare() -> ml_collections.ConfigDict:
  """tiny with 2 layers on Tiny Shakespeare, byte-level; eval_bits_per_byte on validation."""
  config = tiny()
  train_defaults.tiny_shakespeare(config, task="lm")
  _cpu_lm_training(config)
  # Tuned to reach <= 1.80 nats/byte within 3 minutes on a slow 2-core VM: rows of 64 bytes
  # in batches of 32, and two layers instead of tiny's four, which learn as much per step at
  # half the cost (the search is in docs/performance.md, "What was tried").
  config.model.num_layers = 2
  config.optimizer.learning_rate = 6e-3
  config.data.seq_len, config.data.global_batch_size = 64, 32
  config.train.steps, config.train.eval_every = 1000, 250
  # Rows shuffled over the whole corpus (~16k rows of 64 bytes) instead of windows of one
  # play, so the validation loss no longer rises and falls with the play being read.
  config.data.lm_shuffle_window = 16384
  # Two CPU devices, data parallel: one device's op fills the core the other leaves idle
  # (sharding.use_cpu_devices).
  config.mesh.cpu_devices = CPU_DEVICES
  return config


def lora_shakespeare() -> ml_collections.ConfigDict:
  """LoRA fine-tuning of a converted GPT-2-style model on Tiny Shakespeare (README's recipe).

  Give it to `experiments.convert --from_hf DIR --config=...`: the model, tokenizer and ids come
  from DIR, this preset adds model.lora (rank 8 on every projection of the blocks: GPT-2's
  c_attn, c_proj and c_fc) and the data and training sections.
  """
  config = tiny_shakespeare()
  targets = ("qkv", "output", "mlp_up", "mlp_down")
  config.model.lora.update(rank=8, alpha=16.0, dropout=0.05, targets=targets)
  config.optimizer.learning_rate, config.optimizer.weight_decay = 5e-3, 0.0
  config.schedule.warmup_steps = 20
  config.train.steps, config.train.eval_every, config.train.log_every = 300, 100, 50
  config.train.eval_batches = 20
  config.checkpoint.every = 100
  return config


def tiny() -> ml_collections.ConfigDict:
  """A GPT-2-style byte-level model that trains on 2 CPU cores in minutes."""
  config = _gpt2(d_model=128, num_layers=4, num_heads=4)
  config.model.vocab_size = 360  # byte tokenizer: 4 specials + 256 bytes + 100 sentinels
  config.model.max_len = 256
  config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
  _cpu_lm_training(config)
  return config


def llama_tiny() -> ml_collections.ConfigDict:
  """LLaMA-style (RoPE, RMSNorm, SwiGLU, GQA 4:2, untied) at test scale, CPU-sized training."""
  config = _llama(
      vocab_size=360,
      d_model=128,
      num_layers=4,
      num_heads=4,
      num_kv_heads=2,
      mlp_dim=352,
      max_len=256,
      tie=False,
  )
  _cpu_lm_training(config)
  return config


PRESETS = {
    "gpt2-small": lambda: _gpt2(768, 12, 12),
    "gpt2-medium": lambda: _gpt2(1024, 24, 16),
    "gpt2-large": lambda: _gpt2(1280, 36, 20),
    "gpt2-xl": lambda: _gpt2(1600, 48, 25),
    "llama-1b": lambda: _llama(
        vocab_size=32000,
        d_model=2048,
        num_layers=22,
        num_heads=32,
        num_kv_heads=4,
        mlp_dim=5632,
        max_len=2048,
        tie=False,
    ),
    "llama-tiny": llama_tiny,
    "tiny": tiny,
    "tiny-shakespeare": tiny_shakespeare,
    "lora-shakespeare": lora_shakespeare,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  return common.get_preset(PRESETS, arg, "tiny", "gpt.py")()


def sweep(add) -> None:
  """Peak learning rate x seed (4 runs), e.g. for tiny-shakespeare:
  python -m experiments.sweep --config=configs/gpt.py:tiny-shakespeare --workdir=runs/gpt_lr
  """
  from tx_jax.sweep import product  # pylint: disable=g-import-not-at-top

  for overrides in product({"optimizer.learning_rate": [1e-3, 3e-3], "seed": [0, 1]}):
    add(overrides)
