"""LoRA adapters in and out of HuggingFace PEFT, the independent reference.

For GPT-2 (fused c_attn, Conv1D) and LLaMA (GQA, untied head) made here: a PEFT LoRA with
random non-zero A and B, saved and read into tx_jax, gives PEFT's logits; adapters set in
tx_jax, exported, load with PeftModel.from_pretrained and give tx_jax's logits; the merged
export loads in plain transformers and gives the unmerged model's logits.
"""

import json

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import traverse_util

from tests import hf_models
from tests.tiers import slow_except
from tx_jax import hf, lora, models, workdir
from tx_jax.interop import peft as peft_io

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TOL = 1e-4
TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # c_proj: attention's and the MLP's
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
              "lm_head"],
}  # fmt: skip
IDS = np.array([[5, 17, 3, 99, 42, 7, 250, 11], [1, 2, 3, 4, 5, 6, 7, 8]], np.int32)


def _peft_model(family, hf_dir, seed=0):
  """The saved HF model with a PEFT LoRA whose A and B are random, non-zero."""
  base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
  config = peft.LoraConfig(
      r=4, lora_alpha=12, lora_dropout=0.0, target_modules=TARGETS[family],
      fan_in_fan_out=family == "gpt2",
  )  # fmt: skip
  model = peft.get_peft_model(base, config)
  gen = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "lora_" in name:
        param.copy_(0.2 * torch.randn(param.shape, generator=gen))
  return model.eval()


def _torch_logits(model):
  with torch.no_grad():
    return model(torch.tensor(IDS, dtype=torch.long)).logits.numpy()


def _tx_logits(model_cfg, params):
  return np.asarray(models.build(model_cfg).apply({"params": params}, IDS))


@pytest.fixture(scope="module", params=slow_except(["gpt2", "llama"], "gpt2"))
def family_dir(request, tmp_path_factory):
  path = tmp_path_factory.mktemp(request.param) / "hf"
  hf_models.save_model(request.param, path, with_tokenizer=False, scale=0.1)
  return request.param, path


def test_peft_adapter_loads_into_tx_jax(family_dir, tmp_path):
  family, hf_dir = family_dir
  model = _peft_model(family, hf_dir)
  model.save_pretrained(tmp_path / "adapter")
  want = _torch_logits(model)

  workdir.import_hf(hf_dir, tmp_path / "run", peft_dir=tmp_path / "adapter")
  config, params, step = workdir.load(tmp_path / "run")
  assert step == 0 and config.model.lora.rank == 4 and config.model.lora.alpha == 12
  assert lora.adapted_modules(params)
  got = _tx_logits(config.model, nn.unbox(params))
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
  with model.disable_adapter():  # the adapters change the logits: the match is not vacuous
    assert np.abs(got - _torch_logits(model)).max() > 100 * TOL


def test_a_converted_workdir_names_its_base_in_the_adapter_it_exports(family_dir, tmp_path):
  """--to_peft's base_model_name_or_path is the --from_hf directory, which --from_peft then
  accepts; the workdir's params come whole from its frozen base and its step."""
  family, hf_dir = family_dir
  _peft_model(family, hf_dir).save_pretrained(tmp_path / "adapter")
  workdir.import_hf(hf_dir, tmp_path / "run", peft_dir=tmp_path / "adapter")
  assert (tmp_path / "run" / "frozen_base").is_dir()
  workdir.export_peft(tmp_path / "run", tmp_path / "again")
  values = json.loads((tmp_path / "again" / "adapter_config.json").read_text())
  assert values["base_model_name_or_path"] == str(hf_dir.absolute())

  workdir.import_hf(hf_dir, tmp_path / "run2", peft_dir=tmp_path / "again")
  config, params, _ = workdir.load(tmp_path / "run2")
  loaded = peft.PeftModel.from_pretrained(
      transformers.AutoModelForCausalLM.from_pretrained(hf_dir), tmp_path / "again"
  ).eval()
  got = _tx_logits(config.model, nn.unbox(params))
  np.testing.assert_allclose(got, _torch_logits(loaded), atol=TOL, rtol=0)


@pytest.mark.parametrize("runtime", [{}, {"scan_layers": True, "fused_qkv": True}], ids=str)
def test_tx_jax_adapter_loads_in_peft_and_merges(family_dir, tmp_path, runtime):
  family, hf_dir = family_dir
  config, _, base = hf.from_pretrained(hf_dir, **runtime)
  if family == "gpt2":
    targets = ("qkv", "output", "mlp_up", "mlp_down")  # c_attn, c_proj, c_fc, c_proj
  else:
    targets = ("query", "key", "value", "output", "mlp_gate", "mlp_up", "mlp_down", "lm_head")
  config.model.lora.update(rank=3, alpha=7.0, targets=targets)
  params = lora.attach(config.model, base, seed=1)
  rng = np.random.default_rng(2)
  flat = traverse_util.flatten_dict(nn.unbox(params), sep="/")
  flat = {
      k: rng.normal(0, 0.2, v.shape).astype(np.float32) if k.endswith(("lora_a", "lora_b")) else v
      for k, v in flat.items()
  }
  params = traverse_util.unflatten_dict(flat, sep="/")
  mc = models.ModelConfig.from_config(config.model)
  want = _tx_logits(mc, params)

  unrolled = traverse_util.flatten_dict(models.unstack_layers(params), sep="/")
  written = peft_io.to_peft(mc, hf.architecture_for(mc), unrolled, tmp_path / "adapter")
  assert written
  loaded = peft.PeftModel.from_pretrained(
      transformers.AutoModelForCausalLM.from_pretrained(hf_dir), tmp_path / "adapter"
  ).eval()
  np.testing.assert_allclose(_torch_logits(loaded), want, atol=TOL, rtol=0)

  # And back: the exported directory reads into the same adapters.
  lora_fields, adapters = peft_io.from_peft(lora.base_config(mc), hf.architecture_for(mc),
                                            tmp_path / "adapter")  # fmt: skip
  assert lora_fields["rank"] == 3 and lora_fields["alpha"] == 7.0
  assert set(adapters) == {k for k in unrolled if k.endswith(("lora_a", "lora_b"))}
  reread = config.model.copy_and_resolve_references()
  reread.lora.update(targets=lora_fields["targets"])
  assert lora.adapted_modules(models.abstract_params(reread)) == lora.adapted_modules(params)
  for key, value in adapters.items():
    np.testing.assert_array_equal(value, unrolled[key], err_msg=key)

  merged_cfg, merged = lora.merge(mc, params)
  hf.to_pretrained(merged_cfg, merged, tmp_path / "merged")
  plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
  np.testing.assert_allclose(_torch_logits(plain), want, atol=TOL, rtol=0)
  np.testing.assert_allclose(_tx_logits(merged_cfg, merged), want, atol=TOL, rtol=0)


def _save_other_shape(family, path):
  if family == "gpt2":
    config = transformers.GPT2Config(vocab_size=331, n_embd=30, n_layer=2, n_head=3, n_positions=96)
    model = transformers.GPT2LMHeadModel(config)
  else:
    config = transformers.LlamaConfig(
        vocab_size=389, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
  model.save_pretrained(path, safe_serialization=True)


def test_adapter_for_another_base_shape_or_architecture_is_refused(family_dir, tmp_path):
  family, hf_dir = family_dir
  # Saved from a directory named like the base ("hf"): only the shapes tell them apart.
  _save_other_shape(family, tmp_path / "shape" / "hf")
  _peft_model(family, tmp_path / "shape" / "hf").save_pretrained(tmp_path / "shape_adapter")
  with pytest.raises(hf.ConversionError, match="another shape"):
    workdir.import_hf(hf_dir, tmp_path / "run", peft_dir=tmp_path / "shape_adapter")
  other = "llama" if family == "gpt2" else "gpt2"
  _save_other_shape(other, tmp_path / "arch" / "hf")
  _peft_model(other, tmp_path / "arch" / "hf").save_pretrained(tmp_path / "arch_adapter")
  with pytest.raises(hf.ConversionError, match="another architecture"):
    workdir.import_hf(hf_dir, tmp_path / "run", peft_dir=tmp_path / "arch_adapter")
  # The adapter records its base; another directory name is another base.
  _peft_model(family, hf_dir).save_pretrained(tmp_path / "adapter")
  renamed = tmp_path / "renamed"
  renamed.symlink_to(hf_dir)
  with pytest.raises(hf.ConversionError, match="base_model_name_or_path"):
    workdir.import_hf(renamed, tmp_path / "run", peft_dir=tmp_path / "adapter")
  assert not (tmp_path / "run").exists()
