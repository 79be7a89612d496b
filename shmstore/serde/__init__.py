"""Values to bytes and back: a msgpack structure plus out-of-band array and tensor buffers
written straight into shared memory; no pickle, and the decoder accepts exactly what the
encoder can produce.

    _codec.py     encode / decode, dumps / loads, Blank, Verbatim
    _decode.py    the checked decoder
    _types.py     the extension type codes both sides share

May import: errors, handle.
"""
