"""One ``tokenmill tune`` session's settings (:class:`TuneSettings`, its fingerprint for the state file) and the
playbook's lever order."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any


LEVER_ORDER = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold", "prefix_caching",
               "kv_cache_dtype", "quantization", "speculative", "replicas")


@dataclass
class TuneSettings:
    """Everything that defines a tuning session (the state file refuses to resume a different one).

    Attributes:
        model: model path passed to the server (None: the server's default).
        base_serve_args: serve flags the user fixed, e.g. ``["--dtype", "bfloat16"]``.
        serve_command: command that starts a server (model and flags are appended).
        workload: bench dataset arguments (dataset, dataset_path, num_prompts, input_len, output_len, range_ratio,
            prefix_len, num_prefixes, multi_turn, seed, ignore_eos, endpoint, tokenizer, temperature).
        slos: SLO limits in ms, e.g. ``{"ttft": 2000, "tpot": 100}``.
        attainment: target share of requests meeting the SLO.
        initial_rate, precision, min_rate, max_rate, max_probes: goodput search settings (as bench goodput).
        noise_runs: measurements of the starting configuration.
        warmup_probes: discarded probes of the whole workload on each fresh server before its search.
        levers: levers to try, in the playbook's order.
        budget_minutes: measuring time allowed (None: unbounded).
        startup_timeout_s: seconds a server may take to start.
        accuracy_report: JSON of ``benchmarks/quant_accuracy.py --json``; formats it finds not lossless are
            not tried (None: formats are tried and their accuracy reported as not checked).
    """

    model: str | None
    base_serve_args: list[str]
    serve_command: list[str]
    workload: dict[str, Any]
    slos: dict[str, float]
    attainment: float = 0.9
    initial_rate: float = 1.0
    precision: float = 0.1
    min_rate: float = 1.0 / 64
    max_rate: float = 1024.0
    max_probes: int = 8
    noise_runs: int = 2
    warmup_probes: int = 1
    levers: list[str] = field(default_factory=lambda: list(LEVER_ORDER))
    budget_minutes: float | None = None
    startup_timeout_s: float = 300.0
    accuracy_report: str | None = None

    def fingerprint(self) -> str:
        """Hash of what determines measurements (budget and lever list excluded: they may change on resume)."""
        d = asdict(self)
        for k in ("budget_minutes", "levers", "startup_timeout_s", "accuracy_report"):
            d.pop(k)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
