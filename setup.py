"""The one compiled part, shmstore.shm._atomic (ordered words, see its source), is optional:
where no C compiler exists the build goes on without it and shm/_ordering.py falls back to
ctypes (libatomic) or plain loads and stores. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shmstore.shm._atomic", ["shmstore/shm/_atomic.c"], optional=True)])
