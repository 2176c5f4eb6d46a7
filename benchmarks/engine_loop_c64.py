"""Where an in-process EngineCore's decode step at concurrency 64 spends its time outside the model, and the
API process's output processing with and without the direct tokenizer decode, side by side.

64 greedy requests (``--prompt`` random token ids each, ``ignore_eos``) run through an in-process
:class:`EngineCore` on the packaged SmolLM2-135M (float32, the engine defaults); after their prefills, each of
``--steps`` decode steps is split into the runner (input preparation + forward + LM head and sampling), the
engine's scheduling and output update, and what the engine-core process adds before sending (stats snapshot +
pickling, as ``core_proc`` does). The API process's share (``OutputProcessor.process_outputs``: incremental
detokenisation and stop checks) is timed by replaying the recorded outputs of every step into two processors,
one with the detokenizer's direct Rust decode (``detokenizer._backend_decode``) and one with transformers'
``decode`` wrapper, alternating step by step; their texts must be equal.

    /work/bin/quiet .venv/bin/python benchmarks/engine_loop_c64.py --json e.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from tokenmill.config import EngineConfig
    from tokenmill.engine import detokenizer
    from tokenmill.engine.core_proc import dumps
    from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
    from tokenmill.engine.output_processor import OutputProcessor
    from tokenmill.model.layers.linear import wait_for_packing
    from tokenmill.model.process_tuning import configure_threads
    from tokenmill.model.runner import ModelRunner
    from tokenmill.sampling_params import SamplingParams

    threads = configure_threads(torch.device("cpu"))
    cfg = EngineConfig.from_kwargs(model=None, dtype="float32", max_model_len=1024, max_num_seqs=args.batch)
    runner = ModelRunner.from_config(cfg)
    wait_for_packing(runner.model)
    core = EngineCore(runner.config, executor=runner)
    tok = runner.loaded.tokenizer
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    prompts = {}
    for r in range(args.batch):
        prompts[f"e{r}"] = torch.randint(3, runner.arch.vocab_size, (args.prompt,), generator=g).tolist()
        core.add_request(EngineCoreRequest(f"e{r}", prompts[f"e{r}"], params))
    recorded = []
    while core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in core.scheduler.running):
        recorded.append(core.step())
    recorded.append(core.step())
    rows = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        outs = core.step()
        t1 = time.perf_counter()
        dumps(("outputs", outs, core.get_stats(), 1))
        t2 = time.perf_counter()
        recorded.append(outs)
        t = runner.last_timings
        runner_s = t["prepare"] + t["forward"] + t["sample"]
        rows.append({"step": t1 - t0, "runner": runner_s, "prepare": t["prepare"], "forward": t["forward"],
                     "sample": t["sample"], "schedule_update": t1 - t0 - runner_s, "core_send": t2 - t1})
    # the API process's work, replayed: direct backend decode vs transformers' wrapper, alternating per step
    plain = detokenizer._backend_decode
    procs = {}
    for arm in ("direct", "wrapper"):
        detokenizer._backend_decode = plain if arm == "direct" else (lambda tok: None)
        op = OutputProcessor(tok)
        for rid, ids in prompts.items():
            op.add_request(rid, None, ids, params)
        procs[arm] = op
    detokenizer._backend_decode = plain
    api = {"direct": [], "wrapper": []}
    texts = {"direct": {}, "wrapper": {}}
    for k, outs in enumerate(recorded):
        for arm in (("direct", "wrapper") if k % 2 else ("wrapper", "direct")):
            t0 = time.perf_counter()
            res, _ = procs[arm].process_outputs(outs)
            dt = time.perf_counter() - t0
            if k >= len(recorded) - args.steps:
                api[arm].append(dt)
            for o in res:
                texts[arm][o.request_id] = texts[arm].get(o.request_id, "") + "".join(c.text for c in o.outputs)
    same = texts["direct"] == texts["wrapper"]
    med = {k: statistics.median(r[k] for r in rows) * 1e3 for k in rows[0]}
    out = {"batch": args.batch, "prompt": args.prompt, "steps": args.steps, "threads": threads,
           "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "load_avg": open("/proc/loadavg").read().split()[:3], "median_ms": med,
           "api_process_ms": {a: statistics.median(v) * 1e3 for a, v in api.items()}, "same_text": same,
           "raw": {"rows": rows, "api_s": api}}
    print(f"B={args.batch} decode step medians (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in med.items()))
    print(f"API process per step: direct decode {out['api_process_ms']['direct']:.3f} ms, transformers wrapper "
          f"{out['api_process_ms']['wrapper']:.3f} ms; same text {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
