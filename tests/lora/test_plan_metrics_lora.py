"""``tokenmill plan`` with adapters and the LoRA Prometheus series (no model)."""

from __future__ import annotations

from tests.playbook.test_plan import LLAMA3_8B, _plan

GiB = 1 << 30


def test_plan_counts_adapter_slots_in_the_device_budget():
    base = _plan(LLAMA3_8B, dtype="bfloat16", device_memory=80 * GiB, gpu_memory_utilization=0.9)
    lora = _plan(LLAMA3_8B, dtype="bfloat16", device_memory=80 * GiB, gpu_memory_utilization=0.9,
                 max_loras=4, max_lora_rank=16, max_cpu_loras=8)
    h, q, kv, inter = 4096, 4096, 1024, 14336
    per_layer = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)   # A + B of the 7 targets
    one = 32 * 16 * per_layer * 2
    assert lora.lora_slot_bytes == 4 * one and lora.lora_cpu_cache_bytes == 8 * one
    assert lora.kv_cache_memory == base.kv_cache_memory - 4 * one
    assert lora.num_kv_blocks < base.num_kv_blocks
    assert base.lora_slot_bytes == 0


def test_lora_prometheus_series():
    from tokenmill.metrics.prometheus import PrometheusStatLogger
    from tokenmill.metrics.stats import EngineStats

    prom = PrometheusStatLogger("base", 256)
    stats = EngineStats(lora={"running": ["a", "b"], "waiting": ["c"], "max_lora": 2,
                              "requests_total": {"a": 3, "c": 1}})
    prom.record(stats, None)
    stats.lora["requests_total"]["a"] = 5
    stats.lora["running"] = ["a"]
    prom.record(stats, None)
    text = prom.render().decode()
    assert 'tokenmill:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters="c"}' in text
    assert 'running_lora_adapters="a,b"' not in text        # only the latest state
    assert 'tokenmill:lora_requests_total{lora_name="a",model_name="base"} 5.0' in text
    assert 'tokenmill:lora_requests_total{lora_name="c",model_name="base"} 1.0' in text


def test_plan_cuts_adapter_slots_per_rank_and_stage():
    """-tp 2: each rank holds A whole and half of B for column targets, half of A and B whole for row ones;
    -pp 2: a stage holds its layers' share."""
    from tokenmill.playbook.plan import lora_bytes_per_adapter, shape_from_hf_config

    s = shape_from_hf_config(LLAMA3_8B, "cfg")
    full = lora_bytes_per_adapter(s, 16, 2)
    h, q, kv, i = 4096, 4096, 1024, 14336
    per_rank_layer = (h + q // 2) + 2 * (h + kv // 2) + (q // 2 + h) + 2 * (h + i // 2) + (i // 2 + h)
    assert lora_bytes_per_adapter(s, 16, 2, tp=2) == 32 * 16 * per_rank_layer * 2 < full
    assert lora_bytes_per_adapter(s, 16, 2, num_layers=16) * 2 == full
    tp2 = _plan(LLAMA3_8B, dtype="bfloat16", device_memory=80 * GiB, gpu_memory_utilization=0.9,
                max_loras=4, max_lora_rank=16, tensor_parallel_size=2)
    assert tp2.lora_slot_bytes == 4 * lora_bytes_per_adapter(s, 16, 2, tp=2)
