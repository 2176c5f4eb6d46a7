"""Where a step's time outside the weight GEMMs and attention goes (roofline's "other"), part by part.

``benchmarks/roofline.py --breakdown`` reports ``other`` as what is left of a
step after the weight GEMMs (forward hooks on the linears), the attention
backend, sampling and input preparation. This script splits that rest:

* the kernels, each timed on its own (every ctypes function of the loaded
  kernel libraries wrapped with a timer, as in ``benchmarks/step_overhead.py``):
  low-bit GEMMs and oneDNN's packed GEMM (``linear``; the LM head apart as ``head``), K/V write + paged attention (``attention``), and
  the fused element-wise kernels: add+RMSNorm (``norm``), RoPE (``rope``),
  SiLU-and-multiply (``silu``);
* the torch parts of the forward: the embedding lookup (``embed``) and the
  cos/sin computation (``cos_sin``), timed by wrapping them;
* input preparation (``prepare``), and ``sample`` (LM head + sampler, from the
  runner's own timings) minus the LM head GEMM (``head``);
* ``attn_glue``: the attention backend's own Python and torch ops around its
  C kernels (per-step plan, the contiguous copy of q for the prefill kernel);
  roofline counts it as attention;
* ``glue``: the forward's remaining wall time -- Python, module calls,
  ``torch.empty`` for outputs, reshapes and copies between the kernels.

``step`` is the median of uninstrumented ``execute_model`` runs; the parts
come from a separate instrumented pass (the timers add ~1 µs per call, so
``glue`` is a slight over-estimate). Cases: decode at ``--batches`` (batch 1
with the CPU step graph and eager; larger batches as the runner chooses) and
a prefill step of ``--prefill-reqs`` x ``--prefill-len`` tokens.

    TOKENMILL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        .venv/bin/python benchmarks/step_parts.py --dtype float32
    .venv/bin/python benchmarks/step_parts.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from roofline import fill_kv_pool, synthetic_step  # noqa: E402
from step_overhead import kernel_timers  # noqa: E402

PARTS = ("linear", "head", "attention", "attn_glue", "norm", "rope", "silu", "embed", "cos_sin", "glue", "prepare",
         "sampler")


def _category(label: str) -> str:
    lib, fn = label.split(":")
    if lib == "lowbit_gemm":
        return "linear"
    if lib == "paged_attention":
        return "attention"
    if lib == "fused_ops":
        return {"rms": "norm", "rop": "rope", "sil": "silu"}.get(fn[:3], "fused_other")
    return "c_other"


def step_parts(runner, so, reps: int, use_graph: bool) -> dict[str, float]:
    """Median ms per part (see the module docstring) of ``runner.execute_model(so)``."""
    from tokenmill.model import step_graph as sg

    graph = runner.step_graph
    runner.step_graph = graph if use_graph else None
    model = runner.model
    steps = []
    for _ in range(2):
        runner.execute_model(so)
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.execute_model(so)
        steps.append(time.perf_counter() - t0)

    acc, restore = kernel_timers()
    py = {"embed": 0.0, "cos_sin": 0.0, "head_total": 0.0, "attn_call": 0.0}
    emb, rot, backend = model.model.embed_tokens, model.rotary_emb, model.attn_backend
    plain_emb, plain_cs, plain_logits = emb.forward, rot.cos_sin, model.compute_logits
    plain_attn = backend.forward

    def timed(key, fn):
        def w(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            py[key] += time.perf_counter() - t0
            return out
        return w

    emb.forward, rot.cos_sin = timed("embed", plain_emb), timed("cos_sin", plain_cs)
    backend.forward = timed("attn_call", plain_attn)
    head_c = {"t": 0.0}

    def logits(hidden):
        before = sum(v for k, v in acc.items() if k.startswith("lowbit_gemm:") and not k.endswith("#"))
        t0 = time.perf_counter()
        out = plain_logits(hidden)
        py["head_total"] += time.perf_counter() - t0
        head_c["t"] += sum(v for k, v in acc.items() if k.startswith("lowbit_gemm:") and not k.endswith("#")) - before
        return out

    model.compute_logits = logits
    # oneDNN's packed GEMM (PackedLinear's dense path, also inside the step graph): a torch op, timed as "linear"
    ops = torch.ops.mkldnn
    plain_dense = ops._linear_pointwise

    def dense(*a, **k):
        t0 = time.perf_counter()
        out = plain_dense(*a, **k)
        acc["lowbit_gemm:dense"] = acc.get("lowbit_gemm:dense", 0.0) + time.perf_counter() - t0
        return out

    setattr(ops, "_linear_pointwise", dense)
    if runner.step_graph is not None:
        runner.step_graph = sg.CpuStepGraph(model, runner.kv_caches, runner.lowbit_max_tokens, graph.max_tokens)
    rows = []
    try:
        runner.execute_model(so)
        for _ in range(reps):
            acc.clear()
            for k in py:
                py[k] = 0.0
            head_c["t"] = 0.0
            t0 = time.perf_counter()
            runner.execute_model(so)
            total = time.perf_counter() - t0
            t = runner.last_timings
            cat: dict[str, float] = {}
            for k, v in acc.items():
                if not k.endswith("#"):
                    c = _category(k)
                    cat[c] = cat.get(c, 0.0) + v
            # the LM head: its C GEMM time (or the whole call when it is a torch op) goes to "head"
            head = head_c["t"] if head_c["t"] > 0 else py["head_total"]
            cat["linear"] = cat.get("linear", 0.0) - head_c["t"]
            r = {p: cat.get(p, 0.0) for p in ("linear", "attention", "norm", "rope", "silu")}
            r.update(head=head, embed=py["embed"], cos_sin=py["cos_sin"], prepare=t["prepare"],
                     sampler=t["sample"] - py["head_total"])
            fwd_c = sum(r[p] for p in ("linear", "attention", "norm", "rope", "silu", "embed", "cos_sin"))
            # the attention backend's own Python and torch ops (plan, q copy) outside its C kernels
            r["attn_glue"] = py["attn_call"] - r["attention"] if py["attn_call"] else 0.0
            r["glue"] = t["forward"] - fwd_c - r["attn_glue"] + (py["head_total"] - head)
            r["instrumented"] = total
            rows.append(r)
    finally:
        restore()
        del emb.forward, rot.cos_sin, backend.forward
        setattr(ops, "_linear_pointwise", plain_dense)
        del model.compute_logits
        runner.step_graph = graph
    out = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
    out["step"] = statistics.median(steps) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: packaged SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=320, help="cached tokens per request in the decode steps")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prefill-reqs", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=1, help="repeat every case this many times (best kept)")
    args = ap.parse_args()

    from tokenmill.config import EngineConfig
    from tokenmill.model.layers import cpu_build
    from tokenmill.model.layers.linear import wait_for_packing
    from tokenmill.model.process_tuning import configure_threads
    from tokenmill.model.runner import ModelRunner

    threads = configure_threads(torch.device("cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    ctx = args.context
    blocks = max(max(batches) * (-(-(ctx + 1) // 16)), args.prefill_reqs * (-(-args.prefill_len // 16))) + 16
    cfg = EngineConfig.from_kwargs(model=args.model, dtype=args.dtype, num_kv_blocks=blocks,
                                   max_model_len=max(1024, ctx + 64, args.prefill_len + 64), enforce_eager=True,
                                   max_num_seqs=max(max(batches), args.prefill_reqs), enable_prefix_caching=False,
                                   max_num_batched_tokens=max(2048, args.prefill_reqs * args.prefill_len))
    runner = ModelRunner.from_config(cfg)
    wait_for_packing(runner.model)
    fill_kv_pool(runner)   # synthetic steps attend over unwritten positions: finite values, not garbage
    cases = []
    for b in batches:
        so = synthetic_step(runner, [1] * b, [ctx] * b)
        graph_ok = runner.step_graph is not None and runner.step_graph.accepts(b, 1, b)
        if graph_ok:
            cases.append((f"decode B={b} graph", so, True))
        cases.append((f"decode B={b} eager" if graph_ok else f"decode B={b}", so, False))
    so = synthetic_step(runner, [args.prefill_len] * args.prefill_reqs, [0] * args.prefill_reqs)
    cases.append((f"prefill {args.prefill_reqs}x{args.prefill_len}", so, False))
    load = os.getloadavg()
    print(f"torch {torch.__version__}, {threads} threads, kernels {cpu_build.cpu_isa()}, dtype {args.dtype}, "
          f"KV {runner.kv_cache_dtype}, ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '-')}, "
          f"low-bit steps <= {runner.lowbit_max_tokens} tokens, step graph "
          f"{'on' if runner.step_graph else 'off'}, context {ctx}, load average {load[0]:.1f}")
    results = {}
    for _ in range(args.rounds):
        for name, so, g in cases:
            r = step_parts(runner, so, args.reps, g)
            best = results.get(name)
            if best is None or r["step"] < best["step"]:
                results[name] = r
    cols = ("step",) + PARTS + ("other",)
    print(f"\n{'case (ms)':<22}" + "".join(f"{c:>9}" for c in cols))
    for name, _, _ in cases:
        r = results[name]
        # roofline's "other": everything but linears (with head), attention (with its glue), sampler, prepare
        r["other"] = r["norm"] + r["rope"] + r["silu"] + r["embed"] + r["cos_sin"] + r["glue"]
        print(f"{name:<22}" + "".join(f"{r[c]:>9.2f}" for c in cols))
    print("other = norm + rope + silu + embed + cos_sin + glue (roofline --breakdown's 'other'); "
          f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
