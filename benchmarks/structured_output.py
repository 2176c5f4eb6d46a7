"""Structured outputs: a JSON-schema workload against the same prompts unconstrained, with and without
grammar-forced drafts, side by side, at several concurrencies.

Three arms per concurrency ``c`` (a closed loop of ``c`` requests in flight, a new one starting when one
finishes, as ``vllm bench serve --max-concurrency c``), over in-process engines (:class:`tokenmill.LLM`,
the EngineCore the server runs):

* ``constrained``: every request carries the JSON schema (``structured_outputs.json``); forced drafts off
  (``num_forced_draft_tokens: 0``): the bitmask is filled on a worker thread while the forward runs and
  applied to the logits before sampling.
* ``forced k=K learned|tokenizer``: the same requests on an engine with forced drafts
  (``num_forced_draft_tokens`` K, ``--forced``): where the grammar allows exactly one continuation (keys,
  punctuation, the rest of an enum word), those tokens ride in the step as draft tokens and are verified in
  the same forward; ``learned`` drafts a forced string the model already wrote with the tokens it wrote it
  with (``learn_forced_splits``, the default; the table starts empty in every run, so only the measured
  requests teach each other), ``tokenizer`` always with the tokenizer's split (``--learn``).
* ``unconstrained``: the same prompts without the schema, each generating exactly as many tokens as its
  constrained run did (``ignore_eos``, ``max_tokens`` = that length), so the arms do the same work; it runs
  on the ``constrained`` arm's engine.

Greedy (temperature 0). Printed per workload and concurrency: output tok/s, p50 TPOT ((e2e - ttft) /
(tokens - 1), vLLM's definition), the ratio to ``unconstrained``, the mask time per step (fill on the
worker thread, and what the step waited for it + applying it), forced-draft acceptance, and how many
outputs are valid JSON for the schema. The arms run interleaved, ``--repeat`` times, the unconstrained arm
in the middle and the order reversed every repetition (C U, U C, ...); the machine is shared, so every
figure comes with the load average. The table shows the median repetition, the ratio of the arm's median
tok/s to the unconstrained arm's median, and the *paired* ratio: per repetition, the arm's tok/s over the
unconstrained arm's run right beside it (drift of the machine between repetitions cancels out of it), its
median and range; the per-repetition paired ratios and their quartiles follow each table.

Workloads: ``keyheavy`` (a flat record of 12 required keys with short enum/integer/boolean values,
compact JSON: ``disable_any_whitespace``; most of the text is keys and punctuation) and ``person`` (a
nested schema with strings and an array, default whitespace).

    .venv/bin/python benchmarks/structured_output.py                          # both workloads, c = 1, 16, 64
    .venv/bin/python benchmarks/structured_output.py --workloads keyheavy --concurrency 1 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.sampling_params import StructuredOutputsParams  # noqa: E402

KEYHEAVY = {
    "type": "object",
    "properties": {
        "user_id": {"type": "integer"},
        "account_status": {"enum": ["active", "suspended", "closed"]},
        "subscription_tier": {"enum": ["free", "basic", "premium", "enterprise"]},
        "email_verified": {"type": "boolean"},
        "two_factor_enabled": {"type": "boolean"},
        "preferred_language": {"enum": ["english", "french", "german", "spanish"]},
        "notification_frequency": {"enum": ["daily", "weekly", "monthly", "never"]},
        "login_count_last_month": {"type": "integer"},
        "marketing_emails_opt_in": {"type": "boolean"},
        "account_region": {"enum": ["europe", "north_america", "asia_pacific"]},
        "support_tickets_open": {"type": "integer"},
        "is_beta_tester": {"type": "boolean"},
    },
    "additionalProperties": False,
}
KEYHEAVY["required"] = list(KEYHEAVY["properties"])
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "occupation": {"type": "string", "maxLength": 40},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "country": {"type": "string", "maxLength": 30}},
                    "required": ["city", "country"], "additionalProperties": False},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "occupation", "address", "hobbies"],
    "additionalProperties": False,
}
WORKLOADS = {
    "keyheavy": (KEYHEAVY, True, "Write the account record of user number {n}, a {adj} customer from {city}, "
                                 "as JSON with every field of our user schema."),
    "person": (PERSON, False, "Invent a {adj} person who lives in {city} (profile number {n}) and describe "
                              "them as JSON: name, age, occupation, address and hobbies."),
}
CITIES = ["Paris", "Lyon", "Berlin", "Madrid", "Boston", "Osaka", "Toronto", "Lisbon", "Prague", "Dublin"]
ADJS = ["loyal", "new", "frustrated", "happy", "busy", "curious", "quiet", "demanding"]


def prompts_for(llm: LLM, template: str, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    tok = llm.get_tokenizer()
    out = []
    for i in range(n):
        text = template.format(n=rng.randint(100, 99999), adj=rng.choice(ADJS), city=rng.choice(CITIES))
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        out.append(tok.encode(chat, add_special_tokens=False))
    return out


def pct(v: list[float], q: float) -> float:
    if not v:
        return float("nan")
    s = sorted(v)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def run_closed_loop(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], concurrency: int) -> dict:
    """Serve ``prompts`` (``params[i]`` for prompt ``i``) keeping ``concurrency`` in flight."""
    core, proc = llm.engine_core, llm.processor
    so = core.structured_output
    st0 = so.stats.copy()
    queue = list(range(len(prompts)))
    live: dict[str, list] = {}           # rid -> [index, t_start, t_first, t_last, n_tokens, text parts]
    done: list[list] = []

    def add() -> None:
        i = queue.pop(0)
        rid = llm._add(prompts[i], params[i], 0, None)
        live[rid] = [i, time.perf_counter(), None, None, 0, []]

    steps, mask_steps_wall = 0, 0.0
    runner = core.executor
    t0 = time.perf_counter()
    while queue and len(live) < concurrency:
        add()
    while live:
        deltas, stop_ids = proc.process_outputs(core.step())
        steps += 1
        mask_steps_wall += getattr(runner, "last_timings", {}).get("grammar_mask", 0.0)
        if stop_ids:
            core.stop_requests(stop_ids)
        now = time.perf_counter()
        for d in deltas:
            rec = live.get(d.request_id)
            if rec is None:
                continue
            n = len(d.outputs[0].token_ids)
            rec[5].append(d.outputs[0].text)
            if n:
                rec[2] = rec[2] or now
                rec[3] = now
                rec[4] += n
            if d.finished:
                rec.append(d.outputs[0].finish_reason)
                done.append(live.pop(d.request_id))
                proc.remove_request(d.request_id)
                if queue:
                    add()
    wall = time.perf_counter() - t0
    st = so.stats
    tpots = [(r[3] - r[2]) / (r[4] - 1) for r in done if r[4] > 1]
    out_tokens = sum(r[4] for r in done)
    mask_steps = st.mask_steps - st0.mask_steps
    forced = st.forced_draft_tokens - st0.forced_draft_tokens
    done.sort(key=lambda r: r[0])
    return {"wall_s": wall, "output_tokens": out_tokens, "tok_s": out_tokens / wall,
            "tpot_p50_ms": 1e3 * pct(tpots, 50), "tpot_p99_ms": 1e3 * pct(tpots, 99), "steps": steps,
            "mask_fill_ms_per_step": 1e3 * (st.mask_fill_time - st0.mask_fill_time) / mask_steps if mask_steps else 0.0,
            "mask_wait_apply_ms_per_step": 1e3 * mask_steps_wall / mask_steps if mask_steps else 0.0,
            "forced_draft_tokens": forced,
            "forced_acceptance": (st.forced_accepted_tokens - st0.forced_accepted_tokens) / forced if forced else None,
            "lengths": [r[4] for r in done], "texts": ["".join(r[5]) for r in done],
            "finish": [r[6] for r in done]}


def paired(arm: list[dict], unconstrained: list[dict]) -> list[float]:
    """Per repetition ``i``: the arm's output tok/s over the unconstrained arm's in the same repetition (the
    two ran back to back, so a drift of the shared machine between repetitions cancels out of the ratio)."""
    return [a["tok_s"] / u["tok_s"] for a, u in zip(arm, unconstrained)]


def valid_count(texts: list[str], finish: list[str], schema: dict) -> int:
    import jsonschema

    n = 0
    for t, f in zip(texts, finish):
        if f != "stop":
            continue
        try:
            jsonschema.validate(json.loads(t), schema)
            n += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    return n


def machine() -> str:
    try:
        flags = set(re.findall(r"\b(amx_tile|avx512_bf16|avx512f|avx2)\b", Path("/proc/cpuinfo").read_text()))
    except OSError:
        flags = set()
    return f"{os.cpu_count()} CPUs, flags {' '.join(sorted(flags)) or '?'}"


def save(args: argparse.Namespace, load0: tuple, results: list[dict]) -> None:
    """Write the raw results so far to ``--json`` (with the machine and the load averages)."""
    if not args.json:
        return
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
                                           "load_start": load0, "load_now": os.getloadavg(), "args": vars(args),
                                           "results": results}, indent=1))


def mask_bench(llm: LLM, schema: dict, compact: bool, sizes: list[int], reps: int = 20) -> list[dict]:
    """The mask's parts in isolation, side by side: filling ``B`` matchers' rows one call each vs xgrammar's
    batched call, and applying a ``[B, V]`` mask with xgrammar's CPU kernel vs tokenmill's numpy path
    (unpack, on the fill thread in the engine, + write). Matchers sit at spread positions of one canonical
    record of ``schema``. Median of ``reps`` timings, milliseconds."""
    import torch
    import xgrammar as xgr

    from tokenmill.structured_output.xgrammar_backend import MaskPlan, apply_token_bitmask

    so = llm.engine_core.structured_output
    backend = so.backend
    compiled = backend.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=compact))
    sample = {}
    for k, v in schema["properties"].items():
        sample[k] = v["enum"][0] if "enum" in v else {"integer": 42, "boolean": True}.get(v.get("type"), "x")
    text = json.dumps(sample, separators=(", ", ": ") if compact else None)
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    rows_out = []

    def med(f) -> float:
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        return 1e3 * statistics.median(ts)

    for b in sizes:
        matchers = []
        for i in range(b):
            m = backend.new_matcher(compiled)
            m.accept_tokens(ids[:(i * 7) % max(len(ids), 1)])
            matchers.append(m)
        bm = backend.allocate_bitmask(b)
        rows = list(range(b))
        one = med(lambda: [m.fill_bitmask(bm, r) for m, r in zip(matchers, rows)])
        batched = med(lambda: backend.fill_bitmasks(matchers, bm, rows))
        logits = torch.randn(b, backend.vocab_size)
        work = logits.clone()

        def xgr_apply():
            work.copy_(logits)
            xgr.apply_token_bitmask_inplace(work, bm, vocab_size=backend.vocab_size, indices=rows)

        def np_apply(plan=None):
            work.copy_(logits)
            apply_token_bitmask(work, bm, rows, plan)

        copy = med(lambda: work.copy_(logits))
        plan = MaskPlan(bm, rows)
        sparse = len(plan.sparse_rows)
        r = {"rows": b, "fill_one_by_one_ms": one, "fill_batched_ms": batched,
             "apply_xgrammar_ms": med(xgr_apply) - copy, "apply_numpy_ms": med(np_apply) - copy,
             "plan_ms": med(lambda: MaskPlan(bm, rows)),
             "apply_numpy_after_plan_ms": med(lambda: np_apply(plan)) - copy, "sparse_rows": sparse}
        rows_out.append(r)
        print(f"| {b} | {one:.3f} | {batched:.3f} | {r['apply_xgrammar_ms']:.2f} | {r['apply_numpy_ms']:.2f} | "
              f"{r['plan_ms']:.2f} | {r['apply_numpy_after_plan_ms']:.2f} | {sparse}/{b} |",
              flush=True)
    return rows_out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint [default: packaged SmolLM2-135M-Instruct]")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--workloads", default="keyheavy,person")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--num-prompts", type=int, default=0, help="requests per concurrency [default: max(2, c)]")
    ap.add_argument("--max-keys", type=int, default=0,
                    help="keyheavy: keep only the first N of its 12 keys (a shorter record) [default: all]")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--forced", default="3", help="num_forced_draft_tokens of the forced arms, comma-separated "
                                                  "(one engine each); 'none': no forced arm [default: 3]")
    ap.add_argument("--forced-max-batch", type=int, default=0,
                    help="forced_draft_max_batch of the forced arms (forced drafts only in steps with at most this "
                         "many running requests) [default: the engine's]")
    ap.add_argument("--learn", default="on", choices=["on", "off", "both"],
                    help="forced arms with learned splits (learn_forced_splits), the tokenizer's, or both [on]")
    ap.add_argument("--repeat", type=int, default=6,
                    help="repetitions per arm (at least 6 to resolve a 5%% effect on a shared 2-core VM) [6]")
    ap.add_argument("--kv-cache-memory", default="512MiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--mask-bench", default=None, metavar="SIZES",
                    help="only time the mask's parts at these batch sizes (e.g. 1,16,64): fill one by one vs "
                         "batched, apply with xgrammar's kernel vs numpy")
    args = ap.parse_args()

    concs = [int(c) for c in args.concurrency.split(",")]
    load0 = os.getloadavg()
    print(f"# structured_output benchmark {time.strftime('%Y-%m-%d %H:%M')} | {machine()} | load average "
          f"{load0[0]:.1f} {load0[1]:.1f} {load0[2]:.1f} | dtype {args.dtype} | greedy | forced drafts k={args.forced} "
          f"learn={args.learn} "
          f"| repeat {args.repeat}, arms interleaved", flush=True)
    common = dict(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=max(concs))
    if args.mask_bench:
        llm = LLM(args.model, **common)
        results = []
        for w in args.workloads.split(","):
            schema, compact, _ = WORKLOADS[w]
            print(f"\n## mask parts, {w}, ms (median of 20; torch threads {__import__('torch').get_num_threads()})\n"
                  "| rows | fill one by one | fill batched | apply xgrammar kernel | apply numpy (plan + write) "
                  "| plan only (fill thread) | write only (critical path) | sparse rows |\n"
                  "|---|---|---|---|---|---|---|---|", flush=True)
            results += [r | {"workload": w} for r in mask_bench(llm, schema, compact,
                                                                [int(x) for x in args.mask_bench.split(",")])]
        save(args, load0, results)
        llm.shutdown()
        return
    plain = LLM(args.model, structured_outputs_config={"num_forced_draft_tokens": 0}, **common)
    learns = {"on": [True], "off": [False], "both": [True, False]}[args.learn]
    forced_llms = {}                    # arm name -> engine
    for k in ([] if args.forced == "none" else [int(x) for x in args.forced.split(",")]):
        for learn in learns:
            name = f"forced k={k}" + (" learned" if learn else " tokenizer")
            cfg = {"num_forced_draft_tokens": k, "learn_forced_splits": learn}
            if args.forced_max_batch:
                cfg["forced_draft_max_batch"] = args.forced_max_batch
                name += f" max_batch={args.forced_max_batch}"
            forced_llms[name] = LLM(args.model, structured_outputs_config=cfg, **common)
    results = []
    for w in args.workloads.split(","):
        schema, compact, template = WORKLOADS[w]
        if w == "keyheavy" and args.max_keys:
            keys = list(schema["properties"])[:args.max_keys]
            schema = {**schema, "properties": {k: schema["properties"][k] for k in keys}, "required": keys}
        so = StructuredOutputsParams(json=schema, disable_any_whitespace=compact)
        cparams = SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=so)
        print(f"\n## {w} ({'compact' if compact else 'default whitespace'} JSON)\n"
              "| c | arm | output tok/s | TPOT p50 ms | vs unconstrained (medians) | paired ratio median [min-max] "
              "| tokens/step | ms/step | mask fill ms/step (thread) | mask wait+apply ms/step | forced acc. "
              "| valid JSON |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
        for c in concs:
            n = args.num_prompts or max(2, c)
            ps = prompts_for(plain, template, n, args.seed + c)
            for llm in (plain, *forced_llms.values()):     # warm-up off the clock: kernels, backend, compile cache
                llm.generate(ps[:2], [cparams, SamplingParams(temperature=0, max_tokens=8)])
            # the unconstrained arm generates as many tokens per request as the constrained one (greedy: every
            # constrained run gives the same), measured once here off the clock
            lengths = run_closed_loop(plain, ps, [cparams] * n, c)["lengths"]
            uparams = [SamplingParams(temperature=0, max_tokens=max(1, k), ignore_eos=True) for k in lengths]
            reps: dict[str, list[dict]] = {"constrained": [], **{a: [] for a in forced_llms}, "unconstrained": []}
            others = [a for a in reps if a != "unconstrained"]
            half = (len(others) + 1) // 2
            for rep in range(args.repeat):
                # the unconstrained arm (every paired ratio's denominator) in the middle, beside the arms on
                # either side of it; the order reverses every repetition (C U, U C, C U, ...: a linear drift of
                # the machine lands on both sides of the pairs alike)
                order = others[:half] + ["unconstrained"] + others[half:]
                for arm in (order if rep % 2 == 0 else order[::-1]):
                    llm = forced_llms.get(arm, plain)
                    llm.engine_core.scheduler.reset_prefix_cache()
                    # learned splits start empty in every run: only the measured requests teach each other
                    llm.engine_core.structured_output._learned.clear()
                    r = run_closed_loop(llm, ps, uparams if arm == "unconstrained" else [cparams] * n, c)
                    r["valid"] = valid_count(r["texts"], r["finish"], schema) if arm != "unconstrained" else None
                    r["load"] = os.getloadavg()[0]
                    reps[arm].append(r)
            med = {arm: sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2] for arm, rs in reps.items()}
            base = statistics.median(r["tok_s"] for r in reps["unconstrained"])
            for arm in ("unconstrained", "constrained", *forced_llms):
                r = med[arm]
                acc = "-" if r["forced_acceptance"] is None else f"{r['forced_acceptance']:.2f}"
                valid = "-" if r["valid"] is None else f"{r['valid']}/{n}"
                ratio = statistics.median(x["tok_s"] for x in reps[arm]) / base
                pr = paired(reps[arm], reps["unconstrained"])
                print(f"| {c} | {arm} | {r['tok_s']:.1f} | {r['tpot_p50_ms']:.1f} | {ratio:.2f}x | "
                      f"{statistics.median(pr):.3f}x [{min(pr):.3f}-{max(pr):.3f}] | "
                      f"{r['output_tokens'] / max(r['steps'], 1):.2f} | {1e3 * r['wall_s'] / max(r['steps'], 1):.1f} | "
                      f"{r['mask_fill_ms_per_step']:.2f} | {r['mask_wait_apply_ms_per_step']:.2f} | {acc} | {valid} |",
                      flush=True)
            for arm in reps:
                if arm != "unconstrained":
                    pr = paired(reps[arm], reps["unconstrained"])
                    print(f"#   c={c} {arm}: paired ratios per repetition "
                          f"{' '.join(f'{x:.3f}' for x in pr)} (median {statistics.median(pr):.3f}, "
                          f"quartiles {pct(pr, 25):.3f}-{pct(pr, 75):.3f})", flush=True)
            for arm, rs in reps.items():
                pr = paired(rs, reps["unconstrained"])
                for i, r in enumerate(rs):
                    results.append({k: v for k, v in r.items() if k not in ("texts", "lengths", "finish")}
                                   | {"workload": w, "concurrency": c, "arm": arm, "repetition": i, "num_prompts": n,
                                      "ratio_vs_unconstrained_median": r["tok_s"] / base,
                                      "paired_ratio": pr[i]})
            save(args, load0, results)      # after every concurrency: a cut-short run keeps what it measured
    load1 = os.getloadavg()
    print(f"\n# load average at the end {load1[0]:.1f} {load1[1]:.1f} {load1[2]:.1f}")
    save(args, load0, results)
    plain.shutdown()
    for llm in forced_llms.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
