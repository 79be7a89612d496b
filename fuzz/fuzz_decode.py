"""Coverage-guided fuzzing (atheris) of everything that parses bytes from shared memory.

    python fuzz/fuzz_decode.py -runs=200000            # or leave -runs out to run until stopped

Each input is tried as an object body (serde.decode, copies and views), as a packed Handle, and
as a store chunk whose headers and body come from the input. Any exception other than the
documented ones is a finding.
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    import numpy as np

    from shmstore.errors import CorruptObject, InvalidHandle, StaleHandle
    from shmstore.handle import Handle
    from shmstore.serde._codec import decode, dumps

SEED_BODY = dumps({"pixel_values": np.arange(12, dtype=np.float32).reshape(3, 4),
                   "sizes": (336, 336), "text": "x", "h": Handle(64, 1, b"k" * 16, 7)})


def test_one_input(data: bytes) -> None:
    body = memoryview(bytearray(data))
    for copy in (True, False):
        try:
            decode(body, copy=copy)
        except CorruptObject:
            pass
    try:
        decode(body, copy=False, expected_crc=0x12345678)
    except CorruptObject:
        pass
    try:
        Handle.unpack(data[:40])
    except InvalidHandle:
        pass
    # splice the input into a valid body: damage in the middle of real structure
    spliced = bytearray(SEED_BODY)
    if data:
        at = data[0] % len(spliced)
        spliced[at:at + len(data) - 1] = data[1:]
    try:
        decode(memoryview(spliced), copy=False)
    except (CorruptObject, StaleHandle):
        pass


def main() -> None:
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
