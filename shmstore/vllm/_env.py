"""The plugin's own environment variables, named once for the plugin and the caches it installs."""

ENABLE_ENV = "SHMSTORE_VLLM"  # 0/1, false/true, off/on: the plugin off or on
POLICY_ENV = "VLLM_OBJECT_STORAGE_SHM_POLICY"  # a name of store.policy.POLICIES
