"""tx_jax.models."""
