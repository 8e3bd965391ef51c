"""HuggingFace interop without torch models: config mapping, errors, files, scan_layers.

Parity with transformers itself is in tests/test_hf.py; these tests build tx_jax models
(or bare config.json dicts) only.
"""

from __future__ import annotations

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from configs import bert, gpt, t5
from tx_jax import hf, models
from tx_jax.interop.rules import HFConfig
from tx_jax.interop.safetensors_io import INDEX, read_weights, write_weights

transformers = pytest.importorskip("transformers")


def _tiny(config, **overrides):
  m = config.model
  m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads = 51, 32, 2, 4, 4
  m.head_dim, m.mlp_dim, m.max_len = 8, 48, 16
  if m.family == "encdec":
    m.num_decoder_layers = 3
  for key, value in overrides.items():
    m[key] = value
  return config


def _init(config):
  module = models.build(config.model)
  ids = jnp.ones((2, 5), jnp.int32)
  args = (ids, ids) if config.model.family == "encdec" else (ids,)
  init = jax.jit(functools.partial(module.init, train=False))
  return module, jax.tree.map(np.asarray, nn.unbox(init(jax.random.PRNGKey(0), *args)["params"]))


def _flat(params):
  return {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}


@pytest.fixture(scope="module")
def gpt_dir(tmp_path_factory):
  """A tiny GPT-2 written by tx_jax (no torch involved)."""
  config = _tiny(gpt.get_config("tiny"))
  module, params = _init(config)
  directory = tmp_path_factory.mktemp("gpt")
  hf.to_pretrained(config, params, directory)
  return directory, config, module, params


# --- every option of the HF config classes is mapped or checked -------------------------

# Keys that never change the network: bookkeeping, output switches, token ids (the
# tokenizer's business), cache use, and GPT-2's summary head (GPT2DoubleHeadsModel only).
_NOT_MODEL = {
    "_name_or_path",
    "architectures",
    "chunk_size_feed_forward",
    "dtype",
    "id2label",
    "label2id",
    "model_type",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "transformers_version",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "is_encoder_decoder",
    "problem_type",
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
    "decoder_start_token_id",
}


@pytest.mark.parametrize(
    "cls,architecture",
    [
        ("GPT2Config", "GPT2LMHeadModel"),
        ("LlamaConfig", "LlamaForCausalLM"),
        ("BertConfig", "BertModel"),
        ("BertConfig", "BertForMaskedLM"),
        ("BertConfig", "BertForSequenceClassification"),
        ("T5Config", "T5ForConditionalGeneration"),
    ],
)
def test_every_hf_option_is_mapped_or_checked(cls, architecture):
  values = getattr(transformers, cls)().to_dict()
  reader = HFConfig(values, architecture)
  hf.ARCHITECTURES[architecture].read_config(reader, None)
  unread = set(values) - reader.used - _NOT_MODEL
  assert not unread, f"options of {cls} that tx_jax neither maps nor checks: {unread}"


@pytest.mark.parametrize(
    "hf_values,module,preset",
    [
        (dict(architectures=["GPT2LMHeadModel"]), gpt, "gpt2-small"),
        (
            dict(architectures=["GPT2LMHeadModel"], n_embd=1600, n_layer=48, n_head=25),
            gpt,
            "gpt2-xl",
        ),
        (dict(architectures=["BertForMaskedLM"]), bert, "base"),
        (
            dict(
                architectures=["LlamaForCausalLM"],
                vocab_size=32000,
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=22,
                num_attention_heads=32,
                num_key_value_heads=4,
                rms_norm_eps=1e-5,
            ),
            gpt,
            "llama-1b",
        ),
        (
            dict(
                architectures=["T5ForConditionalGeneration"],
                d_ff=1024,
                num_layers=8,
                num_heads=6,
                feed_forward_proj="gated-gelu",
                dropout_rate=0.0,
                tie_word_embeddings=False,
            ),
            t5,
            "t5.1.1-small",
        ),
    ],
)
def test_hf_configs_match_the_presets(hf_values, module, preset):
  """The published HF configs map onto our paper presets (model fields, dropout aside)."""
  fields = hf._relevant(hf.model_fields(hf_values))
  ours = module.get_config(preset).model
  # Without weights, ties and BERT's pooler follow the config alone; real checkpoints
  # settle them (bert-base-uncased holds a pooler, t5-v1_1 an untied head).
  unknowable = {"tie_embeddings", "pooler"}
  differ = {
      k: (v, ours[k])
      for k, v in fields.items()
      if ours[k] != v and "dropout" not in k and k not in unknowable
  }
  assert not differ


# --- errors name what is not implemented ------------------------------------------------


@pytest.mark.parametrize(
    "values,match",
    [
        ({"architectures": ["RobertaModel"]}, "RobertaModel"),
        (
            {
                "architectures": ["LlamaForCausalLM"],
                "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0},
            },
            "rope_parameters.*llama3",
        ),
        (
            {
                "architectures": ["LlamaForCausalLM"],
                "rope_theta": 5e5,
                "rope_scaling": {"type": "linear", "factor": 2.0},
            },
            "rope_scaling.*linear",
        ),
        (
            {"architectures": ["GPT2LMHeadModel"], "activation_function": "quick_gelu"},
            "activation_function='quick_gelu'",
        ),
        ({"architectures": ["BertModel"], "hidden_act": "mish"}, "hidden_act='mish'"),
        (
            {"architectures": ["T5ForConditionalGeneration"], "feed_forward_proj": "gated-mish"},
            "feed_forward_proj='gated-mish'",
        ),
        (
            {"architectures": ["GPT2LMHeadModel"], "scale_attn_by_inverse_layer_idx": True},
            "scale_attn_by_inverse_layer_idx=True",
        ),
        (
            {"architectures": ["BertModel"], "position_embedding_type": "relative_key"},
            "position_embedding_type='relative_key'",
        ),
        ({"architectures": ["BertForMaskedLM"], "tie_word_embeddings": False}, "untied"),
        (
            {
                "architectures": ["T5ForConditionalGeneration"],
                "tie_word_embeddings": False,
                "scale_decoder_outputs": True,
            },
            "scale_decoder_outputs",
        ),
        (
            {"architectures": ["GPT2LMHeadModel"], "embd_pdrop": 0.0, "resid_pdrop": 0.1},
            "embd_pdrop",
        ),
    ],
)
def test_unimplemented_options_are_errors(values, match):
  with pytest.raises(hf.ConversionError, match=match):
    hf.model_fields(values)


def test_pickle_only_directory_is_refused(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
  (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
  with pytest.raises(hf.ConversionError, match="pytorch_model.bin.*safetensors"):
    hf.from_pretrained(tmp_path)
  with pytest.raises(hf.ConversionError, match="no config.json"):
    hf.from_pretrained(tmp_path / "missing")


def test_unexpected_and_missing_tensors_are_errors(gpt_dir, tmp_path):
  directory = gpt_dir[0]
  (tmp_path / "config.json").write_text((directory / "config.json").read_text())
  weights = read_weights(directory)
  write_weights(tmp_path, {**weights, "transformer.h.0.attn.extra": np.zeros(3, np.float32)}, 2**30)
  with pytest.raises(hf.ConversionError, match="transformer.h.0.attn.extra"):
    hf.from_pretrained(tmp_path)
  del weights["transformer.h.1.mlp.c_fc.bias"]
  write_weights(tmp_path, weights, 2**30)
  with pytest.raises(hf.ConversionError, match="transformer.h.1.mlp.c_fc.bias"):
    hf.from_pretrained(tmp_path)


def test_legacy_key_names_load(gpt_dir, tmp_path):
  """The official gpt2 checkpoint has no "transformer." prefix; old BERTs say gamma/beta."""
  directory, _, _, params = gpt_dir
  (tmp_path / "config.json").write_text((directory / "config.json").read_text())
  weights = read_weights(directory)
  write_weights(tmp_path, {k.removeprefix("transformer."): v for k, v in weights.items()}, 2**30)
  _, _, loaded = hf.from_pretrained(tmp_path)
  a, b = _flat(params), _flat(loaded)
  assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_bert_gamma_beta_names_load(tmp_path):
  config = _tiny(bert.get_config("tiny"), num_layers=1)
  _, params = _init(config)
  hf.to_pretrained(config, params, tmp_path / "new")
  weights = read_weights(tmp_path / "new")
  renamed = {
      k.replace("LayerNorm.weight", "LayerNorm.gamma").replace(
          "LayerNorm.bias", "LayerNorm.beta"
      ): v
      for k, v in weights.items()
  }
  assert any(k.endswith("gamma") for k in renamed)
  write_weights(tmp_path / "old", renamed, 2**30)
  (tmp_path / "old" / "config.json").write_text((tmp_path / "new" / "config.json").read_text())
  _, _, loaded = hf.from_pretrained(tmp_path / "old")
  a, b = _flat(params), _flat(loaded)
  assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_fused_and_separate_qkv_load_the_same_model(gpt_dir):
  """GPT-2's c_attn loads as one [D, 3, N, H] kernel (the default) or as three; same logits."""
  directory, _, _, params = gpt_dir
  assert params["stack"]["layer_0"]["self_attention"]["qkv"]["kernel"].ndim == 4
  config, module, fused = hf.from_pretrained(directory)
  _, module3, separate = hf.from_pretrained(directory, fused_qkv=False)
  assert config.model.fused_qkv and set(separate["stack"]["layer_0"]["self_attention"]) == {
      "query", "key", "value", "out"
  }
  ids = jnp.asarray(np.random.RandomState(1).randint(1, 51, (2, 7)), jnp.int32)
  np.testing.assert_allclose(
      np.asarray(module.apply({"params": fused}, ids)),
      np.asarray(module3.apply({"params": separate}, ids)),
      atol=1e-5,
  )


def test_runtime_overrides_only(gpt_dir):
  with pytest.raises(ValueError, match="num_layers"):
    hf.from_pretrained(gpt_dir[0], num_layers=3)


@pytest.mark.parametrize(
    "preset,overrides,match",
    [
        (gpt.get_config("tiny"), dict(num_kv_heads=2), "num_kv_heads=2"),
        (gpt.get_config("tiny"), dict(positions="sinusoidal"), "positions='sinusoidal'"),
        (gpt.get_config("tiny"), dict(norm="rmsnorm"), "norm='rmsnorm'"),
        (
            gpt.get_config("llama-tiny"),
            dict(mlp_activation="gelu", gated_mlp=False),
            "gated_mlp=False",
        ),
        (t5.get_config("tiny"), dict(attention_dropout_rate=0.2), "attention_dropout_rate"),
        (bert.get_config("tiny"), dict(pre_norm=True), "pre_norm=True"),
    ],
)
def test_inexpressible_models_are_errors(preset, overrides, match, tmp_path):
  config = _tiny(preset, **overrides)
  # The config is checked before any tensor is touched, so no params are needed.
  with pytest.raises(hf.ConversionError, match=match):
    hf.to_pretrained(config, {}, tmp_path)
  assert not (tmp_path / "config.json").exists()


# --- files, dtypes and scanned layers ---------------------------------------------------


def test_sharded_bfloat16_scanned_round_trip(gpt_dir, tmp_path):
  """Shards + index, bf16 storage and scan_layers all round-trip bit for bit."""
  directory, config, module, params = gpt_dir
  config16, module16, params16 = hf.from_pretrained(
      directory, param_dtype="bfloat16", scan_layers=True
  )
  assert module16.config.scan_layers
  assert params16["stack"]["layers"]["layer"]["mlp"]["wi"]["kernel"].shape[0] == 2
  hf.to_pretrained(config16, params16, tmp_path, max_shard_bytes=4096)
  assert (tmp_path / INDEX).is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
  original, written = read_weights(directory), read_weights(tmp_path)
  assert original.keys() == written.keys()
  for key, value in written.items():
    assert str(value.dtype) == "bfloat16"
    np.testing.assert_array_equal(value, original[key].astype(value.dtype))
  # Loading the bf16 shards into float32 is exact; the scanned model computes the same.
  _, module32, params32 = hf.from_pretrained(tmp_path, scan_layers=True)
  _, _, unscanned = hf.from_pretrained(tmp_path)
  ids = jnp.asarray(np.random.RandomState(0).randint(1, 51, (2, 6)), jnp.int32)
  a = module32.apply({"params": params32}, ids)
  b = models.build(config.model).apply({"params": unscanned}, ids)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  assert all(str(v.dtype) == "float32" for v in _flat(params32).values())


def test_hf_config_values_pass_through_but_cannot_change_the_model(gpt_dir, tmp_path):
  _, config, _, params = gpt_dir
  hf.to_pretrained(config, params, tmp_path, hf_config={"eos_token_id": 2})
  assert json.loads((tmp_path / "config.json").read_text())["eos_token_id"] == 2
  with pytest.raises(hf.ConversionError, match="num_layers"):
    hf.to_pretrained(config, params, tmp_path, hf_config={"n_layer": 3})
