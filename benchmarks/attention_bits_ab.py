"""Bit comparison of the paged-attention kernels: this tree's build against another checkout's, many random shapes.

Builds ``paged_attention.c`` from this tree's ``tokenmill/model/csrc`` and from ``--baseline-csrc`` (e.g. main's,
exported with ``git archive <commit> tokenmill/model/csrc | tar -x -C /tmp/base``) for each ``--isas`` variant,
then calls ``paged_decode_*``, ``paged_rows_*`` and ``paged_prefill_*`` of both on the same random inputs and
compares the outputs bit for bit. The cases draw heads / KV heads / head_dim (GQA groups 1-12, head_dim 24, 64,
128), block sizes 8-32, 1-3 threads, decode batches of 1-64 with contexts of 1-700 keys, rows / prefill calls of
1-5 requests with 1-200 new tokens after 0-300 cached ones, verify-like rows calls of 4-20 requests with 1-5
tokens after 0-400, float32 / bfloat16 / int8 / fp8 caches and float32 /
bfloat16 queries, over shuffled block tables. Prints each differing case and a total; exits 1 if any differ.
A correctness check, not a timing: run it under ``/work/bin/shared`` (or anywhere).

    .venv/bin/python benchmarks/attention_bits_ab.py --baseline-csrc /tmp/base/tokenmill/model/csrc \\
        --isas avx2,scalar,avx512emu --cases 150 [--define TOKENMILL_DECODE_VEC_ITEM=1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from attention_ab import load  # noqa: E402
from tokenmill.model.layers import cpu_build, paged_attention_cpu as pac  # noqa: E402

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tokenmill", "model", "csrc")
KV_DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
HEADS = [(9, 3, 64), (8, 2, 128), (4, 4, 64), (12, 3, 64), (10, 2, 64), (6, 3, 24), (12, 1, 64), (8, 2, 64),
         (4, 1, 128), (16, 4, 64), (12, 4, 128), (16, 8, 128), (24, 8, 64)]


def random_case(rng: random.Random) -> dict:
    """One random call: kind, dtypes, shape, threads and the requests' (new tokens, context after the step)."""
    kvd = rng.choice(KV_DTYPES)
    qd = rng.choice([torch.float32, torch.float32, torch.bfloat16])
    if kvd == torch.float32 and qd == torch.bfloat16:     # no kernel for a bfloat16 query on a float32 cache
        kvd = torch.bfloat16
    kind = rng.choice(["decode", "decode", "rows", "prefill", "verify"])
    if kind == "verify":          # many short rows: paged_rows's items that serve every KV head of a tile
        reqs = []
        for _ in range(rng.choice([4, 8, 16, 20])):
            n = rng.randint(1, 5)
            reqs.append((n, n + rng.randint(0, 400)))
    elif kind == "decode":
        reqs = [(1, rng.choice([1, 2, 7, 8, 9, 15, 16, 17, 33, 100, 257, 300, rng.randint(1, 700)]))
                for _ in range(rng.choice([1, 2, 3, 5, 8, 17, 64]))]
    else:
        reqs = []
        for _ in range(rng.choice([1, 2, 3, 5])):
            n = rng.choice([1, 2, 5, 16, 17, 33, 64, rng.randint(1, 200)])
            reqs.append((n, n + rng.choice([0, 0, 1, 7, 16, 100, rng.randint(0, 300)])))
    return {"kind": kind, "q_dtype": qd, "kv_dtype": kvd, "heads": rng.choice(HEADS),
            "block": rng.choice([8, 16, 16, 32]), "threads": rng.choice([1, 2, 3]), "reqs": reqs}


def run_case(libs: list, case: dict, rng: random.Random) -> bool:
    """Calls the case's kernel of every library in ``libs`` on the same inputs; True when all outputs are
    bit-identical (outputs start as NaN, so a row one build leaves unwritten differs too)."""
    h, kvh, d = case["heads"]
    bs, reqs, kvd, qd = case["block"], case["reqs"], case["kv_dtype"], case["q_dtype"]
    nbl = [-(-sl // bs) for _, sl in reqs]
    perm = list(range(sum(nbl) + 2))
    rng.shuffle(perm)
    kv = torch.randn(2, sum(nbl) + 2, bs, kvh, d) * 2
    kv = (kv * 20).round().clamp(-127, 127).to(torch.int8) if kvd == torch.int8 else kv.to(kvd)
    bt = torch.zeros(len(reqs), max(nbl) + rng.choice([0, 3]), dtype=torch.int32)
    p = 0
    for r, nb in enumerate(nbl):
        bt[r, :nb] = torch.tensor(perm[p:p + nb], dtype=torch.int32)
        p += nb
    q_len = torch.tensor([n for n, _ in reqs], dtype=torch.int32)
    seq_lens = torch.tensor([sl for _, sl in reqs], dtype=torch.int32)
    q_start = (torch.cumsum(q_len, 0) - q_len).to(torch.int32)
    q = (torch.randn(int(q_len.sum()), h, d) * 1.5).to(qd)
    qs, ks = pac._suffixes(q, kv)
    k_scale, v_scale = (0.05, 0.07) if kvd == torch.int8 else (1.0, 1.0)
    outs = []
    for lib in libs:
        out = torch.full_like(q, float("nan"))
        if case["kind"] == "decode":
            getattr(lib, f"paged_decode_{qs}_{ks}")(
                q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), out.data_ptr(), bt.data_ptr(), bt.stride(0),
                seq_lens.data_ptr(), len(reqs), h, kvh, d, bs, d ** -0.5, k_scale, v_scale, case["threads"])
        else:
            fn = "paged_prefill" if case["kind"] == "prefill" else "paged_rows"
            getattr(lib, f"{fn}_{qs}_{ks}")(
                q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), out.data_ptr(), bt.data_ptr(), bt.stride(0),
                q_start.data_ptr(), q_len.data_ptr(), seq_lens.data_ptr(), len(reqs), h, kvh, d, bs, d ** -0.5,
                k_scale, v_scale, case["threads"])
        outs.append(out.view(torch.int16 if qd == torch.bfloat16 else torch.int32))
    return all(torch.equal(outs[0], o) for o in outs[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-csrc", required=True, help="another checkout's tokenmill/model/csrc")
    ap.add_argument("--isas", default="avx2,scalar,avx512emu", help="kernel variants, comma-separated")
    ap.add_argument("--cases", type=int, default=150, help="random cases per variant")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a -D for this tree's build only (repeatable), e.g. TOKENMILL_DECODE_VEC_ITEM=1: AVX2 "
                         "decode on the tiled item")
    args = ap.parse_args()
    total = differ = 0
    for isa in args.isas.split(","):
        rng = random.Random(args.seed)
        saved = cpu_build._ISA_FLAGS[isa]
        cpu_build._ISA_FLAGS[isa] = [*saved, *(f"-D{d}" for d in args.define)]
        try:     # its own cache name per set of defines
            tag = "_bits_this" + "".join("_" + "".join(c for c in d if c.isalnum()) for d in args.define)
            this = load(HERE, isa, tag)
        finally:
            cpu_build._ISA_FLAGS[isa] = saved
        libs = [load(args.baseline_csrc, isa, "_bits_base"), this]
        for _ in range(args.cases):
            case = random_case(rng)
            same = run_case(libs, case, rng)
            total += 1
            differ += not same
            if not same:
                print(f"DIFFER {isa} {case['kind']} q {case['q_dtype']} kv {case['kv_dtype']} heads {case['heads']} "
                      f"block {case['block']} threads {case['threads']} requests {case['reqs'][:4]}", flush=True)
        print(f"{isa}: {args.cases} cases", flush=True)
    print(f"{total} comparisons, {differ} differ")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
