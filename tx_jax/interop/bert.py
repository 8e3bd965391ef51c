"""BertModel, BertForMaskedLM and BertForSequenceClassification <-> the tx_jax encoder."""

from __future__ import annotations

from typing import Any

from tx_jax.interop import rules as R
from tx_jax.interop.architecture import Architecture, Weights, equal
from tx_jax.interop.rules import HFConfig
from tx_jax.models.config import ModelConfig

# The heads' names in HF and the prefix of the trunk's tensors under each of them.
_HEADS = {
    "BertModel": ("none", ""),
    "BertForMaskedLM": ("mlm", "bert."),
    "BertForSequenceClassification": ("classification", "bert."),
}
_MLM_DECODER = "cls.predictions.decoder."


def _read(architecture: str):
  head, prefix = _HEADS[architecture]

  def read(hf: HFConfig, weights: Weights) -> dict[str, Any]:
    d_model, heads = hf.get("hidden_size", 768), hf.get("num_attention_heads", 12)
    hf.require("position_embedding_type", ("absolute",), "absolute")
    hf.require("is_decoder", (False,), False)
    hf.require("add_cross_attention", (False,), False)
    dropout = hf.get("hidden_dropout_prob", 0.1)
    classifier_dropout = hf.get("classifier_dropout", dropout)
    if classifier_dropout != dropout:
      raise hf.error(
          f"classifier_dropout={classifier_dropout} differs from "
          f"hidden_dropout_prob={dropout}; tx_jax uses one dropout rate"
      )
    embedding = prefix + "embeddings.word_embeddings.weight"
    tie = hf.get("tie_word_embeddings", True)  # only the MLM head has an output matrix
    if head == "mlm" and (
        not tie
        or (
            weights is not None
            and _MLM_DECODER + "weight" in weights
            and not equal(weights, _MLM_DECODER + "weight", embedding)
        )
    ):
      raise hf.error(
          "an MLM decoder untied from the word embeddings is not implemented "
          "(tx_jax's MLM head is tied)"
      )
    hf.get("problem_type")  # which loss to train with; the model is the same
    labels = hf.get("num_labels", len(hf.get("id2label", {})) or 2)
    return dict(
        family="encoder",
        vocab_size=hf.get("vocab_size", 30522),
        d_model=d_model,
        num_layers=hf.get("num_hidden_layers", 12),
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=R.divide(d_model, heads, "BERT hidden_size / num_attention_heads"),
        mlp_dim=hf.get("intermediate_size", 3072),
        mlp_activation=hf.activation("hidden_act", "gelu"),
        gated_mlp=False,
        norm="layernorm",
        norm_eps=hf.get("layer_norm_eps", 1e-12),
        norm_bias=True,
        pre_norm=False,
        embed_norm=True,
        positions="learned",
        max_len=hf.get("max_position_embeddings", 512),
        embed_scale=False,
        tie_embeddings=True,
        tied_output_rescale=False,
        attention_bias=True,
        mlp_bias=True,
        scale_attention=True,
        dropout_rate=dropout,
        attention_dropout_rate=hf.get("attention_probs_dropout_prob", 0.1),
        mlp_inner_dropout_rate=0.0,
        type_vocab_size=hf.get("type_vocab_size", 2),
        # BertForMaskedLM has no pooler; a checkpoint that holds one keeps it.
        pooler=head != "mlm"
        if weights is None
        else head == "classification" or prefix + "pooler.dense.weight" in weights,
        head=head,
        num_classes=labels,
        init="normal",
        init_std=hf.get("initializer_range", 0.02),
    )

  return read


def _write(c: ModelConfig) -> dict[str, Any]:
  values = dict(
      vocab_size=c.vocab_size,
      hidden_size=c.d_model,
      num_hidden_layers=c.num_layers,
      num_attention_heads=c.num_heads,
      intermediate_size=c.mlp_dim,
      hidden_act=R.activation_to_hf(c.mlp_activation, "BERT"),
      layer_norm_eps=c.norm_eps,
      max_position_embeddings=c.max_len,
      type_vocab_size=c.type_vocab_size,
      hidden_dropout_prob=c.dropout_rate,
      attention_probs_dropout_prob=c.attention_dropout_rate,
      classifier_dropout=None,
      initializer_range=c.init_std,
      tie_word_embeddings=True,
      is_decoder=False,
      add_cross_attention=False,
  )
  if c.head == "classification":
    values["id2label"] = {str(i): f"LABEL_{i}" for i in range(c.num_classes)}
    values["label2id"] = {f"LABEL_{i}": i for i in range(c.num_classes)}
  return values


def _rules(architecture: str):
  _, prefix = _HEADS[architecture]

  def rules(c: ModelConfig) -> list[R.Rule]:
    n, h = c.num_heads, c.head_dim
    emb = prefix + "embeddings."
    out = [
        R.copy(emb + "word_embeddings.weight", "token_embed/embedding"),
        R.copy(emb + "position_embeddings.weight", "position_embed/embedding"),
        R.copy(emb + "token_type_embeddings.weight", "type_embed/embedding"),
        R.copy(emb + "LayerNorm.weight", "embed_norm/scale"),
        R.copy(emb + "LayerNorm.bias", "embed_norm/bias"),
    ]
    for i in range(c.num_layers):
      hf, ours = f"{prefix}encoder.layer.{i}.", f"stack/layer_{i}/"
      att = ours + "self_attention/"
      for name in ("query", "key", "value"):
        self_att = f"{hf}attention.self.{name}."
        out += [
            R.heads_in(self_att + "weight", f"{att}{name}/kernel", n, h),
            R.heads_bias(self_att + "bias", f"{att}{name}/bias", n, h),
        ]
      out += [
          R.heads_out(hf + "attention.output.dense.weight", att + "out/kernel", n, h),
          R.copy(hf + "attention.output.dense.bias", att + "out/bias"),
          R.copy(hf + "attention.output.LayerNorm.weight", ours + "self_attention_norm/scale"),
          R.copy(hf + "attention.output.LayerNorm.bias", ours + "self_attention_norm/bias"),
          R.linear(hf + "intermediate.dense.weight", ours + "mlp/wi/kernel"),
          R.copy(hf + "intermediate.dense.bias", ours + "mlp/wi/bias"),
          R.linear(hf + "output.dense.weight", ours + "mlp/wo/kernel"),
          R.copy(hf + "output.dense.bias", ours + "mlp/wo/bias"),
          R.copy(hf + "output.LayerNorm.weight", ours + "mlp_norm/scale"),
          R.copy(hf + "output.LayerNorm.bias", ours + "mlp_norm/bias"),
      ]
    if c.pooler:
      out += [
          R.linear(prefix + "pooler.dense.weight", "pooler/kernel"),
          R.copy(prefix + "pooler.dense.bias", "pooler/bias"),
      ]
    if c.head == "mlm":
      t = "cls.predictions.transform."
      out += [
          R.linear(t + "dense.weight", "mlm_transform/kernel"),
          R.copy(t + "dense.bias", "mlm_transform/bias"),
          R.copy(t + "LayerNorm.weight", "mlm_norm/scale"),
          R.copy(t + "LayerNorm.bias", "mlm_norm/bias"),
          R.copy("cls.predictions.bias", "mlm_bias"),
      ]
    if c.head == "classification":
      out += [
          R.linear("classifier.weight", "classifier/kernel"),
          R.copy("classifier.bias", "classifier/bias"),
      ]
    return out

  return rules


def _tied_copies(c: ModelConfig) -> dict[str, str]:
  if c.head != "mlm":
    return {}
  return {
      _MLM_DECODER + "weight": "bert.embeddings.word_embeddings.weight",
      _MLM_DECODER + "bias": "cls.predictions.bias",
  }


def _architecture(name: str) -> Architecture:
  return Architecture(
      name=name,
      model_type="bert",
      read_config=_read(name),
      write_config=_write,
      rules=_rules(name),
      tied_copies=_tied_copies,
      # Buffers, and BERT pre-training's next-sentence head, which the HF classes
      # loaded here drop as well.
      ignored=(r"position_ids$", r"^cls\.seq_relationship\."),
      base_prefix=_HEADS[name][1],
  )


BERT_MODEL = _architecture("BertModel")
BERT_MLM = _architecture("BertForMaskedLM")
BERT_CLASSIFIER = _architecture("BertForSequenceClassification")
