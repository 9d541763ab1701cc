"""The C extensions live here because setuptools declares ext_modules in setup.py."""

import os
import shlex

from setuptools import Extension, setup

# Every warning is an error: the C runs inside shared memory that other processes
# trust, so a warning is fixed rather than read past. RENDERQUEUE_CFLAGS adds flags
# (the sanitizer build of `make sanitize`).
CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror"]
CFLAGS += shlex.split(os.environ.get("RENDERQUEUE_CFLAGS", ""))
LDFLAGS = shlex.split(os.environ.get("RENDERQUEUE_LDFLAGS", ""))

SHM = ["module", "words", "ring", "leases", "hash", "sites"]
KEEPER = ["module", "index", "select", "moves", "buckets", "skips"]

setup(
    ext_modules=[
        Extension(
            "shm._atomics",
            sources=[f"shm/csrc/{name}.c" for name in SHM],
            depends=["shm/csrc/atomics.h"],
            extra_compile_args=CFLAGS,
            extra_link_args=LDFLAGS,
        ),
        Extension(
            "keeper._native",
            sources=[f"keeper/csrc/{name}.c" for name in KEEPER],
            depends=["keeper/csrc/native.h", "keeper/csrc/skips.h"],
            extra_compile_args=CFLAGS,
            extra_link_args=LDFLAGS,
        ),
    ]
)
