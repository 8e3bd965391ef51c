"""A minimal PyTorch GPT (GPT-2 style: pre-LN, learned positions, tied output, GELU-tanh).

The PyTorch side of `small` and `time_to_loss`: the smallest honest trainer one would write
in plain PyTorch (nanoGPT's shape), so the comparison is with PyTorch, not with a library.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
  """Pre-LN attention + MLP with residuals."""

  def __init__(self, d_model: int, num_heads: int):
    super().__init__()
    self.num_heads = num_heads
    self.ln1 = nn.LayerNorm(d_model)
    self.qkv = nn.Linear(d_model, 3 * d_model)
    self.proj = nn.Linear(d_model, d_model)
    self.ln2 = nn.LayerNorm(d_model)
    self.up = nn.Linear(d_model, 4 * d_model)
    self.down = nn.Linear(4 * d_model, d_model)

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    b, t, d = x.shape
    q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
    q, k, v = (z.view(b, t, self.num_heads, d // self.num_heads).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
    return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
  """Token + position embeddings, blocks, final LayerNorm, tied output projection."""

  def __init__(self, vocab: int, d_model: int, num_layers: int, num_heads: int, max_len: int):
    super().__init__()
    self.wte = nn.Embedding(vocab, d_model)
    self.wpe = nn.Embedding(max_len, d_model)
    self.blocks = nn.ModuleList(Block(d_model, num_heads) for _ in range(num_layers))
    self.ln_f = nn.LayerNorm(d_model)
    for name, p in self.named_parameters():  # GPT-2's init, as tx_jax's init_std 0.02
      if p.dim() == 2:
        std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
        nn.init.normal_(p, std=std)
      elif name.endswith("bias"):
        nn.init.zeros_(p)

  def forward(self, ids: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(ids.shape[1], device=ids.device)
    x = self.wte(ids) + self.wpe(positions)
    for block in self.blocks:
      x = block(x)
    return self.ln_f(x) @ self.wte.weight.T


def loss_fn(model: GPT, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
  """Mean cross-entropy over weighted positions (weights 0 on padding), as tx_jax's loss."""
  logits = model(inputs)
  nll = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
  w = weights.flatten().to(nll.dtype)
  return (nll * w).sum() / w.sum().clamp_min(1.0)


def adamw(model: GPT, lr: float, b1: float, b2: float, eps: float, weight_decay: float):
  """AdamW with decay on matrices only (no decay on biases, norms, embeddings), as tx_jax."""
  decay, no_decay = [], []
  for name, p in model.named_parameters():
    (decay if p.dim() == 2 and not name.startswith(("wte", "wpe")) else no_decay).append(p)
  groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
  return torch.optim.AdamW(groups, lr=lr, betas=(b1, b2), eps=eps)
