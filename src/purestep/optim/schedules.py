"""Learning-rate schedules (placeholder; being written)."""
