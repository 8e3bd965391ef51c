"""tx_jax.data."""
