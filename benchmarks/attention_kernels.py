"""CPU attention kernels per instruction-set variant and KV-cache dtype, against their K/V-bytes bound.

For every kernel variant this CPU runs (``avx512``, ``avx2``, ``scalar``;
see :mod:`tokenmill.model.layers.cpu_build`) and every cache dtype asked for,
times one model step's worth of attention (``--layers`` layers, each its own
cache pool so K/V come from DRAM as in a real step, blocks shuffled):

* decode: ``--batch`` requests with ``--context`` cached tokens each
  (default the issue's B = 32, ctx 256; SmolLM2-135M's 9 query / 3 KV heads of 64);
* prefill: one ``--prefill``-token prompt, against torch's SDPA on the same
  (dequantised) K/V as the reference speed.

Bound of the decode: K/V bytes read (B × (ctx + 1) × 2 × KVH × D × element
bytes × layers) ÷ the machine's read bandwidth (a 1 GiB sum, as
``benchmarks/roofline.py``). Prints time per step, the bound and the ratio.
All variants are timed in one run, interleaved, best of ``--reps``.

    .venv/bin/python benchmarks/attention_kernels.py
    .venv/bin/python benchmarks/attention_kernels.py --kv-dtypes float32,bfloat16,fp8,int8 --batch 32 --context 256
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from roofline import measure_bandwidth  # noqa: E402

from tokenmill.model.layers import cpu_build, paged_attention_cpu  # noqa: E402
from tokenmill.model.layers.attention import TorchAttentionBackend, build_attention_metadata  # noqa: E402
from tokenmill.model.layers.kv_quant import KV_CACHE_DTYPES, KVScales, quantize  # noqa: E402

_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, **{k: v for k, v in KV_CACHE_DTYPES.items() if v}}


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo (or platform.processor())."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_caches(layers: int, lens: list[int], kvh: int, d: int, bs: int, kv_dtype: torch.dtype, seed: int = 0):
    """Per-layer caches holding ``lens`` tokens per request on shuffled blocks; returns caches and tables."""
    rng = random.Random(seed)
    nb = sum(-(-n // bs) for n in lens) + 1
    free = list(range(nb))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // bs))] for n in lens]
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(layers):
        c = torch.randn(2, nb, bs, kvh, d, generator=g)
        caches.append(quantize(c, 0.02, kv_dtype) if kv_dtype in (torch.int8, torch.float8_e4m3fn,
                                                                  torch.float8_e5m2) else c.to(kv_dtype))
    return caches, tables


def best_of(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-dtypes", default="float32,bfloat16,fp8,int8",
                    help="comma list of float32, bfloat16, fp8, fp8_e4m3, fp8_e5m2, int8")
    ap.add_argument("--isas", default=",".join(cpu_build.ISAS))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    isas = [i for i in args.isas.split(",") if cpu_build.isa_supported(i)]
    skipped = [i for i in args.isas.split(",") if not cpu_build.isa_supported(i)]
    bw = measure_bandwidth()
    h, kvh, d, bs, L = args.heads, args.kv_heads, args.head_dim, args.block_size, args.layers
    print(f"# attention kernels | CPU: {cpu_name()} | best ISA: {cpu_build.cpu_isa()} | threads "
          f"{torch.get_num_threads()} | read bandwidth {bw:.1f} GB/s | load average "
          f"{os.getloadavg()[0]:.2f} | torch {torch.__version__}")
    if skipped:
        print(f"# skipped (CPU lacks the instructions): {', '.join(skipped)}")
    print(f"# shape: {L} layers, {h} heads / {kvh} KV heads x {d}, block {bs}; decode B={args.batch} "
          f"ctx={args.context}; prefill {args.prefill} tokens")
    print(f"{'kv dtype':>10} {'isa':>7} | {'decode ms':>9} {'bound ms':>8} {'ratio':>6} | "
          f"{'prefill ms':>10} {'SDPA ms':>8} {'SDPA/kernel':>11}")
    for name in args.kv_dtypes.split(","):
        kv_dtype = _NAMES[name]
        qdt = torch.bfloat16 if kv_dtype == torch.bfloat16 else torch.float32
        esize = torch.empty((), dtype=kv_dtype).element_size()
        lens = [args.context + 1] * args.batch
        caches, tables = make_caches(L, lens, kvh, d, bs, kv_dtype)
        q = torch.randn(args.batch, h, d).to(qdt)
        bt = torch.tensor(tables, dtype=torch.int32)
        sl = torch.tensor(lens, dtype=torch.int32)
        kv_bytes = args.batch * (args.context + 1) * 2 * kvh * d * esize * L
        bound = kv_bytes / (bw * 1e9)
        # prefill: one prompt, K/V already in the cache (as after write_kv)
        pcaches, ptables = make_caches(L, [args.prefill], kvh, d, bs, kv_dtype, seed=1)
        pq = torch.randn(args.prefill, h, d).to(qdt)
        pk = torch.randn(args.prefill, kvh, d).to(qdt)
        scales = KVScales(k=0.02, v=0.02)
        sdpa_ms = None
        if d in (64, 128):
            def sdpa():
                for c in pcaches:
                    md, _ = build_attention_metadata([0], [args.prefill], ptables, bs)
                    TorchAttentionBackend(use_cpu_kernel=False).forward(pq, pk, pk, c, md, d ** -0.5, scales)
            sdpa_ms = best_of(sdpa, max(1, args.reps // 2)) * 1e3
        for isa in isas:
            def decode():
                for c in caches:
                    paged_attention_cpu.paged_decode(q, c, bt, sl, d ** -0.5, 0.02, 0.02, isa=isa)
            dec = best_of(decode, args.reps)
            pre_txt = ""
            if paged_attention_cpu.prefill_supports(pq, pcaches[0], isa):
                out = torch.empty_like(pq)
                pbt = torch.tensor(ptables, dtype=torch.int32)
                i32 = dict(dtype=torch.int32)
                qs, ql, psl = (torch.tensor([0], **i32), torch.tensor([args.prefill], **i32),
                               torch.tensor([args.prefill], **i32))

                def prefill():
                    for c in pcaches:
                        paged_attention_cpu.paged_prefill(pq, c, pbt, qs, ql, psl, d ** -0.5, out, 0.02, 0.02,
                                                          isa=isa)
                pre = best_of(prefill, max(1, args.reps // 2)) * 1e3
                pre_txt = f"{pre:10.1f} {sdpa_ms:8.1f} {sdpa_ms / pre:10.2f}x"
            print(f"{name:>10} {isa:>7} | {dec * 1e3:9.2f} {bound * 1e3:8.2f} {dec / bound:5.1f}x | {pre_txt}",
                  flush=True)


if __name__ == "__main__":
    main()
