"""Every environment switch tokenmill reads, declared once: name, type, default, one line of doc.

Nothing else in the package reads ``os.environ`` for a ``TOKENMILL_*`` name (``tests/test_envs.py``
checks it). Values are read lazily, at attribute access, so a switch exported (or ``monkeypatch``-ed)
after import still counts, as in vLLM's ``vllm/envs.py``::

    from tokenmill import envs

    if envs.TOKENMILL_CPU_STEP_GRAPH: ...         # parsed value (here a bool)
    envs.raw("TOKENMILL_CPU_ISA")                 # the exported string, or None
    envs.setdefault("TOKENMILL_NUM_THREADS", 2)   # for child processes

Engine behaviour belongs in :mod:`tokenmill.config` (CLI flags with vLLM's names); these switches are
kernel ablations, process tuning, storage paths and debugging aids. ``docs/flags.md`` lists them
(``python -m tokenmill.flags_doc --write``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class EnvVar:
    """One declared switch.

    Attributes:
        name: the variable's name (``TOKENMILL_...``).
        type: what a value is, in words (``bool``, ``int``, ``float``, ``str``, ``path``, ...).
        default: the parsed value when the variable is unset (for ``docs/flags.md`` and :meth:`get`).
        doc: one line: what it does, accepted values.
        parse: the exported string -> the value; raises ``ValueError`` with the variable's name on bad input.
        group: heading in ``docs/flags.md``.
        in_weight_key: the processed weights depend on it, so the weight cache's key includes it (the value
            the engine config holds: tokenmill/kernel_plan.py, ``CpuKernelSwitches.weight_key``).
        parse_unset: the value when unset is ``parse("")`` (a default computed at read time, such as a
            path under the user's home), :attr:`default` being only its description.
    """

    name: str
    type: str
    default: Any
    doc: str
    parse: Callable[[str], Any]
    group: str
    in_weight_key: bool = False
    parse_unset: bool = False

    def get(self) -> Any:
        """The current value: :attr:`default` when unset, else :attr:`parse` of the exported string.

        Raises:
            ValueError: the exported string is not a valid value (message names the variable).
        """
        raw = os.environ.get(self.name)
        if raw is None:
            return self.parse("") if self.parse_unset else self.default
        return self.parse(raw)


def _on_unless_zero(raw: str) -> bool:
    return raw != "0"


def _off_unless_one(raw: str) -> bool:
    return raw == "1"


def _non_negative_int(name: str) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {raw.strip()!r}")
        return value
    return parse


def _positive_int(name: str) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw.strip())
        except ValueError:
            value = 0
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {raw.strip()!r}")
        return value
    return parse


def _positive_int_or_unset(name: str) -> Callable[[str], int | None]:
    positive = _positive_int(name)

    def parse(raw: str) -> int | None:
        return positive(raw) if raw.strip() else None
    return parse


def _int8_act(raw: str) -> str | int:
    raw = raw.strip().lower()
    if raw == "auto":
        return "auto"
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"TOKENMILL_CPU_INT8_ACT_MAX_TOKENS must be 'auto' or a non-negative integer, got {raw!r}")
    return value


def _invariant_kernel(raw: str) -> str:
    value = raw.strip().lower()
    if value not in ("int8", "float32"):
        raise ValueError(f"TOKENMILL_CPU_INVARIANT_KERNEL must be int8 or float32, got {raw!r}")
    return value


def _int4_group(raw: str) -> int:
    raw = raw.strip()
    if not raw:
        return 32
    try:
        g = int(raw)
    except ValueError:
        g = -1
    if not 32 <= g <= 128 or g % 4:
        raise ValueError(f"TOKENMILL_INT4_GROUP_SIZE must be a multiple of 4 from 32 to 128, got {raw!r}")
    return g


def _frames(raw: str) -> int:
    try:
        return int(raw or 0)
    except ValueError:
        return 0


def _cache_dir(raw: str) -> str:
    return raw or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")


_CPU, _PROC, _STORE, _SERVE, _TEST = ("CPU kernels", "Processes and threads", "Caches on disk",
                                      "Server and debugging", "Test suite")

_DECLARED = [
    # --- CPU kernels (ablations of the compute paths; docs/guide/cpu_kernels.md) ---
    EnvVar("TOKENMILL_CPU_ISA", "str", "", "Force the C kernels' instruction-set variant: avx512, avx2 or "
           "scalar (empty: the best this CPU runs).", lambda s: s.strip().lower(), _CPU, in_weight_key=True),
    EnvVar("TOKENMILL_CPU_BF16", "bool", True, "0: treat the CPU as lacking native bfloat16, so --dtype auto "
           "means float32.", _on_unless_zero, _CPU, in_weight_key=True),
    EnvVar("TOKENMILL_CPU_ATTENTION_KERNEL", "bool", True, "0: paged attention in torch (SDPA) instead of the "
           "C decode/prefill kernels.", _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_CPU_FUSED_OPS", "bool", True, "0: add+RMSNorm, RoPE and SiLU-and-multiply as torch ops "
           "instead of the fused C kernels, and the greedy sampler's argmax as torch.argmax (same ids).",
           _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_CPU_LORA_KERNEL", "bool", True, "0: the multi-LoRA delta as batched torch ops instead of "
           "the grouped C kernel.", _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_CPU_LOWBIT_KERNEL", "bool", True, "0: no low-bit GEMM kernel (the GGUF's codes are not "
           "used; steps run dense weights).", _on_unless_zero, _CPU, in_weight_key=True),
    EnvVar("TOKENMILL_CPU_LOWBIT_BF16_DOT", "bool", True, "0: the low-bit kernel's AVX512-BF16 dot-product path "
           "stays off.", _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_CPU_LOWBIT_VNNI", "bool", True, "0: the integer low-bit path keeps AVX-512BW multiply-adds "
           "even where the CPU has AVX512-VNNI (same bits, slower; an ablation).", _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_CPU_AMX", "bool", True, "0: the integer low-bit path's many-row passes (>= 8 rows, blocks "
           "of 32) keep VNNI / AVX-512BW even where the CPU has AMX-INT8 tiles (same bits; AMX runs only after "
           "its first-use self-check matched those bits).", _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_CPU_PACKED_LINEAR", "bool", True, "0: plain torch linears instead of oneDNN-prepacked "
           "weights.", _on_unless_zero, _CPU, in_weight_key=True),
    EnvVar("TOKENMILL_CPU_PACK_BACKGROUND", "bool", True, "0: prepack the oneDNN weights before serving instead "
           "of in a background thread (eager mode).", _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_CPU_INT4_MAX_TOKENS", "int >= 0", 8, "Largest step (tokens) whose linears run the GGUF's "
           "low-bit codes; 0 turns that path off.", _non_negative_int("TOKENMILL_CPU_INT4_MAX_TOKENS"), _CPU,
           in_weight_key=True),
    EnvVar("TOKENMILL_CPU_INVARIANT_KERNEL", "int8 | float32", "int8", "The low-bit kernel every step size "
           "runs under --batch-invariant: int8 (int8 activations per 32 columns x the codes; fastest) or float32 "
           "(the float32 low-bit path; closer to the dequantised weights, slower for batches and prefill).",
           _invariant_kernel, _CPU),
    EnvVar("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", "auto | int >= 0", "auto", "Largest step (tokens) on the integer "
           "path (int8 activations x the codes); auto: on for the AVX2 variant, off for AVX-512.", _int8_act, _CPU),
    EnvVar("TOKENMILL_CPU_KV_BF16", "bool", True, "0: --kv-cache-dtype auto keeps float32 for a float32 model on "
           "the CPU low-bit path (default: bfloat16 there).", _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_CPU_STEP_GRAPH", "bool", True, "0: no CPU step graph (every decode step dispatches layer "
           "by layer in Python).", _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS", "int > 0", None, "Largest decode or verify step (tokens) the "
           "step graph serves (unset: --max-num-seqs x (1 + the most draft tokens a request verifies per step: "
           "num_speculative_tokens, num_forced_draft_tokens)).", _positive_int_or_unset("TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS"), _CPU),
    EnvVar("TOKENMILL_CPU_STEP_EXECUTOR", "bool", True, "0: the CPU step graph calls its C kernels one by one "
           "from Python (default: runs of them in one C loop, csrc/step_exec.c; same calls, same bits).",
           _on_unless_zero, _CPU),
    EnvVar("TOKENMILL_INT4_GROUP_SIZE", "int 32..128, multiple of 4", 32, "Largest group of inputs per scale "
           "for --quantization int4 (each layer takes the largest of it/128/64/32 dividing its inputs).",
           _int4_group, _CPU),
    # --- processes and threads ---
    EnvVar("TOKENMILL_NUM_THREADS", "int >= 0", 0, "torch threads per engine process or worker (0: every CPU "
           "the process may run on; 1 on a busy shared machine).", int, _PROC),
    EnvVar("TOKENMILL_MALLOC_TUNING", "bool", True, "0: leave glibc malloc's mmap/trim thresholds alone in the "
           "engine process (default: raised to 256/512 MiB so step buffers are reused, not page-faulted anew).", _on_unless_zero, _PROC),
    EnvVar("TOKENMILL_WORKER_CPUS", "bool", True, "0: do not pin tensor/pipeline-parallel workers to their share "
           "of the CPUs.", _on_unless_zero, _PROC),
    EnvVar("TOKENMILL_RAY_WORKER_CPUS", "float", 1.0, "CPUs each Ray worker reserves (num_cpus of its actor) "
           "with --distributed-executor-backend ray.", float, _PROC),
    EnvVar("TOKENMILL_WORKER_START_TIMEOUT", "float, s", 600.0, "Seconds workers (and data-parallel ranks) get "
           "to connect and load before start-up fails.", float, _PROC),
    EnvVar("TOKENMILL_DIST_TIMEOUT", "float, s", 600.0, "Timeout of one torch.distributed collective between "
           "workers.", float, _PROC),
    EnvVar("TOKENMILL_EPLB_STATS_STEPS", "int > 0", 32, "Steps between EPLB's per-rank load statistics "
           "(a collective over the expert-parallel group).", int, _PROC),
    EnvVar("TOKENMILL_WORKER_AUTHKEY", "hex str", None, "Internal: the multiprocessing executor hands each "
           "worker its connection key through this; never set it by hand.", str, _PROC),
    # --- caches on disk ---
    EnvVar("TOKENMILL_CACHE_DIR", "path", os.path.join("~", ".cache", "tokenmill"), "Root of tokenmill's "
           "caches (processed weights under weights/, tokenizers).", _cache_dir, _STORE,
           parse_unset=True),
    EnvVar("TOKENMILL_WEIGHT_CACHE", "bool", True, "0: no processed-weight cache (same as --no-weight-cache).",
           _on_unless_zero, _STORE),
    EnvVar("TOKENMILL_WEIGHT_CACHE_ENTRIES", "int > 0", 3, "Processed-weight cache entries kept per checkpoint "
           "(one per recipe: dtype, low-bit codes, weight-changing kernel switches), the most recently used; "
           "each is about the model's size in its dtype (1: only the latest recipe).",
           _positive_int("TOKENMILL_WEIGHT_CACHE_ENTRIES"), _STORE),
    EnvVar("TOKENMILL_KV_OFFLOAD_MIN_LOAD_BLOCKS", "int > 0", None, "Shortest run of blocks the KV offloading "
           "tier loads; shorter runs are recomputed (unset: 1, loading won at every length measured on CPUs; "
           "measure yours with benchmarks/kv_offload.py --crossover).",
           _positive_int_or_unset("TOKENMILL_KV_OFFLOAD_MIN_LOAD_BLOCKS"), _STORE),
    EnvVar("TOKENMILL_HUGE_PAGES", "bool", True, "0: ordinary pages for the CPU KV pool (default: ask for "
           "transparent huge pages, madvise; see tokenmill/model/huge_pages.py).",
           _on_unless_zero, _STORE),
    EnvVar("TOKENMILL_KV_BLOCK_RUNS", "bool", True, "0: strict LRU block allocation (default: a request's next "
           "KV block is the one after its last when that one is free and old, so block tables hold runs; see "
           "tokenmill/core/block_pool.py).", _on_unless_zero, _STORE),
    EnvVar("TOKENMILL_KV_CACHE_ZERO", "bool", False, "1: zero the KV pool at allocation (default: uninitialised "
           "pages, touched on first write).", _off_unless_one, _STORE),
    # --- server and debugging ---
    EnvVar("TOKENMILL_LOG_LEVEL", "str", "INFO", "Log level of tokenmill serve and its engine core (DEBUG, "
           "INFO, WARNING, ...).", lambda s: s.upper(), _SERVE),
    EnvVar("TOKENMILL_DEBUG_ENDPOINTS", "bool", False, "1: serve GET /debug/invariants (the engine's leak check "
           "benchmarks/soak.py and tests use).", _off_unless_one, _SERVE),
    EnvVar("TOKENMILL_TRACEMALLOC", "int >= 0", 0, "Frames per allocation site for tracemalloc (0: off); "
           "/debug/invariants then reports the top allocation sites.", _frames, _SERVE),
    EnvVar("TOKENMILL_STEP_TRACE", "path", "", "Debugging: a file the engine core appends one JSON line per step to "
           "(loop, step, runner parts and send times in s, decode requests, prefill tokens, running/waiting, "
           "preemptions; benchmarks/serve_c64_profile.py reads it); empty: off.", str, _SERVE),
    EnvVar("TOKENMILL_SLO_CALIBRATION", "bool", True, "0, false or off: --slo admission uses the step-time "
           "model without its learnt margins.", lambda s: s not in ("0", "false", "off"), _SERVE),
    # --- the test suite's own knobs ---
    EnvVar("TOKENMILL_FAKE_EXECUTOR", "str", "make_fake_executor", "Tests: the factory in tests/server/fakes.py "
           "the model-free server uses.", str, _TEST),
    EnvVar("TOKENMILL_FUZZ_EXAMPLES", "int", 25, "Tests: schemathesis examples per operation in "
           "tests/server/test_fuzz.py.", int, _TEST),
    EnvVar("TOKENMILL_FUZZ_VERBOSE", "bool", False, "Tests: any non-empty value prints the 400 responses the "
           "fuzzer gets.", bool, _TEST),
    EnvVar("TOKENMILL_TEST_PROBE", "bool", True, "Tests: 0 disables the probe library tests/model/test_cpu_build.py "
           "builds (the switch every C kernel library has).", _on_unless_zero, _TEST),
    EnvVar("TOKENMILL_BENCH_LIVE_URL", "URL", None, "Tests: run tests/bench/test_live_server.py against this "
           "server instead of starting one.", lambda s: s.rstrip("/"), _TEST),
]

#: name -> declaration, in declaration order.
VARS: dict[str, EnvVar] = {v.name: v for v in _DECLARED}


def var(name: str) -> EnvVar:
    """The declaration of ``name``.

    Raises:
        KeyError: ``name`` is not declared here.
    """
    try:
        return VARS[name]
    except KeyError:
        raise KeyError(f"{name} is not a declared tokenmill environment switch (tokenmill/envs.py)") from None


def get(name: str) -> Any:
    """The current parsed value of ``name`` (see :meth:`EnvVar.get`)."""
    return var(name).get()


def raw(name: str) -> str | None:
    """The exported string of ``name``, or None when unset."""
    return os.environ.get(var(name).name)


def is_set(name: str) -> bool:
    """Whether ``name`` is exported (even as an empty string)."""
    return var(name).name in os.environ


def set(name: str, value: Any) -> None:  # noqa: A001 - the module's verb, as os.environ's
    """Export ``name=str(value)`` in this process (children inherit it)."""
    os.environ[var(name).name] = str(value)


def setdefault(name: str, value: Any) -> str:
    """Export ``name=str(value)`` unless already exported; returns the exported string."""
    return os.environ.setdefault(var(name).name, str(value))


def unset(name: str) -> str | None:
    """Remove ``name`` from this process's environment; returns the string it had, or None."""
    return os.environ.pop(var(name).name, None)


def __getattr__(name: str) -> Any:
    """``envs.TOKENMILL_X``: the switch's current value, read now (PEP 562)."""
    if name in VARS:
        return VARS[name].get()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(VARS))
