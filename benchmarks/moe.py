"""MoE serving with and without EPLB under a skewed router, at expert-parallel size 1 and 2.

A small random-weight Mixtral (sizes in ``MODEL``, chosen so a run fits the
2-core machine in minutes) is written with transformers' own classes, with
its routers biased toward the ``--hot`` experts by ``--skew`` (a shared
embedding direction plus router rows along it: ``skew_router`` in
``tests/distributed/test_eplb_moe.py``), so that a few experts get most of the
tokens (a skewed synthetic load, as real MoE traffic is).
Default placement puts experts ``0 .. E/ep - 1`` on rank 0, so the hot experts
0 and 1 start on the same rank: the case EPLB exists for.

Arms, side by side in one run on the same seeded workload (greedy, fixed
prompt and output lengths, ``ignore_eos``), per expert-parallel size:

* ``off``: no EPLB (``num_redundant_experts`` 0, default placement);
* ``count``: EPLB counting only (``step_interval`` longer than the run): the
  measured imbalance of the default placement, and the cost of the counters;
* ``eplb``: EPLB rebalancing every ``--interval`` steps (window the same),
  without redundant slots (re-placement only);
* ``eplb+R``: the same with ``--redundant`` redundant slots (replicas of hot experts).

Reported per arm: output tok/s (generated tokens / wall time of the whole
batch), the measured rank-imbalance ratio (busiest / mean expert-parallel
rank, summed over MoE layers; from the engine's per-step EplbStats) over the
steps before the first placement change and over the steps after it,
the expert-imbalance ratio of the router, rebalances and replicas moved, and
per step the communication share (time inside ``torch.distributed`` calls /
worker forward time: the expert-parallel all-to-all dispatch/combine plus the
attention all-reduces; EP 1 has none) and, of it, the all-to-all share alone
(median over steps, the slowest rank).

**Expert parallelism across data-parallel engine cores** (``--dp 2``): the same
workload sent at once to a :class:`~tokenmill.engine.dp_engine.DPAsyncEngine`
(two engine core processes, one CPU each; with ``--dp-tp 2`` each core runs two
tensor-parallel ``mp`` workers on its CPU, and ``dp-ep`` shares the experts over
all four workers: expert parallelism over the TP x DP group), arms ``dp`` (each core holds every
expert, no communication), ``dp-ep`` (``--enable-expert-parallel``: each core
holds half the experts, all-to-all inside every MoE layer, lockstep steps) and
``dp-ep+eplb`` (the same with EPLB rebalancing every ``--interval`` steps).
Reported per core: the all-to-all share of its step time (seconds inside the
MoE dispatch/combine collectives, waiting for the other core included /
seconds in its forwards, dummy steps included), the share of the per-step
agreement, and how many of its steps were dummy (no tokens of its own).

Usage: ``python benchmarks/moe.py [--ep 1,2] [--dp 2 [--dp-tp 1,2]] [--requests 16] [--prompt-len 48] [--max-tokens 32]``
(measurement runs go under the bench lock: ``flock /work/bench.lock .venv/bin/python benchmarks/moe.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from tokenmill import envs  # noqa: E402

# hidden 256, 8 experts of width 512 (top 2), 4 layers, vocabulary 2048: ~25 MB of expert weights (float32)
MODEL = dict(hidden=256, experts=8, expert_ffn=512, top_k=2, layers=4, heads=4, kv_heads=2, vocab=2048)


def build_model(folder: str, hot: list[int], strength: float, seed: int = 0) -> str:
    """Write the skewed random-weight Mixtral (safetensors + word-level tokenizer) to ``folder``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.distributed.test_eplb_moe import skew_router

    m = MODEL
    cfg = transformers.MixtralConfig(
        vocab_size=m["vocab"], hidden_size=m["hidden"], intermediate_size=m["expert_ffn"],
        num_hidden_layers=m["layers"], num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"],
        num_local_experts=m["experts"], num_experts_per_tok=m["top_k"], max_position_embeddings=1024,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, sliding_window=None)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
        sd = dict(model.state_dict())
        skew_router(sd, hot, strength, seed)          # in place: the model's own tensors
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, m["vocab"])}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(folder)
    return folder


def run_arm(path: str, ep: int, arm: str, args) -> dict:
    """One engine, the whole workload, its figures."""
    from tokenmill import LLM, SamplingParams

    kw: dict = dict(dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=args.requests,
                    max_num_batched_tokens=2048, enable_prefix_caching=False, max_model_len=256)
    if ep > 1:
        kw.update(tensor_parallel_size=ep)
    kw["enable_expert_parallel"] = True
    if arm != "off":
        interval = 10**9 if arm == "count" else args.interval
        red = args.redundant if arm.startswith("eplb+") else 0
        kw.update(enable_eplb=True, eplb_config={"window_size": args.interval, "step_interval": interval,
                                                 "num_redundant_experts": red})
    import random

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, MODEL["vocab"]) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    t_load = time.perf_counter()
    llm = LLM(path, **kw)
    t_load = time.perf_counter() - t_load
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))   # warm-up
        shares: list[float] = []
        a2a: list[float] = []                     # the all-to-all (dispatch/combine) part alone
        trace: list[tuple[int, list]] = []        # per step: (placement changes so far, rank_load_total)
        ex = llm.engine_core.executor
        orig = ex.execute_model

        def timed(so):
            out = orig(so)
            st = getattr(ex, "last_step_stats", None)
            if st:
                fwd = max(s.forward for s in st)
                if fwd > 0:
                    shares.append(max(s.comm for s in st) / fwd)
                    a2a.append(max(getattr(s, "ep_comm", 0.0) for s in st) / fwd)
            e = getattr(ex, "eplb_stats", None)
            if e is not None:
                trace.append((e.num_placement_changes, e.rank_load_total))
            return out
        ex.execute_model = timed
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
        ex.execute_model = orig
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        es = llm.engine_core.get_stats().eplb
        tokens = [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
    before, after = _imbalance_split(trace)
    return {"ep": ep, "arm": arm, "tok_s": gen / wall, "wall_s": wall, "load_s": t_load,
            "imbalance": after, "imbalance_default": before, "steps": len(trace),
            "expert_imbalance": es.expert_imbalance_ratio if es else None,
            "rebalances": es.num_placement_changes if es else 0, "moved": es.num_experts_moved if es else 0,
            "rebalance_ms": 1e3 * es.rebalance_seconds_total if es else 0.0,
            "comm_share": statistics.median(shares) if shares else 0.0,
            "a2a_share": statistics.median(a2a) if a2a else 0.0, "tokens": tokens}


def run_dp_arm(path: str, dp: int, arm: str, args, tp: int = 1) -> dict:
    """``dp`` engine core processes (one CPU each) behind a :class:`DPAsyncEngine`, the whole workload at once."""
    import asyncio
    import random

    import transformers

    from tokenmill.config import EngineConfig
    from tokenmill.engine.dp_engine import DPAsyncEngine
    from tokenmill import SamplingParams

    kw: dict = dict(model=path, dtype="float32", num_kv_blocks=512, block_size=16, max_num_seqs=args.requests,
                    max_num_batched_tokens=2048, enable_prefix_caching=False, max_model_len=256,
                    data_parallel_size=dp)
    if tp > 1:                         # each core runs -tp workers (mp); with EP the experts span all of them
        kw["tensor_parallel_size"] = tp
    if arm.startswith("dp-ep"):
        kw["enable_expert_parallel"] = True
    if arm == "dp-ep+eplb":
        kw.update(enable_eplb=True, eplb_config={"window_size": args.interval, "step_interval": args.interval,
                                                 "num_redundant_experts": 0})
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, MODEL["vocab"]) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    t_load = time.perf_counter()
    engine = DPAsyncEngine(EngineConfig.from_kwargs(**kw), tok, start_timeout=600)

    async def one(rid: str, prompt: list[int], p) -> list[int]:
        out: list[int] = []
        async for o in engine.generate(rid, None, prompt, p):
            if o.error:
                raise RuntimeError(o.error)
            out.extend(o.outputs[0].token_ids)
        return out

    async def main() -> tuple[float, list[list[int]]]:
        await engine.start_background()
        warm = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        await asyncio.gather(*(one(f"w{i}", prompts[i], warm) for i in range(2)))
        t0 = time.perf_counter()
        toks = await asyncio.gather(*(one(f"r{i}", p, params) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - t0
        await asyncio.sleep(1.0)          # the cores' stats after the last wave
        return wall, toks

    try:
        engine.start()
        t_load = time.perf_counter() - t_load
        wall, tokens = asyncio.run(main())
        per_core = [e.get_stats() for e in engine.engines]
    finally:
        engine.shutdown()
    gen = sum(len(t) for t in tokens)
    eps = [s.expert_parallel for s in per_core]
    row = {"dp": dp, "tp": tp, "arm": arm, "tok_s": gen / wall, "wall_s": wall, "load_s": t_load, "tokens": tokens,
           "routed": list(engine.num_routed), "a2a_share": None, "sync_share": None, "dummy_frac": None,
           "steps": [s.num_steps for s in per_core]}
    if all(eps):
        row["a2a_share"] = [e["all_to_all_seconds"] / e["step_seconds"] for e in eps]
        row["sync_share"] = [e["sync_seconds"] / e["step_seconds"] for e in eps]
        row["dummy_frac"] = [e["dummy_steps"] / max(1, e["steps"]) for e in eps]
        row["steps"] = [int(e["steps"]) for e in eps]
    es = [s.eplb for s in per_core if s.eplb is not None]
    if es:
        row["rebalances"] = es[0].num_placement_changes
        row["imbalance_before"] = es[0].imbalance_before
        row["imbalance_after"] = es[0].imbalance_after
    return row


def _imbalance_split(trace: list[tuple[int, list]]) -> tuple[float | None, float | None]:
    """Measured rank imbalance over the steps before the first placement change (the default placement) and
    over the steps after it (None when there are none); from the cumulative per-rank loads of every step."""
    import torch

    from tokenmill.distributed.eplb import imbalance_ratio

    if not trace:
        return None, None
    first = next((i for i, (changes, _) in enumerate(trace) if changes > 0), None)
    end = torch.tensor(trace[-1][1], dtype=torch.float64)
    if first is None:
        return imbalance_ratio(end), None
    mid = torch.tensor(trace[first][1], dtype=torch.float64)   # totals up to the step that rebalanced
    return imbalance_ratio(mid), (imbalance_ratio(end - mid) if first < len(trace) - 1 else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ep", default="1,2", help="expert-parallel sizes, comma-separated")
    ap.add_argument("--arms", default="off,count,eplb,eplb+R")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--interval", type=int, default=8, help="EPLB window and step_interval, engine steps")
    ap.add_argument("--redundant", type=int, default=2, help="redundant expert slots of the eplb+R arm")
    ap.add_argument("--hot", default="0,1", help="experts whose router rows are scaled")
    ap.add_argument("--skew", type=float, default=6.0,
                    help="router bias toward the hot experts (tests/distributed/test_eplb_moe.py skew_router)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per process (TOKENMILL_NUM_THREADS; 1: EP 1 has one core, EP 2 one per rank)")
    ap.add_argument("--dp", type=int, default=0,
                    help="also run the data-parallel arms with this many engine cores (0: none)")
    ap.add_argument("--dp-arms", default="dp,dp-ep,dp-ep+eplb")
    ap.add_argument("--dp-tp", default="1",
                    help="tensor-parallel workers per engine core in the --dp arms, comma-separated (2: dp-ep shares "
                         "the experts over the TP x DP group of dp x 2 workers; dp splits every expert's columns "
                         "within each core)")
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    if args.threads:
        envs.set("TOKENMILL_NUM_THREADS", str(args.threads))
    envs.set("TOKENMILL_EPLB_STATS_STEPS", "1")     # EPLB stats (per-rank loads) fresh after every step
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(__file__)).stdout.strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; model {MODEL}; hot experts {args.hot} x{args.skew}; "
          f"{args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} output tokens, greedy; "
          f"{args.threads} thread(s) per process; EPLB window = interval = {args.interval} steps")
    rows = []
    dp_rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_model(tmp, [int(h) for h in args.hot.split(",")], args.skew, args.seed)
        for tp, arm in ([(int(t), a) for t in args.dp_tp.split(",") for a in args.dp_arms.split(",")]
                        if args.dp > 1 else []):
            r = run_dp_arm(path, args.dp, arm, args, tp)
            dp_rows.append(r)
            pct = (lambda xs: "/".join(f"{100 * x:.1f}%" for x in xs) if xs else "  -  ")
            extra = ""
            if "rebalances" in r:
                extra = (f"  placement changes {r['rebalances']} (imbalance {_f(r['imbalance_before'])} -> "
                         f"{_f(r['imbalance_after'])} predicted)")
            print(f"dp {args.dp} tp {tp} {r['arm']:10s} {r['tok_s']:8.1f} tok/s  requests per core {r['routed']}  "
                  f"steps per core {r['steps']}  all-to-all share of step time {pct(r['a2a_share'])}  "
                  f"sync share {pct(r['sync_share'])}  dummy steps {pct(r['dummy_frac'])}{extra}", flush=True)
        if dp_rows:      # float32: the TP arms sum in another order, so equal greedy tokens are not guaranteed
            same = all(r["tokens"] == dp_rows[0]["tokens"] for r in dp_rows)
            print(f"dp {args.dp}: greedy outputs identical across arms: {same}", flush=True)
        for ep in [int(e) for e in args.ep.split(",") if e]:
            for arm in args.arms.split(","):
                r = run_arm(path, ep, arm, args)
                rows.append(r)
                print(f"ep {ep} {arm:8s} {r['tok_s']:8.1f} tok/s  imbalance default placement "
                      f"{_f(r['imbalance_default'])} -> after the first rebalance {_f(r['imbalance'])} "
                      f"({r['steps']} steps)  expert skew {_f(r['expert_imbalance'])}  "
                      f"placement changes {r['rebalances']} ({r['moved']} replicas moved, {r['rebalance_ms']:.0f} ms)  "
                      f"comm share {100 * r['comm_share']:.1f}% (all-to-all {100 * r['a2a_share']:.1f}%)", flush=True)
    by_ep: dict[int, list] = {}
    for r in rows:
        by_ep.setdefault(r["ep"], []).append(r)
    for ep, rs in by_ep.items():
        same = all(r["tokens"] == rs[0]["tokens"] for r in rs)
        print(f"ep {ep}: greedy outputs identical across arms: {same}")
    ref = next((r for r in rows if r["ep"] == 1), None)
    if ref is not None and dp_rows:
        print("dp arms with the one-process (EP 1) greedy outputs: "
              + ", ".join(f"tp {r['tp']} {r['arm']} {r['tokens'] == ref['tokens']}" for r in dp_rows))
    print(f"# load after: {os.getloadavg()[0]:.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "tokens"} for r in rows + dp_rows], f, indent=1)
    return 0


def _f(x) -> str:
    return "  -  " if x is None else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(main())
