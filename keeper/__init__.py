"""renderqueue: keeper."""
