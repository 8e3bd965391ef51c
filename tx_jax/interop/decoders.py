"""GPT2LMHeadModel and LlamaForCausalLM <-> the tx_jax decoder."""

from __future__ import annotations

from typing import Any

from tx_jax.interop import rules as R
from tx_jax.interop.architecture import Architecture, Weights, output_tied
from tx_jax.interop.rules import HFConfig
from tx_jax.models.config import ModelConfig

# ---------------------------------------------------------------------------- GPT-2

_GPT2 = "transformer."


def _gpt2_read(hf: HFConfig, weights: Weights) -> dict[str, Any]:
  d_model, heads = hf.get("n_embd", 768), hf.get("n_head", 12)
  hf.require("scale_attn_by_inverse_layer_idx", (False,), False)
  hf.require("add_cross_attention", (False,), False)
  # Upcasting the attention softmax changes nothing here: tx_jax's is float32 already.
  hf.get("reorder_and_upcast_attn")
  return dict(
      family="decoder",
      vocab_size=hf.get("vocab_size", 50257),
      d_model=d_model,
      num_layers=hf.get("n_layer", 12),
      num_heads=heads,
      num_kv_heads=heads,
      head_dim=R.divide(d_model, heads, "GPT2 n_embd / n_head"),
      mlp_dim=hf.get("n_inner", 4 * d_model),
      mlp_activation=hf.activation("activation_function", "gelu_new"),
      gated_mlp=False,
      norm="layernorm",
      norm_eps=hf.get("layer_norm_epsilon", 1e-5),
      norm_bias=True,
      pre_norm=True,
      positions="learned",
      max_len=hf.get("n_positions", 1024),
      embed_scale=False,
      tie_embeddings=output_tied(hf, weights, "lm_head.weight", _GPT2 + "wte.weight", True),
      tied_output_rescale=False,
      attention_bias=True,
      mlp_bias=True,
      scale_attention=hf.require("scale_attn_weights", (True, False), True),
      dropout_rate=hf.same(("resid_pdrop", "embd_pdrop"), 0.1),
      attention_dropout_rate=hf.get("attn_pdrop", 0.1),
      mlp_inner_dropout_rate=0.0,
      init="normal",
      init_std=hf.get("initializer_range", 0.02),
      fused_qkv=True,  # c_attn is one [D, 3*N*H] weight: configs/gpt.py's layout too
  )


def _gpt2_write(c: ModelConfig) -> dict[str, Any]:
  return dict(
      vocab_size=c.vocab_size,
      n_embd=c.d_model,
      n_layer=c.num_layers,
      n_head=c.num_heads,
      n_inner=None if c.mlp_dim == 4 * c.d_model else c.mlp_dim,
      activation_function=R.activation_to_hf(c.mlp_activation, "GPT-2"),
      layer_norm_epsilon=c.norm_eps,
      n_positions=c.max_len,
      tie_word_embeddings=c.tie_embeddings,
      scale_attn_weights=c.scale_attention,
      resid_pdrop=c.dropout_rate,
      embd_pdrop=c.dropout_rate,
      attn_pdrop=c.attention_dropout_rate,
      initializer_range=c.init_std,
      scale_attn_by_inverse_layer_idx=False,
      reorder_and_upcast_attn=False,
      add_cross_attention=False,
      # GPT-2's <|endoftext|> is id 50256; a smaller vocabulary has none to name.
      bos_token_id=50256 if c.vocab_size > 50256 else None,
      eos_token_id=50256 if c.vocab_size > 50256 else None,
  )


def _gpt2_rules(c: ModelConfig) -> list[R.Rule]:
  n, h = c.num_heads, c.head_dim
  rules = [
      R.copy(_GPT2 + "wte.weight", "token_embed/embedding"),
      R.copy(_GPT2 + "wpe.weight", "position_embed/embedding"),
      R.copy(_GPT2 + "ln_f.weight", "final_norm/scale"),
      R.copy(_GPT2 + "ln_f.bias", "final_norm/bias"),
  ]
  for i in range(c.num_layers):
    hf, ours = f"{_GPT2}h.{i}.", f"stack/layer_{i}/"
    att = ours + "self_attention/"
    qkv = tuple(f"{att}{name}/" for name in ("query", "key", "value"))
    rules += [
        R.copy(hf + "ln_1.weight", ours + "self_attention_norm/scale"),
        R.copy(hf + "ln_1.bias", ours + "self_attention_norm/bias"),
        R.conv_fused_qkv(hf + "attn.c_attn.weight", tuple(p + "kernel" for p in qkv), n, h),
        R.conv_fused_qkv_bias(hf + "attn.c_attn.bias", tuple(p + "bias" for p in qkv), n, h),
        R.conv_heads_out(hf + "attn.c_proj.weight", att + "out/kernel", n, h),
        R.copy(hf + "attn.c_proj.bias", att + "out/bias"),
        R.copy(hf + "ln_2.weight", ours + "mlp_norm/scale"),
        R.copy(hf + "ln_2.bias", ours + "mlp_norm/bias"),
        R.copy(hf + "mlp.c_fc.weight", ours + "mlp/wi/kernel"),
        R.copy(hf + "mlp.c_fc.bias", ours + "mlp/wi/bias"),
        R.copy(hf + "mlp.c_proj.weight", ours + "mlp/wo/kernel"),
        R.copy(hf + "mlp.c_proj.bias", ours + "mlp/wo/bias"),
    ]
  if not c.tie_embeddings:
    rules.append(R.linear("lm_head.weight", "lm_head/kernel"))
  return rules


GPT2 = Architecture(
    name="GPT2LMHeadModel",
    model_type="gpt2",
    read_config=_gpt2_read,
    write_config=_gpt2_write,
    rules=_gpt2_rules,
    tied_copies=lambda c: {"lm_head.weight": _GPT2 + "wte.weight"} if c.tie_embeddings else {},
    # Old checkpoints store the causal-mask buffers.
    ignored=(r"\.attn\.(masked_)?bias$",),
    base_prefix=_GPT2,
)

# ---------------------------------------------------------------------------- LLaMA

_LLAMA = "model."
_ROPE_KEYS = {"rope_type", "type", "rope_theta"}


def _rope_theta(hf: HFConfig) -> float:
  """RoPE's base from `rope_parameters` (transformers 5) or `rope_theta` (older configs).

  Scaled variants (linear, dynamic, yarn, llama3, ...) are not implemented: an error.
  """
  theta = hf.get("rope_theta", 10000.0)
  for key in ("rope_parameters", "rope_scaling"):
    params = hf.get(key, {})
    kind = params.get("rope_type", params.get("type", "default"))
    extra = sorted(set(params) - _ROPE_KEYS)
    if kind != "default" or extra:
      raise hf.error(
          f"{key}={params} asks for RoPE scaling that tx_jax does not "
          "implement; only plain RoPE (rope_type 'default', rope_theta) is"
      )
    theta = params.get("rope_theta", theta)
  return float(theta)


def _llama_read(hf: HFConfig, weights: Weights) -> dict[str, Any]:
  d_model, heads = hf.get("hidden_size", 4096), hf.get("num_attention_heads", 32)
  # Tensor-parallel pretraining splits the same matmuls; the model is unchanged.
  hf.get("pretraining_tp")
  return dict(
      family="decoder",
      vocab_size=hf.get("vocab_size", 32000),
      d_model=d_model,
      num_layers=hf.get("num_hidden_layers", 32),
      num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads", heads),
      head_dim=hf.get("head_dim", R.divide(d_model, heads, "LLaMA hidden_size / heads")),
      mlp_dim=hf.get("intermediate_size", 11008),
      mlp_activation=hf.activation("hidden_act", "silu"),
      gated_mlp=True,
      norm="rmsnorm",
      norm_eps=hf.get("rms_norm_eps", 1e-6),
      norm_bias=False,
      pre_norm=True,
      positions="rope",
      rope_theta=_rope_theta(hf),
      max_len=hf.get("max_position_embeddings", 2048),
      embed_scale=False,
      tie_embeddings=output_tied(
          hf, weights, "lm_head.weight", _LLAMA + "embed_tokens.weight", False
      ),
      tied_output_rescale=False,
      attention_bias=hf.require("attention_bias", (False, True), False),
      mlp_bias=hf.require("mlp_bias", (False, True), False),
      scale_attention=True,
      dropout_rate=0.0,
      attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
      mlp_inner_dropout_rate=0.0,
      init="normal",
      init_std=hf.get("initializer_range", 0.02),
  )


def _llama_write(c: ModelConfig) -> dict[str, Any]:
  return dict(
      vocab_size=c.vocab_size,
      hidden_size=c.d_model,
      num_hidden_layers=c.num_layers,
      num_attention_heads=c.num_heads,
      num_key_value_heads=c.num_kv_heads,
      head_dim=c.head_dim,
      intermediate_size=c.mlp_dim,
      hidden_act=R.activation_to_hf(c.mlp_activation, "LLaMA"),
      rms_norm_eps=c.norm_eps,
      rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
      max_position_embeddings=c.max_len,
      tie_word_embeddings=c.tie_embeddings,
      attention_bias=c.attention_bias,
      mlp_bias=c.mlp_bias,
      attention_dropout=c.attention_dropout_rate,
      initializer_range=c.init_std,
      pretraining_tp=1,
  )


def _llama_rules(c: ModelConfig) -> list[R.Rule]:
  n, k, h = c.num_heads, c.num_kv_heads, c.head_dim
  rules = [
      R.copy(_LLAMA + "embed_tokens.weight", "token_embed/embedding"),
      R.copy(_LLAMA + "norm.weight", "final_norm/scale"),
  ]
  for i in range(c.num_layers):
    hf, ours = f"{_LLAMA}layers.{i}.", f"stack/layer_{i}/"
    att, mlp = hf + "self_attn.", ours + "mlp/"
    rules += [
        R.copy(hf + "input_layernorm.weight", ours + "self_attention_norm/scale"),
        R.copy(hf + "post_attention_layernorm.weight", ours + "mlp_norm/scale"),
        R.heads_in(att + "q_proj.weight", ours + "self_attention/query/kernel", n, h),
        R.heads_in(att + "k_proj.weight", ours + "self_attention/key/kernel", k, h),
        R.heads_in(att + "v_proj.weight", ours + "self_attention/value/kernel", k, h),
        R.heads_out(att + "o_proj.weight", ours + "self_attention/out/kernel", n, h),
        R.linear(hf + "mlp.gate_proj.weight", mlp + "wi_0/kernel"),
        R.linear(hf + "mlp.up_proj.weight", mlp + "wi_1/kernel"),
        R.linear(hf + "mlp.down_proj.weight", mlp + "wo/kernel"),
    ]
    if c.attention_bias:
      rules += [
          R.heads_bias(att + "q_proj.bias", ours + "self_attention/query/bias", n, h),
          R.heads_bias(att + "k_proj.bias", ours + "self_attention/key/bias", k, h),
          R.heads_bias(att + "v_proj.bias", ours + "self_attention/value/bias", k, h),
          R.copy(att + "o_proj.bias", ours + "self_attention/out/bias"),
      ]
    if c.mlp_bias:
      rules += [
          R.copy(hf + f"mlp.{hf_name}.bias", f"{mlp}{name}/bias")
          for hf_name, name in (("gate_proj", "wi_0"), ("up_proj", "wi_1"), ("down_proj", "wo"))
      ]
  if not c.tie_embeddings:
    rules.append(R.linear("lm_head.weight", "lm_head/kernel"))
  return rules


LLAMA = Architecture(
    name="LlamaForCausalLM",
    model_type="llama",
    read_config=_llama_read,
    write_config=_llama_write,
    rules=_llama_rules,
    tied_copies=lambda c: (
        {"lm_head.weight": _LLAMA + "embed_tokens.weight"} if c.tie_embeddings else {}
    ),
    # Old checkpoints store RoPE's inverse frequencies.
    ignored=(r"rotary_emb\.inv_freq$",),
    base_prefix=_LLAMA,
)
