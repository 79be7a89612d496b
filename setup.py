"""The one compiled part, shmstore._native._atomic (ordered words and the queue's hand-off, see its
source), is optional: where no C compiler or no zlib header (zlib1g-dev) exists the build goes on
without it, shm/_ordering.py falls back to ctypes (libatomic) or plain loads and stores, and the
queue to its Python path. Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("shmstore._native._atomic", ["shmstore/_native/_atomic.c"],
                             libraries=["z"], optional=True)])
