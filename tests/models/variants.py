"""Tiny model variants covering every family and position scheme, shared by model tests."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tx_jax.models import ModelConfig, build

_SHAPE = dict(
    vocab_size=53,
    d_model=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=4,
    head_dim=8,
    mlp_dim=64,
    max_len=64,
)

VARIANTS = {
    "gpt2": ModelConfig(  # q, k, v from one kernel, as configs/gpt.py builds GPT-2
        family="decoder", mlp_activation="gelu_tanh", positions="learned", fused_qkv=True, **_SHAPE
    ),
    "llama": ModelConfig(  # query alone, key and value from one kernel, as configs/gpt.py
        family="decoder",
        fused_qkv=True,
        **{**_SHAPE, "num_kv_heads": 2},
        positions="rope",
        norm="rmsnorm",
        norm_bias=False,
        gated_mlp=True,
        mlp_activation="silu",
        tie_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    ),
    "alibi": ModelConfig(family="decoder", positions="alibi", **_SHAPE),
    "t5_decoder_only": ModelConfig(
        family="decoder", positions="relative", norm="rmsnorm", scale_attention=False, **_SHAPE
    ),
    "bert": ModelConfig(
        family="encoder",
        positions="learned",
        pre_norm=False,
        embed_norm=True,
        type_vocab_size=2,
        pooler=True,
        head="mlm",
        **_SHAPE,
    ),
    "transformer": ModelConfig(
        family="encdec",
        num_decoder_layers=2,
        positions="sinusoidal",
        pre_norm=False,
        embed_scale=True,
        mlp_activation="relu",
        attention_bias=False,
        init="xavier_uniform",
        **_SHAPE,
    ),
    "t5": ModelConfig(
        family="encdec",
        num_decoder_layers=3,
        positions="relative",
        norm="rmsnorm",
        norm_bias=False,
        scale_attention=False,
        gated_mlp=True,
        mlp_activation="gelu_tanh",
        tie_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        **{**_SHAPE, "head_dim": 12},
    ),
    "t5_v1_0": ModelConfig(
        family="encdec",
        num_decoder_layers=2,
        positions="relative",
        norm="rmsnorm",
        norm_bias=False,
        scale_attention=False,
        mlp_activation="relu",
        tied_output_rescale=True,
        attention_bias=False,
        mlp_bias=False,
        **_SHAPE,
    ),
}

DECODERS = [k for k, v in VARIANTS.items() if v.family == "decoder"]
ENCDECS = [k for k, v in VARIANTS.items() if v.family == "encdec"]


# Shared by the model-property and KV-cache tests: one init per variant per session.
B, T = 2, 10


@functools.lru_cache(maxsize=None)
def model_and_params(name):
  config = VARIANTS[name]
  module = build(config)
  ids = jnp.ones((1, 4), jnp.int32)
  args = (ids, ids) if config.family == "encdec" else (ids,)
  params = module.init(jax.random.PRNGKey(0), *args)["params"]
  return module, nn.unbox(params), params


def tokens(seed, shape=(B, T), low=4):
  return jnp.asarray(np.random.default_rng(seed).integers(low, 53, shape), jnp.int32)


def forward(name, *args, **kwargs):
  module, params, _ = model_and_params(name)
  return np.asarray(jax.jit(functools.partial(module.apply, **kwargs))({"params": params}, *args))
