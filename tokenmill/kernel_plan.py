"""The CPU kernel choices, resolved once: switches (from the config) x machine facts -> one :class:`KernelPlan`.

Three torch-free pieces, shared by the engine and the planner (``tokenmill plan``), so the rules live here
once and neither re-derives them:

* :class:`CpuKernelSwitches`: the ``TOKENMILL_CPU_*`` switches that change the computed result or the
  processed weights, read from the environment once, where the config is built
  (``EngineConfig.cpu_kernels``: the CLI, :class:`tokenmill.LLM`) and carried by the config into the
  engine core, its workers and the weight cache's key from there on.
* :class:`CpuFacts`: what the machine offers (best C-kernel variant, native bfloat16, oneDNN, whether the
  low-bit kernel loads). The engine probes them with torch (:func:`tokenmill.model.cpu_facts.probe`); the
  planner reads ``/proc/cpuinfo`` (:meth:`CpuFacts.from_cpu_flags`).
* :func:`resolve_kernel_plan`: the rules (dtype ``auto``, oneDNN-packed linears, the low-bit step limit, the
  integer path, the ``--kv-cache-dtype auto`` rule, the step graph, batch invariance) -> a frozen
  :class:`KernelPlan`, which the model runner logs at start-up and runs by.
"""

from __future__ import annotations

import dataclasses
import platform
from dataclasses import dataclass, field
from typing import Any

from tokenmill import envs

#: C-kernel instruction-set variants, best first (tokenmill/model/layers/cpu_build.py builds them).
ISAS = ("avx512", "avx2", "scalar")
# The CPU flags (as /proc/cpuinfo names them) each x86-64 micro-architecture level needs.
X86_V3 = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe")
X86_V4 = X86_V3 + ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")

#: Per kernel ISA variant, what ``TOKENMILL_CPU_INT8_ACT_MAX_TOKENS=auto`` means: where the integer low-bit
#: path beats the dense oneDNN GEMM at 16-512 rows (``benchmarks/lowbit_gemm.py --int8-act``).
INT8_ACT_AUTO = {"avx2": 1 << 30, "avx512": 0, "scalar": 0}

_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float": "float32", "bfloat16": "bfloat16",
                "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16"}


def _env(name: str) -> Any:
    return field(default=envs.var(name).default, metadata={"env": name})


@dataclass(frozen=True)
class CpuKernelSwitches:
    """The CPU kernel switches that change results or weights, as values (one field per ``TOKENMILL_*`` name).

    Built with :meth:`from_env` where the config is built; the defaults are the declared ones
    (tokenmill/envs.py, where each is documented). ``metadata["env"]`` names each field's variable.
    """

    isa: str = _env("TOKENMILL_CPU_ISA")
    native_bf16: bool = _env("TOKENMILL_CPU_BF16")
    lowbit_kernel: bool = _env("TOKENMILL_CPU_LOWBIT_KERNEL")
    packed_linear: bool = _env("TOKENMILL_CPU_PACKED_LINEAR")
    int4_max_tokens: int = _env("TOKENMILL_CPU_INT4_MAX_TOKENS")
    int8_act_max_tokens: str | int = _env("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS")
    kv_bf16: bool = _env("TOKENMILL_CPU_KV_BF16")
    step_graph: bool = _env("TOKENMILL_CPU_STEP_GRAPH")
    step_graph_max_tokens: int | None = _env("TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS")
    attention_kernel: bool = _env("TOKENMILL_CPU_ATTENTION_KERNEL")
    fused_ops: bool = _env("TOKENMILL_CPU_FUSED_OPS")
    lowbit_bf16_dot: bool = _env("TOKENMILL_CPU_LOWBIT_BF16_DOT")
    invariant_kernel: str = _env("TOKENMILL_CPU_INVARIANT_KERNEL")
    lora_kernel: bool = _env("TOKENMILL_CPU_LORA_KERNEL")
    int4_group_size: int = _env("TOKENMILL_INT4_GROUP_SIZE")

    def __post_init__(self) -> None:
        if self.isa and self.isa not in ISAS:
            raise ValueError(f"TOKENMILL_CPU_ISA={self.isa!r}: expected one of {', '.join(ISAS)}")
        if self.int4_max_tokens < 0:
            raise ValueError(f"TOKENMILL_CPU_INT4_MAX_TOKENS must be >= 0, got {self.int4_max_tokens}")
        if self.int8_act_max_tokens != "auto" and not (isinstance(self.int8_act_max_tokens, int)
                                                       and self.int8_act_max_tokens >= 0):
            raise ValueError("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS must be 'auto' or >= 0, got "
                             f"{self.int8_act_max_tokens!r}")
        if self.invariant_kernel not in ("int8", "float32"):
            raise ValueError(f"TOKENMILL_CPU_INVARIANT_KERNEL must be int8 or float32, got {self.invariant_kernel!r}")
        if self.step_graph_max_tokens is not None and self.step_graph_max_tokens <= 0:
            raise ValueError(f"TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS must be > 0, got {self.step_graph_max_tokens}")
        if not 32 <= self.int4_group_size <= 128 or self.int4_group_size % 4:
            raise ValueError("TOKENMILL_INT4_GROUP_SIZE must be a multiple of 4 from 32 to 128, got "
                             f"{self.int4_group_size}")

    @classmethod
    def from_env(cls) -> "CpuKernelSwitches":
        """The switches as this process's environment sets them (the one place they are read).

        Raises:
            ValueError: a variable holds an invalid value (the message names it).
        """
        return cls(**{f.name: envs.get(f.metadata["env"]) for f in dataclasses.fields(cls)})

    def library_switches(self) -> dict[str, bool]:
        """The switches that turn a C kernel library (or one of its paths) on or off, variable name -> on:
        what :func:`tokenmill.model.layers.cpu_build.configure` applies to this process's libraries."""
        return {"TOKENMILL_CPU_ATTENTION_KERNEL": self.attention_kernel, "TOKENMILL_CPU_FUSED_OPS": self.fused_ops,
                "TOKENMILL_CPU_LOWBIT_KERNEL": self.lowbit_kernel,
                "TOKENMILL_CPU_LOWBIT_BF16_DOT": self.lowbit_bf16_dot, "TOKENMILL_CPU_LORA_KERNEL": self.lora_kernel}

    def weight_key(self) -> dict[str, Any]:
        """The switches that change the processed weights (``in_weight_key`` in tokenmill/envs.py),
        variable name -> value: part of the weight cache's key."""
        return {f.metadata["env"]: getattr(self, f.name) for f in dataclasses.fields(self)
                if envs.var(f.metadata["env"]).in_weight_key}


@dataclass(frozen=True)
class CpuFacts:
    """What this machine offers the CPU kernels.

    Attributes:
        supported_isas: the C-kernel variants this CPU runs, best first (``scalar`` always).
        native_bf16: bfloat16 arithmetic in hardware (AVX512-BF16 or AMX) that oneDNN uses.
        onednn: torch has oneDNN (prepacked linears).
        onednn_bf16: oneDNN runs bfloat16 linears on this CPU.
        lowbit_kernel: the low-bit GEMM C kernel builds and loads (a C compiler is there).
    """

    supported_isas: tuple[str, ...] = ("scalar",)
    native_bf16: bool = False
    onednn: bool = True
    onednn_bf16: bool = True
    lowbit_kernel: bool = True

    @classmethod
    def from_cpu_flags(cls, flags: frozenset[str] | set[str], machine: str | None = None) -> "CpuFacts":
        """Facts from ``/proc/cpuinfo``'s flags alone (the planner: no torch); oneDNN and a C compiler
        are assumed present (the engine's default install).

        ``onednn_bf16`` follows torch's own test for oneDNN bfloat16 linears (``mkldnn_bf16_device_check``:
        AVX512 BW + VL + DQ on x86, the ``bf16`` feature on AArch64), so an AVX2-only CPU plans the plain
        bfloat16 linears the engine runs there, not oneDNN's packed ones."""
        arch = (machine or platform.machine()).lower()
        x86 = arch in ("x86_64", "amd64")
        isas = tuple(i for i in ISAS if i == "scalar" or (x86 and isa_supported(i, flags)))
        if x86:
            onednn_bf16 = all(f in flags for f in ("avx512bw", "avx512vl", "avx512dq"))
        else:
            onednn_bf16 = arch in ("aarch64", "arm64") and "bf16" in flags
        return cls(supported_isas=isas, native_bf16="avx512_bf16" in flags or "amx_bf16" in flags,
                   onednn_bf16=onednn_bf16)


def isa_supported(isa: str, flags: frozenset[str] | set[str]) -> bool:
    """Whether a CPU with these ``/proc/cpuinfo`` flags runs the ``isa`` variant (x86-64 assumed)."""
    if isa == "scalar":
        return True
    return all(f in flags for f in {"avx512": X86_V4, "avx2": X86_V3}[isa])


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``flags`` or ``Features``; empty when unreadable)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose_isa(switches: CpuKernelSwitches, facts: CpuFacts) -> str:
    """The C-kernel variant: ``switches.isa`` when set (it must run here), else the best supported.

    Raises:
        ValueError: the forced variant needs instructions this CPU lacks.
    """
    if switches.isa:
        if switches.isa not in facts.supported_isas:
            raise ValueError(f"TOKENMILL_CPU_ISA={switches.isa}: this CPU lacks the instructions it needs")
        return switches.isa
    return facts.supported_isas[0]


def dtype_name(dtype: str) -> str:
    """Canonical name of a ``--dtype`` value other than ``auto`` (``fp32`` -> ``float32``, ...).

    Raises:
        ValueError: an unknown name.
    """
    d = str(dtype).lower().removeprefix("torch.")
    if d not in _DTYPE_NAMES:
        raise ValueError(f"unsupported model dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPE_NAMES[d]


def resolve_dtype_name(dtype: str, device_type: str, switches: CpuKernelSwitches, facts: CpuFacts) -> str:
    """``--dtype`` -> the model dtype's name. ``auto``: bfloat16 off the CPU and on CPUs with native
    bfloat16 (unless ``TOKENMILL_CPU_BF16=0``), float32 on other CPUs (emulated bfloat16 GEMMs are slower),
    as vLLM's CPU backend defaults to bfloat16.

    Raises:
        ValueError: an unknown name.
    """
    if str(dtype).lower() != "auto":
        return dtype_name(dtype)
    if device_type != "cpu":
        return "bfloat16"
    return "bfloat16" if switches.native_bf16 and facts.native_bf16 else "float32"


def packed_linear_on(device_type: str, dtype: str, switches: CpuKernelSwitches, facts: CpuFacts) -> bool:
    """oneDNN-prepacked linears: CPU, oneDNN, float32 (or bfloat16 where oneDNN runs it), switch on."""
    if not switches.packed_linear or device_type != "cpu" or not facts.onednn:
        return False
    return dtype == "float32" or (dtype == "bfloat16" and facts.onednn_bf16)


def plain_bf16_linear(device_type: str, dtype: str, switches: CpuKernelSwitches, facts: CpuFacts) -> bool:
    """A bfloat16 model's linears that oneDNN cannot pack (no oneDNN bfloat16 on this CPU, e.g. AVX2) still
    get the :class:`~tokenmill.model.layers.linear.PackedLinear` wrapper, holding their plain weights (its
    dense path is ``F.linear``): the low-bit codes need the wrapper, not oneDNN, and their kernels widen
    bfloat16 rows themselves on every variant. Without it such a model ran every linear as an emulated
    bfloat16 GEMM (AVX2, 2 cores: ~0.5-1 GFLOP/s, a decode step of SmolLM2-135M 1.4-3.4 s)."""
    return (switches.packed_linear and device_type == "cpu" and dtype == "bfloat16"
            and not packed_linear_on(device_type, dtype, switches, facts))


def lowbit_limit(device_type: str, dtype: str, switches: CpuKernelSwitches, facts: CpuFacts) -> int:
    """Largest step (tokens) whose linears may run a checkpoint's low-bit codes here; 0: that path is off.

    ``TOKENMILL_CPU_INT4_MAX_TOKENS`` (default 8), when the low-bit kernel is on and the linears are wrapped:
    packed linears, or a bfloat16 model's plain ones where oneDNN has no bfloat16 (:func:`plain_bf16_linear`).
    """
    if not switches.int4_max_tokens or not switches.lowbit_kernel or not facts.lowbit_kernel:
        return 0
    wrapped = packed_linear_on(device_type, dtype, switches, facts) or \
        plain_bf16_linear(device_type, dtype, switches, facts)
    return switches.int4_max_tokens if wrapped else 0


def int8_act_limit(lowbit_max_tokens: int, isa: str | None, switches: CpuKernelSwitches) -> int:
    """Largest step (tokens) on the integer low-bit path (int8 activations x the codes); 0: off.

    ``auto``: :data:`INT8_ACT_AUTO` for the variant (on for AVX2, where float32 is the dtype and the integer
    path is 1.4-1.8x oneDNN's float32 GEMM); needs the low-bit path.
    """
    if not lowbit_max_tokens:
        return 0
    if switches.int8_act_max_tokens == "auto":
        return INT8_ACT_AUTO.get(isa or "", 0)
    return int(switches.int8_act_max_tokens)


def kv_cache_dtype_name(kv_cache_dtype: str, dtype: str, device_type: str, lowbit: bool,
                        switches: CpuKernelSwitches) -> str:
    """``--kv-cache-dtype`` -> the cache dtype's name. ``auto`` is the model dtype, except bfloat16 for a
    float32 model on the CPU whose small steps run the low-bit codes (``lowbit``), unless
    ``TOKENMILL_CPU_KV_BF16=0`` (a deviation from vLLM; why: tokenmill.model.layers.kv_quant.auto_kv_bf16)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if dtype == "float32" and device_type == "cpu" and lowbit and switches.kv_bf16:
        return "bfloat16"
    return dtype


@dataclass(frozen=True)
class KernelPlan:
    """How the model's steps run, decided once per engine (and by ``tokenmill plan``).

    Attributes:
        device_type: ``cpu``, ``cuda``, ...
        isa: the C kernels' variant (None off the CPU).
        dtype: the model (activation) dtype's name.
        packed_linear: linears use oneDNN-prepacked weights.
        lowbit_max_tokens: steps of at most this many tokens run the checkpoint's low-bit codes (0: off).
        int8_act_max_tokens: larger steps up to this many run the integer low-bit path (0: off).
        kv_cache_dtype: the KV cache element type's name.
        step_graph: ``TOKENMILL_CPU_STEP_GRAPH`` leaves the CPU step graph on (the model, device or a compiled
            step may still rule it out: tokenmill.model.step_graph.unsupported_reason).
        step_graph_max_tokens: the largest decode or verify step (tokens) it serves.
        batch_invariant: one kernel per linear and attention row at every step size.
    """

    device_type: str
    isa: str | None
    dtype: str
    packed_linear: bool
    lowbit_max_tokens: int
    int8_act_max_tokens: int
    kv_cache_dtype: str
    step_graph: bool
    step_graph_max_tokens: int
    batch_invariant: bool

    def describe(self) -> str:
        """One line for the start-up log."""
        low = (f"low-bit codes for steps <= {self.lowbit_max_tokens} tokens" if self.lowbit_max_tokens
               else "low-bit codes off")
        if self.int8_act_max_tokens:
            low += f", integer path up to {min(self.int8_act_max_tokens, 1 << 20)}"
        graph = f"step graph <= {self.step_graph_max_tokens} tokens" if self.step_graph else "step graph off"
        return (f"kernel plan: {self.device_type}" + (f" ISA {self.isa}" if self.isa else "")
                + f", dtype {self.dtype}, {'oneDNN-packed' if self.packed_linear else 'plain'} linears, {low}, "
                  f"KV cache {self.kv_cache_dtype}, {graph}, batch-invariant {'on' if self.batch_invariant else 'off'}")


def resolve_kernel_plan(switches: CpuKernelSwitches, facts: CpuFacts, *, device_type: str, dtype: str,
                        kv_cache_dtype: str = "auto", quantization: str | None = None, enforce_eager: bool = True,
                        tensor_parallel_size: int = 1, checkpoint_lowbit: bool = True, max_num_seqs: int = 128,
                        batch_invariant: bool = False, max_draft_tokens: int = 0) -> KernelPlan:
    """The plan for one engine.

    Args:
        switches, facts: as above.
        device_type: where the model runs.
        dtype: ``--dtype`` (``auto`` or a name).
        kv_cache_dtype: ``--kv-cache-dtype``.
        quantization: ``--quantization`` (the low-bit path runs a checkpoint's own codes only without it).
        enforce_eager: the compiled step runs no low-bit codes.
        tensor_parallel_size: tensor-parallel ranks (their shards split rows and reductions and load dense
            weights: no low-bit codes above 1). Pipeline stages hold whole layers and keep the codes
            (:func:`tokenmill.distributed.model_loader.shard_lowbit_weights`), so a pipeline runs one
            process's kernels.
        checkpoint_lowbit: the checkpoint has codes the low-bit kernel runs (a GGUF of supported formats).
        max_num_seqs: with ``max_draft_tokens``, the step graph's default limit.
        batch_invariant: ``--batch-invariant``.
        max_draft_tokens: the most draft tokens a request verifies per step (speculative decoding's
            ``num_speculative_tokens``, structured outputs' ``num_forced_draft_tokens``; 0: none): the step
            graph's default limit is ``max_num_seqs * (1 + max_draft_tokens)`` tokens, so verify steps fit.

    Raises:
        ValueError: a forced ISA this CPU cannot run, or an unknown dtype.
    """
    isa = choose_isa(switches, facts) if device_type == "cpu" else None
    name = resolve_dtype_name(dtype, device_type, switches, facts)
    low = 0
    if enforce_eager and quantization is None and tensor_parallel_size == 1 and checkpoint_lowbit:
        low = lowbit_limit(device_type, name, switches, facts)
    return KernelPlan(device_type=device_type, isa=isa, dtype=name,
                      packed_linear=packed_linear_on(device_type, name, switches, facts),
                      lowbit_max_tokens=low, int8_act_max_tokens=int8_act_limit(low, isa, switches),
                      kv_cache_dtype=kv_cache_dtype_name(kv_cache_dtype, name, device_type, bool(low), switches),
                      step_graph=switches.step_graph,
                      step_graph_max_tokens=switches.step_graph_max_tokens or max_num_seqs * (1 + max_draft_tokens),
                      batch_invariant=batch_invariant)


def plan_for_config(config: Any, facts: CpuFacts, device_type: str, checkpoint_lowbit: bool = True) -> KernelPlan:
    """:func:`resolve_kernel_plan` for an :class:`tokenmill.config.EngineConfig`."""
    m = config.model
    drafts = max(config.speculative.num_speculative_tokens if config.speculative is not None else 0,
                 m.structured_outputs.num_forced_draft_tokens)
    return resolve_kernel_plan(config.cpu_kernels, facts, device_type=device_type, dtype=m.dtype,
                               kv_cache_dtype=config.cache.kv_cache_dtype, quantization=m.quantization,
                               enforce_eager=m.enforce_eager,
                               tensor_parallel_size=config.parallel.tensor_parallel_size,
                               checkpoint_lowbit=checkpoint_lowbit, max_num_seqs=config.scheduler.max_num_seqs,
                               batch_invariant=bool(m.batch_invariant), max_draft_tokens=drafts)
