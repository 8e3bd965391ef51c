"""Generic Transformer building blocks; no model-family names inside.

Shape suffixes on tensor names (after nanodo):
  B batch, T query length, S key/value length, D model width, N query heads,
  K key/value heads, H head dim, F mlp width, V vocabulary, L layers.
So `q_BTNH` is a query tensor of shape [batch, query length, heads, head dim].
Attention backends add G query heads per key/value head (N = K * G) and positions add
I frequencies (half the head dim). Decoding (tx_jax/decode) adds P prompt length,
Y generated tokens (y of beam search's lp(y)), W beams and E = 2W candidates per beam step.

Logical axis names (parameters and activations named separately, so that `tx_jax.sharding`
maps them to mesh axes independently) are constants in `layers/axes.py`; activations are
constrained by their shape letters: `axes.constrain(x_BTD, "BTD")`.
"""
