"""The C extensions live here because setuptools declares ext_modules in setup.py."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "shm._atomics",
            sources=["shm/_atomics.c"],
            extra_compile_args=["-O2", "-std=c11"],
        ),
        Extension(
            "keeper._native",
            sources=["keeper/_native.c"],
            extra_compile_args=["-O2", "-std=c11"],
        ),
    ]
)
