"""The names the plugin is known by outside its code: its environment variables (each named
here once, read once by _deployment.py) and its logger; and check_settings, which reads every
one of them before vLLM starts (`shmstore serve`, the plugin's register), so that a bad value
is one line, not a traceback in an API server a minute later. Imports no vLLM."""

from __future__ import annotations

import os

LOG_NAME = "vllm.plugins.shmstore"  # a child of vLLM's logger: its handlers print our lines

ENABLE_ENV = "SHMSTORE_VLLM"  # 0/1, false/true, off/on: the plugin off or on
POLICY_ENV = "VLLM_OBJECT_STORAGE_SHM_POLICY"  # a name of store._policy.POLICIES
SETTLE_ENV = "SHMSTORE_VLLM_SETTLE_S"  # after a request ends: when its unread hand-outs go
LEASE_ENV = "SHMSTORE_VLLM_LEASE_S"  # a hand-out no request claimed: when it goes
PUBLISH_ENV = "SHMSTORE_VLLM_PUBLISH"  # head: the address its Publisher binds
KEYS_ENV = "SHMSTORE_VLLM_KEYS"  # head: its CurveZMQ key pair (NAME.key_secret)
ALLOW_ENV = "SHMSTORE_VLLM_ALLOW"  # head: relays' public key files, separated by ':'
INSECURE_ENV = "SHMSTORE_VLLM_INSECURE"  # head: 1 to publish over plain TCP (no keys)
WAIT_ENV = "SHMSTORE_VLLM_WAIT_S"  # node k worker: longest wait for an item's handle
METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client's: /metrics from files
ACCELERATE_ENV = "SHMSTORE_VLLM_ACCELERATE"  # 0/1 (default 1): lazy images and records (_accel)
POOL_ENV = "SHMSTORE_VLLM_POOL"  # the node's miss pool workers: N, 0/off, or auto (default)
# the switches ACCELERATE_ENV replaced: still read (0 turns the acceleration off), with a warning
REPLACED_ENV = ("SHMSTORE_VLLM_LAZY_IMAGES", "SHMSTORE_VLLM_SHARE_UPDATES")

MAX_POOL_WORKERS = 256
OFF = ("0", "off", "false", "no")


def pool_setting() -> int | None:
    """POOL_ENV's number of workers (0: none), None for auto (unset or "auto").

    Raises:
        InvalidArgument: a value that is none of these, saying what to set.
    """
    from .._proc import int_arg
    from ..errors import InvalidArgument

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
    from .._proc import env_seconds, env_switch
    from ..errors import InvalidArgument
    from ..store._policy import DEFAULT_POLICY, POLICIES

    known = {value for name, value in globals().items()
             if name.endswith("_ENV") and isinstance(value, str)} | set(REPLACED_ENV)
    for name in sorted(os.environ):
        if name.startswith(ENABLE_ENV + "_") and name not in known:
            settings = ", ".join(sorted(n for n in known if n.startswith(ENABLE_ENV)))
            raise InvalidArgument(f"{name} is not a setting of shmstore's vLLM plugin (a typo?); "
                                  f"its settings are {settings}", name, os.environ[name])
    for switch in (ENABLE_ENV, ACCELERATE_ENV, INSECURE_ENV, *REPLACED_ENV):
        env_switch(switch, True)
    for seconds in (SETTLE_ENV, LEASE_ENV, WAIT_ENV):
        env_seconds(seconds, 1.0)
    pool_setting()
    policy = os.environ.get(POLICY_ENV, DEFAULT_POLICY).strip() or DEFAULT_POLICY
    if policy not in POLICIES:
        raise InvalidArgument(f"{POLICY_ENV}={policy!r} is not a policy: use one of "
                              f"{', '.join(POLICIES)} (or unset it: {DEFAULT_POLICY})",
                              POLICY_ENV, policy)
