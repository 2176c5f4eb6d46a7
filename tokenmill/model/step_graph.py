"""A decode step of a Llama-family model as one prepared list of kernel calls (CPU).

Why: at concurrency 1 a decode step's kernels are short (SmolLM2-135M, one
token, bfloat16 on the 2-core AVX-512 EPYC: the 121 low-bit GEMVs, 30 paged
attentions and the fused element-wise ops sum to ~5.6 ms), and the eager
forward spends ~3-4 ms more in per-layer Python and dispatch around them:
``nn.Module`` calls, eligibility checks, ``torch.empty`` for every output,
``data_ptr()``/``stride()`` reads and the ctypes argument conversion of each
call (measured with ``benchmarks/step_overhead.py``). That overhead grows with
the batch (copies, the attention backend's per-step plan): 4.9 ms at 16 and
6.4 ms at 64 decode requests (float32, AVX2; ``benchmarks/step_parts.py``).
llama.cpp runs the whole step in C++.

What: for steps whose every request decodes one token (at most ``max_tokens``
of them, the runner's ``max_num_seqs``), this module builds, once per step
size ``M``, the exact sequence of calls the eager forward makes -- per layer:
fused add+RMSNorm, q/k/v GEMM, in-place RoPE on q and k, K/V write into the
paged cache, paged decode attention, o_proj, add+RMSNorm, gate/up GEMM,
SiLU-and-multiply, down projection -- with every argument (weight codes,
persistent activation buffers, the runner's persistent slot-mapping /
block-table / sequence-length buffers, the KV pool) resolved ahead of time.
Each GEMM takes the path :meth:`PackedLinear.forward` takes at ``M`` rows:
the low-bit float32 kernel up to the low-bit limit, the integer low-bit
kernel (int8 activations) up to its limit, else oneDNN's packed GEMM (one
torch call and a copy into the persistent buffer). A step then is one
embedding lookup, one cos/sin computation, and the prepared calls: ~10 per
layer and nothing else. The step executor (``csrc/step_exec.c``,
:class:`ExecutorRun`) runs each run of consecutive C kernel calls in one C
loop, so a B=1 step is one call from Python instead of ~300 (same functions,
arguments and order; ``TOKENMILL_CPU_STEP_EXECUTOR=0``: each call from a
Python loop, which the profiled step always uses).

Same results: the calls, their arguments and their order are the eager
path's (:meth:`LlamaForCausalLM.forward` with :class:`PackedLinear`,
:mod:`~tokenmill.model.layers.fused_cpu` and the decode kernel of
:mod:`~tokenmill.model.layers.paged_attention_cpu`), so outputs are bit-equal
(``tests/model/test_step_graph.py``); only where the buffers live differs.
The residual stream is updated in place (the fused add+norm reads each
element before writing it at the same index).

Verify steps: a speculative-decoding step (n-gram or draft-model drafts, or
a structured-output request's grammar-forced tokens) schedules each request's
last token plus its ``k`` drafts. The eager attention already serves a query
of at most :data:`~tokenmill.model.layers.attention.SHORT_QUERY_AS_DECODE`
tokens after cached context as that many decode rows, row ``j`` over
``seq_len - query_len + j + 1`` positions of the request's block table
(``TorchAttentionBackend._plan``), with the rows kernel
(:func:`~tokenmill.model.layers.paged_attention_cpu.paged_rows`: the decode
kernel's bits per row, each request's context read once for all its rows);
every other call of the step is per row already. So such a step is an
``M``-row step of the same calls, ``M = sum(query_lens)``, whose attention is
one rows-kernel call over the step's requests (their first rows and counts in
persistent buffers of the graph's own, :meth:`CpuStepGraph.run` with
``query_lens``). Before the rows kernel the graph expanded the step to one
decode row per token, whose attention read each request's context once per
row (a verify step cost 1.5-1.8x a decode step,
``docs/benchmarks/2026-12-02-roofline-avx2.md``).

Where it does not apply the runner keeps the eager forward: prefills and
chunks (a query longer than ``SHORT_QUERY_AS_DECODE``, or one with no cached
context before it), steps above ``max_tokens``, quantised KV caches (a float32
model's bfloat16 cache is served), Qwen3's q/k norm, mixture-of-experts and
pipeline-parallel models, CUDA (device is a parameter of the runner; nothing
here runs off the CPU). ``TOKENMILL_CPU_STEP_GRAPH=0``
turns it off (the ablation switch); ``TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS=N``
caps the step size it serves (e.g. the low-bit limit, 8, as before it took
larger decode steps).

Not thread-safe: one runner calls it from one thread. The hidden states it
returns live in a buffer the next call overwrites.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Sequence

import numpy as np
import torch

from tokenmill import envs
from tokenmill.model.layers.attention import SHORT_QUERY_AS_DECODE, TorchAttentionBackend
from tokenmill.model.layers.cpu_build import load_library

logger = logging.getLogger(__name__)

ENV_SWITCH = "TOKENMILL_CPU_STEP_GRAPH"
MAX_TOKENS_ENV = "TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS"
EXECUTOR_ENV = "TOKENMILL_CPU_STEP_EXECUTOR"

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def step_graph_enabled() -> bool:
    """False when ``TOKENMILL_CPU_STEP_GRAPH=0``."""
    return envs.get(ENV_SWITCH)


def max_tokens_from_env(default: int) -> int:
    """The largest decode step (tokens) the graph serves: ``TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS`` or ``default``.

    Raises:
        ValueError: the variable is not a positive integer.
    """
    n = envs.get(MAX_TOKENS_ENV)
    return default if n is None else n


def unsupported_reason(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                       kv_cache_dtype: torch.dtype, max_tokens: int, enabled: bool | None = None) -> str | None:
    """Why :class:`CpuStepGraph` cannot serve ``model``; None when it can.

    Args:
        model: the loaded model (after the runner packed its linears and attached low-bit weights).
        device, dtype: where and in what dtype it runs.
        kv_cache_dtype: the KV pool's element type.
        max_tokens: the runner's low-bit step limit (0: off).
        enabled: the kernel plan's ``step_graph`` (``TOKENMILL_CPU_STEP_GRAPH`` as the engine config holds
            it); None: the environment's.
    """
    from tokenmill.model.layers import fused_cpu, paged_attention_cpu
    from tokenmill.model.layers.linear import PackedLinear
    from tokenmill.model.layers.mlp import SwiGLUMLP
    from tokenmill.model.llama import LlamaDecoderLayer, LlamaForCausalLM
    from tokenmill.quantization import lowbit

    if not (step_graph_enabled() if enabled is None else enabled):
        return f"{ENV_SWITCH}=0"
    if device.type != "cpu":
        return f"device {device.type}"
    if dtype not in _SUFFIX:
        return f"dtype {dtype}"
    if kv_cache_dtype != dtype and (dtype, kv_cache_dtype) != (torch.float32, torch.bfloat16):
        return f"KV cache dtype {kv_cache_dtype} (quantised caches keep the eager path)"
    if not max_tokens:
        return "low-bit small-step weights are off"
    if type(model) is not LlamaForCausalLM:
        return f"model class {type(model).__name__}"
    cfg = model.config
    if cfg.qk_norm or model.pp_stage is not None:
        return "q/k norm or a pipeline stage"
    backend = model.attn_backend
    if type(backend) is not TorchAttentionBackend or not backend.use_cpu_kernel:
        return "attention backend without the CPU decode kernel"
    rd = model.rotary_emb.rotary_dim
    if rd % 2 or rd > cfg.head_dim:
        return f"rotary dim {rd}"
    if fused_cpu.load() is None or paged_attention_cpu.load(backend.cpu_isa) is None or \
            lowbit._default_kernel() is None:
        return "a C kernel library is unavailable"
    if type(model.model.embed_tokens) is not torch.nn.Embedding:
        return "a sharded embedding (tensor parallel)"
    for layer in model.model.layers:
        if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not SwiGLUMLP:
            return "a layer that is not a plain Llama block"
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            lin = _lora_base(lin)
            # exactly PackedLinear: a subclass (or a tensor-parallel wrapper) may do more than the GEMM
            if type(lin) is not PackedLinear or lin.lowbit is None or lin.lowbit_max_rows < max_tokens:
                return "a linear layer without low-bit codes (or a tensor-parallel one)"
    return None


_ARG_CODES = {ctypes.c_void_p: "p", ctypes.c_int: "i", ctypes.c_int64: "l", ctypes.c_float: "f"}


def load_executor():
    """The step executor library (``csrc/step_exec.c``: runs a prepared list of C kernel calls in one C loop),
    or None when ``TOKENMILL_CPU_STEP_EXECUTOR=0`` or it cannot be built (the graph then calls each kernel from
    Python). Its build has no ISA-specific code; it calls whichever variant's functions it is given."""
    lib = load_library("step_exec", ["step_exec.c"],
                       {"tm_exec_sig": [ctypes.c_char_p], "tm_exec_row": [],
                        "tm_exec_run": [ctypes.c_void_p, ctypes.c_int64]}, EXECUTOR_ENV)
    if lib is not None and lib.tm_exec_run.restype is not ctypes.c_int64:
        lib.tm_exec_sig.restype = ctypes.c_int
        lib.tm_exec_row.restype = ctypes.c_int
        lib.tm_exec_run.restype = ctypes.c_int64
    return lib


class ExecutorRun:
    """Consecutive prepared C kernel calls as one call of the step executor (``tm_exec_run``).

    Args:
        lib: :func:`load_executor`'s library.
        calls: ``(fn, args)`` pairs, each ``fn`` a :mod:`ctypes` function with ``argtypes`` whose type string
            the executor knows (:meth:`encodable`), ``args`` its Python values (ints, floats, None for NULL).

    Calling the object makes the same C calls with the same C-typed values in the same order on this thread
    (the values packed once into an ``[n, row]`` int64 table: pointers and integers as their values, floats as
    their float32 bits after ctypes' own double -> float conversion), so results are the per-call bits.

    Raises:
        ValueError: a call the executor cannot encode.
        RuntimeError (on call): the library stopped before the last call (an unknown signature id).
    """

    def __init__(self, lib, calls: Sequence[tuple]) -> None:
        row = lib.tm_exec_row()
        table = np.zeros((len(calls), row), dtype=np.int64)
        for k, (fn, args) in enumerate(calls):
            sig = self.signature(lib, fn)
            if sig < 0 or len(args) > row - 2:
                raise ValueError(f"step executor cannot call {fn!r}")
            table[k, 0] = ctypes.cast(fn, ctypes.c_void_p).value
            table[k, 1] = sig
            for j, (t, v) in enumerate(zip(fn.argtypes, args, strict=True)):
                if v is None:
                    continue
                if t is ctypes.c_float:
                    table[k, 2 + j] = ctypes.c_uint32.from_buffer(ctypes.c_float(v)).value
                else:
                    table[k, 2 + j] = t(v).value or 0
        self.table, self.n = table, len(calls)
        self._run = lib.tm_exec_run
        self._ptr = table.ctypes.data

    @staticmethod
    def signature(lib, fn) -> int:
        """The executor's signature id for the ctypes function ``fn`` (from its ``argtypes``), -1 if none."""
        argtypes = getattr(fn, "argtypes", None)
        if not isinstance(fn, ctypes._CFuncPtr) or not argtypes or fn.restype is not None:
            return -1
        codes = "".join(_ARG_CODES.get(t, "?") for t in argtypes)
        return -1 if "?" in codes else lib.tm_exec_sig(codes.encode())

    def __call__(self) -> None:
        done = self._run(self._ptr, self.n)
        if done != self.n:
            raise RuntimeError(f"step executor stopped at call {done} of {self.n}")


def executor_plan(lib, calls: Sequence[tuple]) -> list:
    """``calls`` (``(fn, args)`` pairs) with every run of consecutive executor-encodable C calls made one
    :class:`ExecutorRun`; other callables (torch methods, closures) stay as they are, between the runs, in
    order. Returns ``(callable, args)`` pairs."""
    out: list = []
    run: list = []
    for fn, args in calls:
        if ExecutorRun.signature(lib, fn) >= 0:
            run.append((fn, args))
            continue
        if run:
            out.append((ExecutorRun(lib, run), ()))
            run = []
        out.append((fn, args))
    if run:
        out.append((ExecutorRun(lib, run), ()))
    return out


def _lora_base(lin):
    """The base layer of a LoRA-wrapped linear (``LoRALinear.base``), else ``lin`` itself."""
    from tokenmill.model.layers.lora import LoRALinear

    return lin.base if isinstance(lin, LoRALinear) else lin


class CpuStepGraph:
    """Runs a decode-only step of at most ``max_tokens`` tokens as a prepared list of kernel calls.

    Args:
        model: a :class:`~tokenmill.model.llama.LlamaForCausalLM` that
            :func:`unsupported_reason` accepts.
        kv_caches: the runner's per-layer pools ``[2, num_blocks, block_size, KVH, D]``.
        lowbit_tokens: the runner's low-bit step limit (the linears' ``lowbit_max_rows``).
        max_tokens: largest step served (default ``lowbit_tokens``; the runner passes its
            ``max_num_seqs``). The persistent activation buffers grow to the largest step seen.

    Raises:
        ValueError: the model is not supported (see :func:`unsupported_reason`).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], lowbit_tokens: int,
                 max_tokens: int | None = None) -> None:
        from tokenmill.model.layers import fused_cpu, paged_attention_cpu
        from tokenmill.quantization import lowbit

        dtype = model.model.norm.weight.dtype
        reason = unsupported_reason(model, torch.device("cpu"), dtype, kv_caches[0].dtype, lowbit_tokens)
        if reason is not None:
            raise ValueError(f"step graph unsupported: {reason}")
        self.model, self.kv_caches, self.dtype = model, kv_caches, dtype
        self.lowbit_tokens = lowbit_tokens
        self.max_tokens = max(max_tokens or lowbit_tokens, 1)
        sfx = _SUFFIX[dtype]
        fl, pl, ll = fused_cpu.load(), paged_attention_cpu.load(model.attn_backend.cpu_isa), lowbit._default_kernel()
        self._norm, self._rope, self._silu = (getattr(fl, f"{n}_{sfx}") for n in ("rms_norm", "rope", "silu_mul"))
        ksfx = _SUFFIX[kv_caches[0].dtype]   # a float32 model may keep a bfloat16 cache
        self._kv_write = getattr(pl, f"kv_write_{sfx}_{ksfx}")
        self._decode = getattr(pl, f"paged_decode_{sfx}_{ksfx}")
        self._rows = getattr(pl, f"paged_rows_{sfx}_{ksfx}")
        self._gemm, self._gemm_i8, self._gemm_i8_h = ll.tm_lowbit_gemm, ll.tm_lowbit_gemm_i8, ll.tm_lowbit_gemm_i8_h
        cfg = model.config
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        a = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.q_size, a.kv_size
        self.qkv_width = a.q_size + 2 * a.kv_size
        self.rotary_dim = model.rotary_emb.rotary_dim
        # float32 copies of the biases, as lowbit_linear makes them per call
        self._biases: list[torch.Tensor] = []
        self._calls: dict[tuple, list] = {}
        # a LoRA layer of the model (its shared LoRABatch says whether the step has adapter rows)
        lin = model.model.layers[0].self_attn.qkv_proj
        self._lora_mod = lin if _lora_base(lin) is not lin else None
        self._lora_on, self._threads = False, 1
        # the step executor (one C loop over runs of calls; TOKENMILL_CPU_STEP_EXECUTOR=0: None, each call from Python)
        self._exec = load_executor()
        self._plans: dict[tuple, list] = {}
        # first rows and token counts of a multi-token-query step's requests (:meth:`_row_starts`)
        self._q_start: torch.Tensor | None = None
        self._q_len: torch.Tensor | None = None
        #: None, or a dict that :meth:`run` adds each part's seconds to (:meth:`call_kind` names the parts,
        #: plus ``embedding``): ``benchmarks/roofline.py --breakdown`` reads it. Off in serving.
        self.profile: dict[str, float] | None = None
        self.capacity = 0
        self._ensure_capacity(min(self.max_tokens, max(lowbit_tokens, 1)))   # grows with the steps seen
        logger.info("CPU step graph: decode steps of <= %d tokens run as ~%d prepared kernel calls per step (%s; "
                    "low-bit GEMMs up to %d tokens, %s; %s)", self.max_tokens, 10 * len(model.model.layers) + 1, dtype,
                    lowbit_tokens, MAX_TOKENS_ENV,
                    "called from one C loop" if self._exec is not None else f"called from Python, {EXECUTOR_ENV}=0")

    def _ensure_capacity(self, m: int) -> None:
        """Persistent activations for steps of ``m`` tokens (grown geometrically; prepared calls dropped)."""
        if m <= self.capacity:
            return
        cap = min(self.max_tokens, max(m, 2 * self.capacity))
        z = lambda *shape: torch.zeros(shape, dtype=self.dtype)
        # residual stream, normed input, q/k/v, contiguous q, attention out, o_proj out, gate/up, SiLU product,
        # MLP out, final norm, cos/sin
        self.res, self.hn, self.qkv = z(cap, self.hidden), z(cap, self.hidden), z(cap, self.qkv_width)
        self.q, self.attn, self.o = z(cap, self.q_size), z(cap, self.q_size), z(cap, self.hidden)
        self.gu, self.act, self.mlp = z(cap, 2 * self.inter), z(cap, self.inter), z(cap, self.hidden)
        self.final = z(cap, self.hidden)
        self.cos, self.sin = z(cap, self.rotary_dim), z(cap, self.rotary_dim)
        self.capacity = cap
        self._calls.clear()
        self._plans.clear()
        self._biases.clear()

    # -- building -----------------------------------------------------------
    def _gemm_args(self, lin, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple:
        """The call :meth:`PackedLinear.forward` makes for ``m`` rows of ``x``, writing into ``y``.

        A LoRA layer (:class:`~tokenmill.model.layers.lora.LoRALinear`) runs its base's call, then
        adds the step's adapter delta into ``y`` (nothing when the step has no adapter rows)."""
        base = _lora_base(lin)
        if base is not lin:
            fn, args = self._gemm_args(base, x, y, m)
            if not self._lora_on:       # a step without adapter rows: the base call alone
                return fn, args
            xv, yv = x[:m], y[:m]
            if lin.batch.mode in ("auto", "kernel") and lin.kernel_usable(xv, yv):
                dfn, dargs = lin.kernel_call(xv, yv, self._threads)     # the grouped C kernel, prepared

                def with_lora() -> None:
                    fn(*args)
                    dfn(*dargs)
                return (with_lora, ())
            add = lin.add_delta_

            def with_lora_torch() -> None:
                fn(*args)
                add(xv, yv)
            return (with_lora_torch, ())
        path = lin.lowbit_path(m)
        if path == "dense" and not lin.onednn:        # a plain bfloat16 weight (no oneDNN bfloat16 here)
            xv, yv, plain = x[:m], y[:m], lin.dense

            def dense_plain() -> None:
                yv.copy_(plain(xv))
            return (dense_plain, ())
        if path == "dense":
            # oneDNN's packed GEMM, as the eager layer runs it, then into the persistent buffer
            xv, yv, packed, bias = x[:m], y[:m], lin.ensure_packed(), lin.bias
            linear = torch.ops.mkldnn._linear_pointwise

            def dense() -> None:
                yv.copy_(linear(xv, packed, bias, "none", [], ""))
            return (dense, ())
        w = lin.lowbit
        b = None
        if lin.bias is not None:
            bias = lin.bias if lin.bias.dtype == torch.float32 and lin.bias.is_contiguous() else \
                lin.bias.float().contiguous()
            self._biases.append(bias)
            b = bias.data_ptr()
        bf = int(self.dtype == torch.bfloat16)
        fn, codes, sc, mn = (self._gemm, w.codes, w.scale, w.min) if path == "f32" else \
            (self._gemm_i8, w.codes_i8, w.scale, w.min)
        if path != "f32" and w.scale_h is not None:  # float16 scales/mins: the same bits, fewer bytes
            fn, sc, mn = self._gemm_i8_h, w.scale_h, w.min_h
        return (fn, (x.data_ptr(), bf, x.stride(0), m, w.in_features, w.out_features, w.bits,
                     codes.data_ptr(), w.group, sc.data_ptr(),
                     None if mn is None else mn.data_ptr(), b, y.data_ptr(), bf, w.out_features))

    def _build(self, m: int, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               threads: int, rows: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> list:
        """The calls of an ``m``-token step, in the eager forward's order, with every argument resolved
        (``rows``: a multi-token-query step's ``(q_start, q_len, R)``, attention by the rows kernel)."""
        calls: list = []
        nt = threads
        h, inter = self.hidden, self.inter
        nh, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        p = lambda t: t.data_ptr()
        res, hn, qkv, q, attn, o = self.res, self.hn, self.qkv, self.q, self.attn, self.o
        gu, act, mlp = self.gu, self.act, self.mlp
        qkv_row = qkv.stride(0)
        # the kernel wants contiguous [B, H, D] queries; one row is a contiguous slice already
        copy_q = (q[:m].copy_, (qkv[:m, :self.q_size],)) if m > 1 else None
        for i, (layer, kv) in enumerate(zip(self.model.model.layers, self.kv_caches)):
            a = layer.self_attn
            if i == 0:   # the residual stream starts as the embeddings (in ``res``)
                calls.append((self._norm, (p(res), None, None, p(layer.input_layernorm.weight), p(hn), m, h,
                                           float(layer.input_layernorm.eps), nt)))
            else:
                calls.append((self._norm, (p(mlp), p(res), p(res), p(layer.input_layernorm.weight), p(hn), m, h,
                                           float(layer.input_layernorm.eps), nt)))
            calls.append(self._gemm_args(a.qkv_proj, hn, qkv, m))
            calls.append((self._rope, (p(qkv), m, qkv_row, nh + kvh, d, self.rotary_dim, p(self.cos), p(self.sin),
                                       nt)))
            esz = qkv.element_size()
            k_ptr, v_ptr = p(qkv) + self.q_size * esz, p(qkv) + (self.q_size + self.kv_size) * esz
            calls.append((self._kv_write, (k_ptr, v_ptr, p(slot_mapping), m, kvh * d, qkv_row, qkv_row,
                                           kv[0].data_ptr(), kv[1].data_ptr(), 1.0, 1.0)))
            if copy_q is not None:
                calls.append(copy_q)
            bs = kv.shape[2]
            if rows is not None:
                q_start, q_len, nreq = rows
                calls.append((self._rows, (p(q), kv[0].data_ptr(), kv[1].data_ptr(), p(attn), p(block_tables),
                                           block_tables.stride(0), p(q_start), p(q_len), p(seq_lens), nreq, nh, kvh,
                                           d, bs, float(a.scale), 1.0, 1.0, nt)))
            else:
                calls.append((self._decode, (p(qkv) if m == 1 else p(q), kv[0].data_ptr(), kv[1].data_ptr(),
                                             p(attn), p(block_tables), block_tables.stride(0), p(seq_lens), m, nh,
                                             kvh, d, bs, float(a.scale), 1.0, 1.0, nt)))
            calls.append(self._gemm_args(a.o_proj, attn, o, m))
            n2 = layer.post_attention_layernorm
            calls.append((self._norm, (p(o), p(res), p(res), p(n2.weight), p(hn), m, h, float(n2.eps), nt)))
            calls.append(self._gemm_args(layer.mlp.gate_up_proj, hn, gu, m))
            calls.append((self._silu, (p(gu), p(act), m, inter, nt)))
            calls.append(self._gemm_args(layer.mlp.down_proj, act, mlp, m))
        fn = self.model.model.norm
        calls.append((self._norm, (p(mlp), p(res), p(res), p(fn.weight), p(self.final), m, h, float(fn.eps), nt)))
        return calls

    @staticmethod
    def _fast_calls(calls: list) -> list:
        """``calls`` as ``(callable, args, fn)`` triples that :meth:`run` makes faster: each C kernel call
        (a :mod:`ctypes` function with ``argtypes``) becomes a second function object at the same address
        without ``argtypes``, and its arguments ``argtype(value)`` instances made once here, so a call no longer
        converts every Python int through ``argtypes`` (15 arguments: ~4 us per call where the prepared form
        takes ~1.5 us, AVX2 EPYC; a B=1 step makes ~300 such calls). The C function, the values and their C
        types are the same, so are the results. Other callables (torch methods, closures) are kept as they are;
        ``fn`` is the original callable (:meth:`call_kind`)."""
        out = []
        for fn, args in calls:
            argtypes = getattr(fn, "argtypes", None)
            if isinstance(fn, ctypes._CFuncPtr) and argtypes is not None and len(argtypes) == len(args):
                raw = type(fn)(ctypes.cast(fn, ctypes.c_void_p).value)
                raw.restype = fn.restype
                out.append((raw, tuple(None if v is None else t(v) for t, v in zip(argtypes, args)), fn))
            else:
                out.append((fn, args, fn))
        return out

    def call_kind(self, fn) -> str:
        """The part of a step a prepared call belongs to: ``linear`` (weight GEMMs: low-bit kernels, oneDNN,
        a LoRA layer's base call and delta), ``attention`` (K/V write, the query copy, paged decode
        attention or the rows kernel) or ``elementwise`` (add+RMSNorm, RoPE, SiLU-and-multiply)."""
        if fn in (self._gemm, self._gemm_i8, self._gemm_i8_h) or getattr(fn, "__name__", "") in ("dense", "dense_plain", "with_lora"):
            return "linear"
        if fn in (self._kv_write, self._decode, self._rows) or getattr(fn, "__name__", "") == "copy_":
            return "attention"
        if fn in (self._norm, self._rope, self._silu):
            return "elementwise"
        raise ValueError(f"unknown step-graph call {fn!r}")

    def _run_profiled(self, calls: list) -> None:
        """The calls of :meth:`run`, each timed into :attr:`profile` under :meth:`call_kind`."""
        prof, clock = self.profile, time.perf_counter
        kinds = [self.call_kind(orig) for _, _, orig in calls]
        for (fn, args, _), kind in zip(calls, kinds):
            t0 = clock()
            fn(*args)
            prof[kind] = prof.get(kind, 0.0) + clock() - t0

    # -- running ------------------------------------------------------------
    def accepts(self, num_tokens: int, max_query_len: int, padded_tokens: int,
                query_lens: Sequence[int] | None = None, seq_lens: Sequence[int] | None = None) -> bool:
        """True for an unpadded step of at most ``max_tokens`` tokens whose every token is a decode row of the
        eager attention.

        That is a decode-only step (``max_query_len == 1``), or, given the step's ``query_lens`` and
        ``seq_lens`` (context after the step, per request), one where every request has one token or at most
        :data:`~tokenmill.model.layers.attention.SHORT_QUERY_AS_DECODE` tokens after cached context
        (``seq_len > query_len``): a speculative-decoding verify step, the eager path's rule for serving a
        short query with the decode kernel (``TorchAttentionBackend._plan``), so the bits are the eager
        step's.
        """
        if num_tokens > self.max_tokens or padded_tokens != num_tokens:
            return False
        if max_query_len == 1:
            return True
        if query_lens is None or seq_lens is None or max_query_len > SHORT_QUERY_AS_DECODE:
            return False
        return all(ql == 1 or sl > ql for ql, sl in zip(query_lens, seq_lens, strict=True))

    def _row_starts(self, query_lens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A multi-token-query step's per-request first rows and token counts, for the rows kernel.

        Request ``r`` owns rows ``q_start[r] : q_start[r] + q_len[r]`` of the step; its token ``j`` sees
        ``seq_len - q_len + j + 1`` positions through the request's block table (the causal mask), as
        ``TorchAttentionBackend._plan`` serves a short query.

        Returns:
            ``([R]`` int32, ``[R]`` int32) views of persistent buffers (same storage every call until a
            step with more requests grows them), which the prepared calls of the step read.
        """
        n = len(query_lens)
        if self._q_start is None or self._q_start.shape[0] < n:
            size = max(n, self.max_tokens)
            self._q_start = torch.zeros(size, dtype=torch.int32)
            self._q_len = torch.zeros(size, dtype=torch.int32)
        qls = np.fromiter(query_lens, dtype=np.int64, count=n)
        self._q_len.numpy()[:n] = qls
        self._q_start.numpy()[:n] = np.cumsum(qls) - qls
        return self._q_start[:n], self._q_len[:n]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor,
            query_lens: Sequence[int] | None = None) -> torch.Tensor:
        """One step over ``m = len(input_ids)`` tokens: a decode step of ``m`` requests, or (``query_lens``)
        a step that :meth:`accepts` with several tokens for some requests (a verify step).

        Args:
            input_ids, positions: ``[m]`` int64.
            slot_mapping: ``[m]`` int64 contiguous (the K/V slot of each token).
            block_tables: ``[R, max_blocks]`` int32, last dimension contiguous (``R`` requests; ``R == m``
                for a decode step).
            seq_lens: ``[R]`` int32 contiguous (context after this step).
            query_lens: ``R`` new-token counts (sum ``m``); None: one each.

        The tensors' storage may change between calls (the runner grows its
        buffers); the prepared calls are keyed by their addresses.

        Returns:
            ``[m, hidden_size]`` final-norm hidden states (a view of a buffer the next call overwrites).
        """
        m = input_ids.shape[0]
        rows = None
        if query_lens is not None and len(query_lens) != m:     # several tokens for some request: rows kernel
            q_start, q_len = self._row_starts(query_lens)
            rows = (q_start, q_len, len(query_lens))
        threads = torch.get_num_threads()
        key = (m, slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
               threads)
        if rows is not None:
            key += ("rows", rows[0].data_ptr(), rows[1].data_ptr(), rows[2])
        lora = self._lora_mod
        if lora is not None:    # adapter rows or not, the delta's form, the address of the step's segment index
            b = lora.batch
            self._lora_on = b.active
            key += (b.active, b.mode, b.meta.data_ptr()) if b.active else (False,)
        calls = self._calls.get(key)
        if calls is None:
            self._threads = threads
            self._ensure_capacity(m)
            if len(self._calls) >= 4 * self.max_tokens + 64:
                self._calls.clear()
                self._plans.clear()
                self._biases.clear()
            built = self._build(m, slot_mapping, block_tables, seq_lens, threads, rows)
            calls = self._calls[key] = self._fast_calls(built)
            if self._exec is not None:
                self._plans[key] = executor_plan(self._exec, built)
        t0 = time.perf_counter() if self.profile is not None else 0.0
        torch.index_select(self.model.model.embed_tokens.weight, 0, input_ids, out=self.res[:m])
        cos, sin = self.model.rotary_emb.cos_sin(positions, self.dtype)
        self.cos[:m].copy_(cos.view(m, -1))
        self.sin[:m].copy_(sin.view(m, -1))
        plan = self._plans.get(key) if self._exec is not None else None
        if self.profile is None and plan is not None:
            for fn, args in plan:
                fn(*args)
        elif self.profile is None:
            for fn, args, _ in calls:
                fn(*args)
        else:
            self.profile["embedding"] = self.profile.get("embedding", 0.0) + time.perf_counter() - t0
            self._run_profiled(calls)
        return self.final[:m]
