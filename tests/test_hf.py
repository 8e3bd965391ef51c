"""HuggingFace interop: forward parity with transformers (torch, CPU) and exact round trips.

Each case builds a small random transformers model, perturbs every parameter (so zero
biases and unit norms are tested too), saves it with safetensors, loads it with
`tx_jax.hf.from_pretrained` and compares float32 eval-mode outputs on a padded batch.
Shapes are chosen not to divide evenly: odd vocabularies, GQA / MQA, T5 d_kv != d_model /
num_heads, LLaMA head_dim != hidden / heads, unequal encoder / decoder depths.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file  # noqa: E402

from tx_jax import hf  # noqa: E402
from tx_jax.interop.safetensors_io import read_weights  # noqa: E402

TOLERANCE = 1e-4  # max |delta| in float32 (the bound)
B, T, S = 3, 7, 5  # batch, source / LM length, T5 target length


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  build: Callable[[], Any]  # -> a transformers model
  kind: str  # "decoder", "bert", "bert_mlm", "bert_cls", "t5"


def _bert_config(**kw):
  return transformers.BertConfig(
      vocab_size=99,
      hidden_size=32,
      num_hidden_layers=2,
      num_attention_heads=4,
      intermediate_size=44,
      max_position_embeddings=16,
      **kw,
  )


def _t5_config(**kw):
  return transformers.T5Config(
      vocab_size=103,
      d_model=32,
      d_kv=12,
      d_ff=40,
      num_layers=2,
      num_decoder_layers=3,
      num_heads=4,
      relative_attention_num_buckets=8,
      relative_attention_max_distance=12,
      **kw,
  )


def _t5_v1_1():
  model = transformers.T5ForConditionalGeneration(
      _t5_config(feed_forward_proj="gated-gelu", tie_word_embeddings=False)
  )
  # transformers 5 builds T5 with the head tied to `shared`; real v1.1 checkpoints hold
  # a separate lm_head, which it then loads untied. Build that.
  model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.shared.weight))
  model.all_tied_weights_keys.pop("lm_head.weight", None)
  return model


def _llama(**kw):
  config = dict(
      vocab_size=97,
      hidden_size=32,
      intermediate_size=40,
      num_hidden_layers=2,
      num_attention_heads=4,
      rms_norm_eps=1e-5,
  )
  return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **kw}))


CASES = [
    Case("bert", lambda: transformers.BertModel(_bert_config()), "bert"),
    Case("bert_mlm", lambda: transformers.BertForMaskedLM(_bert_config()), "bert_mlm"),
    Case(
        "bert_cls",
        lambda: transformers.BertForSequenceClassification(_bert_config(num_labels=3)),
        "bert_cls",
    ),
    Case(
        "gpt2",
        lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=101,
                n_embd=32,
                n_layer=2,
                n_head=4,
                n_positions=16,
                bos_token_id=1,
                eos_token_id=2,
            )
        ),
        "decoder",
    ),
    Case(
        "t5_v1_0",
        lambda: transformers.T5ForConditionalGeneration(_t5_config(feed_forward_proj="relu")),
        "t5",
    ),
    Case("t5_v1_1", _t5_v1_1, "t5"),
    Case(
        "llama_gqa_untied",
        lambda: _llama(
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        "decoder",
    ),
    Case(
        "llama_mqa_tied_bias",
        lambda: _llama(
            num_key_value_heads=1,
            head_dim=12,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        ),
        "decoder",
    ),
]


def _perturb(model) -> None:
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for param in model.parameters():  # tied parameters appear once
      param.add_(0.1 * torch.randn(param.shape, generator=gen))


def _mask(lengths, width) -> np.ndarray:
  return (np.arange(width)[None] < np.asarray(lengths)[:, None]).astype(np.int64)


def _batch(vocab: int) -> dict[str, np.ndarray]:
  rng = np.random.RandomState(0)
  mask, dec_mask = _mask([T, 4, 1], T), _mask([S, 2, 4], S)
  return {
      "ids": rng.randint(1, vocab, (B, T)) * mask,
      "mask": mask,
      "types": rng.randint(0, 2, (B, T)) * mask,
      "dec_ids": rng.randint(1, vocab, (B, S)) * dec_mask,
      "dec_mask": dec_mask,
  }


def _hf_outputs(model, kind: str, b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  t = {k: torch.tensor(v) for k, v in b.items()}
  with torch.no_grad():
    if kind == "decoder":
      return {"logits": model(input_ids=t["ids"], attention_mask=t["mask"]).logits.numpy()}
    if kind == "t5":
      return {
          "logits": (
              model(
                  input_ids=t["ids"],
                  attention_mask=t["mask"],
                  decoder_input_ids=t["dec_ids"],
                  decoder_attention_mask=t["dec_mask"],
              ).logits.numpy()
          )
      }
    out = model(input_ids=t["ids"], attention_mask=t["mask"], token_type_ids=t["types"])
    if kind == "bert":
      return {"sequence": out.last_hidden_state.numpy(), "pooled": out.pooler_output.numpy()}
    return {"logits": out.logits.numpy()}


def _our_outputs(module, params, kind: str, b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  # One jitted call compiles faster than eager op-by-op dispatch of a fresh model.
  return jax.jit(functools.partial(_apply, module, kind))(
      params, {k: jnp.asarray(v, jnp.int32) for k, v in b.items()}
  )


def _apply(module, kind: str, params, j: dict[str, jax.Array]) -> dict[str, jax.Array]:
  variables = {"params": params}
  if kind == "decoder":
    return {"logits": module.apply(variables, j["ids"], segment_ids=j["mask"])}
  if kind == "t5":
    return {
        "logits": module.apply(
            variables,
            j["ids"],
            j["dec_ids"],
            encoder_segment_ids=j["mask"],
            decoder_segment_ids=j["dec_mask"],
        )
    }
  out = module.apply(variables, j["ids"], token_type_ids=j["types"], segment_ids=j["mask"])
  if kind == "bert":
    return {"sequence": out[0], "pooled": out[1]}
  return {"logits": out}


def _max_delta(ours, theirs, kind: str, b: dict[str, np.ndarray]) -> float:
  """max |delta| over real (non-padding) positions; padded rows are undefined in HF."""
  deltas = []
  for key, ref in theirs.items():
    diff = np.abs(np.asarray(ours[key], np.float64) - ref.astype(np.float64))
    if key in ("logits", "sequence") and kind != "bert_cls":
      diff = diff[(b["dec_mask"] if kind == "t5" else b["mask"]).astype(bool)]
    deltas.append(float(diff.max()))
  return max(deltas)


@pytest.fixture(scope="module", params=CASES, ids=[c.name for c in CASES])
def loaded(request, tmp_path_factory):
  case: Case = request.param
  torch.manual_seed(0)
  model = case.build()
  _perturb(model)
  model.eval()
  directory = tmp_path_factory.mktemp(case.name)
  model.save_pretrained(directory)
  config, module, params = hf.from_pretrained(directory)
  batch = _batch(config.model.vocab_size)
  return dict(
      case=case,
      model=model,
      dir=directory,
      config=config,
      module=module,
      params=params,
      batch=batch,
      hf_out=_hf_outputs(model, case.kind, batch),
  )


def test_forward_parity(loaded):
  case, b = loaded["case"], loaded["batch"]
  ours = _our_outputs(loaded["module"], loaded["params"], case.kind, b)
  delta = _max_delta(ours, loaded["hf_out"], case.kind, b)
  print(f"{case.name}: max |delta| = {delta:.3g}")
  assert delta <= TOLERANCE


def test_left_padded_decoder_parity(loaded):
  """Left-padded prompts (as decoding uses them): positions start at the first real token."""
  if loaded["case"].kind != "decoder":
    pytest.skip("decoder-only")
  b = loaded["batch"]
  mask = b["mask"][:, ::-1].copy()
  ids = b["ids"][:, ::-1] * mask
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
  with torch.no_grad():
    theirs = loaded["model"](
        input_ids=torch.tensor(ids),
        attention_mask=torch.tensor(mask),
        position_ids=torch.tensor(positions),
    ).logits.numpy()
  ours = jax.jit(
      lambda p, *a: loaded["module"].apply({"params": p}, a[0], segment_ids=a[1], positions=a[2])
  )(loaded["params"], *(jnp.asarray(x, jnp.int32) for x in (ids, mask, positions)))
  delta = np.abs(np.asarray(ours) - theirs)[mask.astype(bool)].max()
  assert delta <= TOLERANCE


def test_round_trip(loaded, tmp_path):
  case, model = loaded["case"], loaded["model"]
  # LLaMA cases are written in shards (with an index), which transformers must load too.
  shard = 8192 if case.name.startswith("llama") else 2**30
  hf.to_pretrained(loaded["config"], loaded["params"], tmp_path, max_shard_bytes=shard)
  assert (tmp_path / "model.safetensors.index.json").is_file() == (shard == 8192)
  # Every tensor written is bit-identical to the one transformers saved.
  original = load_file(str(loaded["dir"] / "model.safetensors"))
  written = read_weights(tmp_path)
  assert set(written) <= set(original)
  for key, value in written.items():
    assert value.dtype == original[key].dtype and np.array_equal(value, original[key]), key
  # transformers loads it as the same model: the same outputs, bit for bit.
  reloaded = type(model).from_pretrained(tmp_path)
  reloaded.eval()
  again = _hf_outputs(reloaded, case.kind, loaded["batch"])
  for key, value in loaded["hf_out"].items():
    assert np.array_equal(again[key], value), key
  # And tx_jax loads it back to the same config and bit-identical params.
  config, _, params = hf.from_pretrained(tmp_path)
  assert config.model.to_dict() == loaded["config"].model.to_dict()
  flat = lambda p: {
      "/".join(k): np.asarray(v)
      for k, v in __import__("flax").traverse_util.flatten_dict(p).items()  # noqa: E731
  }
  ours, back = flat(loaded["params"]), flat(params)
  assert ours.keys() == back.keys()
  for key in ours:
    assert np.array_equal(ours[key], back[key]), key


def test_stacked_and_separate_projections_load_and_write_the_same_weights(loaded, tmp_path):
  """`fused_qkv` flipped: stacked q/k/v kernels ("qkv", or "query" and "kv" with fewer kv
  heads) or separate ones give the same outputs and write back the same tensors."""
  case, b = loaded["case"], loaded["batch"]
  fused_qkv = not loaded["config"].model.fused_qkv
  config, module, params = hf.from_pretrained(loaded["dir"], fused_qkv=fused_qkv)
  attention = params["stack" if "stack" in params else "encoder"]["layer_0"]["self_attention"]
  assert ("qkv" in attention or "kv" in attention) == fused_qkv, set(attention)
  ours = _our_outputs(module, params, case.kind, b)
  assert _max_delta(ours, loaded["hf_out"], case.kind, b) <= TOLERANCE
  hf.to_pretrained(config, params, tmp_path)
  original = load_file(str(loaded["dir"] / "model.safetensors"))
  for key, value in read_weights(tmp_path).items():
    assert np.array_equal(value, original[key]), key


def test_config_json_round_trip_keeps_hf_config(loaded, tmp_path):
  """The written config.json loads in transformers as the same architecture values."""
  hf.to_pretrained(loaded["config"], loaded["params"], tmp_path)
  ours = transformers.AutoConfig.from_pretrained(tmp_path).to_dict()
  theirs = loaded["model"].config.to_dict()
  skip = {
      "_name_or_path",
      "transformers_version",
      "architectures",
      "bos_token_id",
      "eos_token_id",
      "pad_token_id",
      "dtype",
      "initializer_range",
      "initializer_factor",
      "decoder_start_token_id",
  }
  differ = {
      k: (theirs.get(k), ours.get(k))
      for k in set(ours) | set(theirs)
      if k not in skip and ours.get(k) != theirs.get(k)
  }
  assert not differ
