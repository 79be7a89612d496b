"""The tiny models the vLLM tests serve: `shmstore tiny-model`'s builder (shmstore/cli/_tiny.py)."""

from shmstore.cli._tiny import IMAGE_SIZE, build

__all__ = ["IMAGE_SIZE", "build"]
