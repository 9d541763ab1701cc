"""renderqueue: fleet."""
