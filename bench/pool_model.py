"""A model of new-image throughput and preprocessing latency against the miss pool's size, for
nodes bigger than this one, from per-item costs measured here (bench_pool.py).

    python bench/pool_model.py [--worker-ms 62] [--thread-ms 56] [--hit-ms 3]
                               [--cores 16,64] [--api-servers 1,4]

Each miss is a job: on vLLM alone, served by its API servers' one multimodal thread each
(`--thread-ms` per miss: decode plus HF processor); with the pool, by W worker processes
(`--worker-ms` per miss, what one costs in a worker: bench_pool's CPU per miss), after which
the API server's thread still spends `--hit-ms` on it (the item is a hit there: hash, record,
hand-out). Arrivals are Poisson (M/M/c, Erlang C): the mean time a miss spends before its
request leaves preprocessing is the wait for a free server plus the service. Assumptions: the
engines run on accelerators (their CPU is not counted), the pool's workers and the API servers
have a core each, and the GIL is not shared (separate processes). Nothing here is measured on a
16- or 64-core node: the per-item costs are, the scaling is the model's.
"""

from __future__ import annotations

import argparse
import math


def erlang_c_wait_s(arrivals_per_s: float, servers: int, service_s: float) -> float:
    """Mean wait in queue of an M/M/c queue (inf when saturated)."""
    load = arrivals_per_s * service_s  # offered load in servers
    if load >= servers:
        return math.inf
    term = sum(load**k / math.factorial(k) for k in range(servers))
    top = load**servers / math.factorial(servers) * servers / (servers - load)
    p_wait = top / (term + top)
    return p_wait * service_s / (servers - load)


def latency_ms(rate: float, servers: int, service_s: float) -> float:
    return 1e3 * (erlang_c_wait_s(rate, servers, service_s) + service_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker-ms", type=float, default=62.0)
    parser.add_argument("--thread-ms", type=float, default=56.0)
    parser.add_argument("--hit-ms", type=float, default=3.0)
    parser.add_argument("--cores", default="16,64")
    parser.add_argument("--api-servers", default="1,4")
    args = parser.parse_args()
    worker_s, thread_s, hit_s = args.worker_ms / 1e3, args.thread_ms / 1e3, args.hit_ms / 1e3
    print(f"per miss: {args.thread_ms:g} ms on vLLM's thread, {args.worker_ms:g} ms in a pool "
          f"worker then {args.hit_ms:g} ms on the thread (a hit there)")
    for cores in (int(c) for c in args.cores.split(",")):
        for api in (int(a) for a in args.api_servers.split(",")):
            pools = sorted({w for w in (1, 2, 4, 8, 16, 32, cores - api) if 1 <= w <= cores - api})
            vllm_cap = api / thread_s
            print(f"\n{cores}-core node, {api} API server(s): vLLM alone takes at most "
                  f"{vllm_cap:.0f} new images/s")
            rates = [r for r in (0.5 * vllm_cap, 0.9 * vllm_cap, 2 * vllm_cap, 8 * vllm_cap)]
            print("pool  misses/s max   " + "  ".join(f"ms at {r:5.0f}/s" for r in rates))
            row = "  ".join(f"{latency_ms(r / api, 1, thread_s):11.0f}" for r in rates)
            print(f"none {vllm_cap:11.0f}     {row}")
            for w in pools:
                cap = min(w / worker_s, api / hit_s)
                lat = [latency_ms(r, w, worker_s) + latency_ms(r / api, 1, hit_s) for r in rates]
                print(f"{w:4d} {cap:11.0f}     " + "  ".join(f"{x:11.0f}" for x in lat))
    print("\n(inf: more arrivals than the servers can take: the queue grows without bound)")


if __name__ == "__main__":
    main()
