"""Per-token weight GEMMs of SmolLM2-135M with float32 weights, torch's low-bit CPU kernels and ours, side by side.

Times every weight GEMM of one step (30 layers x fused q/k/v 576->960, o 576->576, fused gate/up 576->3072,
down 1536->576, plus the 576->49152 LM head) at M = 1, 4, 8 rows:
  fp32 packed   oneDNN-prepacked float32 (the runner's dense path)
  bf16 packed   oneDNN-prepacked bfloat16 (where oneDNN has bf16)
  torch int8    aten._weight_int8pack_mm (float32 activations; torchao's int8 weight-only CPU path)
  torch int4    aten._weight_int4pack_mm_for_cpu (bfloat16 activations; torchao's Int4CPULayout)
  ours q4/q8    tokenmill's low-bit kernel (best ISA variant, and every other variant the CPU runs),
                Q4_1-like 4-bit blocks (group 32 + min) for the block linears, Q8_0 for the LM head;
                with bfloat16 activations on an AVX512-BF16 CPU both the dot-product path ("dot") and the
                float32 FMA path ("FMA") of the avx512 variant.
Times are medians of single calls (robust on a shared machine). Also prints the bytes each variant reads per step and the implied bandwidth.

    python benchmarks/lowbit_gemm.py [--threads 2] [--rows 1,4,8] [--reps 20]

Also times the integer path ("ours ISA (int8 act)": activations quantised to int8 per row and 32-column block,
8-bit integer dot products with the codes; the default above TOKENMILL_CPU_INT4_MAX_TOKENS on AVX2), e.g.
``--rows 16,64,256 --skip-torch-int8`` for the batched steps and prefill chunks it serves.

With ``--model-step`` it instead times whole decode steps (forward + logits, ``--context`` cached tokens per
request) of the packaged model at batch 1 and 8, with the GGUF's low-bit codes on and off
(``TOKENMILL_CPU_INT4_MAX_TOKENS`` 8 vs 0), the two runners interleaved in one process: the ablation of the
small-step path; ``--int8-act`` adds a third runner whose larger steps run the integer path
(``--rows 16,64 --query-lens 1`` batched decode, ``--rows 1 --query-lens 256`` a prefill chunk).

With ``--per-shape`` it prints GMAC/s per weight shape of the integer path (``--rows 64,2048``: batched decode
and a prefill chunk), interleaved per repetition with torch's ``_int_mm`` (oneDNN int8 x int8 -> int32, no
scales: the library's ceiling for the same multiply-adds) and float32 oneDNN on the same sizes; with
``--baseline-csrc DIR`` also the kernel built from another checkout's ``tokenmill/model/csrc`` (before/after
side by side in one run), e.g.::

    TOKENMILL_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/lowbit_gemm.py \
        --per-shape --rows 64,2048 --isas avx2 --baseline-csrc /path/to/main/tokenmill/model/csrc

``--model-step --baseline-csrc DIR`` times whole steps of the packaged model on the integer path with the two
kernel builds swapped per repetition in one process (``--rows 16,64 --query-lens 1`` decode,
``--rows 8 --query-lens 256`` a 2048-token prefill step).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill import envs  # noqa: E402
from tokenmill.model.layers.cpu_build import ISAS, isa_supported  # noqa: E402
from tokenmill.quantization.lowbit import LowBitWeight, load_kernel, lowbit_linear, set_bf16_dot, set_vnni  # noqa: E402

SHAPES = [(576, 960, 30), (576, 576, 30), (576, 3072, 30), (1536, 576, 30), (576, 49152, 1)]  # (K, N, count)


def bench(f, reps: int) -> float:
    """Median seconds per call (robust to the other tenants of a shared machine preempting a call)."""
    for _ in range(3):
        f()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def model_step(args) -> None:
    """Decode-step ablation: low-bit codes on vs off, interleaved, medians.

    With ``--query-lens 1,5`` each of the ``--rows`` requests brings ``q`` new tokens and every row gets
    logits: a speculative-decoding verify step (the request's last token and ``q - 1`` drafts)."""
    from tokenmill.config import EngineConfig
    from tokenmill.model.layers.attention import build_attention_metadata
    from tokenmill.model.runner import ModelRunner

    runners = {}
    envs.set("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", "0")
    for dtype in args.dtypes.split(","):
        for limit in ("8", "0") + (("8i",) if args.int8_act else ()):
            envs.set("TOKENMILL_CPU_INT4_MAX_TOKENS", limit.rstrip("i"))
            envs.set("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", "65536" if limit.endswith("i") else "0")
            cfg = EngineConfig.from_kwargs(dtype=dtype, num_kv_blocks=256, block_size=16, max_model_len=1024)
            runners[(dtype, limit)] = ModelRunner.from_config(cfg, with_tokenizer=False)
    torch.set_num_threads(args.threads)
    from tokenmill.quantization.lowbit import _default_kernel

    dot_lib = _default_kernel()
    if dot_lib is not None and not set_bf16_dot(dot_lib, True):
        dot_lib = None                      # no AVX512-BF16: nothing to ablate
    print(f"decode step, context {args.context}, threads {args.threads}, load average {os.getloadavg()[0]:.1f}")
    base: dict[str, float] = {}
    for b in (int(r) for r in args.rows.split(",")):
        for q in (int(x) for x in args.query_lens.split(",")):
            ctx = args.context
            nb = (ctx + q) // 16 + 1
            tables = [list(range(i * nb, (i + 1) * nb)) for i in range(b)]
            md, pos = build_attention_metadata([ctx] * b, [q] * b, tables, 16)
            ids = torch.randint(0, 49152, (b * q,))
            arms = [(k, True) for k in runners] + ([((d, "8"), False) for d in args.dtypes.split(",")
                                                     if d == "bfloat16"] if dot_lib is not None else [])
            times = {a: [] for a in arms}
            with torch.inference_mode():
                for _ in range(args.reps):
                    for arm in arms:
                        r = runners[arm[0]]
                        if dot_lib is not None:
                            set_bf16_dot(dot_lib, arm[1])
                        md.cache.clear()
                        t = time.perf_counter()
                        r.model.compute_logits(r.model(ids, pos, r.kv_caches, md))
                        times[arm].append(time.perf_counter() - t)
            if dot_lib is not None:
                set_bf16_dot(dot_lib, True)
            med = lambda a: sorted(times[a])[args.reps // 2]  # noqa: E731
            for dtype in args.dtypes.split(","):
                on, off = med(((dtype, "8"), True)), med(((dtype, "0"), True))
                if b == 1 and q == 1:
                    base[dtype] = on
                rel = f", {on / base[dtype]:.2f}x the 1-token step" if dtype in base else ""
                fma = ""
                if ((dtype, "8"), False) in times:
                    f = med(((dtype, "8"), False))
                    fma = f"; low-bit without the bf16 dot path {f * 1e3:.1f} ms ({f / on:.2f}x the dot path's)"
                i8 = ""
                if ((dtype, "8i"), True) in times:
                    t8 = med(((dtype, "8i"), True))
                    i8 = f"; integer path (int8 act.) {t8 * 1e3:.1f} ms -> {off / t8:.2f}x the dense step"
                print(f"B={b} q={q} ({b * q} tokens) {dtype}: low-bit codes {on * 1e3:.1f} ms, "
                      f"dense {off * 1e3:.1f} ms -> {off / on:.2f}x{rel}{fma}{i8}", flush=True)


def bench_interleaved(fns: dict, reps: int) -> dict:
    """Median seconds per call of each of ``fns`` (name -> callable), the arms interleaved per repetition so
    that a shared machine's load changes hit them alike, and their order rotated each repetition so that no arm
    always runs right after the same one (whose cache footprint and OpenMP thread state it inherits)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    names = list(fns)
    for rep in range(reps):
        for k in names[rep % len(names):] + names[:rep % len(names)]:
            f = fns[k]
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def load_baseline(csrc: str, isa: str):
    """The kernel library built from another checkout's C sources (``csrc``), for before/after figures."""
    from tokenmill.model.layers import cpu_build
    from tokenmill.quantization.lowbit import _FUNCTIONS, ENV_SWITCH

    saved = cpu_build.CSRC_DIR
    cpu_build.CSRC_DIR = os.path.abspath(csrc)
    with open(os.path.join(csrc, "lowbit_gemm.c")) as f:       # an older source may lack newer entry points
        src = f.read()
    functions = {k: v for k, v in _FUNCTIONS.items() if f" {k}(" in src}
    try:
        return cpu_build.load_library("lowbit_gemm_baseline", ["lowbit_gemm.c"], functions, ENV_SWITCH, isa)
    finally:
        cpu_build.CSRC_DIR = saved


def per_shape(args) -> None:
    """GMAC/s per SmolLM2-135M weight shape on the integer path vs torch._int_mm and float32 oneDNN."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    isas = [i for i in ISAS if isa_supported(i) and (not args.isas or i in args.isas.split(","))]
    libs = {i: load_kernel(i) for i in isas}
    if args.baseline_csrc:
        for i in isas:
            libs[f"{i} baseline"] = load_baseline(args.baseline_csrc, i)
    vnni_libs = [k for k, lib in libs.items() if lib is not None and "baseline" not in k and set_vnni(lib, True)]
    print(f"threads {args.threads}, integer path GMAC/s per shape (medians of {args.reps}, arms interleaved); "
          f"load average {os.getloadavg()[0]:.1f}")
    names = ["Q4_1 576->960 (qkv)", "Q4_1 576->576 (o)", "Q4_1 576->3072 (gate/up)", "Q4_1 1536->576 (down)",
             "Q8_0 576->49152 (head)"]
    for m in (int(r) for r in args.rows.split(",")):
        print(f"\nM={m} rows")
        bf16 = args.act_dtype == "bfloat16"
        hdr = ([f"ours {k}" for k in libs] + [f"ours {k} no-VNNI" for k in vnni_libs]
               + ["ours f32 path" + (" (bf16 act.)" if bf16 else ""), "torch _int_mm", "fp32 oneDNN"]
               + (["bf16 oneDNN"] if bf16 else []))
        print(f"{'shape':<26}" + "".join(f"{h:>22}" for h in hdr))
        tot = {h: 0.0 for h in hdr}
        for (k, n, count), name in zip(SHAPES, names):
            head = n == 49152
            if head and m > 256:
                continue                                   # a prefill never runs the head on every row
            if head:
                # scales and mins float16 numbers, as the GGUF's (Q8_0 / Q4_1): the integer path's float16 copies
                lb = LowBitWeight.from_codes(torch.randint(-127, 128, (n, k)), torch.rand(n, k // 32).half().float(),
                                             None, 8)
            else:
                lb = LowBitWeight.from_codes(torch.randint(0, 16, (n, k)), torch.rand(n, k // 32).half().float(),
                                             torch.randn(n, k // 32).half().float(), 4)
            x = torch.randn(m, k).to(getattr(torch, args.act_dtype))
            fns = {}
            for key, lib in libs.items():
                lb.codes_i8 = None
                if lb.prepare_i8(lib):
                    w = LowBitWeight(lb.out_features, lb.in_features, lb.bits, lb.group, lb.codes, lb.scale,
                                     lb.min, lb.fmt, lb.codes_i8, lb.scale_h, lb.min_h)
                    fns[f"ours {key}"] = (lambda w=w, lib=lib: lowbit_linear(x, w, lib=lib, int8_act=True))
                    if key in vnni_libs:       # the same library with its AVX512-VNNI switch off, then on again
                        def no_vnni(w=w, lib=lib):
                            set_vnni(lib, False)
                            lowbit_linear(x, w, lib=lib, int8_act=True)
                            set_vnni(lib, True)
                        fns[f"ours {key} no-VNNI"] = no_vnni
            fns[hdr[len(libs) + len(vnni_libs)]] = lambda: lowbit_linear(x, lb, lib=libs[isas[0]])
            a8 = torch.randint(-127, 128, (max(m, 17), k), dtype=torch.int8)
            b8 = torch.randint(-127, 128, (n, k), dtype=torch.int8).t()
            fns["torch _int_mm"] = lambda: torch._int_mm(a8, b8)
            p32 = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k))
            x32 = x.float()
            fns["fp32 oneDNN"] = lambda: torch.ops.mkldnn._linear_pointwise(x32, p32, None, "none", [], "")
            if bf16:
                pb = torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(torch.bfloat16))
                fns["bf16 oneDNN"] = lambda: torch.ops.mkldnn._linear_pointwise(x, pb, None, "none", [], "")
            reps = max(3, args.reps // (4 if head or m >= 1024 else 1))
            med = bench_interleaved(fns, reps)
            macs = m * k * n
            row = f"{name:<26}"
            for h in hdr:
                if h in med:
                    tot[h] += med[h] * count
                    row += f"{macs / med[h] / 1e9:15.1f} GMAC/s"
                else:
                    row += f"{'-':>22}"
            print(row, flush=True)
        print(f"{'all GEMMs of a step, ms':<26}" + "".join(f"{tot[h] * 1e3:19.2f} ms" for h in hdr))


def model_step_ab(args) -> None:
    """Whole steps of the packaged model on the integer path with this tree's kernel and with the kernel built
    from ``--baseline-csrc``, the two libraries swapped per repetition in one process (same weights, same
    inputs): the before/after of a kernel change at the model level, free of run-to-run machine drift."""
    from tokenmill.config import EngineConfig
    from tokenmill.model.layers.attention import build_attention_metadata
    from tokenmill.model.runner import ModelRunner
    import tokenmill.quantization.lowbit as lbm

    envs.set("TOKENMILL_CPU_INT4_MAX_TOKENS", "8")
    envs.set("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", "65536")
    dtype = args.dtypes.split(",")[0]
    cfg = EngineConfig.from_kwargs(dtype=dtype, num_kv_blocks=max(256, 64 * (args.context + 2048) // 16 + 64),
                                   block_size=16, max_model_len=args.context + 2048 + 16)
    r = ModelRunner.from_config(cfg, with_tokenizer=False)
    torch.set_num_threads(args.threads)
    new = lbm._default_kernel()
    isa = new.tm_lowbit_isa().decode()
    libs = {"this tree": new, "baseline": load_baseline(args.baseline_csrc, isa)}
    saved = lbm._default_kernel
    print(f"model steps, {dtype}, kernel {isa}, context {args.context}, threads {args.threads}, medians of "
          f"{args.reps} (arms alternating); load average {os.getloadavg()[0]:.1f}")
    try:
        for b in (int(x) for x in args.rows.split(",")):
            for q in (int(x) for x in args.query_lens.split(",")):
                ctx = args.context if q == 1 else 0
                nb = (ctx + q) // 16 + 1
                tables = [list(range(i * nb, (i + 1) * nb)) for i in range(b)]
                md, pos = build_attention_metadata([ctx] * b, [q] * b, tables, 16)
                ids = torch.randint(0, 49152, (b * q,))
                times = {k: [] for k in libs}
                with torch.inference_mode():
                    for rep in range(args.reps + 1):
                        for name, lib in libs.items():
                            lbm._default_kernel = lambda lib=lib: lib
                            md.cache.clear()
                            t = time.perf_counter()
                            r.model.compute_logits(r.model(ids, pos, r.kv_caches, md))
                            if rep:
                                times[name].append(time.perf_counter() - t)
                med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
                print(f"B={b} q={q} ({b * q} tokens): this tree {med['this tree'] * 1e3:.1f} ms, baseline "
                      f"{med['baseline'] * 1e3:.1f} ms -> {med['baseline'] / med['this tree']:.3f}x", flush=True)
    finally:
        lbm._default_kernel = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--skip-torch-int8", action="store_true", help="skip the (slow, scalar) int8pack kernel")
    ap.add_argument("--isas", default="", help="kernel variants to time, e.g. avx512 [default: every one the CPU runs]")
    ap.add_argument("--model-step", action="store_true", help="time whole decode steps of the real model instead")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--act-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="--per-shape: the activations' dtype (bfloat16 adds oneDNN's bfloat16 GEMM)")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--int8-act", action="store_true",
                    help="--model-step: also the integer path (int8 activations x the codes) for every step size")
    ap.add_argument("--query-lens", default="1", help="--model-step: new tokens per request (verify steps: 1,5)")
    ap.add_argument("--per-shape", action="store_true",
                    help="GMAC/s per weight shape of the integer path vs torch._int_mm and float32 oneDNN")
    ap.add_argument("--baseline-csrc", default="",
                    help="--per-shape: also time the kernel built from this C source directory (before/after); "
                         "with --model-step: whole integer-path steps with this tree's kernel vs that one")
    args = ap.parse_args()
    if args.per_shape:
        per_shape(args)
        return
    if args.model_step and args.baseline_csrc:
        model_step_ab(args)
        return
    if args.model_step:
        model_step(args)
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    isas = [i for i in ISAS if isa_supported(i) and (not args.isas or i in args.isas.split(","))]
    libs = {i: load_kernel(i) for i in isas}
    print(f"threads {args.threads}, kernel variants this CPU runs: {', '.join(isas)}; load average "
          f"{os.getloadavg()[0]:.1f}")
    layers = []
    for k, n, count in SHAPES:
        w = torch.randn(n, k) * 0.02
        head = n == 49152
        if head:
            codes = torch.randint(-127, 128, (n, k)); lb = LowBitWeight.from_codes(codes, torch.rand(n, k // 32), None, 8)
        else:
            codes = torch.randint(0, 16, (n, k)); lb = LowBitWeight.from_codes(codes, torch.rand(n, k // 32),
                                                                               torch.randn(n, k // 32), 4)
        packed32 = torch.ops.mkldnn._reorder_linear_weight(w)
        bf16_ok = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        packed16 = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16()) if bf16_ok else None
        w8 = torch.randint(-128, 127, (n, k), dtype=torch.int8)
        i4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        sz = torch.rand(k // 32, n, 2).bfloat16()
        layers.append(dict(k=k, n=n, count=count, lb=lb, p32=packed32, p16=packed16, w8=w8, s8=torch.rand(n),
                           i4=i4, sz=sz))
    for m in (int(r) for r in args.rows.split(",")):
        x32 = {L["k"]: torch.randn(m, L["k"]) for L in layers}
        tot: dict[str, float] = {}
        nbytes: dict[str, float] = {}
        def add(name, fn, L, bytes_per_weight):
            reps = max(3, args.reps // (8 if L["n"] == 49152 else 1))
            tot[name] = tot.get(name, 0.0) + bench(fn, reps) * L["count"]
            nbytes[name] = nbytes.get(name, 0.0) + bytes_per_weight * L["n"] * L["k"] * L["count"]
        for L in layers:
            x = x32[L["k"]]; xb = x.bfloat16()
            add("fp32 packed", lambda: torch.ops.mkldnn._linear_pointwise(x, L["p32"], None, "none", [], ""), L, 4)
            if L["p16"] is not None:
                add("bf16 packed", lambda: torch.ops.mkldnn._linear_pointwise(xb, L["p16"], None, "none", [], ""), L, 2)
            if not args.skip_torch_int8:
                add("torch int8 (fp32 act)", lambda: torch._weight_int8pack_mm(x, L["w8"], L["s8"]), L, 1)
            add("torch int4 (bf16 act)",
                lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, L["i4"], 32, L["sz"]), L, 0.5 + 4 / 32)
            lb = L["lb"]
            bpw = (lb.nbytes - (0 if lb.codes_i8 is None else lb.codes_i8.numel())) / (L["n"] * L["k"])
            for isa, lib in libs.items():
                add(f"ours {isa} (fp32 act)", lambda: lowbit_linear(x, lb, lib=lib), L, bpw)
                if lb.prepare_i8(lib):            # the integer path: int8 activations per 32 columns x the codes
                    add(f"ours {isa} (int8 act)", lambda: lowbit_linear(x, lb, lib=lib, int8_act=True), L, bpw)
                if set_bf16_dot(lib, True):       # AVX512-BF16 dot products vs the float32 FMA path, side by side
                    add(f"ours {isa} (bf16 act, dot)", lambda: lowbit_linear(xb, lb, lib=lib), L, bpw)
                    set_bf16_dot(lib, False)
                    add(f"ours {isa} (bf16 act, FMA)", lambda: lowbit_linear(xb, lb, lib=lib), L, bpw)
                    set_bf16_dot(lib, True)
                else:
                    add(f"ours {isa} (bf16 act)", lambda: lowbit_linear(xb, lb, lib=lib), L, bpw)
        base = tot["fp32 packed"]
        print(f"\nM={m} rows: all weight GEMMs of one step")
        print(f"{'kernel':<26} {'ms':>9} {'vs fp32':>8} {'MB read':>8} {'GB/s':>6}")
        for name, t in tot.items():
            print(f"{name:<26} {t * 1e3:9.2f} {base / t:7.2f}x {nbytes[name] / 1e6:8.1f} {nbytes[name] / t / 1e9:6.1f}")


if __name__ == "__main__":
    main()
