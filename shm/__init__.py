"""renderqueue: shm."""
