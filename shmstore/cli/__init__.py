"""The `shmstore` command: ls, rm, gc, demo, hitrate and relay.

    commands.py  the parser, ls / rm / gc, and main()
    demo.py      `shmstore demo`: a frontend and tensor-parallel workers on real images
    hitrate.py   `shmstore hitrate TRACE`: which cache and how big, from a trace
    relay.py     `shmstore relay keygen | serve`
    _units.py    sizes and ages as the command line reads and prints them
    _traces.py   request traces for `hitrate`: csv and libCacheSim's oracleGeneral, checked

May import: every other layer.
"""

from .commands import main

__all__ = ["main"]
