"""renderqueue benchmarks: `python -m bench all [--quick]`."""
