"""Step time against a step's shape on the default paths: decode batches, prefill steps, context, mixed.

Times single engine steps in-process (``LLM``, ``--max-num-seqs 64``, ``--max-num-batched-tokens 512``):
decode steps at batch 1-64 (median of 5), prefill steps of 16-512 tokens alone (median of 3), the four
512-token chunks of a 2,048-token prompt (attention over a growing context), and 4 or 16 decodes with a
64- or 256-token prompt beside them. ``inv`` runs the batch-invariant default, ``plain``
``--no-batch-invariant``; a third argument runs a short version (a smoke check). Prints one JSON line.

    /work/bin/quiet .venv/bin/python benchmarks/step_shape_probe.py inv
"""
import sys, time, random, statistics, json
from tokenmill import LLM
from tokenmill.engine.engine_core import EngineCoreRequest
from tokenmill.sampling_params import SamplingParams
inv = sys.argv[1] == "inv"
llm = LLM(max_num_seqs=64, max_num_batched_tokens=512, batch_invariant=inv)
core = llm.engine_core
rng = random.Random(0)
ids = [0]
def add(n, mt=200):
    ids[0] += 1
    rid = f"p{ids[0]}"
    core.add_request(EngineCoreRequest(rid, [rng.randrange(100, 40000) for _ in range(n)], SamplingParams(max_tokens=mt, ignore_eos=True, temperature=0)))
    return rid
def step():
    t = time.perf_counter(); core.step(); dt = time.perf_counter() - t
    ls = core._last_step
    return (tuple(ls[:2]) if ls else (0, 0)), dt
def drain():
    s = core.scheduler
    s.finish_requests(list(s.requests), __import__("tokenmill.core.request", fromlist=["x"]).RequestStatus.FINISHED_ABORTED)
    s.reset_prefix_cache(); core._last_step=None
# warm
add(16, 4); 
for _ in range(6): step()
drain()
res = {"decode": {}, "prefill": {}, "mixed": {}, "ctx": []}
QUICK = len(sys.argv) > 2
for B in ((1, 2) if QUICK else (1, 2, 4, 8, 16, 32, 64)):
    for _ in range(B): add(8)
    while True:
        sh, dt = step()
        if sh[1] == 0: break
    ts = [step()[1] for _ in range(5)]
    res["decode"][B] = statistics.median(ts)
    drain()
for T in ((16,) if QUICK else (16, 32, 64, 128, 256, 512)):
    ts = []
    for _ in range(3):
        add(T, 2); sh, dt = step(); assert sh[1] == T, sh; ts.append(dt); drain()
    res["prefill"][T] = statistics.median(ts)
# context dependence: 2048 prompt chunked at 512
add(2048, 2)
for _ in range(4):
    sh, dt = step(); res["ctx"].append((sh, dt))
drain()
# mixed: B decodes + T prefill
for B in ((4,) if QUICK else (4, 16)):
    for _ in range(B): add(8)
    while step()[0][1] != 0: pass
    if QUICK: pass
    for T in (64, 256):
        ts = []
        for _ in range(2):
            r = add(T, 1); sh, dt = step(); ts.append((sh, dt))
            core.scheduler.finish_requests([r], __import__("tokenmill.core.request", fromlist=["x"]).RequestStatus.FINISHED_ABORTED)
            step()
        res["mixed"][f"{B}+{T}"] = ts
    drain()
print(json.dumps(res))
