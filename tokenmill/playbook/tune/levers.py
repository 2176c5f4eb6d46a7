"""The playbook's levers: each proposes flag changes from the best trial so far, or says why it is skipped."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenmill.playbook.tune.measure import Measurement


MAX_STEPS_PER_LEVER = 3


@dataclass
class Change:
    """One candidate change: flags to set on top of the current best, and why."""

    flags: dict[str, Any]
    why: str


@dataclass
class LeverContext:
    """What a lever sees: the current best flags (over the base defaults), its measurement, the SLO, helpers."""

    best_flags: dict[str, Any]
    defaults: dict[str, Any]
    best: Measurement
    slos: dict[str, float]
    options: dict[str, argparse.Action]
    capacity: Callable[[dict[str, Any]], dict[str, Any] | None]
    accuracy: dict[str, dict[str, Any]] = field(default_factory=dict)

    def verdict(self, fmt: str) -> tuple[bool | None, str]:
        """(lossless?, text) for a weight format or ``kv-<dtype>`` from the accuracy report (None: not in it)."""
        r = self.accuracy.get(fmt)
        if r is None or "lossless" not in r:
            return None, ("accuracy not checked (pass --accuracy-report from benchmarks/quant_accuracy.py --json)"
                          if not self.accuracy else f"{fmt} not in the accuracy report")
        figs = ", ".join(f"{k} {r[k]:.4g}" for k in ("top1", "kl", "ppl_ratio", "greedy") if k in r)
        return bool(r["lossless"]), f"accuracy report: {'lossless' if r['lossless'] else 'NOT lossless'} ({figs})"

    def value(self, name: str) -> Any:
        return self.best_flags.get(name, self.defaults.get(name))

    def has(self, flag: str) -> bool:
        return flag in self.options

    def choices(self, flag: str) -> list[str]:
        a = self.options.get(flag)
        return list(a.choices or []) if a is not None else []


def _binding_slo(ctx: LeverContext) -> str:
    """'ttft' or 'tpot': the limit the best run's p99 is closer to (ratio p99 / limit)."""
    r_ttft = ctx.best.p99_ttft_ms / ctx.slos["ttft"] if "ttft" in ctx.slos else 0.0
    r_tpot = ctx.best.p99_tpot_ms / ctx.slos["tpot"] if "tpot" in ctx.slos else 0.0
    r_ttft = 0.0 if math.isnan(r_ttft) else r_ttft
    r_tpot = 0.0 if math.isnan(r_tpot) else r_tpot
    return "ttft" if r_ttft >= r_tpot else "tpot"


def lever_max_num_seqs(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--max-num-seqs"):
        return "the engine has no --max-num-seqs"
    seqs = int(ctx.value("max_num_seqs"))
    cap = ctx.capacity(ctx.best_flags)
    fit = cap["max_num_seqs_without_preemption"] if cap else None
    out: list[Change] = []
    if ctx.best.preemptions > 0:
        if ctx.has("--kv-cache-memory") and cap:
            mem = 2 * int(cap["kv_cache_memory"])
            out.append(Change({"kv_cache_memory": str(mem)},
                              f"{ctx.best.preemptions:.0f} preemptions: double the KV pool to {mem / 2**20:.0f} MiB"))
        if fit and fit < seqs:
            out.append(Change({"max_num_seqs": max(1, fit)},
                              f"{ctx.best.preemptions:.0f} preemptions: the pool holds {fit} requests at their peak "
                              f"(tokenmill plan), not {seqs}"))
        return out or "preemptions, but no KV memory or max_num_seqs change is possible"
    new = seqs * 2
    if fit is not None and fit < new:
        if fit > seqs:
            new = fit
        elif ctx.has("--kv-cache-memory") and cap:
            mem = 2 * int(cap["kv_cache_memory"])
            return [Change({"max_num_seqs": new, "kv_cache_memory": str(mem)},
                           f"no preemptions; {new} running requests need a larger pool ({mem / 2**20:.0f} MiB)")]
        else:
            return f"no preemptions and the pool holds no more than {fit} requests"
    return [Change({"max_num_seqs": new}, f"no preemptions at {seqs}: a bigger decode batch ({new})")]


def lever_max_num_batched_tokens(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--max-num-batched-tokens"):
        return "the engine has no --max-num-batched-tokens"
    cur = int(ctx.value("max_num_batched_tokens"))
    up, down = cur * 2, max(64, cur // 2)
    if _binding_slo(ctx) == "ttft":
        order = [(up, f"p99 TTFT is the binding limit: a larger step budget ({up}) prefills faster")]
        if down < cur:
            order.append((down, f"the opposite direction ({down})"))
    else:
        order = [(down, f"p99 TPOT is the binding limit: a smaller step budget ({down}) shortens decode steps")]
        order.append((up, f"the opposite direction ({up})"))
    return [Change({"max_num_batched_tokens": v}, why) for v, why in order if v != cur]


def lever_long_prefill_token_threshold(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--long-prefill-token-threshold"):
        return "the engine has no --long-prefill-token-threshold"
    cur = int(ctx.value("long_prefill_token_threshold") or 0)
    budget = int(ctx.value("max_num_batched_tokens") or 2048)
    if _binding_slo(ctx) != "ttft":
        return "p99 TPOT, not TTFT, is the binding limit: a prefill cap would not help"
    new = max(64, (cur or budget) // 4)
    if cur and new >= cur:
        return "already capped"
    return [Change({"long_prefill_token_threshold": new},
                   f"p99 TTFT is the binding limit: cap each prompt's share of a step at {new} tokens")]


def lever_prefix_caching(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--enable-prefix-caching"):
        return "the engine has no --enable-prefix-caching"
    if ctx.value("enable_prefix_caching"):
        return "already on"
    return [Change({"enable_prefix_caching": True}, "reuse KV blocks of shared prompt prefixes")]


def lever_kv_cache_dtype(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--kv-cache-dtype"):
        return "the engine has no --kv-cache-dtype (not on main yet)"
    want = [c for c in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8") if c in ctx.choices("--kv-cache-dtype")] or ["fp8"]
    if ctx.value("kv_cache_dtype") in want:
        return "already a 1-byte KV cache"
    out, refused = [], []
    for d in want:
        ok, text = ctx.verdict(f"kv-{d}")
        if ok is False:
            refused.append(f"{d}: {text}")
        else:
            out.append(Change({"kv_cache_dtype": d}, f"1-byte KV cache ({d}): twice the tokens in the pool; {text}"))
    return out[:1] or "; ".join(refused)


def lever_quantization(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--quantization"):
        return "the engine has no --quantization (not on main yet)"
    choices = [c for c in ("int8", "w8a8", "int4") if c in ctx.choices("--quantization")] or ["int8"]
    if ctx.value("quantization") in choices:
        return "already quantized"
    out, refused = [], []
    for q in choices:
        ok, text = ctx.verdict(q)
        if ok is False:
            refused.append(f"{q}: {text}")
        else:
            out.append(Change({"quantization": q}, f"{q} weights: fewer bytes read per decode step; {text}"))
    return out or "; ".join(refused)


def lever_speculative(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--speculative-config"):
        return "the engine has no --speculative-config (not on main yet)"
    if ctx.value("speculative_config"):
        return "already on"
    return [Change({"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
                   "n-gram speculative decoding (3 draft tokens): fewer decode steps when drafts are accepted")]


def lever_replicas(ctx: LeverContext) -> list[Change] | str:
    if not ctx.has("--data-parallel-size"):
        return "the engine has no --data-parallel-size (not on main yet)"
    cur = int(ctx.value("data_parallel_size") or 1)
    return [Change({"data_parallel_size": cur * 2}, f"{cur * 2} engine replicas behind one endpoint")]


LEVERS: dict[str, Callable[[LeverContext], list[Change] | str]] = {
    "max_num_seqs": lever_max_num_seqs, "max_num_batched_tokens": lever_max_num_batched_tokens,
    "long_prefill_token_threshold": lever_long_prefill_token_threshold, "prefix_caching": lever_prefix_caching,
    "kv_cache_dtype": lever_kv_cache_dtype, "quantization": lever_quantization, "speculative": lever_speculative,
    "replicas": lever_replicas,
}
