"""``tokenmill router``: a cache-aware router over OpenAI-compatible backends (its own process).

Modules: :mod:`~tokenmill.router.backends` (specs, health checks),
:mod:`~tokenmill.router.policies` (round_robin, least_load, prefix_aware,
kv_aware), :mod:`~tokenmill.router.prefix_tree` (approximate per-backend
prefix tree), :mod:`~tokenmill.router.kv_index` (KV event subscriber and
block index), :mod:`~tokenmill.router.prompt` (tokenization and block hashes
as the engine computes them), :mod:`~tokenmill.router.app` (the HTTP proxy).
"""
