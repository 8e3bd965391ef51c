"""T5ForConditionalGeneration (v1.0 and v1.1) <-> the tx_jax encoder-decoder."""

from __future__ import annotations

from typing import Any

from tx_jax.interop import rules as R
from tx_jax.interop.architecture import Architecture, Weights, equal
from tx_jax.interop.rules import HFConfig
from tx_jax.models.config import ModelConfig


def _mlp_from_proj(hf: HFConfig) -> tuple[str, bool]:
  """feed_forward_proj ("relu", "gated-gelu", "gated-silu", ...) -> (activation, gated)."""
  proj = hf.get("feed_forward_proj", "relu")
  parts = proj.split("-")
  gated = len(parts) == 2 and parts[0] == "gated"
  if len(parts) > 2 or (len(parts) == 2 and not gated):
    raise hf.error(f"feed_forward_proj={proj!r} is not 'ACT' or 'gated-ACT'")
  # transformers reads "gated-gelu" as gelu_new (tanh), for backward compatibility.
  name = "gelu_new" if proj == "gated-gelu" else parts[-1]
  if name not in R.ACTIVATIONS_FROM_HF:
    raise hf.error(
        f"feed_forward_proj={proj!r}: activation {name!r} is not implemented; "
        f"accepted: {sorted(R.ACTIVATIONS_FROM_HF)}"
    )
  hf.get("dense_act_fn")  # both derived from feed_forward_proj by transformers
  hf.get("is_gated_act")
  return R.ACTIVATIONS_FROM_HF[name], gated


def _read(hf: HFConfig, weights: Weights) -> dict[str, Any]:
  d_model, heads = hf.get("d_model", 512), hf.get("num_heads", 8)
  hf.require("is_decoder", (False,), False)
  hf.require("is_encoder_decoder", (True,), True)
  hf.get("classifier_dropout")  # T5's classification head, not this architecture's
  activation, gated = _mlp_from_proj(hf)
  # transformers 5 ties the head unless the checkpoint holds a different one, and scales
  # the decoder output by d_model^-0.5 per `scale_decoder_outputs` (older configs: when
  # tie_word_embeddings is not false).
  tie_flag = hf.get("tie_word_embeddings", True) is not False
  if weights is None:
    tied = tie_flag
  else:
    tied = "lm_head.weight" not in weights or equal(weights, "lm_head.weight", "shared.weight")
  scale = hf.get("scale_decoder_outputs", tie_flag)
  if scale and not tied:
    raise hf.error(
        "scale_decoder_outputs with an untied lm_head is not implemented: "
        "tx_jax rescales only tied outputs (T5 v1.0)"
    )
  dropout = hf.get("dropout_rate", 0.1)
  num_layers = hf.get("num_layers", 6)
  return dict(
      family="encdec",
      vocab_size=hf.get("vocab_size", 32128),
      d_model=d_model,
      num_layers=num_layers,
      num_decoder_layers=hf.get("num_decoder_layers", num_layers),
      num_heads=heads,
      num_kv_heads=heads,
      head_dim=hf.get("d_kv", 64),
      mlp_dim=hf.get("d_ff", 2048),
      mlp_activation=activation,
      gated_mlp=gated,
      norm="rmsnorm",
      norm_eps=hf.get("layer_norm_epsilon", 1e-6),
      norm_bias=False,
      pre_norm=True,
      embed_norm=False,
      positions="relative",
      relative_buckets=hf.get("relative_attention_num_buckets", 32),
      relative_max_distance=hf.get("relative_attention_max_distance", 128),
      max_len=hf.get("n_positions", 512),
      embed_scale=False,
      tie_embeddings=tied,
      tied_output_rescale=bool(scale),
      attention_bias=False,
      mlp_bias=False,
      scale_attention=False,
      dropout_rate=dropout,
      attention_dropout_rate=dropout,
      mlp_inner_dropout_rate=dropout,
      init="normal",
      init_std=hf.get("initializer_factor", 1.0) / d_model**0.5,
  )


def _write(c: ModelConfig) -> dict[str, Any]:
  act = R.activation_to_hf(c.mlp_activation, "T5")
  if c.gated_mlp and c.mlp_activation == "gelu":
    raise R.ConversionError(
        "config.model.mlp_activation='gelu' (exact) with gated_mlp has "
        "no T5 spelling: 'gated-gelu' means the tanh form (gelu_tanh)"
    )
  proj = (
      ("gated-gelu" if c.mlp_activation == "gelu_tanh" else f"gated-{act}") if c.gated_mlp else act
  )
  return dict(
      vocab_size=c.vocab_size,
      d_model=c.d_model,
      d_kv=c.head_dim,
      d_ff=c.mlp_dim,
      num_layers=c.num_layers,
      num_decoder_layers=c.num_decoder_layers,
      num_heads=c.num_heads,
      relative_attention_num_buckets=c.relative_buckets,
      relative_attention_max_distance=c.relative_max_distance,
      dropout_rate=c.dropout_rate,
      layer_norm_epsilon=c.norm_eps,
      feed_forward_proj=proj,
      tie_word_embeddings=c.tie_embeddings,
      scale_decoder_outputs=c.tie_embeddings and c.tied_output_rescale,
      initializer_factor=round(c.init_std * c.d_model**0.5, 12),
      is_encoder_decoder=True,
      decoder_start_token_id=0,
  )


def _attention(hf: str, ours: str, c: ModelConfig) -> list[R.Rule]:
  n, h = c.num_heads, c.head_dim
  return [
      R.heads_in(hf + "q.weight", ours + "query/kernel", n, h),
      R.heads_in(hf + "k.weight", ours + "key/kernel", n, h),
      R.heads_in(hf + "v.weight", ours + "value/kernel", n, h),
      R.heads_out(hf + "o.weight", ours + "out/kernel", n, h),
  ]


def _mlp(hf: str, ours: str, c: ModelConfig) -> list[R.Rule]:
  inner = ("wi_0", "wi_1") if c.gated_mlp else ("wi",)
  return [
      R.linear(f"{hf}DenseReluDense.{name}.weight", f"{ours}mlp/{name}/kernel")
      for name in inner + ("wo",)
  ] + [R.copy(hf + "layer_norm.weight", ours + "mlp_norm/scale")]


def _rules(c: ModelConfig) -> list[R.Rule]:
  rules = [
      R.copy("shared.weight", "shared_embed/embedding"),
      R.copy("encoder.final_layer_norm.weight", "encoder_final_norm/scale"),
      R.copy("decoder.final_layer_norm.weight", "decoder_final_norm/scale"),
  ]
  for stack in ("encoder", "decoder"):
    rules.append(
        R.copy(
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias" ".weight",
            f"{stack}_relative_bias/rel_embedding",
        )
    )
    layers = c.num_layers if stack == "encoder" else c.num_decoder_layers
    for i in range(layers):
      hf, ours = f"{stack}.block.{i}.layer.", f"{stack}/layer_{i}/"
      rules += _attention(hf + "0.SelfAttention.", ours + "self_attention/", c)
      rules.append(R.copy(hf + "0.layer_norm.weight", ours + "self_attention_norm/scale"))
      if stack == "decoder":
        rules += _attention(hf + "1.EncDecAttention.", ours + "cross_attention/", c)
        rules.append(R.copy(hf + "1.layer_norm.weight", ours + "cross_attention_norm/scale"))
      rules += _mlp(hf + ("2." if stack == "decoder" else "1."), ours, c)
  if not c.tie_embeddings:
    rules.append(R.linear("lm_head.weight", "lm_head/kernel"))
  return rules


def _tied_copies(c: ModelConfig) -> dict[str, str]:
  copies = {
      "encoder.embed_tokens.weight": "shared.weight",
      "decoder.embed_tokens.weight": "shared.weight",
  }
  if c.tie_embeddings:
    copies["lm_head.weight"] = "shared.weight"
  return copies


T5 = Architecture(
    name="T5ForConditionalGeneration",
    model_type="t5",
    read_config=_read,
    write_config=_write,
    rules=_rules,
    tied_copies=_tied_copies,
)
