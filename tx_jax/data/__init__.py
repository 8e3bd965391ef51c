"""tx_jax.data: sources, tokenizers, task transforms and grain pipelines (ARCHITECTURE.md)."""

from tx_jax.data.context_order import to_zigzag
from tx_jax.data.pipeline import (
    build_eval_batches,
    build_train_iterator,
    check_global_rows,
    eval_examples,
    make_global_batch,
    validate,
)
from tx_jax.data.sources import build_source
from tx_jax.data.tokenizers import (
    ByteTokenizer,
    SentencePieceTokenizer,
    build_tokenizer,
    train_sentencepiece,
)

__all__ = [
    "ByteTokenizer",
    "SentencePieceTokenizer",
    "build_eval_batches",
    "build_source",
    "build_tokenizer",
    "build_train_iterator",
    "check_global_rows",
    "eval_examples",
    "make_global_batch",
    "train_sentencepiece",
    "to_zigzag",
    "validate",
]
