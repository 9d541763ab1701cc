"""Bench only: `bench.sections.cluster` puts this directory on a node's PYTHONPATH with
RQ_BENCH_PROBE set, so the node's worker 0 carries `bench.harness.cluster_probe`."""

import os
import sys

if os.environ.get("RQ_BENCH_PROBE"):
    try:
        from bench.harness.cluster_probe import install

        install(os.environ["RQ_BENCH_PROBE"])
    except Exception as exc:  # the node must still start; the bench notices the missing probe
        print(f"bench.harness.cluster_probe: not installed: {exc!r}", file=sys.stderr)
