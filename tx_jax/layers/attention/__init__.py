"""Attention: the layer, what may attend to what, and the backends that compute it.

- `multi_head.py`: `MultiHeadAttention` (self / cross, GQA, RoPE, KV cache).
- `spec.py`: `AttentionSpec`, the description every backend materialises per block.
- `dense.py`: the reference (one softmax over [T, S]) and the helpers the backends share.
- `blockwise.py`, `pallas.py`, `cudnn.py`: one backend each; `backends.py` names them.
- `ring.py`: context-parallel self-attention when the mesh splits the sequence.
"""

from tx_jax.layers.attention.backends import BACKENDS, get_backend
from tx_jax.layers.attention.multi_head import MultiHeadAttention
from tx_jax.layers.attention.spec import AttentionSpec

__all__ = ["AttentionSpec", "BACKENDS", "MultiHeadAttention", "get_backend"]
