"""The `shmstore` command: ls, rm, gc, demo, hitrate, relay, serve and tiny-model.

    _commands.py the parser, ls / rm / gc, and main()
    _demo.py     `shmstore demo`: a frontend and tensor-parallel workers on real images
    _hitrate.py  `shmstore hitrate TRACE`: which cache and how big, from a trace
    _relay.py    `shmstore relay keygen | serve`
    _serve.py    `shmstore serve`: vLLM's `vllm serve` on its CUDA or CPU build
    _tiny.py     `shmstore tiny-model DIR`: a tiny LLaVA with random weights, built offline
    _units.py    sizes and ages as the command line reads and prints them
    _traces.py   request traces for `hitrate`: csv and libCacheSim's oracleGeneral, checked

May import: every other layer.
"""

from ._commands import main

__all__ = ["main"]
