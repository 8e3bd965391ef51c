"""The original Transformer (Vaswani et al. 2017): post-LN encoder-decoder, sinusoidal
positions, ReLU, source/target/pre-softmax embeddings shared and scaled by sqrt(d_model).

Usage: --config=configs/transformer.py (the default experiment), :base, :big, :tiny.
`base` is Table 3's base model with a shared 37,000-token vocabulary.
"""

import ml_collections

from configs import common


def _transformer(d_model: int, num_heads: int, mlp_dim: int, dropout: float,
                 num_layers: int = 6) -> ml_collections.ConfigDict:
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
    return config


def tiny() -> ml_collections.ConfigDict:
    """A byte-level Transformer small enough for 2 CPU cores."""
    config = _transformer(d_model=128, num_heads=4, mlp_dim=512, dropout=0.0, num_layers=2)
    config.model.vocab_size = 360  # byte tokenizer: 4 specials + 256 bytes + 100 sentinels
    return config


PRESETS = {
    "base": lambda: _transformer(512, 8, 2048, dropout=0.1),
    "big": lambda: _transformer(1024, 16, 4096, dropout=0.3),
    "tiny": tiny,
    "default": tiny,  # the default experiment: tiny on the synthetic translation task
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return common.get_preset(PRESETS, arg, "default", "transformer.py")()
