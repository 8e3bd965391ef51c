"""BERT presets (Devlin et al. 2019): post-LN encoder, learned positions, token types.

Usage: --config=configs/bert.py:base (large, tiny). Presets carry the MLM head; the
`params:` figure of the dry run counts the encoder + pooler, as HF's BertModel does.
"""

import ml_collections

from configs import common


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
    return config


def tiny() -> ml_collections.ConfigDict:
    """A byte-level BERT that trains on 2 CPU cores in minutes."""
    config = _bert(d_model=128, num_layers=4, num_heads=4)
    config.model.vocab_size = 360  # byte tokenizer: 4 specials + 256 bytes + 100 sentinels
    config.model.max_len = 256
    config.model.dropout_rate = config.model.attention_dropout_rate = 0.0
    return config


PRESETS = {
    "base": lambda: _bert(768, 12, 12),
    "large": lambda: _bert(1024, 24, 16),
    "tiny": tiny,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return common.get_preset(PRESETS, arg, "tiny", "bert.py")()
