"""A service on this machine for this user: how the node's local services (a store's writer
host, the miss pool's host) are named, served and reached, whatever they say.

    _service.py   service_address (a name another user can neither predict nor take first),
                  SameUserServer (same-uid accept, a thread per connection, a bounded log of
                  refusals), connect (checks the peer's uid), readable
    _frames.py    a u32 length and a msgpack body: send_frame / recv_frame, each with its
                  limit and the refusal's advice as parameters

May import: errors, _proc, shm.
"""
