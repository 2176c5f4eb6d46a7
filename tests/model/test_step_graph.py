"""CpuStepGraph: a decode step as prepared kernel calls gives the eager forward's outputs bit for bit.

The same seeded model and the same scheduled steps (chunked prefills, decode
steps of 1, 3 and 5 requests, a mixed step) run through a runner with the
graph and one without it (the ablation switch); the logits of every step must
be equal, and the graph must have served exactly the decode-only steps. With
lowered limits the three decode sizes take the three GEMM paths (low-bit
float32, integer low-bit, oneDNN dense). Verify steps (each request's last
token and its drafts, beside decode rows and short chunks) run through the
graph as one row per token, equal to the eager forward's logits on every
draft row.
"""

from __future__ import annotations

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.model.layers.linear import lowbit_max_tokens
from tokenmill.model.loader import build_model_from_config
from tokenmill.model.runner import ModelRunner
from tokenmill.model.step_graph import CpuStepGraph, unsupported_reason

from .conftest import tiny_arch
from .test_runner import BLOCK, NUM_BLOCKS, STEPS, play


def q4(n: int, k: int, seed: int):
    from tokenmill.quantization.lowbit import LowBitWeight

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    zero = (torch.rand(n, k // 32, generator=g) - 0.5) * 0.1
    return LowBitWeight.from_codes(codes, scale, zero, 4, fmt="Q4_1")


def lowbit_weights(model) -> dict:
    """Random Q4_1 codes for every block linear and the tied head (group 32)."""
    out, seed = {}, 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers."):
            out[name] = q4(mod.out_features, mod.in_features, seed)
            seed += 1
    emb = model.model.embed_tokens.weight
    out["model.embed_tokens"] = q4(emb.shape[0], emb.shape[1], seed)
    return out


def build(variant: str, dtype: torch.dtype, graph: bool, monkeypatch, limits: dict | None = None
          ) -> tuple[ModelRunner, object, object]:
    monkeypatch.setenv("TOKENMILL_CPU_STEP_GRAPH", "1" if graph else "0")
    for k, v in (limits or {}).items():
        monkeypatch.setenv(k, v)
    arch = tiny_arch(variant, max_position_embeddings=128)
    model = build_model_from_config(arch, dtype=dtype, seed=5)
    weights = lowbit_weights(model)
    cfg = EngineConfig.from_kwargs(num_kv_blocks=NUM_BLOCKS, block_size=BLOCK, max_model_len=128, max_num_seqs=8,
                                   max_num_batched_tokens=64, dtype=str(dtype).replace("torch.", ""),
                                   batch_invariant=not limits)   # explicit step-size limits: the multi-path mode
    runner = ModelRunner(model, arch, cfg, torch.device("cpu"), dtype, [2], lowbit_weights=weights)
    return runner, model, arch


def needs_lowbit(dtype: torch.dtype) -> None:
    if not lowbit_max_tokens("cpu", dtype):
        pytest.skip(f"no low-bit small-step path for {dtype} on this machine (oneDNN or the C kernel missing)")


# decode steps of 1, 3 and 5 requests: all on the low-bit float32 kernel (default limits), or one on each of
# the low-bit float32 kernel (<= 2), the integer low-bit kernel (<= 4) and oneDNN's dense GEMM (5)
LIMITS = {"default": {},
          "three_paths": {"TOKENMILL_CPU_INT4_MAX_TOKENS": "2", "TOKENMILL_CPU_INT8_ACT_MAX_TOKENS": "4"}}


@pytest.mark.parametrize("limits", list(LIMITS))
@pytest.mark.parametrize("variant", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_steps_equal_the_eager_steps(variant, dtype, limits, monkeypatch):
    needs_lowbit(dtype)
    eager, model_e, arch = build(variant, dtype, graph=False, monkeypatch=monkeypatch, limits=LIMITS[limits])
    assert eager.step_graph is None
    logits_e, tokens_e, _ = play(eager, model_e, arch, check_reference=False)

    runner, model, _ = build(variant, dtype, graph=True, monkeypatch=monkeypatch, limits=LIMITS[limits])
    assert isinstance(runner.step_graph, CpuStepGraph)
    served = []
    run = runner.step_graph.run
    runner.step_graph.run = lambda ids, *a: served.append(ids.shape[0]) or run(ids, *a)
    if limits == "three_paths":
        assert runner.step_graph.capacity == 2
    logits_g, tokens_g, _ = play(runner, model, arch, check_reference=False)
    if limits == "three_paths":
        assert runner.step_graph.capacity == 8   # grown: 2 -> 4 (step of 3) -> 8 (step of 5)
        lin = model.model.layers[0].mlp.down_proj
        assert (lin.lowbit_max_rows, lin.lowbit_i8_max_rows) == (2, 4), "integer path unavailable for this layer"
        fns = {n: [c[0] for c in runner.step_graph._build(n, *[runner.buffers.to_device(k, n) for k in
                                                                 ("slot_mapping", "block_tables", "seq_lens")], 1)]
               for n in (1, 3, 5)}
        g = runner.step_graph
        assert g._gemm in fns[1] and g._gemm_i8 not in fns[1]
        assert g._gemm_i8 in fns[3] and g._gemm not in fns[3]
        assert g._gemm not in fns[5] and g._gemm_i8 not in fns[5]

    decode_only = [len(s) for s in STEPS if all(n == 1 for _, n in s)]
    assert served == decode_only == [3, 1, 5]
    assert tokens_g == tokens_e
    assert len(logits_g) == len(logits_e)
    for g, e in zip(logits_g, logits_e):
        assert torch.equal(g, e)


def test_graph_is_refused_where_the_eager_path_differs(monkeypatch):
    needs_lowbit(torch.float32)
    runner, model, arch = build("llama", torch.float32, graph=True, monkeypatch=monkeypatch)
    cpu = torch.device("cpu")
    assert unsupported_reason(model, cpu, torch.float32, torch.float32, 8) is None
    assert "KV cache" in unsupported_reason(model, cpu, torch.float32, torch.int8, 8)
    assert "low-bit" in unsupported_reason(model, cpu, torch.float32, torch.float32, 0)
    assert "cuda" in unsupported_reason(model, torch.device("cuda"), torch.float32, torch.float32, 8)
    # more tokens than the low-bit limit the layers were given
    assert "low-bit" in unsupported_reason(model, cpu, torch.float32, torch.float32, 16)
    monkeypatch.setenv("TOKENMILL_CPU_STEP_GRAPH", "0")
    assert "=0" in unsupported_reason(model, cpu, torch.float32, torch.float32, 8)
    q3, q3_arch = build("qwen3", torch.float32, graph=True, monkeypatch=monkeypatch)[1:]
    monkeypatch.setenv("TOKENMILL_CPU_STEP_GRAPH", "1")
    assert "q/k norm" in unsupported_reason(q3, cpu, torch.float32, torch.float32, 8)
    # a subclass (e.g. one that all-reduces after the GEMM) is not served: the graph would skip its extra work
    from tokenmill.model.layers.linear import PackedLinear

    o_proj = model.model.layers[1].self_attn.o_proj

    class Reducing(PackedLinear):
        pass

    model.model.layers[1].self_attn.o_proj = Reducing.__new__(Reducing)
    model.model.layers[1].self_attn.o_proj.__dict__.update(o_proj.__dict__)
    assert "tensor-parallel" in unsupported_reason(model, cpu, torch.float32, torch.float32, 8)
    model.model.layers[1].self_attn.o_proj = o_proj
    assert unsupported_reason(model, cpu, torch.float32, torch.float32, 8) is None
    g = runner.step_graph
    assert g.max_tokens == 40    # the runner's max_num_seqs x (1 + 4 grammar-forced drafts, the default)
    assert g.accepts(5, 1, 5) and not g.accepts(41, 1, 41) and not g.accepts(3, 2, 3) and not g.accepts(3, 1, 4)
    assert g.accepts(3, 2, 3, [2, 1], [5, 4])    # a verify step: one draft after cached context
    # TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS caps the steps served; bad values are refused
    monkeypatch.setenv("TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS", "3")
    capped = build("llama", torch.float32, graph=True, monkeypatch=monkeypatch)[0].step_graph
    assert capped.max_tokens == 3 and capped.accepts(3, 1, 3) and not capped.accepts(4, 1, 4)
    for bad in ("0", "x"):
        monkeypatch.setenv("TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS", bad)
        with pytest.raises(ValueError, match="STEP_GRAPH_MAX_TOKENS"):
            build("llama", torch.float32, graph=True, monkeypatch=monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float32-int8"])
def test_real_model_greedy_decode_is_the_same_with_and_without_the_graph(dtype, monkeypatch):
    """The packaged SmolLM2 GGUF: a prompt, then 12 greedy decode steps of 2 requests (on separate blocks),
    once through the graph and once through the eager forward: equal logits at every step.
    ``float32-int8``: the 2-request steps run the integer low-bit path (low-bit float32 limit 1)."""
    multi_path = dtype == "float32-int8"     # the --no-batch-invariant mode's per-size limits
    if multi_path:
        dtype = "float32"
        monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "1")
        monkeypatch.setenv("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", "64")
    from tokenmill.core.sched_output import ScheduledRequest, SchedulerOutput
    from tokenmill.model.layers.linear import wait_for_packing
    from tokenmill.sampling_params import SamplingParams

    from .test_runner import RecordingSampler

    needs_lowbit(getattr(torch, dtype))
    cfg = EngineConfig.from_kwargs(dtype=dtype, num_kv_blocks=64, max_model_len=512, max_num_seqs=8,
                                   enable_prefix_caching=False, batch_invariant=not multi_path)
    runner = ModelRunner.from_config(cfg, with_tokenizer=False)
    wait_for_packing(runner.model)
    assert runner.step_graph is not None
    graph = runner.step_graph
    if runner.lowbit_max_tokens == 1:
        assert runner.model.model.layers[0].mlp.down_proj.lowbit_i8_max_rows == 64
    params = SamplingParams(temperature=0.0, max_tokens=64)
    prompts = [[1, 504, 3458, 282, 4649, 314, 2], [1, 378, 1345, 28, 339, 3067, 3929, 30, 5]]

    def generate(first_block: int) -> list[torch.Tensor]:
        rec = RecordingSampler()
        runner.sampler = rec
        toks = [list(p) for p in prompts]
        computed = [0, 0]
        tables = [[first_block + 4 * i + j for j in range(4)] for i in range(2)]
        for _ in range(13):
            reqs = [ScheduledRequest(f"r{i}", toks[i][computed[i]:], computed[i], tables[i], sample=True,
                                     sampling_params=params, prompt_token_ids=prompts[i],
                                     output_token_ids=toks[i][len(prompts[i]):], new=computed[i] == 0)
                    for i in range(2)]
            so = SchedulerOutput(scheduled=reqs, total_num_scheduled_tokens=sum(len(r.token_ids) for r in reqs))
            out = runner.execute_model(so)
            for i, t in enumerate(out.sampled_token_ids):
                computed[i] = len(toks[i])
                toks[i].append(t)
        return rec.logits

    served = []
    run = graph.run
    graph.run = lambda ids, *a: served.append(ids.shape[0]) or run(ids, *a)
    with_graph = generate(0)
    assert served == [2] * 12      # the first step is the prompts' prefill
    runner.step_graph = None
    eager = generate(16)
    for g, e in zip(with_graph, eager, strict=True):
        assert torch.equal(g, e)


# Verify steps (speculative decoding, grammar-forced drafts): per step, (request, new tokens, of which drafts).
# Prompts first (eager), then verify steps of uneven k beside decode rows, a step of one request's verify rows
# alone, a decode step, a short chunk after cached context beside a verify step, two requests' 4 drafts each.
VERIFY_PROMPT = {"a": 7, "b": 5, "c": 6}
VERIFY_STEPS = [
    [("a", 7, 0), ("b", 5, 0)],
    [("a", 4, 3), ("b", 1, 0)],
    [("a", 1, 0), ("b", 5, 4)],
    [("a", 3, 2)],
    [("a", 1, 0), ("b", 1, 0), ("c", 4, 0)],
    [("c", 2, 0), ("a", 2, 1), ("b", 3, 2)],
    [("a", 5, 4), ("b", 5, 4)],
    [("a", 2, 1), ("b", 1, 0), ("c", 1, 0)],
]


def play_verify(runner: ModelRunner, vocab: int) -> tuple[list[torch.Tensor], list]:
    """Run VERIFY_STEPS (a fixed token stream per request; the drafts are the step's last tokens): every
    sampled row's logits (the last token and each draft) and each step's output tokens."""
    import random

    from tokenmill.core.sched_output import ScheduledRequest, SchedulerOutput
    from tokenmill.sampling_params import SamplingParams

    from .test_runner import RecordingSampler

    rec = RecordingSampler()
    runner.sampler = runner.spec_decode.sampler = rec
    rng = random.Random(7)
    stream = {r: [rng.randrange(3, vocab) for _ in range(40)] for r in VERIFY_PROMPT}
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables: dict[str, list[int]] = {r: [] for r in VERIFY_PROMPT}
    computed = {r: 0 for r in VERIFY_PROMPT}
    params = SamplingParams(temperature=0.0, max_tokens=64)
    outs = []
    for step in VERIFY_STEPS:
        reqs = []
        for rid, n, k in step:
            c = computed[rid]
            while len(tables[rid]) * BLOCK < c + n:
                tables[rid].append(free.pop())
            toks = stream[rid][c:c + n]
            p = VERIFY_PROMPT[rid]
            reqs.append(ScheduledRequest(rid, toks, c, list(tables[rid]), sample=c + n >= p, sampling_params=params,
                                         prompt_token_ids=stream[rid][:p], output_token_ids=stream[rid][p:c],
                                         new=c == 0, spec_token_ids=toks[n - k:] if k else []))
            computed[rid] = c + n
        so = SchedulerOutput(scheduled=reqs, total_num_scheduled_tokens=sum(len(r.token_ids) for r in reqs))
        out = runner.execute_model(so)
        outs.append((out.sampled_token_ids, dict(out.verified_token_ids)))
    return rec.logits, outs


@pytest.mark.parametrize("limits", list(LIMITS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_steps_through_the_graph_equal_the_eager_steps(dtype, limits, monkeypatch):
    """A verify step (each request's last token + its drafts) runs through the graph as one row per token,
    bit-equal to the eager forward's decode-kernel rows; prefills and oversized steps stay eager."""
    needs_lowbit(dtype)
    eager, model_e, arch = build("llama", dtype, graph=False, monkeypatch=monkeypatch, limits=LIMITS[limits])
    assert eager.step_graph is None and eager.spec_decode is not None    # verify-only worker (forced drafts)
    logits_e, outs_e = play_verify(eager, arch.vocab_size)

    runner = build("llama", dtype, graph=True, monkeypatch=monkeypatch, limits=LIMITS[limits])[0]
    served = []
    run = runner.step_graph.run
    runner.step_graph.run = lambda ids, *a: served.append(ids.shape[0]) or run(ids, *a)
    logits_g, outs_g = play_verify(runner, arch.vocab_size)
    # not served: the prompts, the step with c's 4-token prompt (no cached context: a prefill)
    assert served == [5, 6, 3, 7, 10, 4]
    assert outs_g == outs_e
    assert len(logits_g) == len(logits_e) == len(VERIFY_STEPS)
    for g, e in zip(logits_g, logits_e):
        assert g.shape == e.shape and torch.equal(g, e)
    assert [g.shape[0] for g in logits_g] == [2, 5, 6, 3, 2, 6, 10, 4]   # every sampled row, drafts included


def test_graph_accepts_verify_steps_the_eager_attention_serves_as_decode_rows(monkeypatch):
    from tokenmill.model.layers.attention import SHORT_QUERY_AS_DECODE as S

    needs_lowbit(torch.float32)
    g = build("llama", torch.float32, graph=True, monkeypatch=monkeypatch)[0].step_graph
    assert g.accepts(5, 4, 5, [4, 1], [20, 9])           # a verify step (1 + 3 drafts) beside a decode row
    assert g.accepts(8, 8, 8, [8], [9])                  # the longest short query, after one cached token
    assert not g.accepts(5, 4, 5, [4, 1], [4, 9])        # a 4-token prompt (no cached context): a prefill
    assert not g.accepts(5, 4, 5)                        # lengths unknown
    assert not g.accepts(8, 4, 9, [4, 4], [9, 9])        # padded
    assert g.accepts(S, S, S, [S], [S + 1]) and not g.accepts(S + 1, S + 1, S + 1, [S + 1], [S + 2])
    monkeypatch.setenv("TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS", "8")
    capped = build("llama", torch.float32, graph=True, monkeypatch=monkeypatch)[0].step_graph
    assert capped.accepts(8, 4, 8, [4, 4], [9, 9]) and not capped.accepts(9, 5, 9, [5, 4], [9, 9])  # > max


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_calls_are_the_same_c_calls_with_the_same_values(dtype, monkeypatch):
    """:meth:`CpuStepGraph._fast_calls`: each C kernel call keeps its function's address and passes every
    argument as an instance of the C type the library declares, holding the value ``argtypes`` would convert
    to (a wrong type, a dropped argument or a float narrowed twice fails here); the graph's step with the
    prepared calls equals the step with the plain ones bit for bit."""
    import ctypes

    needs_lowbit(dtype)
    runner, model, arch = build("qwen2", dtype, graph=True, monkeypatch=monkeypatch)   # qwen2: biases
    g = runner.step_graph
    g._exec = None                            # the per-call path (the executor's own test: below)
    bufs = [runner.buffers.to_device(k, 3) for k in ("slot_mapping", "block_tables", "seq_lens")]
    plain = g._build(3, *bufs, 2)
    fast = CpuStepGraph._fast_calls(plain)
    assert len(fast) == len(plain)
    n_c = 0
    for (fn, args), (ffn, fargs, orig) in zip(plain, fast):
        assert orig is fn
        if not isinstance(fn, ctypes._CFuncPtr):
            assert ffn is fn and fargs is args
            continue
        n_c += 1
        assert ffn is not fn and ffn.argtypes is None and ffn.restype is fn.restype
        assert ctypes.cast(ffn, ctypes.c_void_p).value == ctypes.cast(fn, ctypes.c_void_p).value
        assert len(fargs) == len(args) == len(fn.argtypes)
        for t, v, fv in zip(fn.argtypes, args, fargs):
            if v is None:
                assert fv is None
                continue
            assert type(fv) is t
            assert fv.value == t(v).value and (t in (ctypes.c_float, ctypes.c_double) or fv.value == v or
                                               (t is ctypes.c_void_p and fv.value == v))
    assert n_c >= 10 * len(model.model.layers)           # every kernel call of every layer is prepared
    assert g.call_kind(fast[1][2]) == "linear"           # the profile still books calls by their original function

    # the same step through both forms: bit-equal final hidden states
    ids = torch.tensor([5, 9, 17])
    pos = torch.tensor([3, 4, 5])
    slots, tables, lens = bufs
    for r, p in enumerate(pos.tolist()):      # request r: blocks 8r.., its token at position p
        tables[r].copy_(torch.arange(8 * r, 8 * r + tables.shape[1]).to(tables.dtype))
        lens[r] = p + 1
        slots[r] = (8 * r + p // BLOCK) * BLOCK + p % BLOCK
    gen = torch.Generator().manual_seed(0)
    for kv in g.kv_caches:                    # a context to attend over
        kv.copy_(torch.randn(kv.shape, generator=gen).to(kv.dtype))
    out = {}
    for name, form in (("plain", lambda calls: [(f, a, f) for f, a in calls]), ("fast", CpuStepGraph._fast_calls)):
        g._calls.clear()
        monkeypatch.setattr(g, "_fast_calls", form)
        out[name] = g.run(ids, pos, *bufs).clone()
    assert out["plain"].isfinite().all()
    assert torch.equal(out["plain"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       out["fast"].view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
