"""The CPU kernel plan (tokenmill/kernel_plan.py): its rules, that the engine and the planner resolve the same
plan, and that the engine follows the config's switches rather than the environment of the moment."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill import envs
from tokenmill.config import EngineConfig
from tokenmill.kernel_plan import INT8_ACT_AUTO, CpuFacts, CpuKernelSwitches, resolve_kernel_plan

AVX512 = CpuFacts(supported_isas=("avx512", "avx2", "scalar"))
AVX2 = CpuFacts(supported_isas=("avx2", "scalar"))
BF16 = dataclasses.replace(AVX512, native_bf16=True)
ON = CpuKernelSwitches()


def plan(switches=ON, facts=AVX512, **kw):
    return resolve_kernel_plan(switches, facts, **{"device_type": "cpu", "dtype": "auto", **kw})


def test_defaults_match_the_declared_switches(monkeypatch):
    for f in dataclasses.fields(CpuKernelSwitches):
        monkeypatch.delenv(f.metadata["env"], raising=False)
        assert getattr(ON, f.name) == envs.var(f.metadata["env"]).default, f.name
    assert CpuKernelSwitches.from_env() == ON


def test_dtype_auto_and_the_low_bit_path():
    p = plan()
    assert (p.isa, p.dtype, p.packed_linear, p.lowbit_max_tokens, p.int8_act_max_tokens, p.kv_cache_dtype) == \
        ("avx512", "float32", True, 8, INT8_ACT_AUTO["avx512"], "bfloat16")
    assert plan(facts=BF16).dtype == "bfloat16" and plan(facts=BF16).kv_cache_dtype == "bfloat16"
    assert plan(CpuKernelSwitches(native_bf16=False), BF16).dtype == "float32"       # TOKENMILL_CPU_BF16=0
    assert plan(device_type="cuda").dtype == "bfloat16" and plan(device_type="cuda").isa is None
    assert plan(device_type="cuda", dtype="float32").lowbit_max_tokens == 0


@pytest.mark.parametrize("why, kw, switches, facts", [
    ("int4 limit 0", {}, CpuKernelSwitches(int4_max_tokens=0), AVX512),
    ("no packed linears", {}, CpuKernelSwitches(packed_linear=False), AVX512),
    ("low-bit kernel off", {}, CpuKernelSwitches(lowbit_kernel=False), AVX512),
    ("no compiler", {}, ON, dataclasses.replace(AVX512, lowbit_kernel=False)),
    ("no oneDNN", {}, ON, dataclasses.replace(AVX512, onednn=False)),
    ("--quantization", {"quantization": "int8"}, ON, AVX512),
    ("compiled step", {"enforce_eager": False}, ON, AVX512),
    ("tensor parallel", {"tensor_parallel_size": 2}, ON, AVX512),
    ("no codes in the checkpoint", {"checkpoint_lowbit": False}, ON, AVX512),
])
def test_what_turns_the_low_bit_path_off(why, kw, switches, facts):
    p = plan(switches, facts, dtype="float32", **kw)
    assert p.lowbit_max_tokens == 0 and p.int8_act_max_tokens == 0, why
    assert p.kv_cache_dtype == "float32", why          # --kv-cache-dtype auto: the model's dtype then


def test_bfloat16_without_onednn_bfloat16_keeps_the_low_bit_path():
    """A bfloat16 model where oneDNN has no bfloat16 (AVX2): no packed linears, but the low-bit codes and the
    integer path still serve it (plain wrapped weights); before, it ran emulated bfloat16 GEMMs."""
    no_bf16 = dataclasses.replace(AVX2, onednn_bf16=False)
    p = plan(facts=no_bf16, dtype="bfloat16")
    assert (p.packed_linear, p.lowbit_max_tokens, p.int8_act_max_tokens, p.kv_cache_dtype) == \
        (False, 8, INT8_ACT_AUTO["avx2"], "bfloat16")
    assert plan(facts=no_bf16, dtype="float32").packed_linear                       # float32 unchanged
    for switches in (CpuKernelSwitches(packed_linear=False), CpuKernelSwitches(lowbit_kernel=False),
                     CpuKernelSwitches(int4_max_tokens=0)):
        assert plan(switches, no_bf16, dtype="bfloat16").lowbit_max_tokens == 0, switches
    assert plan(facts=no_bf16, dtype="bfloat16", tensor_parallel_size=2).lowbit_max_tokens == 0


def test_integer_path_kv_rule_step_graph_and_isa():
    assert plan(facts=AVX2).int8_act_max_tokens == INT8_ACT_AUTO["avx2"] > 0
    assert plan(CpuKernelSwitches(int8_act_max_tokens=64)).int8_act_max_tokens == 64
    assert plan(CpuKernelSwitches(kv_bf16=False)).kv_cache_dtype == "float32"
    assert plan(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert plan(max_num_seqs=8).step_graph_max_tokens == 8
    assert plan(max_num_seqs=8, max_draft_tokens=4).step_graph_max_tokens == 40   # verify steps: 1 + 4 rows each
    assert plan(CpuKernelSwitches(step_graph_max_tokens=3), max_num_seqs=8).step_graph_max_tokens == 3
    assert not plan(CpuKernelSwitches(step_graph=False)).step_graph
    assert plan(CpuKernelSwitches(isa="scalar")).isa == "scalar"
    assert plan(batch_invariant=True).batch_invariant and "batch-invariant on" in plan(batch_invariant=True).describe()
    with pytest.raises(ValueError, match="lacks the instructions"):
        plan(CpuKernelSwitches(isa="avx512"), AVX2)
    for bad in (dict(isa="sse"), dict(int4_max_tokens=-1), dict(int8_act_max_tokens="x"),
                dict(step_graph_max_tokens=0), dict(int4_group_size=30)):
        with pytest.raises(ValueError):
            CpuKernelSwitches(**bad)


def test_the_config_reads_the_environment_once(monkeypatch):
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "3")
    monkeypatch.setenv("TOKENMILL_CPU_KV_BF16", "0")
    config = EngineConfig.from_kwargs(max_num_seqs=4)
    monkeypatch.delenv("TOKENMILL_CPU_INT4_MAX_TOKENS")
    monkeypatch.delenv("TOKENMILL_CPU_KV_BF16")
    assert (config.cpu_kernels.int4_max_tokens, config.cpu_kernels.kv_bf16) == (3, False)
    assert config.replace(block_size=32).cpu_kernels == config.cpu_kernels
    assert EngineConfig.from_kwargs(cpu_kernels={"int4_max_tokens": 2}).cpu_kernels.int4_max_tokens == 2
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "-1")
    with pytest.raises(ValueError, match="TOKENMILL_CPU_INT4_MAX_TOKENS"):
        EngineConfig()


def test_the_planner_resolves_the_engines_plan(monkeypatch):
    """``tokenmill plan`` (torch-free, /proc/cpuinfo) and the engine (torch probes) apply the same rules; on this
    machine their facts agree wherever the plan depends on them, so the plans are equal."""
    pytest.importorskip("torch")
    from tokenmill.model.cpu_facts import engine_plan
    from tokenmill.playbook.plan import PlanOptions, cpu_kernel_plan, default_model_path, load_shape

    for f in dataclasses.fields(CpuKernelSwitches):
        monkeypatch.delenv(f.metadata["env"], raising=False)
    path = default_model_path()
    if path is None:
        pytest.skip("the packaged model is not installed")
    shape = load_shape(path)
    for dtype in ("float32", "auto", "bfloat16"):   # bfloat16: oneDNN's bfloat16 linears exist or not (AVX2)
        engine = engine_plan(EngineConfig.from_kwargs(model=path, dtype=dtype, device="cpu"), "cpu",
                             checkpoint_lowbit=True)
        if not engine.lowbit_max_tokens:
            pytest.skip("no low-bit kernel on this machine (no C compiler or oneDNN)")
        assert cpu_kernel_plan(shape, PlanOptions(dtype=dtype, device="cpu")) == \
            dataclasses.replace(engine, batch_invariant=False), dtype


@pytest.mark.parametrize("machine,flags,onednn_bf16", [
    ("x86_64", {"avx", "avx2", "fma"}, False),                                     # AVX2 only
    ("x86_64", {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, True),     # AVX-512 without BF16
    ("x86_64", {"avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_bf16"}, True),
    ("x86_64", {"avx2", "avx512f"}, False),                                          # no BW/VL/DQ
    ("aarch64", {"asimd", "bf16"}, True),
    ("aarch64", {"asimd"}, False),
])
def test_planner_facts_follow_torchs_onednn_bfloat16_rule(machine, flags, onednn_bf16):
    """The planner (no torch) decides oneDNN bfloat16 from /proc/cpuinfo as torch does (AVX512 BW+VL+DQ on
    x86), so a bfloat16 model on an AVX2 CPU is planned with the plain (unpacked) linears the engine runs."""
    facts = CpuFacts.from_cpu_flags(frozenset(flags), machine=machine)
    assert facts.onednn_bf16 is onednn_bf16
    assert plan(facts=facts, dtype="bfloat16").packed_linear is onednn_bf16
