"""Generic Transformer building blocks; no model-family names inside.

Shape suffixes on tensor names (after nanodo):
  B batch, T query length, S key/value length, D model width, N query heads,
  K key/value heads, H head dim, F mlp width, V vocabulary, L layers.
So `q_BTNH` is a query tensor of shape [batch, query length, heads, head dim].
Attention backends add G query heads per key/value head (N = K * G) and positions add
I frequencies (half the head dim). Decoding (tx_jax/decode) adds P prompt length,
Y generated tokens (y of beam search's lp(y)), W beams and E = 2W candidates per beam step.

Logical axis names. Parameters and activations carry separate names so that
`tx_jax.sharding` can map them to mesh axes independently:
  parameters:  vocab, embed, mlp, heads, kv_heads, head_dim, layers,
               relpos_buckets, type_vocab, position
  activations: act_batch, act_len, act_kv_len, act_embed, act_heads,
               act_kv_heads, act_head_dim, act_mlp, act_vocab
"""
