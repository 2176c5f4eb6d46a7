"""Goodput benchmark for OpenAI-compatible servers (``tokenmill bench``).

Modules:
    metrics        TTFT/TPOT/ITL/E2EL, goodput and SLO attainment math (vLLM's definitions)
    arrivals       gamma-distributed request arrivals (rate, burstiness)
    datasets       workloads: random, prefix-repetition, mt-bench, jsonl
    tokenizer      local tokenizer resolution and loading (GGUF or HF folder)
    client         streaming SSE client for /v1/completions and /v1/chat/completions
    loadgen        the load generator (arrivals, concurrency cap, conversations)
    report         printed table and result JSON (vLLM key names)
    plots          latency CDFs, tokens/s over time, goodput curve
    goodput_search DistServe goodput search (arXiv 2401.09670)
    cli            ``bench serve`` and ``bench goodput`` argument parsing and runs
"""

from tokenmill.bench.metrics import BenchmarkMetrics, RequestRecord, compute_metrics, parse_goodput

__all__ = ["BenchmarkMetrics", "RequestRecord", "compute_metrics", "parse_goodput"]
