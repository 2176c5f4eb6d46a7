"""The roofline of one benchmark cell: the fastest any engine doing tokenmill's arithmetic could serve it here.

A ``compare_engines`` cell (``N`` prompts of ``input_len`` tokens, ``output_len`` greedy tokens each, at most
``concurrency`` in flight, all sent at once) is replayed through a model of vLLM's chunked-prefill scheduler
(Agrawal et al., "Sarathi-Serve", OSDI 2024, §4: each step first gives every running request its one decode
token, then fills the remaining ``--max-num-batched-tokens`` budget with prompt chunks in arrival order). Every
step's lower bound comes from :func:`roofline.step_cost_parts` with the rates of a ``benchmarks/roofline.py
--json`` run on the same machine::

    step bound = max(bytes / bandwidth, linear FLOPs / int8 rate + attention FLOPs / float GEMM rate)

(the "i8 bound" of roofline.py: the linears run the exact integer path). The cell's wall bound is the sum of its
steps' bounds, so its output tok/s bound is ``N × output_len / wall bound``; against another engine's measured
tok/s in the same cell it gives the largest ratio this arithmetic can reach on this machine. ``--int8-gflops``
replaces the int8 rate, e.g. by the instruction peak of the integer path's multiply-adds (a looser roof than a
library's GEMM rate: benchmarks/lowbit_kernel_ab.py).

The model ignores what no bound can see: sampling, element-wise kernels, the scheduler, and the time between
steps. Bytes count every weight once per step and every request's cached K/V.

    .venv/bin/python benchmarks/roofline.py --skip-engine --batches 1 --json /tmp/rl.json
    .venv/bin/python benchmarks/cell_roofline.py --roofline /tmp/rl.json \\
        --compare docs/benchmarks/2026-12-02-compare-engines-avx2-night.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import _HEAD_BYTES, step_cost_parts  # noqa: E402


@dataclass
class Rates:
    """Machine rates of one roofline run: read bandwidth (GB/s), int8 and float GEMM rates (GFLOP/s)."""
    bandwidth_gbs: float
    int8_gflops: float
    float_gflops: float


def schedule_cell(num_prompts: int, input_len: int, output_len: int, concurrency: int,
                  budget: int) -> list[tuple[list[int], list[int], int]]:
    """The steps of one cell under chunked prefill: ``[(query_lens, contexts, sample_rows), ...]``.

    Each step: every running request with its prompt done decodes one token; the remaining ``budget`` goes to
    prompt chunks in arrival order (at most ``concurrency`` requests admitted at once). A request samples in the
    step that finishes its prompt (its first output token) and in each decode step until ``output_len`` tokens.

    Raises:
        ValueError: a non-positive size or a budget smaller than the concurrency (decodes would not fit).
    """
    if min(num_prompts, input_len, output_len, concurrency, budget) <= 0 or budget < concurrency:
        raise ValueError("sizes must be positive and the budget at least the concurrency")
    waiting = list(range(num_prompts))
    running: dict[int, list[int]] = {}           # id -> [prompt tokens computed, output tokens]
    steps = []
    while waiting or running:
        while waiting and len(running) < concurrency:
            running[waiting.pop(0)] = [0, 0]
        decoding = [st for st in running.values() if st[0] == input_len]
        left = budget - len(decoding)
        chunks = []                               # (state, prompt tokens this step), oldest first
        for st in running.values():
            if st[0] < input_len and left > 0:
                take = min(left, input_len - st[0])
                chunks.append((st, take))
                left -= take
        ql = [1] * len(decoding) + [t for _, t in chunks]
        ctx = [input_len + st[1] - 1 for st in decoding] + [st[0] for st, _ in chunks]
        rows = len(decoding) + sum(1 for st, t in chunks if st[0] + t == input_len)
        for st in decoding:
            st[1] += 1
        for st, take in chunks:
            st[0] += take
            if st[0] == input_len:
                st[1] = 1                         # the step that ends the prompt samples the first token
        for rid in [r for r, st in running.items() if st[1] >= output_len]:
            del running[rid]
        steps.append((ql, ctx, rows))
    return steps


def step_bound(arch, rates: Rates, ql: list[int], ctx: list[int], rows: int, dtype_bytes: int,
               head_bytes: float | None, kv_bytes: float | None = None) -> float:
    """Seconds: ``max(bytes / bandwidth, linear FLOPs / int8 rate + attention FLOPs / float rate)``;
    ``kv_bytes``: bytes per KV cache element (None: ``dtype_bytes``)."""
    parts = step_cost_parts(arch, dtype_bytes, ql, ctx, sample_rows=rows, int4_linear=True, head_bytes=head_bytes,
                            kv_bytes=kv_bytes)
    nbytes = sum(b for b, _ in parts.values())
    return max(nbytes / (rates.bandwidth_gbs * 1e9),
               parts["linear"][1] / (rates.int8_gflops * 1e9) + parts["attention"][1] / (rates.float_gflops * 1e9))


def cell_bound(arch, rates: Rates, num_prompts: int, input_len: int, output_len: int, concurrency: int,
               budget: int, dtype_bytes: int = 4, head_bytes: float | None = _HEAD_BYTES["Q8_0"],
               kv_bytes: float | None = None) -> dict:
    """The cell's wall bound (s), output tok/s bound, and its prefill-carrying / decode-only split (s);
    ``kv_bytes``: bytes per KV cache element (None: ``dtype_bytes``)."""
    steps = schedule_cell(num_prompts, input_len, output_len, concurrency, budget)
    mixed = decode = 0.0
    for ql, ctx, rows in steps:
        t = step_bound(arch, rates, ql, ctx, rows, dtype_bytes, head_bytes, kv_bytes)
        if any(q > 1 for q in ql):
            mixed += t
        else:
            decode += t
    wall = mixed + decode
    return {"steps": len(steps), "wall_s": wall, "mixed_s": mixed, "decode_s": decode,
            "output_tok_s": num_prompts * output_len / wall}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--roofline", required=True, help="JSON of benchmarks/roofline.py --json (same machine)")
    p.add_argument("--compare", help="compare_engines JSON: take the random cells' sizes and measured tok/s")
    p.add_argument("--model", default=None, help="GGUF (default: the packaged SmolLM2-135M)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--int8-gflops", type=float, default=None,
                   help="int8 rate for the linears instead of the roofline run's (e.g. the instruction peak)")
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args(argv)

    from tokenmill.model.checkpoint import load_arch_config
    from tokenmill.model.default_model import default_model_path

    rl = json.load(open(args.roofline))
    arch = load_arch_config(args.model or default_model_path())
    rates = Rates(rl["bandwidth_gbs"], rl["int8_rate_gflops"], rl["compute_rate_gflops"])
    roofs = {"library int8 rate": rates}
    if args.int8_gflops:
        roofs["given int8 rate"] = Rates(rates.bandwidth_gbs, args.int8_gflops, rates.float_gflops)
    dtype_bytes = 4 if rl.get("dtype", "float32") == "float32" else 2
    # the KV cache the roofline run's engine read (a float32 model's default cache on the CPU low-bit path is
    # bfloat16); runs before 2026-12-03 08:10 UTC did not record it: the model's dtype, as they assumed
    kv_bytes = rl.get("kv_elem_bytes", dtype_bytes)

    cells = [("random", args.concurrency, args.num_prompts, args.input_len, args.output_len, {})]
    if args.compare:
        doc = json.load(open(args.compare))
        doc = doc.get("compare_quick", doc)
        cells = []
        for conc in sorted({c["concurrency"] for c in doc["cells"] if c["workload"] == "random"}):
            measured = {c["engine"]: c["output_throughput"] for c in doc["cells"]
                        if c["workload"] == "random" and c["concurrency"] == conc}
            n = next(c["num_requests"] for c in doc["cells"] if c["workload"] == "random" and c["concurrency"] == conc)
            cells.append(("random", conc, n, doc["input_len"], doc["output_len"], measured))

    print(f"machine (roofline run {rl.get('time_utc', '?')}): read {rates.bandwidth_gbs:.1f} GB/s, "
          f"float {rates.float_gflops:.0f} GFLOP/s, int8 {rates.int8_gflops:.0f} GFLOP/s; "
          f"budget {args.max_num_batched_tokens} tokens/step; KV {kv_bytes} bytes per element")
    out = []
    for wl, conc, n, ilen, olen, measured in cells:
        for roof, r in roofs.items():
            b = cell_bound(arch, r, n, ilen, olen, conc, max(args.max_num_batched_tokens, conc), dtype_bytes,
                           kv_bytes=kv_bytes)
            line = (f"{wl} c={conc} ({n} x {ilen}->{olen}), {roof} {r.int8_gflops:.0f}: {b['steps']} steps, "
                    f"wall bound {b['wall_s']:.2f} s (prefill-carrying {b['mixed_s']:.2f}, decode {b['decode_s']:.2f})"
                    f", {b['output_tok_s']:.1f} tok/s")
            rec = {"workload": wl, "concurrency": conc, "num_prompts": n, "input_len": ilen, "output_len": olen,
                   "roof": roof, "int8_gflops": r.int8_gflops, **b, "measured_tok_s": measured}
            for eng, tps in measured.items():
                if eng == "tokenmill":
                    line += f"; tokenmill {tps:.1f} = {tps / b['output_tok_s']:.0%} of it"
                else:
                    line += f"; bound / {eng} {b['output_tok_s'] / tps:.2f}x"
            print(line)
            out.append(rec)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"roofline": args.roofline, "cells": out}, f, indent=1)


if __name__ == "__main__":
    main()
