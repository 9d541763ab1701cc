"""renderqueue: workers."""
