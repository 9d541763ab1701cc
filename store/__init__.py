"""renderqueue: store."""
