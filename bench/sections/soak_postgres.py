"""The soak (bench/sections/soak.py) on a scratch PostgreSQL database, with backend terminations
among the faults: `python -m bench soak_postgres [--minutes N] [--quick]`."""

from __future__ import annotations

import sys

from bench.sections.soak import main

if __name__ == "__main__":
    sys.exit(main(postgres=True))
