"""Speculative decoding ablation: with and without each proposer, side by side, at several concurrencies.

For every configuration (``base``: no speculation; ``ngram``: prompt lookup
with a fixed draft length; ``ngram-dyn``: the same with a draft length that
shrinks with the batch, ``num_speculative_tokens_per_batch_size``;
``draft``: a draft model) one in-process engine (:class:`tokenmill.LLM`, the
same EngineCore the server runs) serves a closed loop of ``c`` concurrent
requests (a new one starts when one finishes, as ``vllm bench serve
--max-concurrency c``) for each ``c`` in ``--concurrency``. Printed per
workload, configuration and concurrency: output tok/s, p50/p99 TPOT
(``(e2e - ttft) / (output tokens - 1)``, vLLM's definition), acceptance rate
(accepted / drafted tokens), mean acceptance length (tokens per verifying
request-step) and the speed-up over ``base`` at the same concurrency.

Workloads (greedy, temperature 0, so every configuration produces the same
tokens up to bfloat16 rounding):

* ``mtbench``: the first turns of MT-bench (``shared/data/mt_bench_questions.jsonl``
  or ``--mt-bench``) with the model's chat template, ``--output-len`` tokens at most;
* ``lookup``: prompt-lookup friendly: "rewrite this paragraph with the typos
  fixed" over paragraphs of this repository's docs (the answer copies most of
  the prompt).

The draft model (``--draft-layers N``) is the target's first ``N`` decoder
layers with its final norm and tied LM head, saved as a GGUF with the
target's own block formats (a Hugging Face folder for a non-GGUF target):
self-speculation by early exit, as LayerSkip (Elhoushi et al. arXiv
2404.16710) without its training; no smaller checkpoint shares SmolLM2's
tokenizer here.

    .venv/bin/python benchmarks/spec_decode.py                       # everything (~30 min on 2 cores)
    .venv/bin/python benchmarks/spec_decode.py --workloads lookup --configs base,ngram --concurrency 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokenmill import envs  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.spec_decode.early_exit import truncate_gguf  # noqa: E402

MT_BENCH = Path("/work/shared/data/mt_bench_questions.jsonl")


def mtbench_prompts(llm: LLM, path: Path, n: int, seed: int) -> list[list[int]]:
    """First turns of MT-bench, chat-templated and tokenized (``n`` of them, shuffled with ``seed``)."""
    qs = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]
    random.Random(seed).shuffle(qs)
    tok = llm.get_tokenizer()
    out = []
    for q in (qs * (n // len(qs) + 1))[:n]:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True,
                                       chat_template=llm.chat_template)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def _paragraphs() -> list[str]:
    """Prose paragraphs (60-160 words) from the repository's own documents."""
    paras = []
    docs = [REPO / "docs" / "architecture.md", REPO / "README.md",
            *sorted((REPO / "docs" / "guide").glob("*.md")), *sorted((REPO / "docs" / "benchmarks").glob("*.md"))]
    for f in [*docs, REPO / "tokenmill" / "bench" / "README.md"]:
        if not f.exists():
            continue
        for p in re.split(r"\n\s*\n", f.read_text()):
            p = " ".join(p.split())
            if 60 <= len(p.split()) <= 160 and not p.startswith(("|", "```", "#")):
                paras.append(p)
    return paras


def lookup_prompts(llm: LLM, n: int, seed: int) -> list[list[int]]:
    """"Rewrite with the typos fixed" over repository paragraphs: the answer repeats the prompt."""
    rng = random.Random(seed)
    paras = _paragraphs()
    rng.shuffle(paras)
    tok = llm.get_tokenizer()
    out = []
    for p in (paras * (n // max(1, len(paras)) + 1))[:n]:
        words = p.split()
        for _ in range(max(1, len(words) // 30)):         # a few typos: swap two letters of a word
            i = rng.randrange(len(words))
            w = words[i]
            if len(w) > 3:
                j = rng.randrange(len(w) - 1)
                words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
        msg = ("Rewrite the following text with its typos fixed. Keep everything else exactly as it is.\n\n"
               + " ".join(words))
        text = tok.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                       add_generation_prompt=True, chat_template=llm.chat_template)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def build_draft(target: str | None, layers: int, folder: Path) -> str:
    """The target's first ``layers`` decoder layers (+ final norm, tied head) as a checkpoint of their own.

    A GGUF target gives a GGUF draft: the same tensors in the same block formats (Q4_1 layers, Q8_0
    embedding), metadata copied with ``block_count = layers``, so the draft runs on the same low-bit
    kernels as the target. Any other target gives a Hugging Face folder.
    """
    from tokenmill.model.loader import default_model_path

    path = target or default_model_path()
    if path.endswith(".gguf"):
        return truncate_gguf(path, layers, folder / "draft.gguf")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    cfg = model.config
    cfg.num_hidden_layers = layers
    fresh = transformers.AutoModelForCausalLM.from_config(cfg, dtype="float32")
    keep = {k: v for k, v in model.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    missing, unexpected = fresh.load_state_dict(keep, strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        raise RuntimeError(f"draft weights do not match: missing {missing}, unexpected {unexpected}")
    fresh.save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def pct(v: list[float], q: float) -> float:
    if not v:
        return float("nan")
    s = sorted(v)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def run_closed_loop(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> dict:
    """Serve ``prompts`` keeping ``concurrency`` requests in flight; per-request timings and totals."""
    core, proc = llm.engine_core, llm.processor
    st0 = core.scheduler.spec_stats.copy()
    queue = list(prompts)
    live: dict[str, list] = {}           # rid -> [t_start, t_first, t_last, n_tokens]
    done: list[list] = []

    def add() -> None:
        rid = llm._add(queue.pop(0), params, 0, None)
        live[rid] = [time.perf_counter(), None, None, 0]

    parts: dict[str, float] = {}
    steps = 0
    runner = getattr(core.executor, "last_timings", None) is not None and core.executor
    t0 = time.perf_counter()
    while queue and len(live) < concurrency:
        add()
    while live:
        deltas, stop_ids = proc.process_outputs(core.step())
        if runner:
            steps += 1
            for k, v in runner.last_timings.items():
                parts[k] = parts.get(k, 0.0) + v
        if stop_ids:
            core.stop_requests(stop_ids)
        now = time.perf_counter()
        for d in deltas:
            rec = live.get(d.request_id)
            if rec is None:
                continue
            n = len(d.outputs[0].token_ids)
            if n:
                rec[1] = rec[1] or now
                rec[2] = now
                rec[3] += n
            if d.finished:
                done.append(live.pop(d.request_id))
                proc.remove_request(d.request_id)
                if queue:
                    add()
    wall = time.perf_counter() - t0
    st = core.scheduler.spec_stats
    drafts = st.num_drafts - st0.num_drafts
    dtoks = st.num_draft_tokens - st0.num_draft_tokens
    acc = st.num_accepted_tokens - st0.num_accepted_tokens
    tpots = [(r[2] - r[1]) / (r[3] - 1) for r in done if r[3] > 1]
    out_tokens = sum(r[3] for r in done)
    return {"wall_s": wall, "output_tokens": out_tokens, "tok_s": out_tokens / wall,
            "tpot_p50_ms": 1e3 * pct(tpots, 50), "tpot_p99_ms": 1e3 * pct(tpots, 99),
            "acceptance_rate": acc / dtoks if dtoks else None,
            "mean_acceptance_length": 1 + acc / drafts if drafts else None,
            "steps": steps, "step_ms": {k: 1e3 * v / max(steps, 1) for k, v in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target checkpoint [default: packaged SmolLM2-135M-Instruct]")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workloads", default="lookup,mtbench")
    ap.add_argument("--configs", default="base,ngram,ngram-dyn,draft")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--num-prompts", type=int, default=0,
                    help="requests per concurrency level [default: max(4, 2c) capped at 64]")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens for ngram [default: 4]")
    ap.add_argument("--draft-k", type=int, default=3, help="num_speculative_tokens for the draft model [default: 3]")
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--dyn", default="[[1,1,4],[2,3,2],[4,100000,0]]",
                    help="num_speculative_tokens_per_batch_size for ngram-dyn (JSON)")
    ap.add_argument("--mt-bench", default=str(MT_BENCH))
    ap.add_argument("--kv-cache-memory", default="640MiB",
                    help="KV pool per engine (all configurations stay loaded side by side) [default: 640MiB]")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    concs = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    tmp = tempfile.TemporaryDirectory()
    ngram = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    specs: dict[str, dict | None] = {"base": None, "ngram": ngram,
                                     "ngram-dyn": {**ngram, "num_speculative_tokens_per_batch_size": json.loads(args.dyn)}}
    if "draft" in args.configs.split(","):
        specs["draft"] = {"method": "draft_model", "num_speculative_tokens": args.draft_k,
                          "model": build_draft(args.model, args.draft_layers, Path(tmp.name) / "draft")}
    configs = [c for c in args.configs.split(",") if c in specs]
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    print(f"# spec_decode benchmark {time.strftime('%Y-%m-%d %H:%M')} | load average {os.getloadavg()[0]:.1f} "
          f"| dtype {args.dtype} | threads {envs.raw('TOKENMILL_NUM_THREADS') or 'all CPUs'} "
          f"| output_len {args.output_len} | ngram k={args.k} (n 2..4), dyn {args.dyn} | "
          f"draft: first {args.draft_layers} layers, k={args.draft_k}", flush=True)
    results = []
    llms = {name: LLM(args.model, dtype=args.dtype, speculative_config=specs[name],
                      kv_cache_memory=args.kv_cache_memory) for name in configs}
    prompts = {}
    first = llms[configs[0]]
    for w in workloads:
        n = max(args.num_prompts, 64 + max(concs))
        prompts[w] = (lookup_prompts(first, n, args.seed) if w == "lookup"
                      else mtbench_prompts(first, Path(args.mt_bench), n, args.seed))
    for w in workloads:
        print(f"\n## {w}\n| c | config | output tok/s | TPOT p50 ms | TPOT p99 ms | acceptance | mean acc. len | vs base "
              f"| ms per step: forward / sample / propose |")
        print("|---|---|---|---|---|---|---|---|---|", flush=True)
        for c in concs:
            n = args.num_prompts or min(max(4, 2 * c), 64)
            # warm-up (kernels, allocator) off the clock, then the same prompts for every config
            ps = prompts[w][:n]
            base_tps = None
            for name in configs:
                llm = llms[name]
                llm.generate(ps[:1], SamplingParams(temperature=0, max_tokens=8))
                llm.engine_core.scheduler.reset_prefix_cache()
                r = run_closed_loop(llm, ps, params, c)
                r.update(workload=w, config=name, concurrency=c, num_prompts=n)
                results.append(r)
                if name == "base":
                    base_tps = r["tok_s"]
                fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
                print(f"| {c} | {name} | {r['tok_s']:.1f} | {r['tpot_p50_ms']:.1f} | {r['tpot_p99_ms']:.1f} | "
                      f"{fmt(r['acceptance_rate'], '.2f')} | {fmt(r['mean_acceptance_length'], '.2f')} | "
                      f"{fmt(r['tok_s'] / base_tps if base_tps else None, '.2f')}x | "
                      f"{' / '.join(format(r['step_ms'].get(p, 0.0), '.1f') for p in ('forward', 'sample', 'propose'))}"
                      f" |", flush=True)
    print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
