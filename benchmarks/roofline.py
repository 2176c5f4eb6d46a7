"""Roofline: this machine's bandwidth and GEMM rates, the model's lower bound per step, and tokenmill's actual step.

1. Measures memory read bandwidth (GB/s, a full-tensor sum over 1 GiB,
   best of several) and dense GEMM rates (GFLOP/s, ``m = n = k = 2048`` by
   default; smaller where the CPU lacks native arithmetic for the type) in
   float32, bfloat16 and int8 (the faster of ``torch._int_mm`` and FBGEMM's
   uint8 × int8 ``quantized.linear``, int32 accumulate), with the threads the
   engine core would use. Bandwidth and the int8 rate are sampled again after
   the timed steps and the bounds take the higher sample: a shared VM's
   bandwidth drifts by 15-25% within minutes. A bfloat16 model's compute bound uses the float32
   rate where that is faster (no native bfloat16 arithmetic, e.g. AVX2).
2. From the model's bytes and FLOPs computes the lower bound of one step:
   ``max(bytes / bandwidth, flops / gemm_rate)`` (Williams, Waterman &
   Patterson, "Roofline", CACM 2009), where

   * bytes = every weight once (the tied LM head reads the embedding) +
     the K/V of every request's context (read) + the new K/V (written);
   * flops = ``2 × tokens × linear weights`` (q/k/v/o, gate/up/down) +
     ``2 × logit rows × vocab × hidden`` (LM head) + attention
     ``4 × layers × heads × head_dim × sum(context per query token)``.

   Decode steps at batch 1, 8, 32, 64 (``--context`` tokens already cached
   per request) and a prefill of one 512-token chunk.
3. Times :meth:`tokenmill.model.runner.ModelRunner.execute_model` on a
   synthetic :class:`SchedulerOutput` at the same sizes (greedy sampling
   included) and prints ``actual / bound``; for the prefill also the reached
   share of the measured GEMM rate. ``--block-layout engine`` (the default)
   gives the requests the block tables of a long-running server under the
   engine's allocator (``TOKENMILL_KV_BLOCK_RUNS``), simulated on the real
   ``KVCacheManager`` over an engine-sized pool (``--kv-cache-memory``'s
   default, 1 GiB) by ``benchmarks/kv_block_alloc_sim.py`` (c=64, 200-312
   prompt and 128-256 output tokens); ``scattered`` a seeded random sample
   of that pool (what strict LRU popping leaves: 98-99% of neighbouring
   entries not adjacent); ``contiguous`` blocks in id order, each request's
   in one run (a fresh pool). On the AVX2 EPYC scattered blocks made decode
   B=64 attention 1.4x slower than contiguous ones
   (docs/benchmarks/2026-12-03-kv-block-layout-avx2.md).
4. With ``--breakdown``, times the parts of each step (weight GEMMs with
   the LM head, attention, element-wise kernels, embedding, sampling, input
   preparation, the rest; a step-graph step per prepared call) and sets
   the GEMMs and the attention against their own bounds and against the
   whole step's bound: where the step loses against the roofline.
5. Runs a real :class:`EngineCore` with 64 requests to report the share of a
   decode step spent in the scheduler and in the runner's input preparation.

    .venv/bin/python benchmarks/roofline.py --dtype bfloat16
    .venv/bin/python benchmarks/roofline.py --dtype float32 --context 256 --compile
    .venv/bin/python benchmarks/roofline.py --dtype bfloat16 --breakdown --skip-engine

The model defaults to the packaged SmolLM2-135M GGUF (``--model`` for another).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch


# --------------------------------------------------------------------------- machine
def measure_bandwidth(gib: float = 1.0, reps: int = 5) -> float:
    """Read bandwidth in GB/s (1e9 bytes/s): best of ``reps`` sums over a ``gib`` GiB float32 tensor, on ordinary
    pages and, where the engine uses them (:mod:`tokenmill.model.huge_pages`), on transparent huge pages; the
    higher of the two (the stricter bound: huge pages read up to 13% faster on the AVX2 EPYC, 2026-12-03)."""
    from tokenmill.model import huge_pages
    n = int(gib * 2**30) // 4
    kinds = [lambda: torch.ones(n)]
    if huge_pages.enabled():
        kinds.append(lambda: huge_pages.huge_page_tensor((n,), torch.float32).fill_(1.0))
    best = float("inf")
    for make in kinds:
        x = make()
        x.sum()
        for _ in range(reps):
            t0 = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - t0)
        del x
    return n * 4 / best / 1e9


def _gemm_fn(dtype: torch.dtype, n: int, engine: str = "torch"):
    """A zero-argument callable doing one ``n × n × n`` product, or None where it is unsupported.

    ``engine="torch"``: ``a @ b`` (int8: ``torch._int_mm``, int8 × int8 → int32);
    ``engine="fbgemm"`` (int8 only): ``torch.ops.quantized.linear``, uint8 activations × int8 weights with int32
    accumulation (FBGEMM's VPMADDUBSW / VPDPBUSD kernels) and a requantised uint8 output.
    """
    if dtype == torch.int8 and engine == "fbgemm":
        import warnings
        try:
            if "fbgemm" not in torch.backends.quantized.supported_engines:
                return None
            torch.backends.quantized.engine = "fbgemm"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                qx = torch.quantize_per_tensor(torch.randn(n, n), 0.05, 128, torch.quint8)
                qw = torch.quantize_per_tensor(torch.randn(n, n), 0.05, 0, torch.qint8)
                packed = torch.ops.quantized.linear_prepack(qw, None)

            def fn():
                return torch.ops.quantized.linear(qx, packed, 1.0, 0)
            fn()
        except (RuntimeError, AttributeError):
            return None
        return fn
    if dtype == torch.int8:
        a = torch.randint(-64, 64, (n, n), dtype=torch.int8)
        b = torch.randint(-64, 64, (n, n), dtype=torch.int8)
        try:
            def fn():
                return torch._int_mm(a, b)
            fn()
        except (RuntimeError, AttributeError):
            return None
        return fn
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)

    def fn():
        return a @ b
    fn()
    return fn


def measure_gemm(dtype: torch.dtype, n: int = 2048, reps: int = 5, engine: str = "torch",
                 budget_s: float = 1.0) -> tuple[float, int]:
    """Dense ``n × n × n`` GEMM rate in GFLOP/s (2 n³ per product), best of ``reps``, and the size timed.

    A CPU without native arithmetic for the type (bfloat16 without AVX512-BF16/AMX, int8 ``_int_mm`` without
    VNNI: reference loops at ~1 GFLOP/s, ~20 s per 2048³ product) would spend minutes of a benchmark slot
    here: a 256³ probe comes first, and the size halves (down to 256) until one product is expected to take at
    most ``budget_s``; the returned size says which was timed. Returns ``(0.0, n)`` where unsupported (see
    :func:`_gemm_fn` for ``engine``).
    """
    probe = _gemm_fn(dtype, 256, engine)
    if probe is None:
        return 0.0, n
    probe()             # _gemm_fn ran it once already: this second call is warm
    t0 = time.perf_counter()
    probe()
    rate = 2 * 256**3 / max(time.perf_counter() - t0, 1e-9)
    while n > 256 and 2 * n**3 / rate > budget_s:
        n //= 2
    fn = _gemm_fn(dtype, n, engine) if n != 256 else probe
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9, n


# --------------------------------------------------------------------------- model cost
def step_cost_parts(arch, dtype_bytes: int, query_lens: list[int], contexts: list[int], sample_rows: int,
                    int4_linear: bool = False, head_bytes: float | None = None,
                    kv_bytes: float | None = None) -> dict[str, tuple[float, float]]:
    """``{"linear": (bytes, flops), "attention": (bytes, flops)}`` of one step.

    ``linear`` is every GEMM with a weight (q/k/v/o, gate/up/down and the LM
    head, which reads the embedding table when tied); ``attention`` is the
    paged attention (reads every request's cached K/V, writes the new K/V).

    Args:
        arch: :class:`~tokenmill.model.arch_config.ModelArchConfig`.
        dtype_bytes: bytes per weight and KV element.
        query_lens: new tokens per request.
        contexts: tokens already cached per request (before this step).
        sample_rows: rows that go through the LM head.
        int4_linear: the block linears read 4-bit weights (0.5 byte per
            weight + a bfloat16 scale and zero per 32: 0.625 bytes), as the
            runner's small-step int4 path does; the LM head keeps ``dtype_bytes``.
        head_bytes: bytes per LM-head (embedding) weight when it reads low-bit codes (Q8_0: 1.0625);
            None: ``dtype_bytes``.
        kv_bytes: bytes per K/V cache element (a float32 model's default cache on the CPU low-bit path is
            bfloat16: 2; int8/fp8: 1); None: ``dtype_bytes``.
    """
    h, i, L = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers
    nh, kvh, d, v = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.vocab_size
    linear = L * (h * (nh + 2 * kvh) * d + nh * d * h + 3 * h * i)       # weights in GEMMs, per layer sum
    emb = v * h
    tokens = sum(query_lens)
    kv_tok = 2 * L * kvh * d * (dtype_bytes if kv_bytes is None else kv_bytes)
    weight_bytes = (linear * (0.625 if int4_linear else dtype_bytes)
                    + emb * (dtype_bytes if head_bytes is None else head_bytes)
                    + (0 if arch.tie_word_embeddings else emb * dtype_bytes))
    kv_bytes = sum(c + q for c, q in zip(contexts, query_lens)) * kv_tok + tokens * kv_tok
    # attention: each query token t (0-based in its chunk) sees c + t + 1 keys; QK^T and PV are 2 flops each
    attn_keys = sum(q * c + q * (q + 1) // 2 for c, q in zip(contexts, query_lens))
    return {"linear": (float(weight_bytes), float(2 * tokens * linear + 2 * sample_rows * emb)),
            "attention": (float(kv_bytes), float(4 * L * nh * d * attn_keys))}


def step_cost(arch, dtype_bytes: int, query_lens: list[int], contexts: list[int], sample_rows: int,
              int4_linear: bool = False, head_bytes: float | None = None,
              kv_bytes: float | None = None) -> tuple[float, float]:
    """``(bytes, flops)`` of one step: the sum of :func:`step_cost_parts`."""
    parts = step_cost_parts(arch, dtype_bytes, query_lens, contexts, sample_rows, int4_linear, head_bytes,
                            kv_bytes).values()
    return sum(b for b, _ in parts), sum(f for _, f in parts)


#: GGUF bytes per weight of the formats the packaged model's LM head (tied embedding) may read as codes.
_HEAD_BYTES = {"Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32}


def weights_read(runner, tokens: int) -> tuple[bool, float | None, str]:
    """What a ``tokens``-token step's linears read: ``(block linears on 4-bit codes, LM-head bytes per weight
    or None for the dtype's, the kernel path)``, from the layers' own :meth:`PackedLinear.lowbit_path` (in
    batch-invariant mode the codes at every size; otherwise up to the low-bit limit)."""
    from tokenmill.model.layers.linear import PackedLinear

    model = runner.model
    block = [m for m in model.model.layers.modules() if isinstance(m, PackedLinear) and m.lowbit is not None]
    path = block[0].lowbit_path(tokens) if block else "dense"
    head = getattr(model, "_logits_head", None)
    hb = None
    if isinstance(head, PackedLinear) and head.lowbit is not None and head.lowbit_path(1) != "dense":
        hb = _HEAD_BYTES.get(head.lowbit.fmt, head.lowbit.bits / 8 + 4 / 32)
    return path != "dense", hb, path


# --------------------------------------------------------------------------- tokenmill's step
def synthetic_step(runner, query_lens: list[int], contexts: list[int], first_block: int = 0,
                   order: list[int] | None = None):
    """A :class:`SchedulerOutput` with the given requests on disjoint blocks (greedy sampling): blocks
    ``first_block, first_block + 1, ...`` of ``order`` (the pool's block ids in the order handed out;
    default: ascending ids, each request's blocks one contiguous run)."""
    from tokenmill.core.sched_output import ScheduledRequest, SchedulerOutput
    from tokenmill.sampling_params import SamplingParams

    bs = runner.block_size
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    reqs, nxt = [], first_block
    g = torch.Generator().manual_seed(0)
    for r, (q, c) in enumerate(zip(query_lens, contexts)):
        nb = -(-(c + q) // bs)
        blocks = list(range(nxt, nxt + nb)) if order is None else order[nxt:nxt + nb]
        nxt += nb
        toks = torch.randint(3, runner.arch.vocab_size, (q,), generator=g).tolist()
        reqs.append(ScheduledRequest(req_id=f"r{r}", token_ids=toks, num_computed_tokens=c, block_ids=blocks,
                                     sample=True, sampling_params=params, prompt_token_ids=[1] * max(c, 1),
                                     output_token_ids=[], new=False))
    if nxt > runner.num_kv_blocks:
        raise ValueError(f"step needs {nxt} blocks, pool has {runner.num_kv_blocks}")
    return SchedulerOutput(scheduled=reqs, total_num_scheduled_tokens=sum(query_lens))


def block_order(layout: str, num_blocks: int, block_size: int = 16) -> list[int] | None:
    """The pool's block ids in the order :func:`synthetic_step` hands them out, for a ``--block-layout``.

    ``contiguous``: None (ascending ids); ``scattered``: a seeded random permutation; ``engine``: the running
    requests' block tables at the end of :func:`kv_block_alloc_sim.simulate` under the engine's allocator
    (``runs`` or ``lru`` as ``TOKENMILL_KV_BLOCK_RUNS`` says), concatenated, then the rest of the pool in a
    seeded random order (the step's requests take consecutive slices, so the runs are kept).
    """
    if layout == "contiguous":
        return None
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    if layout == "scattered":
        return perm
    if layout != "engine":
        raise ValueError(f"unknown block layout {layout!r}")
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    import kv_block_alloc_sim as sim
    from tokenmill import envs
    tables = sim.simulate("runs" if envs.TOKENMILL_KV_BLOCK_RUNS else "lru", num_blocks, 64, block_size)[-1]
    head = [b for t in tables for b in t]
    taken = set(head)
    return head + [b for b in perm if b not in taken]


def fill_kv_pool(runner, seed: int = 0) -> None:
    """Fill the runner's KV pool (floating-point caches) with seeded N(0, 1) values.

    The pool is allocated without zeroing, and :func:`synthetic_step`'s decode steps attend over cached positions
    that no prefill wrote: on the AVX2 EPYC that garbage gave NaN logits in every row, so timed steps took the
    sampler's NaN path (a ``nan_to_num`` copy and a second argmax: "sampling" 10.5 ms at B=64 instead of 1.8) and
    the SiLU kernel libmvec's special-case ``expf`` (element-wise 7.5 ms instead of 5.3). A served request's cache
    holds finite values; so do the timed steps after this."""
    g = torch.Generator().manual_seed(seed)
    for kv in runner.kv_caches:
        if kv.is_floating_point():
            kv.copy_(torch.randn(kv.shape, generator=g, dtype=torch.float32).to(kv.dtype))


def time_step(runner, so, reps: int) -> float:
    """Median seconds of ``runner.execute_model(so)`` after two warm-up calls."""
    runner.execute_model(so)
    runner.execute_model(so)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        runner.execute_model(so)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


#: The parts :func:`step_breakdown` reports, in print order.
PARTS = ("linear", "attention", "elementwise", "embedding", "sampling", "prepare", "other")


def step_breakdown(runner, so, reps: int) -> dict[str, float]:
    """Median seconds per part of ``runner.execute_model(so)``.

    Parts (:data:`PARTS`): ``linear`` (every weight GEMM, the LM head included), ``attention`` (K/V write +
    paged attention), ``elementwise`` (add+RMSNorm, RoPE, SiLU-and-multiply), ``embedding`` (the token
    lookup and the RoPE tables), ``sampling`` (the sampler, after the LM head), ``prepare`` (input
    preparation) and ``other``: the step's time minus all of them (Python between the calls, the runner's
    bookkeeping).

    Where the runner's :class:`~tokenmill.model.step_graph.CpuStepGraph` serves the step (decode-only steps;
    it calls the kernels directly, so module hooks never see them), every prepared call is timed by the
    graph itself (``CpuStepGraph.profile``) and booked by :meth:`~tokenmill.model.step_graph.CpuStepGraph.call_kind`;
    the LM head (outside the graph) by a forward hook. In an eager step (prefill) linears are timed with
    forward hooks, the attention backend by wrapping its ``forward``, the fused element-wise kernels by
    wrapping the loaded ``fused_ops`` library's functions (add+RMSNorm, RoPE, SiLU-and-multiply), and the
    embedding by a hook on the token embedding plus a wrapper around the RoPE table computation; ``other`` is
    then the Python and torch glue between them. Timers add ~0.1-1 us per call, so ``step`` is the median of
    separate uninstrumented runs and ``parts`` the instrumented step the parts came from.
    """
    from torch import nn

    from tokenmill.model.layers.linear import PackedLinear

    model = runner.model
    graph = getattr(runner, "step_graph", None)
    head = getattr(model, "_logits_head", None) or getattr(model, "lm_head", None)
    acc = {"linear": 0.0, "head": 0.0, "attention": 0.0, "elementwise": 0.0, "embedding": 0.0}
    starts: dict[int, float] = {}

    def pre(mod, _args):
        starts[id(mod)] = time.perf_counter()

    def post(mod, _args, _out):
        dt = time.perf_counter() - starts[id(mod)]
        acc["linear"] += dt
        if mod is head:
            acc["head"] += dt

    handles = []
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, PackedLinear)):
            handles += [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]
    backend = model.attn_backend
    plain_forward = backend.forward

    def timed_forward(*args, **kwargs):
        t0 = time.perf_counter()
        out = plain_forward(*args, **kwargs)
        acc["attention"] += time.perf_counter() - t0
        return out

    backend.forward = timed_forward
    # eager steps: the fused element-wise kernels (the step graph's prepared calls hold the unwrapped functions
    # and book these themselves) and the embedding + RoPE tables
    from tokenmill.model.layers import cpu_build
    wrapped = []
    for (lib_name, _isa), lib in list(cpu_build._libs.items()):
        if lib is None or not lib_name.startswith("fused_ops"):
            continue
        for fname in ("rms_norm_f32", "rms_norm_bf16", "rope_f32", "rope_bf16", "silu_mul_f32", "silu_mul_bf16"):
            fn = getattr(lib, fname, None)
            if fn is None:
                continue

            def timed_kernel(*a, _fn=fn):
                t0 = time.perf_counter()
                _fn(*a)
                acc["elementwise"] += time.perf_counter() - t0
            setattr(lib, fname, timed_kernel)
            wrapped.append((lib, fname, fn))
    inner = getattr(model, "model", model)
    embed = getattr(inner, "embed_tokens", None)
    rotary = getattr(inner, "rotary_emb", None)

    def pre_embed(_mod, _args):
        starts[-1] = time.perf_counter()

    def post_embed(_mod, _args, _out):
        acc["embedding"] += time.perf_counter() - starts[-1]

    if embed is not None:
        handles += [embed.register_forward_pre_hook(pre_embed), embed.register_forward_hook(post_embed)]
    plain_cos_sin = rotary.cos_sin if rotary is not None else None
    if rotary is not None:
        def timed_cos_sin(*args, **kwargs):
            t0 = time.perf_counter()
            out = plain_cos_sin(*args, **kwargs)
            acc["embedding"] += time.perf_counter() - t0
            return out
        rotary.cos_sin = timed_cos_sin
    rows = []
    try:
        runner.execute_model(so)
        for _ in range(reps):
            acc.update(linear=0.0, head=0.0, attention=0.0, elementwise=0.0, embedding=0.0)
            prof: dict[str, float] = {}
            if graph is not None:
                graph.profile = prof
            t0 = time.perf_counter()
            runner.execute_model(so)
            total = time.perf_counter() - t0
            if graph is not None:
                graph.profile = None
            t = runner.last_timings
            row = {"linear": acc["linear"] + prof.get("linear", 0.0),
                   "attention": acc["attention"] + prof.get("attention", 0.0),
                   "elementwise": prof.get("elementwise", acc["elementwise"]),
                   "embedding": prof.get("embedding", acc["embedding"]),
                   "sampling": max(0.0, t["sample"] - acc["head"]), "prepare": t["prepare"]}
            row["other"] = max(0.0, total - sum(row.values()))
            row["parts"] = total
            row["graph"] = float(bool(prof))
            rows.append(row)
    finally:
        del backend.forward
        for lib, fname, fn in wrapped:
            setattr(lib, fname, fn)
        if rotary is not None:
            del rotary.cos_sin
        if graph is not None:
            graph.profile = None
        for hd in handles:
            hd.remove()
    out = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["step"] = time_step(runner, so, reps)
    return out


def engine_breakdown(runner, batch: int, prompt_len: int, steps: int) -> dict[str, float]:
    """Run a real EngineCore with ``batch`` requests; mean seconds per decode step of each part."""
    from tokenmill.engine.engine_core import EngineCore, EngineCoreRequest
    from tokenmill.sampling_params import SamplingParams

    core = EngineCore(runner.config, executor=runner)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    for r in range(batch):
        ids = torch.randint(3, runner.arch.vocab_size, (prompt_len,), generator=g).tolist()
        core.add_request(EngineCoreRequest(f"e{r}", ids, params))
    while core.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                            for r in core.scheduler.running):
        core.step()
    core.step()
    rows = []
    for _ in range(steps):
        core.step()
        t = getattr(runner, "last_timings", {}) or {}
        rows.append((core._last_step_time, core._last_schedule_time, t.get("prepare", 0.0)))
    n = len(rows)
    return {"step": sum(r[0] for r in rows) / n, "schedule": sum(r[1] for r in rows) / n,
            "prepare": sum(r[2] for r in rows) / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: packaged SmolLM2-135M)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=256, help="cached tokens per request in the decode steps")
    ap.add_argument("--prefill", type=int, default=512, help="tokens of the prefill chunk")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gemm-n", type=int, default=2048)
    ap.add_argument("--compile", action="store_true",
                    help="also capture the compiled step at the measured sizes and time it side by side")
    ap.add_argument("--skip-engine", action="store_true", help="skip the EngineCore breakdown at batch 64")
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the parts of each eager step (weight GEMMs, attention, sampling, rest) "
                         "against each part's own bound")
    ap.add_argument("--block-layout", default="engine", choices=["engine", "scattered", "contiguous"],
                    help="the synthetic steps' block tables: a simulated long-running server's under the engine's "
                         "allocator (default), a seeded random sample of an engine-sized pool (strict LRU's), or "
                         "each request's blocks in one run (a fresh pool)")
    ap.add_argument("--json", default="", help="also write the measurements (rates, bounds, steps, breakdown) here")
    ap.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false",
                    help="the per-step-size kernels (default: the batch-invariant mode, as the engine's default)")
    args = ap.parse_args()

    from tokenmill.config import EngineConfig
    from tokenmill.model.process_tuning import configure_threads
    from tokenmill.model.runner import ModelRunner

    threads = configure_threads(torch.device("cpu"))
    batches = [int(b) for b in args.batches.split(",")]
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]

    print(f"torch {torch.__version__}, {threads} threads, mkldnn={torch.backends.mkldnn.is_available()}")
    # The read bandwidth of a shared VM drifts by 15-25% within minutes (AVX2 EPYC, 2026-12-03: 33-42 GB/s in one
    # quiet slot): sampled again after the timed steps, and the bounds use the highest sample (the strictest).
    bw_samples = [measure_bandwidth()]
    measured = {name: measure_gemm(d, args.gemm_n, engine=eng) for name, d, eng in
                (("float32", torch.float32, "torch"), ("bfloat16", torch.bfloat16, "torch"),
                 ("int8", torch.int8, "torch"), ("int8 fbgemm", torch.int8, "fbgemm"))}
    bw = bw_samples[0]
    print(f"memory read bandwidth: {bw:.1f} GB/s (first sample; sampled again after the timed steps)")
    notes = {"int8": "torch._int_mm, int8 x int8", "int8 fbgemm": "quantized.linear, uint8 x int8"}
    for name, (r, n) in measured.items():
        print(f"GEMM {n}^3 {name:>11}: {r:.1f} GFLOP/s" + (f"  ({notes[name]})" if name in notes else ""))
    rates = {name: r for name, (r, _) in measured.items()}
    # the int8 roof: the faster of the two libraries' int8 x int8 -> int32 products (the same multiply-adds the
    # integer path does; without VNNI torch._int_mm runs a reference loop, FBGEMM the VPMADDUBSW kernels)
    rates["int8"] = max(rates["int8"], rates.pop("int8 fbgemm"))
    gemm = rates[args.dtype]
    if args.dtype == "bfloat16" and rates["float32"] > gemm:
        # no native bfloat16 arithmetic (AVX2, AVX-512 without BF16): bfloat16 values are exact in float32, so
        # the float32 rate is the faster roof for the same products; a bound must take the faster one
        print(f"bfloat16 GEMM slower than float32 here: the compute bound uses the float32 rate "
              f"({rates['float32']:.0f} GFLOP/s)")
        gemm = rates["float32"]

    max_ctx = max(args.context + 1, args.prefill) + 64
    need_blocks = max(max(batches) * (-(-(args.context + 1) // 16)), -(-args.prefill // 16)) + 8
    cfg = EngineConfig.from_kwargs(model=args.model, dtype=args.dtype,
                                   num_kv_blocks=need_blocks if args.block_layout == "contiguous" else None,
                                   max_model_len=max(max_ctx, 1024), enforce_eager=True,
                                   max_num_seqs=max(batches), enable_prefix_caching=False,
                                   batch_invariant=args.batch_invariant)
    t0 = time.perf_counter()
    runner = ModelRunner.from_config(cfg)
    # the oneDNN packing runs in a background thread after start-up: timing before it ends measured it too
    # (AVX2, 2 cores: float32 decode B=1 36 ms instead of 11)
    from tokenmill.model.layers.linear import wait_for_packing
    wait_for_packing(runner.model)
    print(f"runner ready in {time.perf_counter() - t0:.1f} s; batch-invariant {runner.batch_invariant}"
          + (f"; block linears read int4 codes ({'at every step size' if runner.batch_invariant else f'in steps of <= {runner.lowbit_max_tokens} tokens'};"
             f" the bound uses their bytes)" if runner.lowbit_max_tokens else ""))
    arch, eb = runner.arch, torch.empty((), dtype=dt).element_size()
    kvb = torch.empty((), dtype=runner.kv_cache_dtype).element_size()     # the cache the steps read
    if runner.num_kv_blocks < need_blocks:
        raise SystemExit(f"the engine's default pool has {runner.num_kv_blocks} blocks, the steps need {need_blocks}: "
                         f"--block-layout contiguous sizes the pool to the steps")
    order = block_order(args.block_layout, runner.num_kv_blocks, runner.block_size)
    print(f"block layout {args.block_layout}: pool of {runner.num_kv_blocks} blocks; KV cache {runner.kv_cache_dtype} "
          f"({kvb} bytes per element, the bounds use it)")
    fill_kv_pool(runner)

    report: dict = {"block_layout": args.block_layout, "pool_blocks": runner.num_kv_blocks, "steps": {},
                    "breakdown": {}, "kv_cache_dtype": str(runner.kv_cache_dtype).replace("torch.", ""),
                    "kv_elem_bytes": kvb}
    cases = [(f"decode B={b} ctx={args.context}", [1] * b, [args.context] * b) for b in batches]
    cases.append((f"prefill {args.prefill}", [args.prefill], [0]))
    steps = [synthetic_step(runner, ql, ctx, order=order) for _, ql, ctx in cases]
    eager = [time_step(runner, so, args.reps) for so in steps]
    compiled = None
    if args.compile:
        sizes = sorted({sum(ql) for _, ql, _ in cases})
        t0 = time.perf_counter()
        runner.capture(sizes)
        print(f"compiled step captured for {sizes} in {time.perf_counter() - t0:.1f} s")
        compiled = [time_step(runner, so, args.reps) for so in steps]
        # eager again, interleaved, so both columns see the same machine load
        runner.model.set_dense_fns(None, None)
        saved, runner.compile_buckets = runner.compile_buckets, []
        eager = [min(a, time_step(runner, so, args.reps)) for a, so in zip(eager, steps)]
        runner.compile_buckets = saved

    bw_samples.append(measure_bandwidth())
    int8_again = measure_gemm(torch.int8, args.gemm_n, engine="fbgemm")[0]
    if int8_again > rates["int8"]:
        rates["int8"] = int8_again
    bw = max(bw_samples)
    print(f"\nread bandwidth samples {', '.join(f'{b:.1f}' for b in bw_samples)} GB/s: the bounds use {bw:.1f}; "
          f"int8 rate {rates['int8']:.0f} GFLOP/s (the higher of two samples)")
    print(f"\nbound = max(bytes / bandwidth, FLOPs / the {args.dtype} GEMM rate); 'i8 bound' (steps whose linears run "
          f"the integer path): their FLOPs at the int8 GEMM rate instead, the stricter roof of that arithmetic")
    print(f"{'step':<22}{'path':>5}{'MB read':>9}{'GFLOP':>8}{'mem ms':>8}{'cmp ms':>8}{'bound ms':>9}"
          f"{'eager ms':>10}{'ratio':>9}{'GFLOP/s':>9}{'i8 bound':>9}{'ratio':>8}"
          + (f"{'compiled':>10}{'ratio':>9}" if compiled else ""))
    for k, (name, ql, ctx) in enumerate(cases):
        low, hb, path = weights_read(runner, sum(ql))
        parts = step_cost_parts(arch, eb, ql, ctx, sample_rows=len(ql), int4_linear=low, head_bytes=hb, kv_bytes=kvb)
        nbytes, flops = sum(b for b, _ in parts.values()), sum(f for _, f in parts.values())
        t_mem, t_cmp = nbytes / (bw * 1e9), flops / (gemm * 1e9)
        bound = max(t_mem, t_cmp)
        actual = eager[k]
        i8 = f"{'-':>9}{'':>8}"
        if path == "i8" and rates["int8"] > 0:
            b8 = max(t_mem, parts["linear"][1] / (rates["int8"] * 1e9) + parts["attention"][1] / (gemm * 1e9))
            i8 = f"{b8 * 1e3:>9.2f}{actual / b8:>7.2f}x"
        line = (f"{name:<22}{path:>5}{nbytes / 1e6:>9.1f}{flops / 1e9:>8.2f}{t_mem * 1e3:>8.2f}{t_cmp * 1e3:>8.2f}"
                f"{bound * 1e3:>9.2f}{actual * 1e3:>10.2f}{actual / bound:>8.2f}x{flops / actual / 1e9:>9.0f}{i8}")
        if compiled:
            line += f"{compiled[k] * 1e3:>10.2f}{compiled[k] / bound:>8.2f}x"
        print(line)
        report["steps"][name] = {"path": path, "bytes": nbytes, "flops": flops, "bound_s": bound, "step_s": actual,
                                 "ratio": actual / bound}
        if path == "i8" and rates["int8"] > 0:
            report["steps"][name]["i8_bound_s"] = b8
        if compiled:
            report["steps"][name]["compiled_s"] = compiled[k]
        if name.startswith("prefill"):
            best = min(actual, compiled[k]) if compiled else actual
            print(f"  prefill reaches {flops / best / 1e9 / gemm:.0%} of the measured {args.dtype} GEMM rate")

    if args.breakdown:
        print(f"\n{'step':<22}{'part':<11}{'ms':>8}{'share':>7}{'bound ms':>10}{'ratio':>9}"
              f"{'/ step bound':>14}")
        for k, (name, ql, ctx) in enumerate(cases):
            br = step_breakdown(runner, steps[k], args.reps)
            report["breakdown"][name] = dict(br)
            low, hb, path = weights_read(runner, sum(ql))
            parts = step_cost_parts(arch, eb, ql, ctx, sample_rows=len(ql), int4_linear=low, head_bytes=hb, kv_bytes=kvb)
            # linears on the integer path: their FLOPs at the int8 rate (the roof of that arithmetic), else the
            # dtype's GEMM rate; attention at the dtype's rate
            lin_rate = rates["int8"] if path == "i8" and rates["int8"] > 0 else gemm
            step_bound = max(sum(b for b, _ in parts.values()) / (bw * 1e9),
                             sum(f for _, f in parts.values()) / (gemm * 1e9))
            step_bound_i8 = max(sum(b for b, _ in parts.values()) / (bw * 1e9),
                                parts["linear"][1] / (lin_rate * 1e9) + parts["attention"][1] / (gemm * 1e9))
            print(f"{name:<22}{'(' + ('step graph' if br['graph'] else 'eager') + ')':<11}"
                  + (f"  linear bound at the int8 rate ({lin_rate:.0f} GFLOP/s)" if lin_rate != gemm else ""))
            for part in PARTS:
                t = br[part]
                line = f"{'':<22}{part:<11}{t * 1e3:>8.2f}{t / br['parts']:>7.0%}"
                if part in parts:
                    nbytes, flops = parts[part]
                    pb = max(nbytes / (bw * 1e9), flops / ((lin_rate if part == "linear" else gemm) * 1e9))
                    line += f"{pb * 1e3:>10.2f}{t / pb:>8.2f}x{t / step_bound:>13.2f}x"
                print(line)
            print(f"{'':<22}{'(timed)':<11}{br['parts'] * 1e3:>8.2f}{'':>7}  the instrumented step the "
                  f"shares are of")
            print(f"{'':<22}{'step':<11}{br['step'] * 1e3:>8.2f}{'':>7}{step_bound * 1e3:>10.2f}"
                  f"{br['step'] / step_bound:>8.2f}x"
                  + (f"   i8 bound {step_bound_i8 * 1e3:.2f} ms: {br['step'] / step_bound_i8:.2f}x"
                     if lin_rate != gemm else ""))

    if args.json:
        import json
        import platform
        flags = sorted(f for f in open("/proc/cpuinfo").read().split() if f.startswith(("avx", "amx", "fma")))
        report.update(machine=platform.processor() or platform.machine(), cpu_flags=sorted(set(flags)),
                      dtype=args.dtype, threads=threads, batch_invariant=runner.batch_invariant,
                      bandwidth_gbs=bw, bandwidth_samples_gbs=bw_samples, gemm={k: {"gflops": r, "n": m} for k, (r, m) in measured.items()},
                      compute_rate_gflops=gemm, int8_rate_gflops=rates["int8"], reps=args.reps,
                      context=args.context, load_avg=open("/proc/loadavg").read().split()[:3],
                      time_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)

    if not args.skip_engine:
        b = max(batches)
        br = engine_breakdown(runner, b, prompt_len=args.context, steps=10)
        print(f"\nEngineCore decode at batch {b}: step {br['step'] * 1e3:.1f} ms, scheduler+update "
              f"{br['schedule'] * 1e3:.2f} ms ({br['schedule'] / br['step']:.1%}), input preparation "
              f"{br['prepare'] * 1e3:.2f} ms ({br['prepare'] / br['step']:.1%}), together "
              f"{(br['schedule'] + br['prepare']) / br['step']:.1%}")


if __name__ == "__main__":
    main()
