"""T5 presets (Raffel et al. 2020): v1.0 (ReLU, tied, d_model^-0.5 rescale) and v1.1
(gated GELU, untied). Pre-RMSNorm without bias, relative position bias, no absolute
positions, unscaled attention logits. Usage: --config=configs/t5.py:t5-small.
"""

import ml_collections

from configs import common


def _t5(d_model: int, num_layers: int, num_heads: int, mlp_dim: int,
        v1_1: bool) -> ml_collections.ConfigDict:
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
        m.dropout_rate = m.mlp_inner_dropout_rate = 0.1
    m.init_std = 1.0 / d_model ** 0.5
    return config


def tiny() -> ml_collections.ConfigDict:
    """A byte-level T5 v1.1-style model that trains on 2 CPU cores in minutes."""
    config = _t5(d_model=128, num_layers=2, num_heads=4, mlp_dim=256, v1_1=True)
    config.model.vocab_size = 360  # byte tokenizer: 4 specials + 256 bytes + 100 sentinels
    config.model.head_dim = 32
    return config


PRESETS = {
    "t5-small": lambda: _t5(512, 6, 8, 2048, v1_1=False),
    "t5-base": lambda: _t5(768, 12, 12, 3072, v1_1=False),
    "t5-large": lambda: _t5(1024, 24, 16, 4096, v1_1=False),
    "t5.1.1-small": lambda: _t5(512, 8, 6, 1024, v1_1=True),
    "t5.1.1-base": lambda: _t5(768, 12, 12, 2048, v1_1=True),
    "tiny": tiny,
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return common.get_preset(PRESETS, arg, "tiny", "t5.py")()
