"""Kernels for XLA:CPU, opt-in through `config.model.kernels = "cpu"`; the models never import this.

What it swaps in, through the `layers.ops` seam:
- projections and the tied output embedding: MKL's sgemm as an XLA FFI call where the
  `cpu-mkl` extra is installed (`gemm.py`), else XLA's dot with a VJP that transposes the
  smaller operand (`projection.py`);
- norms: a hand-written backward with about half the passes of autodiff's;
- the `dense` backend: causal queries in chunks with FlashAttention's backward, its
  contractions read in place by MKL (`chunked_attention.py`, `einsum.py`);
- the `blockwise` backend's contractions: MKL's batched GEMMs.

Every one of these is a `jax.custom_vjp`: reverse mode only, so `jax.jvp` and
`jax.linearize` refuse a model that uses them. Outputs equal the plain kernels' within
float32 rounding. The set registers under the entry point group `tx_jax.kernels`
(pyproject.toml), which `layers.ops.get` reads.
"""

from tx_jax.cpu import chunked_attention, einsum, projection
from tx_jax.layers import ops

KERNELS = ops.Kernels(
    name="cpu",
    project=projection.project,
    normalize=projection.normalize,
    einsum=einsum.einsum,
    dense_attention=chunked_attention.dense_attention,
)
