"""This build's version, written here and nowhere else: the package metadata reads it
from this file (pyproject.toml), and the node reports it (`renderqueue --version`,
`renderqueue_build_info` in /metrics, `GET /v1/cluster`)."""

VERSION = "0.1.0"
