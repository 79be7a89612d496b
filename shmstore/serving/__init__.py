"""Serving, whatever the engine: the sender's hand-outs, the requests they follow, and a tensor-
parallel group across nodes. An engine's adapter (vLLM's: the vllm layer) turns its calls and
items into these.

    _sender.py     Sender: hits, misses, touches, settle-then-retry, delivery to the engine
    _receiver.py   Receiver: a worker's reads, each hand-out once per request, checked first
    _requests.py   RequestLedger: every hand-out settled with its request
    _nodes.py      HeadPublisher (the head's relay Publisher) and NodeFeed (a worker on node k)
    _deployment.py Shape (a deployment: store, API servers, engines, nodes, pool, timings),
                   open_writer and open_pool, which pick this process's writer and its way
                   into the node's miss pool by shape
    _pool.py       MissPool: misses processed by worker processes straight into the store,
                   one processing per key in flight, every failure a fallback Outcome
    _crew.py       the pool's workers: their lives in the owner (Crew) and the worker process
    _lending.py    PoolStore and Lending: the chunks a worker writes an item into, lent and
                   published by the writer in the pool's process, through the worker's pipe
    _outcome.py    the pool's words: Outcome, check_job, Processor, PoolStats, the Pool protocol
    _pool_share.py PoolHost and PoolClient: one pool per node, served to its other API servers
    _photos.py     PhotoOutbox and read_photo: a miss's photo by shared memory, read in place
    _log.py        the core's logger, sent through the engine's own (log_to)

May import: errors, handle, _proc, shm, serde, local, store, queue, cache, relay.
"""
