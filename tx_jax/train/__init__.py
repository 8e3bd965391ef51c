"""tx_jax.train."""
