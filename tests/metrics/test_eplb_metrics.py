"""EPLB config validation and its Prometheus series."""

from __future__ import annotations

import pytest

from tokenmill.config import EngineConfig, EplbConfig
from tokenmill.metrics.prometheus import PrometheusStatLogger
from tokenmill.metrics.stats import EngineStats, EplbStats


def test_eplb_config_defaults_are_vllms():
    c = EngineConfig().parallel
    assert c.enable_eplb is False and c.eplb == EplbConfig()
    assert (EplbConfig().window_size, EplbConfig().step_interval, EplbConfig().num_redundant_experts,
            EplbConfig().log_balancedness, EplbConfig().log_balancedness_interval) == (1000, 3000, 0, False, 1)


@pytest.mark.parametrize("kwargs,match", [
    (dict(eplb_config='{"window_size": 0}'), "window_size must be >= 1"),
    (dict(eplb_config='{"step_interval": -3}'), "step_interval must be >= 1"),
    (dict(eplb_config='{"num_redundant_experts": -1}'), "num_redundant_experts must be >= 0"),
    (dict(eplb_config='{"window_size": "10"}'), "must be an integer"),
    (dict(eplb_config='{"log_balancedness": 1}'), "true or false"),
    (dict(eplb_config='{"windowsize": 10}'), "unknown keys"),
    (dict(eplb_config='[]'), "JSON object"),
    (dict(eplb_config='{nope'), "not valid JSON"),
    (dict(eplb_config='{"num_redundant_experts": 2}'), "add --enable-eplb"),
])
def test_eplb_config_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(**kwargs)


def test_eplb_config_from_dict_and_flags():
    from tokenmill.server.cli_args import build_parser, config_from_args

    c = EngineConfig.from_kwargs(enable_eplb=True, eplb_config={"window_size": 10, "num_redundant_experts": 2})
    assert c.parallel.eplb.window_size == 10 and c.parallel.eplb.num_redundant_experts == 2
    assert c.replace(max_num_seqs=4).parallel.eplb == c.parallel.eplb
    args = build_parser().parse_args(["--enable-eplb", "--eplb-config", '{"step_interval": 7}'])
    assert config_from_args(args).parallel.eplb.step_interval == 7


def _render(stats: EplbStats) -> str:
    p = PrometheusStatLogger("m", 128)
    p.record(EngineStats(eplb=stats), None)
    return p.render().decode()


def test_eplb_metrics_exported():
    st = EplbStats(num_ranks=2, num_moe_layers=2, num_logical_experts=3, num_physical_experts=4, window_steps=5,
                   load_layers=["0", "1"], expert_load=[[10, 2, 3], [4, 5, 6]], imbalance_ratio=1.25,
                   expert_imbalance_ratio=2.0, imbalance_before=1.5, imbalance_after=1.1, num_rebalances=3,
                   num_placement_changes=2, num_experts_moved=7, rebalance_seconds_total=0.25)
    text = _render(st)
    assert 'tokenmill:eplb_expert_load{engine="0",expert="0",layer="0",model_name="m"} 10.0' in text
    assert 'tokenmill:eplb_expert_load{engine="0",expert="2",layer="1",model_name="m"} 6.0' in text
    assert 'tokenmill:eplb_imbalance_ratio{engine="0",model_name="m"} 1.25' in text
    assert 'tokenmill:eplb_imbalance_ratio_before_rebalance{engine="0",model_name="m"} 1.5' in text
    assert 'tokenmill:eplb_imbalance_ratio_after_rebalance{engine="0",model_name="m"} 1.1' in text
    assert 'tokenmill:eplb_expert_imbalance_ratio{engine="0",model_name="m"} 2.0' in text
    assert 'tokenmill:eplb_rebalances_total{engine="0",model_name="m"} 3.0' in text
    assert 'tokenmill:eplb_moved_experts_total{engine="0",model_name="m"} 7.0' in text
    assert 'tokenmill:eplb_rebalance_seconds_total{engine="0",model_name="m"} 0.25' in text


def test_eplb_metrics_absent_without_eplb():
    p = PrometheusStatLogger("m", 128)
    p.record(EngineStats(), None)
    assert "tokenmill:eplb_imbalance_ratio{" not in p.render().decode()


def test_eplb_counters_advance_not_reset():
    p = PrometheusStatLogger("m", 128)
    for n in (1, 1, 4):
        p.record(EngineStats(eplb=EplbStats(num_rebalances=n, load_layers=["all"], expert_load=[[1, 2]])), None)
    assert 'tokenmill:eplb_rebalances_total{engine="0",model_name="m"} 4.0' in p.render().decode()


def test_eplb_load_series_bounded():
    from tokenmill.metrics.stats import EPLB_MAX_LOAD_SERIES
    from tokenmill.distributed.eplb import EplbController
    import torch

    class Layer:   # 48 layers x 128 experts (Qwen3-MoE-30B-A3B's shape): rows summed into layer="all"
        num_experts, num_physical_experts = 128, 128
        physical_to_logical = torch.arange(128)
        w13 = w2 = torch.zeros(128, 1)

        def take_expert_load(self):
            return torch.ones(128, dtype=torch.int64)

    ctl = EplbController([Layer() for _ in range(48)], EplbConfig(window_size=2, step_interval=100))
    ctl.after_step()
    st = ctl.stats()
    assert st.load_layers == ["all"] and st.expert_load == [[48] * 128]
    text = _render(st)
    assert text.count("tokenmill:eplb_expert_load{") == 128 <= EPLB_MAX_LOAD_SERIES
