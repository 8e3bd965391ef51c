"""Default `mesh` and `sharding` config sections: mesh axis sizes and the logical-axis rules.

configs/common.py assembles these into every family config. Every field has a value and a
one-line comment: library code (tx_jax/sharding.py) reads `config.x` and never falls back to a
default of its own. Override from the command line, e.g.
`--config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2`.
"""

import ml_collections

from tx_jax.layers import axes

ACT = axes.ACTIVATION_AXES  # activation axis name by shape letter


def mesh_config() -> ml_collections.ConfigDict:
  """The `config.mesh` section: device-mesh axis sizes; their product is the device count."""
  c = ml_collections.ConfigDict()
  c.data = -1  # data-parallel replicas (batch split, params replicated); -1 = fill the rest
  c.fsdp = 1  # ZeRO-3 shards: batch split and params + optimizer state split; -1 = fill
  c.sequence = 1  # sequence parallelism: activations split along their length; -1 = fill
  c.tensor = 1  # Megatron tensor parallelism: heads / mlp / vocab split; -1 = fill
  # CPU only: the CPU devices a run uses. The process is split into this many before JAX
  # starts (one that already has more uses the first N); the axis left at -1 spreads over
  # them. 0 = every device JAX has, by default one per process (sharding.use_cpu_devices).
  c.cpu_devices = 0
  return c


def sharding_config() -> ml_collections.ConfigDict:
  """The `config.sharding` section: how logical axis names map onto the mesh axes."""
  c = ml_collections.ConfigDict()
  # (logical axis, mesh axis | tuple of mesh axes | None) in priority order: within one array
  # a mesh axis is used at most once, by the first rule that claims it. Logical names are
  # defined in tx_jax/layers/axes.py. None = replicated along that axis.
  c.rules = [
      # Activations: batch over data and fsdp, Megatron-split inner dims over tensor.
      (ACT["B"], ("data", "fsdp")),
      (ACT["T"], "sequence"),
      (ACT["S"], None),
      (ACT["D"], None),
      (ACT["N"], "tensor"),
      (ACT["K"], "tensor"),
      (ACT["H"], None),
      (ACT["F"], "tensor"),
      (ACT["V"], "tensor"),
      # Parameters. Column-parallel QKV [embed, heads, head_dim] and up/gate [embed, mlp]
      # split their output dim over tensor; row-parallel out [heads, head_dim, embed] and
      # down [mlp, embed] split their input dim; the embedding [vocab, embed] and the lm head
      # [embed, vocab] split the vocabulary. Every `embed` dim is split over fsdp (ZeRO-3).
      (axes.VOCAB, "tensor"),
      (axes.HEADS, "tensor"),
      (axes.KV_HEADS, "tensor"),
      (axes.MLP, "tensor"),
      (axes.EMBED, "fsdp"),
      (axes.HEAD_DIM, None),
      (axes.QKV, None),
      (axes.LAYERS, None),
      (axes.RELPOS_BUCKETS, None),
      (axes.TYPE_VOCAB, None),
      (axes.POSITION, None),
      (axes.LORA_RANK, None),
  ]
  return c
