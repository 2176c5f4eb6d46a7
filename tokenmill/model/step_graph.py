"""A small decode step of a Llama-family model as one prepared list of C kernel calls (CPU).

Why: at concurrency 1 a decode step's kernels are short (SmolLM2-135M, one
token, bfloat16 on the 2-core AVX-512 EPYC: the 121 low-bit GEMVs, 30 paged
attentions and the fused element-wise ops sum to ~5.6 ms), and the eager
forward spends ~3 ms more in per-layer Python and dispatch around them:
``nn.Module`` calls, eligibility checks, ``torch.empty`` for every output,
``data_ptr()``/``stride()`` reads and the ctypes argument conversion of each
call (measured with ``benchmarks/step_overhead.py``). llama.cpp runs the whole
step in C++.

What: for steps whose every request decodes one token and whose token count
``M`` is at most the low-bit limit (``TOKENMILL_CPU_INT4_MAX_TOKENS``), this
module builds, once per ``M``, the exact sequence of C calls the eager forward
makes — per layer: fused add+RMSNorm, low-bit q/k/v GEMM, in-place RoPE on q
and k, K/V write into the paged cache, paged decode attention, low-bit o_proj,
add+RMSNorm, low-bit gate/up, SiLU-and-multiply, low-bit down projection —
with every argument (weight codes, persistent activation buffers, the
runner's persistent slot-mapping / block-table / sequence-length buffers, the
KV pool) resolved to a plain integer ahead of time. A step then is one
embedding lookup, one cos/sin computation, and a Python loop of
``fn(*args)`` calls: ~10 ctypes calls per layer and nothing else.

Same results: the calls, their arguments and their order are the eager
path's (:meth:`LlamaForCausalLM.forward` with :class:`PackedLinear`'s low-bit
path, :mod:`~tokenmill.model.layers.fused_cpu` and the decode kernel of
:mod:`~tokenmill.model.layers.paged_attention_cpu`), so outputs are bit-equal
(``tests/model/test_step_graph.py``); only where the buffers live differs.
The residual stream is updated in place (the fused add+norm reads each
element before writing it at the same index).

Where it does not apply the runner keeps the eager forward: prefill or
mixed steps, steps above the low-bit limit, quantised KV caches (a float32
model's bfloat16 cache is served), Qwen3's q/k norm, mixture-of-experts and pipeline-parallel models, speculative decoding,
CUDA (device is a parameter of the runner; nothing here runs off the CPU).
``TOKENMILL_CPU_STEP_GRAPH=0`` turns it off (the ablation switch).

Not thread-safe: one runner calls it from one thread. The hidden states it
returns live in a buffer the next call overwrites.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

ENV_SWITCH = "TOKENMILL_CPU_STEP_GRAPH"

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


def step_graph_enabled() -> bool:
    """False when ``TOKENMILL_CPU_STEP_GRAPH=0``."""
    return os.environ.get(ENV_SWITCH, "1") != "0"


def unsupported_reason(model: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                       kv_cache_dtype: torch.dtype, max_tokens: int, spec_decode: bool = False) -> str | None:
    """Why :class:`CpuStepGraph` cannot serve ``model``; None when it can.

    Args:
        model: the loaded model (after the runner packed its linears and attached low-bit weights).
        device, dtype: where and in what dtype it runs.
        kv_cache_dtype: the KV pool's element type.
        max_tokens: the runner's low-bit step limit (0: off).
        spec_decode: speculative decoding is configured.
    """
    from tokenmill.model.layers import fused_cpu, paged_attention_cpu
    from tokenmill.model.layers.attention import TorchAttentionBackend
    from tokenmill.model.layers.linear import PackedLinear
    from tokenmill.model.layers.mlp import SwiGLUMLP
    from tokenmill.model.llama import LlamaDecoderLayer, LlamaForCausalLM
    from tokenmill.quantization import lowbit

    if not step_graph_enabled():
        return f"{ENV_SWITCH}=0"
    if device.type != "cpu":
        return f"device {device.type}"
    if dtype not in _SUFFIX:
        return f"dtype {dtype}"
    if kv_cache_dtype != dtype and (dtype, kv_cache_dtype) != (torch.float32, torch.bfloat16):
        return f"KV cache dtype {kv_cache_dtype} (quantised caches keep the eager path)"
    if not max_tokens:
        return "low-bit small-step weights are off"
    if spec_decode:
        return "speculative decoding"
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
            # exactly PackedLinear: a subclass (or a tensor-parallel wrapper) may do more than the GEMM
            if type(lin) is not PackedLinear or lin.lowbit is None or lin.lowbit_max_rows < max_tokens:
                return "a linear layer without low-bit codes (or a tensor-parallel one)"
    return None


class CpuStepGraph:
    """Runs a decode-only step of at most ``max_tokens`` tokens as a prepared list of C calls.

    Args:
        model: a :class:`~tokenmill.model.llama.LlamaForCausalLM` that
            :func:`unsupported_reason` accepts.
        kv_caches: the runner's per-layer pools ``[2, num_blocks, block_size, KVH, D]``.
        max_tokens: largest step served (the low-bit limit).

    Raises:
        ValueError: the model is not supported (see :func:`unsupported_reason`).
    """

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_tokens: int) -> None:
        from tokenmill.model.layers import fused_cpu, paged_attention_cpu
        from tokenmill.quantization import lowbit

        dtype = model.model.norm.weight.dtype
        reason = unsupported_reason(model, torch.device("cpu"), dtype, kv_caches[0].dtype, max_tokens)
        if reason is not None:
            raise ValueError(f"step graph unsupported: {reason}")
        self.model, self.kv_caches, self.max_tokens, self.dtype = model, kv_caches, max_tokens, dtype
        sfx = _SUFFIX[dtype]
        fl, pl, ll = fused_cpu.load(), paged_attention_cpu.load(model.attn_backend.cpu_isa), lowbit._default_kernel()
        self._norm, self._rope, self._silu = (getattr(fl, f"{n}_{sfx}") for n in ("rms_norm", "rope", "silu_mul"))
        ksfx = _SUFFIX[kv_caches[0].dtype]   # a float32 model may keep a bfloat16 cache
        self._kv_write = getattr(pl, f"kv_write_{sfx}_{ksfx}")
        self._decode = getattr(pl, f"paged_decode_{sfx}_{ksfx}")
        self._gemm = ll.tm_lowbit_gemm
        cfg = model.config
        self.hidden, self.inter = cfg.hidden_size, cfg.intermediate_size
        a = model.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = a.num_heads, a.num_kv_heads, a.head_dim
        self.q_size, self.kv_size = a.q_size, a.kv_size
        self.qkv_width = a.q_size + 2 * a.kv_size
        self.rotary_dim = model.rotary_emb.rotary_dim
        m = max_tokens
        z = lambda *shape: torch.zeros(shape, dtype=dtype)
        # persistent activations: residual stream, normed input, q/k/v, contiguous q, attention out,
        # o_proj out, gate/up, SiLU product, MLP out, final norm, cos/sin
        self.res, self.hn, self.qkv = z(m, self.hidden), z(m, self.hidden), z(m, self.qkv_width)
        self.q, self.attn, self.o = z(m, self.q_size), z(m, self.q_size), z(m, self.hidden)
        self.gu, self.act, self.mlp = z(m, 2 * self.inter), z(m, self.inter), z(m, self.hidden)
        self.final = z(m, self.hidden)
        self.cos, self.sin = z(m, self.rotary_dim), z(m, self.rotary_dim)
        # float32 copies of the biases, as lowbit_linear makes them per call
        self._biases: list[torch.Tensor] = []
        self._calls: dict[tuple, list] = {}
        logger.info("CPU step graph: decode steps of <= %d tokens run as %d prepared C calls per step (%s)",
                    max_tokens, 10 * len(model.model.layers) + 1, dtype)

    # -- building -----------------------------------------------------------
    def _gemm_args(self, lin, x: torch.Tensor, y: torch.Tensor, m: int) -> tuple:
        w = lin.lowbit
        b = None
        if lin.bias is not None:
            bias = lin.bias if lin.bias.dtype == torch.float32 and lin.bias.is_contiguous() else \
                lin.bias.float().contiguous()
            self._biases.append(bias)
            b = bias.data_ptr()
        bf = int(self.dtype == torch.bfloat16)
        return (self._gemm, (x.data_ptr(), bf, x.stride(0), m, w.in_features, w.out_features, w.bits,
                             w.codes.data_ptr(), w.group, w.scale.data_ptr(),
                             None if w.min is None else w.min.data_ptr(), b, y.data_ptr(), bf, w.out_features))

    def _build(self, m: int, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               threads: int) -> list:
        """The calls of an ``m``-token step, in the eager forward's order, with every argument resolved."""
        calls: list = []
        nt = threads
        h, inter = self.hidden, self.inter
        nh, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        p = lambda t: t.data_ptr()
        res, hn, qkv, q, attn, o = self.res, self.hn, self.qkv, self.q, self.attn, self.o
        gu, act, mlp = self.gu, self.act, self.mlp
        qkv_row = qkv.stride(0)
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
            if m > 1:    # the kernel wants contiguous [B, H, D] queries; one row is a contiguous slice already
                calls.append(("copy_q", None))
            bs = kv.shape[2]
            calls.append((self._decode, (p(qkv) if m == 1 else p(q), kv[0].data_ptr(), kv[1].data_ptr(), p(attn),
                                         p(block_tables), block_tables.stride(0), p(seq_lens), m, nh, kvh, d, bs,
                                         float(a.scale), 1.0, 1.0, nt)))
            calls.append(self._gemm_args(a.o_proj, attn, o, m))
            n2 = layer.post_attention_layernorm
            calls.append((self._norm, (p(o), p(res), p(res), p(n2.weight), p(hn), m, h, float(n2.eps), nt)))
            calls.append(self._gemm_args(layer.mlp.gate_up_proj, hn, gu, m))
            calls.append((self._silu, (p(gu), p(act), m, inter, nt)))
            calls.append(self._gemm_args(layer.mlp.down_proj, act, mlp, m))
        fn = self.model.model.norm
        calls.append((self._norm, (p(mlp), p(res), p(res), p(fn.weight), p(self.final), m, h, float(fn.eps), nt)))
        return calls

    # -- running ------------------------------------------------------------
    def accepts(self, num_tokens: int, max_query_len: int, padded_tokens: int) -> bool:
        """True for a decode-only step (every request one token) of at most ``max_tokens`` tokens, unpadded."""
        return max_query_len == 1 and num_tokens <= self.max_tokens and padded_tokens == num_tokens

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """One decode step over ``m = len(input_ids)`` requests.

        Args:
            input_ids, positions: ``[m]`` int64.
            slot_mapping: ``[m]`` int64 contiguous (the K/V slot of each token).
            block_tables: ``[m, max_blocks]`` int32, last dimension contiguous.
            seq_lens: ``[m]`` int32 contiguous (context after this step).

        The tensors' storage may change between calls (the runner grows its
        buffers); the prepared calls are keyed by their addresses.

        Returns:
            ``[m, hidden_size]`` final-norm hidden states (a view of a buffer the next call overwrites).
        """
        m = input_ids.shape[0]
        threads = torch.get_num_threads()
        key = (m, slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
               threads)
        calls = self._calls.get(key)
        if calls is None:
            if len(self._calls) > 64:
                self._calls.clear()
            calls = self._calls[key] = self._build(m, slot_mapping, block_tables, seq_lens, threads)
        torch.index_select(self.model.model.embed_tokens.weight, 0, input_ids, out=self.res[:m])
        cos, sin = self.model.rotary_emb.cos_sin(positions, self.dtype)
        self.cos[:m].copy_(cos.view(m, -1))
        self.sin[:m].copy_(sin.view(m, -1))
        q_src, q_dst = self.qkv[:m, :self.q_size], self.q[:m]
        for fn, args in calls:
            if args is None:
                q_dst.copy_(q_src)
            else:
                fn(*args)
        return self.final[:m]
