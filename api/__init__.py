"""renderqueue: api."""
