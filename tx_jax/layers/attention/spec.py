"""What may attend to what: a small description that any backend materialises per block.

An `AttentionSpec` holds, for queries and keys separately, segment ids (padding and
packing), indices (causality and sliding windows) and positions (relative biases), plus
the bias as parameters (`positions.RelativeBias`: T5's bucket table; `positions.AlibiBias`:
ALiBi slopes), and optionally an explicit boolean mask for patterns these fields can't say
(a prefix LM, a pattern of the caller's own).
Everything a [T, S] mask or bias needs is a function of these [B, T] / [B, S] vectors, so
any query block x key block pair can be materialised on its own: `spec.queries(start,
size).keys(start, size).mask()`. `dense` materialises the whole [T, S]; `blockwise` one
block at a time; a future ring attention swaps in the key half of another device's spec
(`with_keys`).

Rules:
- segment id 0 is padding: it attends to nothing and nothing attends to it; otherwise a
  query sees only keys of its own segment (packing);
- causal: key index <= query index (by index, not position: positions restart inside
  packed rows);
- window w: |query index - key index| < w (with causal: the w most recent keys);
- explicit_mask [B|1, 1|N, T, S]: True where the query may attend; ANDed with the above.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from tx_jax.layers.positions import AlibiBias, RelativeBias

Array = jnp.ndarray


Bias = RelativeBias | AlibiBias


def _slice(x_BL: Array, start: Array | int, size: int) -> Array:
  return jax.lax.dynamic_slice_in_dim(x_BL, start, size, axis=1)


def _arange_like(x_BL: Array) -> Array:
  return jnp.broadcast_to(jnp.arange(x_BL.shape[1], dtype=jnp.int32), x_BL.shape)


# The spec's per-token fields: what moves with the tokens when a sequence is split or reordered.
SEQUENCE_FIELDS = (
    "query_segment_ids",
    "key_segment_ids",
    "query_index",
    "key_index",
    "query_positions",
    "key_positions",
)


def _pad(x_BL: Array, length: int) -> Array:
  return jnp.pad(x_BL, ((0, 0), (0, length - x_BL.shape[1])))


def _slice_mask(mask: Array | None, axis: int, start: Array | int, size: int) -> Array | None:
  return None if mask is None else jax.lax.dynamic_slice_in_dim(mask, start, size, axis=axis)


@flax.struct.dataclass
class AttentionSpec:
  """Segment ids, indices and positions of queries [B, T] and keys [B, S], causal flag,
  optional sliding window, the bias parameters and an optional explicit mask."""

  query_segment_ids: Array  # [B, T] int; 0 = padding
  key_segment_ids: Array  # [B, S]
  query_index: Array  # [B, T] int; order for causality and the window
  key_index: Array  # [B, S]
  query_positions: Array  # [B, T] int; what the bias is a function of
  key_positions: Array  # [B, S]
  bias: Bias | None = None
  explicit_mask: Array | None = None  # [B|1, 1|N, T, S] bool, True = may attend
  causal: bool = flax.struct.field(pytree_node=False, default=False)
  window: int | None = flax.struct.field(pytree_node=False, default=None)
  # Query i is key i (self-attention over the whole sequence, indices 0..T-1): kernels
  # that take one segment-id array and index causality (Pallas GPU) need this.
  same_tokens: bool = flax.struct.field(pytree_node=False, default=False)
  # False promises one segment per row followed only by padding (ids 1..1 0..0), for queries
  # and keys alike, so kernels that take lengths (cuDNN) need no mask; ids are data, so the
  # promise comes from the config (data.pack). True (the safe default) makes no promise.
  packed: bool = flax.struct.field(pytree_node=False, default=True)

  @classmethod
  def self_attention(
      cls,
      segment_ids_BT: Array,
      positions_BT: Array | None = None,
      *,
      causal: bool,
      window: int | None = None,
      bias: Bias | None = None,
      index_BT: Array | None = None,
      explicit_mask: Array | None = None,
      packed: bool = True,
  ) -> AttentionSpec:
    """Queries and keys are the same tokens; index defaults to 0..T-1, positions to index."""
    same_tokens = index_BT is None
    if index_BT is None:
      index_BT = _arange_like(segment_ids_BT)
    if positions_BT is None:
      positions_BT = index_BT
    return cls(
        segment_ids_BT,
        segment_ids_BT,
        index_BT,
        index_BT,
        positions_BT,
        positions_BT,
        bias=bias,
        explicit_mask=explicit_mask,
        causal=causal,
        window=window,
        same_tokens=same_tokens,
        packed=packed,
    )

  @classmethod
  def cross_attention(
      cls, query_segment_ids_BT: Array, key_segment_ids_BS: Array, *, packed: bool = True
  ) -> AttentionSpec:
    """Encoder-decoder attention: a query sees the keys of its own segment, no causality.

    Packed seq2seq rows pair segment i of the decoder with segment i of the encoder, so the
    segment rule is the cross-attention mask; with all ids 1 (or 0) it is padding only.
    """
    q_index, k_index = _arange_like(query_segment_ids_BT), _arange_like(key_segment_ids_BS)
    return cls(
        query_segment_ids_BT, key_segment_ids_BS, q_index, k_index, q_index, k_index, packed=packed
    )

  @property
  def query_length(self) -> int:
    return self.query_segment_ids.shape[1]

  @property
  def key_length(self) -> int:
    return self.key_segment_ids.shape[1]

  def mask(self) -> Array:
    """Boolean [B, 1, T, S] (or [B, N, T, S] with a per-head explicit mask): True where
    query t may attend to key s."""
    q_seg, k_seg = self.query_segment_ids[:, :, None], self.key_segment_ids[:, None, :]
    allowed = (q_seg == k_seg) & (q_seg != 0) & (k_seg != 0)
    if self.causal or self.window is not None:
      offset_BTS = self.query_index[:, :, None] - self.key_index[:, None, :]
      if self.causal:
        allowed = allowed & (offset_BTS >= 0)
      if self.window is not None:
        allowed = allowed & (jnp.abs(offset_BTS) < self.window)
    allowed = allowed[:, None]
    if self.explicit_mask is not None:
      allowed = allowed & self.explicit_mask.astype(bool)
    return allowed

  def bias_logits(self) -> Array | None:
    """The additive bias [B, N, T, S] in float32, or None without a bias."""
    if self.bias is None:
      return None
    return self.bias.logits(self.query_positions, self.key_positions)

  def queries(self, start: Array | int, size: int) -> AttentionSpec:
    """The description of queries start..start+size-1 against all keys."""
    return self.replace(
        same_tokens=False,
        query_segment_ids=_slice(self.query_segment_ids, start, size),
        query_index=_slice(self.query_index, start, size),
        query_positions=_slice(self.query_positions, start, size),
        explicit_mask=_slice_mask(self.explicit_mask, 2, start, size),
    )

  def keys(self, start: Array | int, size: int) -> AttentionSpec:
    """The description of all queries against keys start..start+size-1."""
    return self.replace(
        same_tokens=False,
        key_segment_ids=_slice(self.key_segment_ids, start, size),
        key_index=_slice(self.key_index, start, size),
        key_positions=_slice(self.key_positions, start, size),
        explicit_mask=_slice_mask(self.explicit_mask, 3, start, size),
    )

  def with_keys(self, segment_ids_BS: Array, index_BS: Array, positions_BS: Array) -> AttentionSpec:
    """The same queries against other keys (for example another device's key block)."""
    if self.explicit_mask is not None:
      raise ValueError(
          "an AttentionSpec with an explicit_mask describes its own keys only; "
          "swapping in other keys needs the mask of those keys"
      )
    return self.replace(
        same_tokens=False,
        packed=True,  # other keys need not end where these queries' padding starts
        key_segment_ids=segment_ids_BS,
        key_index=index_BS,
        key_positions=positions_BS,
    )

  def padded(self, query_length: int, key_length: int) -> AttentionSpec:
    """Appends padding (segment id 0: sees nothing, seen by nothing) up to the given lengths."""
    explicit_mask = self.explicit_mask
    if explicit_mask is not None:
      pad_t, pad_s = query_length - self.query_length, key_length - self.key_length
      explicit_mask = jnp.pad(explicit_mask, ((0, 0), (0, 0), (0, pad_t), (0, pad_s)))
    return self.replace(
        explicit_mask=explicit_mask,
        same_tokens=self.same_tokens and query_length == key_length,
        query_segment_ids=_pad(self.query_segment_ids, query_length),
        query_index=_pad(self.query_index, query_length),
        query_positions=_pad(self.query_positions, query_length),
        key_segment_ids=_pad(self.key_segment_ids, key_length),
        key_index=_pad(self.key_index, key_length),
        key_positions=_pad(self.key_positions, key_length),
    )
