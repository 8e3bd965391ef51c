"""Builders shared by the sections: tx_jax configs and jitted steps, PyTorch models and steps."""

from __future__ import annotations

import os
import pathlib
from typing import Callable

import ml_collections

from tx_jax.benchmarks import common
from tx_jax.benchmarks.common import Shape


def jax_config(
    shape: Shape, data_dir: str = "", kernels: str = "plain"
) -> ml_collections.ConfigDict:
  """configs/gpt.py:tiny reshaped to `shape` (GPT-2 style, fp32, dropout 0, AdamW).

  It runs on shape.cpu_devices CPU devices (config.mesh.cpu_devices), the first of the
  configs/gpt.py:CPU_DEVICES that runner.run starts the benchmark's process with, as a
  shape.mesh_axis mesh axis (data or fsdp).

  With data_dir, the data section reads Tiny Shakespeare byte-level, unpacked as
  configs/gpt.py:tiny-shakespeare ships it (its rows are whole chunks: packing would only
  cost host time); token ids then stay below 360 whatever the vocabulary, which costs the
  same.
  """
  gpt = common.preset_module("gpt")
  train_defaults = common.preset_module("train_defaults")

  config = gpt.get_config("tiny")
  m = config.model
  m.num_layers, m.d_model, m.num_heads = shape.num_layers, shape.d_model, shape.num_heads
  m.num_kv_heads, m.head_dim, m.mlp_dim = shape.num_heads, shape.d_model // shape.num_heads, 4 * shape.d_model
  m.vocab_size, m.max_len = shape.vocab, shape.seq_len
  m.dropout_rate = m.attention_dropout_rate = 0.0
  m.kernels = kernels
  config.data.seq_len, config.data.global_batch_size = shape.seq_len, shape.batch
  config.mesh.cpu_devices = shape.cpu_devices
  if shape.mesh_axis == "fsdp":  # the devices split params and optimizer state (ZeRO-3)
    config.mesh.data, config.mesh.fsdp = 1, -1
  if data_dir:
    train_defaults.tiny_shakespeare(config, task="lm")
    config.data.manual_dir = str(pathlib.Path(data_dir) / "tinyshakespeare")
  return config


def random_batch(shape: Shape, seed: int = 0) -> dict:
  """An LM batch of random ids in tx_jax's layout (inputs, targets, weights)."""
  import numpy as np  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(seed)
  ids = rng.integers(4, shape.vocab, (shape.batch, shape.seq_len + 1), dtype=np.int32)
  return {
      "inputs": ids[:, :-1],
      "targets": ids[:, 1:],
      "weights": np.ones((shape.batch, shape.seq_len), np.float32),
  }


def jax_step(config: ml_collections.ConfigDict, batch: dict) -> Callable[[], None]:
  """The trainer's jitted train step (tx_jax.train.run.jit_steps), alone, state donated.

  On the trainer's mesh (config.mesh over sharding.run_devices) with its shardings, so it
  is the very program the trainer runs. Returns `run(wait=True)`, which runs one step and,
  with `wait`, waits for it. Timing several steps with `wait=False` and waiting only for
  the last measures what the trainer gets: JAX dispatches the next step while the current
  one runs, as the loop does.
  """
  import jax  # pylint: disable=g-import-not-at-top

  from tx_jax import models, sharding  # pylint: disable=g-import-not-at-top
  from tx_jax.train import optimizers, run as run_lib

  mesh, rules = sharding.make_mesh(config.mesh), sharding.logical_rules(config)
  module = models.build(config.model)
  tx, schedule = optimizers.build_optimizer(config)
  layout = run_lib.state_layout(config, module, tx, batch, mesh, rules)
  holder = {"state": run_lib.jit_init(layout, mesh)()}
  step, _ = run_lib.jit_steps(config, module, tx, schedule, layout.shardings, mesh, rules)
  device_batch = jax.device_put(batch, sharding.batch_sharding(mesh))

  def run(wait: bool = True) -> None:
    holder["state"], metrics = step(holder["state"], device_batch)
    if wait:
      jax.block_until_ready(metrics)

  return run


def set_torch_threads() -> int:
  """torch's intra-op threads = the cores XLA:CPU uses (its pool spans every core)."""
  import torch  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(os.cpu_count() or 1)
  return torch.get_num_threads()


def hf_gpt2(shape: Shape):
  """transformers.GPT2LMHeadModel of `shape`, dropout 0, in train mode."""
  import transformers  # pylint: disable=g-import-not-at-top

  hf_config = transformers.GPT2Config(
      vocab_size=shape.vocab,
      n_positions=shape.seq_len,
      n_embd=shape.d_model,
      n_layer=shape.num_layers,
      n_head=shape.num_heads,
      activation_function="gelu_new",
      resid_pdrop=0.0,
      embd_pdrop=0.0,
      attn_pdrop=0.0,
      bos_token_id=None,  # GPT-2's 50256 lies outside the bench vocabularies; no step reads it
      eos_token_id=None,
  )
  model = transformers.GPT2LMHeadModel(hf_config)
  # The loss HF falls back to for GPT-2 anyway, named so that it does not warn on every run.
  model.loss_type = "ForCausalLM"
  return model.train()


def torch_step(model, shape: Shape, loss_of: Callable, compile_model: bool) -> Callable[[], None]:
  """One AdamW step (clip 1.0, decay 0.1) of `model` on a fixed random batch.

  loss_of(model, ids) -> scalar loss. With compile_model, the model goes through
  torch.compile (forward and backward; the optimizer stays eager).
  """
  import torch  # pylint: disable=g-import-not-at-top

  ids = torch.randint(4, shape.vocab, (shape.batch, shape.seq_len), generator=torch.Generator().manual_seed(0))
  opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)
  forward = torch.compile(model) if compile_model else model

  def run() -> None:
    loss = loss_of(forward, ids)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)

  return run


def hf_loss(model, ids):
  """HF GPT2's own LM loss (labels shifted inside)."""
  return model(input_ids=ids, labels=ids).loss


def minimal_loss(model, ids):
  """Next-token loss of tx_jax.benchmarks.torch_gpt on ids."""
  import torch  # pylint: disable=g-import-not-at-top

  from tx_jax.benchmarks import torch_gpt  # pylint: disable=g-import-not-at-top

  return torch_gpt.loss_fn(model, ids[:, :-1], ids[:, 1:], torch.ones_like(ids[:, 1:]))
