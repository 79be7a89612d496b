"""Messages: a broadcast queue (one writer, every reader gets every message, in order) and the
Channel that sends small values inline and large ones by handle through a store.

    _broadcast.py  BroadcastQueue.create / attach, QueueReader
    _writer.py     QueueWriter
    _layout.py     the binary layout of the queue's header, reader rows and slots
    _slots.py      the hand-off, chosen once at import: compiled (_native/) or its Python twin
    _channel.py    Channel, ChannelWriter, ChannelReader

May import: errors, handle, _proc, _native, shm, serde, store.
"""
