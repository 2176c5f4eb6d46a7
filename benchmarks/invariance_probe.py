"""Probe every batch-invariance symptom of issue #31 on the packaged SmolLM2-135M, one dtype per run.

Each check runs the same requests two ways at engine level (``LLM``) and compares token ids AND logprobs
bit for bit; it prints ``equal k/n`` per check (n = requests compared) for ``--batch-invariant`` (the
default) and, with ``--plain``, the same for ``--no-batch-invariant`` (where differences are allowed, so a
check that never differs there is noted). Checks:

* ``alone``: each prompt alone vs all prompts batched;
* ``chunk16``: ``max_num_batched_tokens=16`` vs the default budget;
* ``preempt``: a KV pool small enough to preempt (recompute) vs a large one;
* ``threads``: 1 vs 2 torch threads;
* ``n3``: a seeded ``n=3`` request vs its three children (seed, seed+1, seed+2) each alone (what a
  streamed and a non-streamed request reduce to in the engine: the same child requests, other schedules);
* ``rawlp``: the first position's raw ``top_logprobs`` of a greedy request vs the same prompt with
  temperature / top-p / top-k (alone and together with the greedy one);
* ``penalty``: a seeded request alone vs beside a neighbour with penalties;
* ``kv-<fmt>``: a ~700-token system prompt + question, miss then hit (prefix cache) in one engine, fp8/int8;
* ``ngram``: n-gram speculative decoding on vs off (greedy);
* ``pp2`` / ``tp3`` (``--parallel``): pipeline / tensor parallel vs one rank (TP may differ: measured).

    python benchmarks/invariance_probe.py --dtype auto [--plain] [--parallel] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

from tokenmill import LLM, SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are",
           "Water boils at", "In 1492, Columbus", "The quick brown fox", "My favourite food is"]
SYSTEM = ("You are a careful assistant for a paged-attention serving engine. " +
          "Keys and values are stored in fixed-size blocks of sixteen tokens, shared between requests whose "
          "prompts begin alike; a block is freed when no request holds it and reused when memory runs out. "
          * 18)


def greedy(n=24, lp=5):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=lp)


def res(outs):
    r = []
    for o in outs:
        for c in o.outputs:
            r.append((tuple(c.token_ids), tuple((lp.logprob, tuple(lp.top_token_ids), tuple(lp.top_logprobs))
                                                for lp in (c.logprobs or []))))
    return r


def cmp(a, b):
    return sum(x == y for x, y in zip(a, b)), len(a), sum(x[0] == y[0] for x, y in zip(a, b))


def run_checks(args, invariant: bool) -> dict:
    base = dict(dtype=args.dtype, batch_invariant=invariant, max_model_len=1024)
    out = {}

    def note(name, a, b, extra=None):
        eq, n, tok = cmp(a, b)
        out[name] = {"equal": eq, "n": n, "tokens_equal": tok, **(extra or {})}
        print(f"  [{'inv' if invariant else 'plain'} {args.dtype}] {name:10s} bit-equal {eq}/{n}, token ids "
              f"equal {tok}/{n}", flush=True)

    g = greedy()
    llm = LLM(**base, kv_cache_memory="256MiB")
    ref = res(llm.generate(PROMPTS, g))
    note("alone", ref, [res(llm.generate([p], g))[0] for p in PROMPTS])
    th = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        note("threads", ref, res(llm.generate(PROMPTS, g)))
    finally:
        torch.set_num_threads(th)
    # n=3 seeded vs its children alone
    s3 = SamplingParams(temperature=0.8, top_p=0.95, seed=42, n=3, max_tokens=24, ignore_eos=True, logprobs=2)
    together = res(llm.generate([PROMPTS[1], PROMPTS[3]], [s3, greedy()]))[:3]
    kids = [res(llm.generate([PROMPTS[1]], SamplingParams(temperature=0.8, top_p=0.95, seed=42 + i, max_tokens=24,
                                                           ignore_eos=True, logprobs=2)))[0] for i in range(3)]
    note("n3", together, kids)
    # raw top logprobs do not depend on the sampling parameters
    gl = res(llm.generate([PROMPTS[4]], greedy(1, 3)))[0][1][0][1:]
    others = []
    for sp in (SamplingParams(temperature=0.7, max_tokens=1, logprobs=3, seed=1),
               SamplingParams(temperature=1.0, top_p=0.5, max_tokens=1, logprobs=3, seed=1),
               SamplingParams(temperature=1.0, top_k=5, max_tokens=1, logprobs=3, seed=1)):
        others.append(res(llm.generate([PROMPTS[4]], sp))[0][1][0][1:])
        others.append(res(llm.generate([PROMPTS[4], PROMPTS[4]], [greedy(1, 3), sp]))[1][1][0][1:])
    note("rawlp", [gl] * len(others), others, {"greedy": gl, "others": others})
    # seeded request with and without a penalised neighbour
    sd = SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)
    pen = SamplingParams(temperature=0.9, seed=8, max_tokens=24, ignore_eos=True, frequency_penalty=1.0,
                         presence_penalty=0.5, repetition_penalty=1.3)
    alone = res(llm.generate([PROMPTS[2]], sd))
    beside = res(llm.generate([PROMPTS[2], PROMPTS[5]], [sd, pen]))[:1]
    note("penalty", alone, beside)
    del llm
    llm = LLM(**base, kv_cache_memory="256MiB", max_num_batched_tokens=16)
    note("chunk16", ref, res(llm.generate(PROMPTS, g)))
    del llm
    llm = LLM(**{**base, "max_model_len": 128}, num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    got = res(llm.generate(PROMPTS, greedy(40)))
    pre = llm.engine_core.scheduler.num_preemptions_total
    del llm
    llm = LLM(**base, kv_cache_memory="256MiB")
    note("preempt", res(llm.generate(PROMPTS, greedy(40))), got, {"preemptions": pre})
    del llm
    llm = LLM(**base, kv_cache_memory="256MiB", speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                    "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    rep = [p + " " + p + " " + p for p in PROMPTS]
    spec = res(llm.generate(rep, greedy(32)))
    acc = llm.engine_core.scheduler.spec_stats.num_accepted_tokens
    del llm
    llm = LLM(**base, kv_cache_memory="256MiB")
    note("ngram", res(llm.generate(rep, greedy(32))), spec, {"accepted": acc})
    del llm
    for kv in ("fp8", "int8"):
        llm = LLM(**base, kv_cache_memory="256MiB", kv_cache_dtype=kv)
        ntok = len(llm.get_tokenizer().encode(SYSTEM))
        qs = [SYSTEM + "\nQuestion: " + p for p in PROMPTS[:4]]
        miss = res(llm.generate(qs, greedy(24)))
        hit = res(llm.generate(qs, greedy(24)))
        hit1 = [res(llm.generate([q], greedy(24)))[0] for q in qs]
        note(f"kv-{kv}", miss + miss, hit + hit1, {"system_tokens": ntok})
        del llm
    if args.parallel:
        ref4 = ref[:4]
        for name, kw in (("pp2", dict(pipeline_parallel_size=2)), ("tp3", dict(tensor_parallel_size=3))):
            llm = LLM(**base, kv_cache_memory="256MiB", **kw)
            try:
                got = res(llm.generate(PROMPTS[:4], g))
            finally:
                llm.shutdown()
            dev = []     # |top-k logprob difference| where both runs share the context and rank the same ids
            for (ta, la), (tb, lb) in zip(ref4, got):
                div = next((i for i, (a, b) in enumerate(zip(ta, tb)) if a != b), len(ta))
                for x, y in list(zip(la, lb))[:div + 1]:
                    dev += [abs(a - b) for a, b in zip(x[2], y[2])] if x[1] == y[1] else []
            note(name, ref4, got, {"max_top_lp_dev": max(dev, default=0.0)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--plain", action="store_true", help="also run --no-batch-invariant")
    ap.add_argument("--parallel", action="store_true", help="also PP 2 and TP 3 (worker processes)")
    ap.add_argument("--json")
    args = ap.parse_args()
    t0 = time.time()
    result = {"dtype": args.dtype, "threads": torch.get_num_threads(),
              "invariant": run_checks(args, True)}
    if args.plain:
        result["plain"] = run_checks(args, False)
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps({k: v for k, v in result.items() if k not in ("invariant", "plain")}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)


if __name__ == "__main__":
    main()
