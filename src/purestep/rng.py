"""Counter-based PRNG keys (placeholder; being written)."""
