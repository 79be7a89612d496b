"""Serving, whatever the engine: the sender's hand-outs, the requests they follow, and a tensor-
parallel group across nodes. An engine's adapter (vLLM's: the vllm layer) turns its calls and
items into these.

    _sender.py     Sender: hits, misses, touches, settle-then-retry, delivery to the engine
    _receiver.py   Receiver: a worker's reads, each hand-out once per request, checked first
    _requests.py   RequestLedger: every hand-out settled with its request
    _nodes.py      HeadPublisher (the head's relay Publisher) and NodeFeed (a worker on node k)
    _deployment.py Shape (a deployment: store, API servers, engines, nodes, timings) and
                   open_writer, which picks this process's writer by shape
    _pool.py       MissPool: misses processed by worker processes straight into the store,
                   one processing per key in flight, every failure a fallback outcome
    _pool_share.py PoolHost and PoolClient: one pool per node, served to its other API servers
    _log.py        the core's logger, sent through the engine's own (log_to)

May import: errors, handle, _proc, shm, serde, local, store, queue, cache, relay.
"""
