"""``tokenmill router``: a cache-aware router over OpenAI-compatible backends (its own process).

Modules: :mod:`~tokenmill.router.backends` (specs, health checks),
:mod:`~tokenmill.router.policies` (round_robin, least_load, prefix_aware,
kv_aware), :mod:`~tokenmill.router.prefix_tree` (approximate per-backend
prefix tree), :mod:`~tokenmill.router.kv_index` (KV event subscriber and
block index), :mod:`~tokenmill.router.prompt` (tokenization and block hashes
as the engine computes them), :mod:`~tokenmill.router.placement` (prefix groups and their
placement over the replicas' pools), :mod:`~tokenmill.router.router` (state and request path),
:mod:`~tokenmill.router.relay` (streaming answers to the client), :mod:`~tokenmill.router.metrics`
(the router's Prometheus metrics), :mod:`~tokenmill.router.pd` (prefill-decode disaggregation),
:mod:`~tokenmill.router.app` (the FastAPI app).

Imports go one way: ``app`` → ``pd`` → ``router`` → ``relay`` / ``metrics`` / ``policies``.
"""
