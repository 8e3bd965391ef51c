"""Generic Transformer building blocks; no model-family names inside.

Shape suffixes on tensor names (after nanodo):
  B batch, T query length, S key/value length, D model width, N query heads,
  K key/value heads, H head dim, F mlp width, V vocabulary, L layers.
So `q_BTNH` is a query tensor of shape [batch, query length, heads, head dim].

Logical axis names. Parameters and activations carry separate names so that
`tx_jax.sharding` can map them to mesh axes independently:
  parameters:  vocab, embed, mlp, heads, kv_heads, head_dim, layers,
               relpos_buckets, type_vocab, position
  activations: act_batch, act_len, act_kv_len, act_embed, act_heads,
               act_kv_heads, act_head_dim, act_mlp, act_vocab
"""
