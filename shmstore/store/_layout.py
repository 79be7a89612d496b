"""The binary layouts of an object store: its meta area, reader rows and objects.

Store meta area (segment offset 64, after the segment header; little-endian)::

    offset  size  field
    0       8     max_object_bytes  u64, largest serialized object accepted
    8       4     policy            u32, policy.POLICY_IDS
    12      4     reserved
    16      8     handout_seq       u64, number of the last hand-out (written by the writer)
    24      40    reserved
    64      128*n reader rows (shm/_readers.py head, then the store's words):
                    0   8   owner            shm/_readers.py
                    8   8   ready_ns         shm/_readers.py
                    16  8   attach_handout   hand-outs up to this number are not owed to this
                                             reader generation
                    24  8   total_reads      reads this row finished, ever
                    32  8   corrupt_reads    objects this row gave up on (failed validation)
                    40  8   pin_mask         bit i set: pins[i] holds a seq
                    48  8   done_through     0, or: this reader takes its hand-outs in order
                                             and is done with every one up to this number
                                             (read, or lost with a damaged message)
                    56  8   reserved
                    64  64  pins[8]          seqs of chunks this reader is inside of now

Object layout (the payload of one ring chunk)::

    offset  size  field
    0       16    key_digest      blake2b-128 of the key
    16      8     body_bytes      u64, serialized size (serde body)
    24      4     structure_crc   u32, CRC-32 of the body's header, buffer table and msgpack
                                  structure, continued over body_bytes (not the raw array bytes)
    28      4     reserved
    32      8     origin_seq      u64, seq of the put that wrote these bytes; a copy forward
                                  keeps it, so (key_digest, origin_seq) names the content across
                                  moves (what a relay caches remote copies under)
    40      24    reserved
    64      8*n   read counters   u64 per reader: generation << 32 | reads by that generation,
                                  each written only by its reader (store-release)
    64+8n   pad   to a cache line
    header  ...   body            serde layout; arrays inside stay cache-line aligned

Pins (why a chunk under read is never reused)::

    reader                                   writer (freeing chunk seq X)
    1. pin_mask |= bit; pins[i] = X           1. chunk seq word = 0     (tombstone)
       (exchange: full barrier)                  (exchange: full barrier)
    2. chunk seq word == X ?  else Stale      2. any attached reader with a pin == X ?
    3. read; count the read                      yes: keep the bytes, try again later
    4. pins[i] = 0; pin_mask &= ~bit             no:  reuse the bytes

Dekker's argument: of the two exchanges one comes first in the total order; if the reader's
came first the writer sees the pin, otherwise the reader sees the tombstone. So a reader that
passed step 2 reads bytes that stay put until step 4, even across clear(); and its counter
store (step 3) never lands in another object.
"""

from __future__ import annotations

import struct

from ..shm._readers import ROW_HEAD_BYTES
from ..shm._segment import ALIGN_BYTES, align_up

__all__ = ["STORE_META", "OBJECT_HEADER", "STORE_ROW", "object_header_bytes", "counter_offset"]

STORE_META = struct.Struct("<QI4xQ40x")
STORE_ROW = struct.Struct("<QQQQQQQ8x8Q")
OBJECT_HEADER = struct.Struct("<16sQI4xQ24x")
assert STORE_META.size == OBJECT_HEADER.size == ALIGN_BYTES and STORE_ROW.size == 2 * ALIGN_BYTES
META_HANDOUT_SEQ = 16  # byte offsets inside the store meta area
ROW_ATTACH_HANDOUT = ROW_HEAD_BYTES  # byte offsets inside a reader row
ROW_TOTAL_READS = ROW_HEAD_BYTES + 8
ROW_CORRUPT_READS = ROW_HEAD_BYTES + 16
ROW_PIN_MASK = ROW_HEAD_BYTES + 24
ROW_DONE_THROUGH = ROW_HEAD_BYTES + 32
ROW_PINS = 64
MAX_PINS = 8  # views one reader may hold open at once (nested or in threads)
COUNT_MASK = (1 << 32) - 1
U64 = struct.Struct("<Q")


def object_header_bytes(n_readers: int) -> int:
    """Bytes before an object's body: the fixed header and one counter per reader."""
    return OBJECT_HEADER.size + align_up(8 * n_readers)


def counter_offset(address: int, reader: int) -> int:
    """Byte offset of `reader`'s read counter in the object at chunk `address`."""
    return address + ALIGN_BYTES + OBJECT_HEADER.size + 8 * reader
