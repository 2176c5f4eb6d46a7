"""Batch invariance (``--batch-invariant``, the default): a request's tokens and logprobs are bit-identical
whatever the batch, the step size, the chunk budget, prefix-cache hits, preemption and the thread count.

Three levels, each for every kernel variant (``avx512``, ``avx2``, ``scalar``: built and run explicitly;
a variant this CPU cannot run is skipped with its reason) and both activation dtypes:

1. the low-bit GEMM: row ``i`` of an ``M``-row call equals the same row computed alone, for many ``M``
   and 1 or 2 threads, on the integer path the invariant mode runs by default (AVX-512BW, AVX512-VNNI,
   AVX2, scalar multiply-adds) and the float32 path (FMA; bfloat16 activations also on the AVX512-BF16 dot
   products), float32 and bfloat16 activations;
2. the attention backend with ``batch_invariant=True``: a request's output rows are equal whether its
   tokens run as one prefill, in chunks after a cached prefix, one decode step at a time, or beside other
   requests, for model-dtype and int8 KV caches;
3. the engine (property test): a tiny GGUF whose every linear is low-bit (head_dim 64, so the vector
   attention loops run) serves the same greedy, seeded and penalised requests under random batch
   compositions (staggered arrivals), chunk budgets, ``max_num_seqs``, prefix caching on/off, pools small
   enough to preempt, n-gram speculative decoding, and 1 or 2 threads; every run's token ids and logprobs
   equal the requests run alone.
   The same runs with ``batch_invariant=False`` are checked to differ somewhere (the test can fail).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tests.kernel_variants import variants
from tokenmill.model.layers import cpu_build
from tokenmill.model.layers.attention import TorchAttentionBackend, build_attention_metadata
from tokenmill.model.layers.kv_quant import KVScales
from tokenmill.quantization import lowbit
from tokenmill.quantization.lowbit import LowBitWeight, lowbit_linear


def _isa_or_skip(isa: str) -> None:
    if not cpu_build.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} kernel variant (missing instructions in /proc/cpuinfo)")


def _weight(n: int, k: int, bits: int, seed: int) -> LowBitWeight:
    g = torch.Generator().manual_seed(seed)
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        mins = (torch.rand(n, k // 32, generator=g) - 0.5) * 0.1
    else:
        codes = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int16).to(torch.int8)
        mins = None
    return LowBitWeight.from_codes(codes, torch.rand(n, k // 32, generator=g) * 0.02, mins, bits, fmt=f"q{bits}")


ROW_COUNTS = (1, 2, 3, 5, 8, 9, 16, 17, 33, 70)


@pytest.mark.parametrize("isa", variants())
@pytest.mark.parametrize("act", ["float32", "bfloat16", "bfloat16-dot", "int8", "int8-bfloat16", "int8-vnni",
                                 "int8-vnni-bfloat16"])
@pytest.mark.parametrize("bits", [4, 8])
def test_lowbit_gemm_rows_do_not_depend_on_the_step(isa, act, bits):
    """Both low-bit kernels: the float32 path (FMA, or AVX512-BF16 dot products) and the integer path the
    invariant mode runs by default (``int8*``: int8 activations; AVX-512BW/AVX2/scalar multiply-adds, or
    AVX512-VNNI for ``-vnni``), float32 or bfloat16 activations. The integer path is also run on a weight
    of 33 tiles, where every thread quantises the rows itself (fewer tiles: quantised once, shared)."""
    _isa_or_skip(isa)
    lib = lowbit.load_kernel(isa)
    if lib is None:
        pytest.skip(f"the {isa} low-bit kernel did not build (no C compiler?)")
    dot, int8, vnni = act == "bfloat16-dot", act.startswith("int8"), "vnni" in act
    if dot and not lowbit.set_bf16_dot(lib, True):
        pytest.skip(f"no AVX512-BF16 dot-product path in the {isa} variant on this CPU")
    if vnni and not lowbit.set_vnni(lib, True):
        pytest.skip(f"no AVX512-VNNI integer path in the {isa} variant on this CPU")
    if not dot:
        lowbit.set_bf16_dot(lib, False)
    if int8 and not vnni:
        lowbit.set_vnni(lib, False)
    try:
        dtype = torch.bfloat16 if act.endswith("bfloat16") else torch.float32
        x = torch.randn(max(ROW_COUNTS), 192, generator=torch.Generator().manual_seed(1)).to(dtype)
        for n in ((80, 528) if int8 else (80,)):
            w = _weight(n, 192, bits, seed=bits)
            if int8:
                assert w.prepare_i8(lib)
            run = lambda rows: lowbit_linear(rows, w, lib=lib, int8_act=int8)  # noqa: E731
            alone = torch.cat([run(x[i:i + 1]) for i in range(x.shape[0])])
            threads = torch.get_num_threads()
            try:
                for t in sorted({1, max(threads, 2)}):
                    torch.set_num_threads(t)
                    for m in ROW_COUNTS:
                        y = run(x[:m])
                        assert torch.equal(y, alone[:m]), (isa, act, bits, n, m, t)
                        # a step whose rows start elsewhere in the batch (the request's place in it)
                        y = run(x[max(0, m - 5):m + 3])
                        assert torch.equal(y, alone[max(0, m - 5):m + 3]), (isa, act, bits, n, m, t)
            finally:
                torch.set_num_threads(threads)
    finally:
        lowbit.set_bf16_dot(lib, True)
        lowbit.set_vnni(lib, True)


def _attention_rows(backend, q, k, v, pool, scales, reqs) -> dict[int, torch.Tensor]:
    """Run one step: ``reqs`` = [(request, first position, count)]; returns request -> its output rows."""
    qs, ks, vs, tables, computed, lens = [], [], [], [], [], []
    for r, s, n in reqs:
        qs.append(q[r][s:s + n]); ks.append(k[r][s:s + n]); vs.append(v[r][s:s + n])
        tables.append(list(range(r * 8, r * 8 + 8)))
        computed.append(s); lens.append(n)
    md, _ = build_attention_metadata(computed, lens, tables, 16)
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), pool, md, 0.125, scales)
    rows, off = {}, 0
    for r, _, n in reqs:
        rows[r] = out[off:off + n]
        off += n
    return rows


@pytest.mark.parametrize("isa", variants())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv", ["model", "int8"])
def test_attention_rows_do_not_depend_on_the_step(isa, dtype, kv):
    _isa_or_skip(isa)
    from tokenmill.model.layers import paged_attention_cpu

    if paged_attention_cpu.load(isa) is None:
        pytest.skip(f"the {isa} attention kernels did not build (no C compiler?)")
    backend = TorchAttentionBackend(use_cpu_kernel=True, cpu_isa=isa, batch_invariant=True)
    h, kvh, d, n = 6, 2, 64, 45
    g = torch.Generator().manual_seed(3)
    q = [torch.randn(n, h, d, generator=g).to(dtype) for _ in range(3)]
    k = [torch.randn(n, kvh, d, generator=g).to(dtype) for _ in range(3)]
    v = [torch.randn(n, kvh, d, generator=g).to(dtype) for _ in range(3)]
    kv_dtype = dtype if kv == "model" else torch.int8
    pool = torch.zeros(2, 25, 16, kvh, d, dtype=kv_dtype)
    scales = KVScales(k=0.03, v=0.03) if kv == "int8" else None
    whole = _attention_rows(backend, q, k, v, pool, scales, [(0, 0, n)])[0]
    # chunks of 7 after a cached prefix, beside other requests' prefills and decodes
    got = []
    for s in range(0, n, 7):
        got.append(_attention_rows(backend, q, k, v, pool, scales,
                                   [(1, 0, min(s + 3, n)), (0, s, min(7, n - s)), (2, 0, 1 + s % 5)])[0])
    assert torch.equal(torch.cat(got), whole), "chunked beside others"
    # one token per step (decode), alone and in a batch
    got = [_attention_rows(backend, q, k, v, pool, scales, [(0, s, 1)])[0] for s in range(n)]
    assert torch.equal(torch.cat(got), whole), "decode alone"
    got = [_attention_rows(backend, q, k, v, pool, scales, [(2, s % 9, 1), (0, s, 1), (1, 0, 2)])[0]
           for s in range(n)]
    assert torch.equal(torch.cat(got), whole), "decode in a batch"
    # and with fewer threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_attention_rows(backend, q, k, v, pool, scales, [(0, 0, n)])[0], whole), "1 thread"
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------- engine level
H, FFN, HEADS, KVH, HD, VOCAB, LAYERS = 128, 256, 2, 1, 64, 160, 2


def write_lowbit_gguf(path) -> None:
    """A 2-layer Llama GGUF whose every linear is low-bit (Q4_1 / Q4_0 / Q8_0; tied Q8_0 embedding as the
    logits head), head_dim 64, with a toy BPE tokenizer (the prompts are token ids)."""
    gguf = pytest.importorskip("gguf")
    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(7)
    w = gguf.GGUFWriter(str(path), "llama")
    for add, val in ((w.add_block_count, LAYERS), (w.add_context_length, 512), (w.add_embedding_length, H),
                     (w.add_feed_forward_length, FFN), (w.add_head_count, HEADS), (w.add_head_count_kv, KVH),
                     (w.add_rope_dimension_count, HD), (w.add_rope_freq_base, 10000.0),
                     (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, VOCAB), (w.add_bos_token_id, 1),
                     (w.add_eos_token_id, 2)):
        add(val)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB - 3)])
    w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    w.add_token_merges(["a a", "b b"])

    def add(name, shape, qt, scale=0.15):
        arr = rng.normal(0, scale, shape).astype(np.float32)
        if qt == q.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    add("token_embd.weight", (VOCAB, H), q.Q8_0, 0.5)
    w.add_tensor("output_norm.weight", (1 + rng.normal(0, 0.1, H)).astype(np.float32))
    for i in range(LAYERS):
        p = f"blk.{i}."
        for n in ("attn_norm", "ffn_norm"):
            w.add_tensor(p + n + ".weight", (1 + rng.normal(0, 0.1, H)).astype(np.float32))
        add(p + "attn_q.weight", (HEADS * HD, H), q.Q4_1)
        add(p + "attn_k.weight", (KVH * HD, H), q.Q4_1)
        add(p + "attn_v.weight", (KVH * HD, H), q.Q4_1)
        add(p + "attn_output.weight", (H, HEADS * HD), q.Q4_0)
        add(p + "ffn_gate.weight", (FFN, H), q.Q4_1)
        add(p + "ffn_up.weight", (FFN, H), q.Q4_1)
        add(p + "ffn_down.weight", (H, FFN), q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _requests(seed: int):
    """Prompts (two share a 40-token prefix, so prefix-cache hits happen) and their sampling parameters:
    greedy with logprobs, seeded sampling with top-p/top-k, and a penalised seeded neighbour."""
    from tokenmill.sampling_params import SamplingParams

    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 9))] for _ in range(2)]
    prompts += [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 60))] for _ in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=1.1, top_k=20, seed=5, max_tokens=14, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=3, frequency_penalty=0.7, repetition_penalty=1.2, max_tokens=14,
                             ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, presence_penalty=0.5, logprobs=2)]
    return prompts, params


def _result(out):
    o = out.outputs[0]
    return o.token_ids, [None if lp is None else (lp.logprob, lp.top_token_ids, lp.top_logprobs)
                         for lp in (o.logprobs or [])]


def _serve(llm, prompts, params, arrivals, threads: int):
    """Add request i at step arrivals[i] (steps of this engine), run until all finish; results in order."""
    torch.set_num_threads(threads)
    ids, step = {}, 0
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    pending = list(order)
    done: dict[str, object] = {}
    while pending or any(rid not in done for rid in ids.values()):
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            ids[i] = llm._add(prompts[i], params[i], 0, None)
        if llm.engine_core.has_unfinished_requests():
            deltas, stop_ids = llm.processor.process_outputs(llm.engine_core.step())
            if stop_ids:
                llm.engine_core.stop_requests(stop_ids)
            for d in deltas:
                if d.finished:
                    done[d.request_id] = True
        step += 1
    res = [_result(llm.processor.final_output(ids[i])) for i in range(len(prompts))]
    for rid in ids.values():
        llm.processor.remove_request(rid)
    return res


@pytest.fixture
def variant_env(monkeypatch, request):
    """Force the kernel variant for this test's engines (TOKENMILL_CPU_ISA + the per-process caches)."""
    isa = request.param
    _isa_or_skip(isa)
    monkeypatch.setenv("TOKENMILL_CPU_ISA", isa)
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE", "0")
    cpu_build.cpu_isa.cache_clear()
    lowbit._default_kernel.cache_clear()
    threads = torch.get_num_threads()
    yield isa
    torch.set_num_threads(threads)
    monkeypatch.delenv("TOKENMILL_CPU_ISA")
    cpu_build.cpu_isa.cache_clear()
    lowbit._default_kernel.cache_clear()


@pytest.mark.parametrize("variant_env", cpu_build.ISAS, indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kernel", ["int8", "float32"])
def test_engine_outputs_do_not_depend_on_the_schedule(variant_env, dtype, kernel, tmp_path, monkeypatch):
    """``kernel``: the invariant mode's low-bit kernel (``TOKENMILL_CPU_INVARIANT_KERNEL``; int8 is the
    default)."""
    from tokenmill import LLM
    from tokenmill.model.layers.linear import PackedLinear, lowbit_max_tokens

    monkeypatch.setenv("TOKENMILL_CPU_INVARIANT_KERNEL", kernel)

    if not lowbit_max_tokens("cpu", getattr(torch, dtype)):
        pytest.skip(f"no low-bit path for {dtype} on this machine (oneDNN bfloat16 or the C kernel missing)")
    path = tmp_path / "tiny-lowbit.gguf"
    write_lowbit_gguf(path)
    prompts, params = _requests(seed=1)
    base = dict(model=str(path), dtype=dtype, max_model_len=256, block_size=16)

    def engine(**kw):
        return LLM(**{**base, "num_kv_blocks": 64, **kw})

    alone_llm = engine(max_num_seqs=1)
    lin = [m for m in alone_llm.engine_core.executor.model.modules() if isinstance(m, PackedLinear) and m.lowbit]
    assert lin and all(m.lowbit_path(n) == ("i8" if kernel == "int8" else "f32") for m in lin for n in (1, 9, 600))
    alone = [_serve(alone_llm, [p], [sp], [0], 2)[0] for p, sp in zip(prompts, params)]
    # raw logprobs (the default --logprobs-mode) do not depend on the sampling parameters: the first
    # position of the greedy request, asked again with temperature, top-p and top-k
    from tokenmill.sampling_params import SamplingParams

    greedy3 = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3)
    for sampled in (SamplingParams(temperature=0.7, top_p=0.8, top_k=10, seed=1, max_tokens=1, logprobs=3),
                    SamplingParams(temperature=0.7, seed=1, max_tokens=1, logprobs=3),
                    SamplingParams(temperature=1.0, top_p=0.5, seed=1, max_tokens=1, logprobs=3),
                    SamplingParams(temperature=1.0, top_k=4, seed=1, max_tokens=1, logprobs=3)):
        first = _serve(alone_llm, [prompts[0], prompts[0]], [greedy3, sampled], [0, 0], 2)
        assert first[0][1][0][1:] == first[1][1][0][1:] == (alone[0][1][0][1], alone[0][1][0][2][:3]), sampled
    del alone_llm
    rng = random.Random(f"{variant_env}-{dtype}-{kernel}")
    differs = False
    for trial in range(3):
        kw = dict(max_num_batched_tokens=rng.choice([8, 16, 37, 64, 512]), max_num_seqs=rng.choice([2, 3, 6]),
                  enable_prefix_caching=rng.random() < 0.7)
        small = trial == 1     # a pool of 9 blocks: at most two 60-token requests, the others are preempted
        if small:
            kw.update(num_kv_blocks=9, max_num_seqs=6)
        if trial == 2:         # speculative decoding (n-gram drafts, verified as k + 1 rows)
            kw.update(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                          "prompt_lookup_max": 2})
        llm = engine(**kw)
        # staggered arrivals; the small pool's trial admits them within 3 steps so that they must preempt
        arrivals = [rng.randrange(0, 3 if small else 12) for _ in prompts]
        threads = rng.choice([1, 2])
        got = _serve(llm, prompts, params, arrivals, threads)
        ctx = (variant_env, dtype, kernel, kw, arrivals, threads)
        if small:
            assert llm.engine_core.scheduler.num_preemptions_total > 0, ctx
        for i, (a, b) in enumerate(zip(alone, got)):
            assert a == b, (i, ctx)
        if trial == 2:
            assert llm.engine_core.scheduler.spec_stats.num_accepted_tokens > 0, ctx
        # the same schedule without batch invariance: the test can see a difference
        plain = engine(**kw, batch_invariant=False)
        differs |= _serve(plain, prompts, params, arrivals, threads) != alone
        del llm, plain
    assert differs, "the non-invariant mode gave the same bits every time: the check cannot fail"


def _outs(outs):
    """Every choice's token ids and (logprob, top ids, top logprobs) per position, in order."""
    return [(tuple(c.token_ids), tuple((lp.logprob, tuple(lp.top_token_ids), tuple(lp.top_logprobs))
                                       for lp in (c.logprobs or [])))
            for o in outs for c in o.outputs]


def _tiny_llm(path, dtype, **kw):
    from tokenmill import LLM
    from tokenmill.model.layers.linear import lowbit_max_tokens

    if not lowbit_max_tokens("cpu", getattr(torch, dtype)):
        pytest.skip(f"no low-bit path for {dtype} on this machine (oneDNN bfloat16 or the C kernel missing)")
    return LLM(**{"model": str(path), "dtype": dtype, "max_model_len": 256, "block_size": 16, "num_kv_blocks": 96,
                  **kw})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_seeded_n_choices_equal_each_choice_alone(dtype, tmp_path):
    """A seeded ``n=3`` request (what a streamed and a non-streamed request both become in the engine: three
    child requests with seeds ``seed + i``, scheduled differently) beside other requests under a 16-token
    chunk budget: every choice equals its child request run alone, token ids and logprobs."""
    from tokenmill.sampling_params import SamplingParams

    path = tmp_path / "tiny-lowbit.gguf"
    write_lowbit_gguf(path)
    prompts, params = _requests(seed=2)
    n3 = SamplingParams(temperature=0.9, top_p=0.95, seed=21, n=3, max_tokens=14, ignore_eos=True, logprobs=2)
    llm = _tiny_llm(path, dtype, max_num_batched_tokens=16, max_num_seqs=4)
    got = _outs(llm.generate([prompts[2], prompts[0], prompts[3]], [params[0], n3, params[3]]))[1:4]
    del llm
    llm = _tiny_llm(path, dtype)
    alone = [_outs(llm.generate([prompts[0]], SamplingParams(temperature=0.9, top_p=0.95, seed=21 + i, max_tokens=14,
                                                              ignore_eos=True, logprobs=2)))[0] for i in range(3)]
    assert len({g[0] for g in got}) > 1, "the three choices must draw with different seeds"
    assert got == alone


SYSTEM_TOKENS = 700


@pytest.mark.parametrize("kv", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantised_kv_prefix_hit_equals_miss(kv, dtype, tmp_path):
    """A 1-byte KV cache (fp8 / int8) and a 700-token system prompt shared by four questions: the greedy
    continuations (token ids and logprobs) of the first run, which computes the system prompt (miss, the four
    prompts prefilled together), equal a second run in which every full block of it comes from the prefix
    cache (hit), batched and one request at a time. Every path reads the same stored bytes through the same
    decode kernel. ``--no-batch-invariant`` (the prefill kernel for prompt rows, dense GEMMs for large steps)
    must differ somewhere in the same runs, so the comparison can fail."""
    from tokenmill.sampling_params import SamplingParams

    path = tmp_path / "tiny-lowbit.gguf"
    write_lowbit_gguf(path)
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(SYSTEM_TOKENS)]
    prompts = [system + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(3, 12))] for _ in range(4)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)

    def runs(invariant: bool):
        # the four prompts in one step (budget 4096), so the first run computes every block (no hit within it)
        llm = _tiny_llm(path, dtype, kv_cache_dtype=kv, max_model_len=768, num_kv_blocks=240,
                        max_num_batched_tokens=4096, batch_invariant=invariant)
        stats = llm.engine_core.scheduler.kv_cache_manager.prefix_cache_stats
        miss = _outs(llm.generate(prompts, greedy, cache_salt="s"))
        assert stats.hits == 0
        hit = _outs(llm.generate(prompts, greedy, cache_salt="s"))
        assert stats.hits >= 4 * (SYSTEM_TOKENS // 16) * 16
        one = [_outs(llm.generate([p], greedy, cache_salt="s"))[0] for p in prompts]
        return miss, hit, one

    miss, hit, one = runs(True)
    assert hit == miss, "prefix-cache hit (batched) != miss"
    assert one == miss, "prefix-cache hit (one at a time) != miss"
    pmiss, phit, pone = runs(False)
    assert (pmiss, pmiss) != (phit, pone), "--no-batch-invariant gave the same bits: the check cannot fail"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pipeline_parallel_equals_one_process(dtype, tmp_path):
    """``--pipeline-parallel-size 2``: each stage holds whole layers and runs the GGUF's low-bit codes as one
    process does (distributed/model_loader.shard_lowbit_weights), so greedy and seeded requests give one
    process's token ids and logprobs bit for bit (tensor parallelism splits reductions: not covered)."""
    path = tmp_path / "tiny-lowbit.gguf"
    write_lowbit_gguf(path)
    prompts, params = _requests(seed=3)
    want = _outs(_tiny_llm(path, dtype).generate(prompts, params))
    with _tiny_llm(path, dtype, pipeline_parallel_size=2) as llm:
        got = _outs(llm.generate(prompts, params))
    assert got == want
