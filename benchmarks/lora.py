"""Multi-LoRA serving: the base alone vs N adapters cycled across requests, grouped delta vs per-request loop.

Engine arms (offline engine, one closed batch of ``c`` requests, random 128-token prompts, 64 output
tokens, ignore EOS, greedy; the same EngineCore loop the server runs):

* ``base``: an engine without ``--enable-lora`` (no wrapped layers);
* ``lora-0``: the LoRA engine serving only base requests (the wrappers' overhead);
* ``lora-N`` for N in 2, 8, 32: request ``i`` uses adapter ``i mod N`` (rank ``--rank``, all seven
  targets), ``--max-loras 32`` slots, delta in ``auto`` mode;
* ``torch-8``: 8 adapters with the grouped delta as batched torch ops (``stacked`` / ``segmented``
  picked by the cost model) instead of the C kernel — the ablation of the kernel;
* ``loop-8``: 8 adapters with the per-request loop (one shrink + expand GEMM pair per request per
  layer) instead of the grouped delta — the ablation of the grouping.

Every cell also records a profile of its steps (``StepProbe``): decode steps, their mean rows and
adapters, the step graph's share, mean forward and prepare milliseconds, total prefill forward time.

Arms are interleaved and repeated (``--repeat``); the machine is shared, so the figures are noisy
(the load average is recorded before and after every cell). Prints output tok/s and mean TPOT per arm
and concurrency, the ratio to ``base``, and memory: N merged models (N copies of the base's weights)
vs the base plus N adapters (CPU cache bytes) plus the slot buffers.

``--step-op`` adds the C kernel calls of one decode step with cold adapter weights (the bandwidth part).
``--op`` adds a micro-benchmark of one q/k/v-shaped layer's delta (stacked / segmented / loop) at
16 and 64 rows with 8 adapters, next to the base GEMM, to calibrate
:data:`tokenmill.model.layers.lora.CALL_COST_S` / ``GEMM_RATE``.

    .venv/bin/python benchmarks/lora.py --out docs/benchmarks/lora_2026-12-01
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time
from pathlib import Path

import torch

SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
          "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}


def machine() -> dict:
    flags = subprocess.run("grep -o -w 'amx_tile\\|avx512_bf16\\|avx512f\\|avx2' /proc/cpuinfo | sort -u",
                           shell=True, capture_output=True, text=True).stdout.split()
    return {"cpu_flags": flags, "nproc": os.cpu_count(), "platform": platform.platform(),
            "torch_threads": torch.get_num_threads()}


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def write_adapter(folder: Path, r: int, seed: int, layers: int = 30) -> str:
    """A random PEFT adapter (all seven targets, rank ``r``) for SmolLM2-135M."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(layers):
        for mod, (fin, fout) in SHAPES.items():
            block = "mlp" if mod in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{block}.{mod}"
            t[f"{key}.lora_A.weight"] = torch.randn(r, fin, generator=g) * 0.1
            t[f"{key}.lora_B.weight"] = torch.randn(fout, r, generator=g) * 0.02
    save_file(t, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(SHAPES), "bias": "none"}))
    return str(folder)


class StepProbe:
    """Wraps the runner's ``execute_model``: per step its rows, whether it was decode-only and ran the CPU step
    graph, and its forward / prepare seconds (the profile of a mixed step: does the graph stay on, do adapters
    shrink the batch the scheduler forms, where the time goes)."""

    def __init__(self, runner) -> None:
        self.runner, self.steps = runner, []
        self._orig = runner.execute_model
        runner.execute_model = self._wrapped

    def _wrapped(self, so):
        out = self._orig(so)
        if not so.is_empty:
            rows = sum(len(r.token_ids) for r in so.scheduled)
            decode = all(len(r.token_ids) == 1 for r in so.scheduled)
            g = self.runner.step_graph
            t = self.runner.last_timings
            self.steps.append({"rows": rows, "reqs": len(so.scheduled), "decode": decode,
                               "graph": bool(decode and g is not None and rows <= g.max_tokens),
                               "forward": t.get("forward", 0.0), "prepare": t.get("prepare", 0.0),
                               "adapters": len({r.lora_request.lora_int_id for r in so.scheduled
                                                if r.lora_request is not None})})
        return out

    def take(self) -> dict:
        st, self.steps = self.steps, []
        dec = [x for x in st if x["decode"]]
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0
        return {"steps": len(st), "decode_steps": len(dec),
                "decode_rows_mean": mean([x["rows"] for x in dec]),
                "decode_graph_share": mean([float(x["graph"]) for x in dec]),
                "decode_forward_ms": 1e3 * mean([x["forward"] for x in dec]),
                "decode_prepare_ms": 1e3 * mean([x["prepare"] for x in dec]),
                "decode_adapters_mean": mean([x["adapters"] for x in dec]),
                "prefill_forward_ms_total": 1e3 * sum(x["forward"] for x in st if not x["decode"])}


def run_cell(llm, prompts, loras, output_len: int, probe: StepProbe | None = None) -> dict:
    from tokenmill import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    la0 = loadavg()
    if probe is not None:
        probe.take()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, lora_request=loras)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = []
    for o in outs:
        m = o.metrics
        k = len(o.outputs[0].token_ids)
        if m.first_token_time and m.finished_time and k > 1:
            tpots.append((m.finished_time - m.first_token_time) / (k - 1))
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"requests failed: {errors[:3]}")
    return {"output_tokens": n, "seconds": dt, "tok_s": n / dt, "tpot_ms": 1e3 * sum(tpots) / len(tpots),
            "load_before": la0, "load_after": loadavg(), **(probe.take() if probe is not None else {})}


def op_bench(reps: int = 200, dtype: torch.dtype | None = None) -> list[dict]:
    """One q/k/v-shaped LoRALinear (576 -> 960, 3 slices) with 8 adapters of rank 16: delta modes vs base GEMM."""
    import numpy as np
    from torch import nn

    from tokenmill.model.layers.lora import LoRABatch, LoRALinear, load_kernel

    if dtype is None:
        dtype = torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32
    base = nn.Linear(576, 960, bias=False).to(dtype)
    slices = [("q_proj", 0, 576), ("k_proj", 576, 192), ("v_proj", 768, 192)]
    lin = LoRALinear(base, slices, 576, 8, 16, dtype)
    for s in range(8):
        lin.set_slot(s, {n: (torch.randn(16, 576, dtype=dtype) * .1, torch.randn(w, 16, dtype=dtype) * .1)
                         for n, _, w in slices})
    rows = []
    for n in (16, 64, 512):
        x = torch.randn(n, 576, dtype=dtype)
        per_req = [(i, i + 1, i % 8) for i in range(n)] if n <= 64 else \
            [(i * (n // 8), (i + 1) * (n // 8), i) for i in range(8)]   # prefill: 8 requests of n/8 rows
        out = {"rows": n, "dtype": str(dtype)}
        modes = ("kernel", "stacked", "segmented", "loop") if load_kernel() is not None else \
            ("stacked", "segmented", "loop")
        with torch.inference_mode():
            t0 = time.perf_counter()
            for _ in range(reps):
                y = base(x)
            out["base_gemm_us"] = 1e6 * (time.perf_counter() - t0) / reps
            for mode in modes:
                lin.batch = LoRABatch(dtype=dtype, mode=mode)
                lin.batch.fill(np.array([s for _, _, s in per_req]), np.array([b - a for a, b, _ in per_req]), n)
                lin.add_delta_(x, y)
                t0 = time.perf_counter()
                for _ in range(reps):
                    lin.add_delta_(x, y)
                out[f"{mode}_us"] = 1e6 * (time.perf_counter() - t0) / reps
        rows.append(out)
        print(f"op  rows={n:4d} ({dtype}): base GEMM {out['base_gemm_us']:.0f} us; delta "
              + ", ".join(f"{m} {out[f'{m}_us']:.0f} us" for m in modes))
    return rows


def step_op_bench(dtype: torch.dtype, layers: int = 30, slots: int = 8, rank: int = 16) -> list[dict]:
    """The C kernel calls of one decode step of SmolLM2-135M with ``slots`` adapters of rank ``rank`` on all targets:
    ``layers`` x (qkv, o, gate/up, down), each layer its own adapter weights (cold: the step streams them from
    memory, as in the engine), 16 and 64 rows, 1 and 2 threads; ``hot`` repeats the first layer's four calls
    ``layers`` times (weights cache-resident: the compute part). GB/s = the slot bytes read per step / time."""
    import numpy as np
    from torch import nn

    from tokenmill.model.layers.lora import LoRABatch, LoRALinear, load_kernel

    if load_kernel() is None:
        return []
    fused = [(576, ["q_proj", "k_proj", "v_proj"]), (576, ["o_proj"]), (576, ["gate_proj", "up_proj"]),
             (1536, ["down_proj"])]
    g = torch.Generator().manual_seed(0)
    batch, lins = LoRABatch(dtype=dtype), []
    for _ in range(layers):
        for fin, names in fused:
            sl, off = [], 0
            for nm in names:
                sl.append((nm, off, SHAPES[nm][1]))
                off += SHAPES[nm][1]
            lin = LoRALinear(nn.Identity(), sl, fin, slots, rank, dtype)
            for s in range(slots):
                lin.set_slot(s, {nm: (torch.randn(rank, fin, generator=g).to(dtype) * .1,
                                      torch.randn(w, rank, generator=g).to(dtype) * .1) for nm, _, w in sl})
            lin.batch = batch
            lins.append(lin)
    nbytes = sum((x.a_rows.numel() + x.b_all.numel()) * x.a_rows.element_size() for x in lins)
    out = []
    for rows in (16, 64):
        batch.fill(np.arange(rows) % slots, np.ones(rows, dtype=np.int64), rows)
        xs = {k: torch.randn(rows, k).to(dtype) for k in (576, 1536)}
        ys = [torch.zeros(rows, x.out_features, dtype=dtype) for x in lins]
        for threads in (1, 2):
            calls = [x.kernel_call(xs[x.in_features], y, threads) for x, y in zip(lins, ys)]
            for f, a in calls:
                f(*a)
            cold = 1e9
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(4):
                    for f, a in calls:
                        f(*a)
                cold = min(cold, (time.perf_counter() - t0) / 4)
            t0 = time.perf_counter()
            for _ in range(10):
                for f, a in calls[:4] * layers:
                    f(*a)
            hot = (time.perf_counter() - t0) / 10
            r = {"dtype": str(dtype), "rows": rows, "threads": threads, "cold_ms": 1e3 * cold, "hot_ms": 1e3 * hot,
                 "slot_mib": nbytes / 2**20, "cold_gb_s": nbytes / cold / 1e9}
            out.append(r)
            print(f"step-op {dtype} rows {rows:3d} threads {threads}: cold {r['cold_ms']:.2f} ms "
                  f"({r['cold_gb_s']:.1f} GB/s of {r['slot_mib']:.0f} MiB), hot {r['hot_ms']:.2f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--adapters", type=int, nargs="+", default=[2, 8, 32])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--op", action="store_true", help="also the per-layer delta micro-benchmark")
    ap.add_argument("--no-loop", action="store_true", help="skip the per-request loop ablation")
    ap.add_argument("--no-torch", action="store_true", help="skip the batched-torch-ops ablation (no C kernel)")
    ap.add_argument("--max-loras", type=int, default=None, help="adapter slots (default: the most adapters run)")
    ap.add_argument("--arms", nargs="+", default=None, help="only these arms (e.g. base lora-8)")
    ap.add_argument("--out", default=None, help="write OUT.json with every cell")
    ap.add_argument("--op-only", action="store_true", help="only the per-layer delta micro-benchmark")
    ap.add_argument("--op-dtype", nargs="+", default=["float32", "bfloat16"], help="dtypes of the micro-benchmark")
    ap.add_argument("--step-op", action="store_true",
                    help="also the C kernel calls of one decode step (30 layers of cold adapter weights)")
    args = ap.parse_args()
    if args.op_only:
        ops = [r for d in args.op_dtype for r in op_bench(dtype=getattr(torch, d))]
        steps = [r for d in args.op_dtype for r in step_op_bench(getattr(torch, d))] if args.step_op else []
        print(json.dumps({"machine": machine(), "load": loadavg(), "op": ops, "step_op": steps}, indent=1))
        return

    from tokenmill import LLM
    from tokenmill.lora.request import LoRARequest

    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"tokenmill-lora-bench-{os.getpid()}"
    n_max = max(args.adapters)
    loras = [LoRARequest(f"a{i}", i + 1, write_adapter(root / f"a{i}", args.rank, seed=i)) for i in range(n_max)]
    cmax = max(args.concurrency)
    common = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=cmax, enable_prefix_caching=False,
                  max_num_batched_tokens=2048)
    base = LLM(**common)
    lora = LLM(**common, enable_lora=True, max_loras=args.max_loras or n_max, max_lora_rank=args.rank,
               max_cpu_loras=n_max)
    probes = {id(base): StepProbe(base.engine_core.executor), id(lora): StepProbe(lora.engine_core.executor)}
    mgr = lora.engine_core.lora_manager
    for lr in loras:
        mgr.load_now(lr)
    rng = random.Random(0)
    vocab = base.engine_core.executor.arch.vocab_size
    prompts = {c: [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(c)]
               for c in args.concurrency}
    # warm-up both engines (and every slot)
    from tokenmill import SamplingParams

    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    base.generate(prompts[cmax][:8], warm)
    lora.generate(prompts[cmax][:n_max], warm, lora_request=loras)
    arms = [("base", base, 0, "auto"), ("lora-0", lora, 0, "auto")]
    arms += [(f"lora-{n}", lora, n, "auto") for n in args.adapters]
    if not args.no_torch and 8 <= n_max:
        arms.append(("torch-8", lora, 8, "torch"))
    if not args.no_loop and 8 <= n_max:
        arms.append(("loop-8", lora, 8, "loop"))
    if args.arms:
        arms = [a for a in arms if a[0] in args.arms or a[0] == "base"]
    cells = []
    for rep in range(args.repeat):
        for c in args.concurrency:
            order = arms if rep % 2 == 0 else arms[::-1]     # interleaved, alternating order
            for name, llm, n, mode in order:
                if llm is lora:
                    mgr.mode = mode
                reqs = [loras[i % n] if n else None for i in range(c)]
                cell = {"arm": name, "concurrency": c, "adapters": n, "mode": mode, "repeat": rep,
                        **run_cell(llm, prompts[c], reqs, args.output_len, probes[id(llm)])}
                cells.append(cell)
                print(f"rep {rep} c={c:3d} {name:8s}: {cell['tok_s']:7.1f} tok/s, TPOT {cell['tpot_ms']:6.1f} ms; "
                      f"decode steps {cell['decode_steps']} of {cell['decode_rows_mean']:.1f} rows "
                      f"({cell['decode_adapters_mean']:.1f} adapters), forward {cell['decode_forward_ms']:.1f} ms, "
                      f"prepare {cell['decode_prepare_ms']:.2f} ms, graph {cell['decode_graph_share']:.0%}; "
                      f"prefill {cell['prefill_forward_ms_total']:.0f} ms "
                      f"(load {cell['load_before']:.1f}->{cell['load_after']:.1f})", flush=True)
    mgr.mode = "auto"
    summary = {}
    for c in args.concurrency:
        bt = [x["tok_s"] for x in cells if x["arm"] == "base" and x["concurrency"] == c]
        b = sum(bt) / len(bt)
        for name, *_ in arms:
            xs = [x for x in cells if x["arm"] == name and x["concurrency"] == c]
            t = sum(x["tok_s"] for x in xs) / len(xs)
            tp = sum(x["tpot_ms"] for x in xs) / len(xs)
            fw = sum(x["decode_forward_ms"] for x in xs) / len(xs)
            summary[f"{name}@c{c}"] = {"tok_s": t, "tpot_ms": tp, "vs_base": t / b, "decode_forward_ms": fw}
    print("\nsummary (mean over repeats; ratio to the base engine at the same concurrency)")
    for k, v in summary.items():
        print(f"  {k:14s} {v['tok_s']:7.1f} tok/s  TPOT {v['tpot_ms']:6.1f} ms  {v['vs_base']:.2f}x base  "
              f"(decode step forward {v['decode_forward_ms']:.1f} ms)")
    wbytes = sum(base.engine_core.executor.weight_bytes.values())
    adapter_bytes = mgr.cpu_bytes / max(len(mgr.cpu), 1)
    memory = {"base_weight_bytes": wbytes, "adapter_bytes_each": adapter_bytes, "slot_buffer_bytes": mgr.slot_bytes,
              "rank": args.rank, "dtype": str(lora.engine_core.executor.dtype)}
    print(f"\nmemory: base weights {wbytes / 2**20:.1f} MiB, one rank-{args.rank} adapter "
          f"{adapter_bytes / 2**20:.2f} MiB, slot buffers ({n_max} slots) {mgr.slot_bytes / 2**20:.1f} MiB")
    for n in args.adapters:
        merged = n * wbytes
        ours = wbytes + n * adapter_bytes + mgr.slot_bytes * min(n, n_max) / n_max
        memory[f"n{n}"] = {"merged_models_bytes": merged, "base_plus_adapters_bytes": ours}
        print(f"  N={n:2d}: {n} merged models {merged / 2**20:8.1f} MiB vs base + {n} adapters + {min(n, n_max)} "
              f"slots {ours / 2**20:7.1f} MiB ({merged / ours:.1f}x less)")
    ops = [r for d in args.op_dtype for r in op_bench(dtype=getattr(torch, d))] if args.op else []
    step_ops = [r for d in args.op_dtype for r in step_op_bench(getattr(torch, d))] if args.step_op else []
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(), "args": vars(args),
              "cells": cells, "summary": summary, "memory": memory, "op": ops, "step_op": step_ops,
              "note": "offline engine, closed batch of c requests; shared 2-core machine, arms interleaved"}
    if args.out:
        Path(args.out + ".json").write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}.json")


if __name__ == "__main__":
    main()
