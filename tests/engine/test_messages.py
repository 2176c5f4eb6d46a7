"""The API process <-> engine core messages (tokenmill/engine/messages.py): every kind round-trips through
MessagePack into its own struct with its payload's dataclasses rebuilt, wrong types are refused, and no
sender in the package still builds the old pickled tuples."""

from __future__ import annotations

import ast
import pathlib
import typing

import msgspec
import numpy as np
import pytest

from tokenmill.core.kv_offload_stats import KVOffloadStats
from tokenmill.core.kv_transfer_stats import KVTransferStats
from tokenmill.core.sched_output import EngineCoreOutput
from tokenmill.core.scheduler import QueueState
from tokenmill.core.spec_decode_stats import SpecDecodingStats
from tokenmill.engine import messages as m
from tokenmill.engine.engine_core import EngineCoreRequest
from tokenmill.lora.request import LoRARequest
from tokenmill.metrics.stats import EngineStats, EplbStats
from tokenmill.metrics.step_timing import StepTimingSnapshot
from tokenmill.outputs import TokenLogprobs
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.structured_output.manager import StructuredOutputStats

PKG = pathlib.Path(__file__).resolve().parents[2] / "tokenmill"


def _request() -> EngineCoreRequest:
    sp = SamplingParams(temperature=0.7, top_k=5, max_tokens=5, stop="END", stop_token_ids=[7], seed=3, logprobs=2,
                        logit_bias={3: 1.5}, kv_transfer_params={"do_remote_decode": True},
                        structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    return EngineCoreRequest("r-1", [1, 2, 3], sp, 12.5, 2, "salt", True, LoRARequest("sql", 1, "/a", "base"))


def _stats() -> EngineStats:
    return EngineStats(num_running=3, num_waiting=1, kv_cache_usage=0.25, num_kv_blocks=64, block_size=16,
                       queue=QueueState({0: (1, 20), 5: (2, 7)}, (1, 3), remaining_output_tokens=[4, 5]),
                       step_timing=StepTimingSnapshot([(1.0, 0.02), (8.0, 0.05)], 0.001, 0.002, 9),
                       spec_decoding=SpecDecodingStats(2, 8, 5, [2, 2, 1, 0]),
                       eplb=EplbStats(num_ranks=2, load_layers=["0", "all"], expert_load=[[1, 2], [3, 4]],
                                      imbalance_before=1.5),
                       kv_transfer=KVTransferStats(bytes_sent=10, recent_times=[0.1]),
                       kv_offload=KVOffloadStats(hits=2, writes_paused=True),
                       prompt_tokens_by_source={"local_compute": 3, "local_cache_hit": 16},
                       expert_parallel={"steps": 3.0, "dummy_steps": 1.0},
                       structured_outputs=StructuredOutputStats({"json": 2}, compile_count=1),
                       lora={"running": ["sql"], "waiting": [], "max_lora": 1, "requests_total": {"sql": 2}})


def _output() -> EngineCoreOutput:
    return EngineCoreOutput("r-1", [5, 6], [TokenLogprobs(-0.1, 1, [5, 9], [-0.1, -2.5]), None], "stop", "END",
                            num_cached_tokens=16, arrival_time=1.0, first_token_time=2.0, num_prompt_tokens=3,
                            prompt_logprobs=[None, TokenLogprobs(-1.0, 2, [1], [-0.5])],
                            kv_transfer_params={"remote_block_ids": [1, 2], "remote_engine_id": "e"})


INPUTS = [m.AddRequest(_request()), m.AbortRequests(["a", "a-1"]), m.StopRequests(["b"]),
          m.ReleaseKV([(None, "x"), ("engine-0", "y")]), m.CheckInvariants(3), m.LoadLoRA(4, LoRARequest("l", 2, "/p")),
          m.UnloadLoRA(2), m.Wake(5), m.Shutdown()]
OUTPUTS = [m.Ready(m.CoreInfo(2048, 500, 16, [2], pid=7, num_threads=2, load_time=1.5, parallel="tp 2",
                              stats=_stats(), profile_time=0.5)),
           m.Ready(m.CoreInfo(128, 10, 16)),
           m.Outputs([_output(), EngineCoreOutput("r-2", finish_reason="error", error="bad", error_code=500)],
                     _stats(), 7),
           m.Outputs([], EngineStats(), 0),
           m.Invariants(3, {"ok": True, "leaked_blocks": 0}), m.LoRALoaded(4, None), m.LoRALoaded(5, "no such file"),
           m.Error("engine core failed: RuntimeError: x")]


def test_every_kind_is_listed_once():
    assert {type(x) for x in INPUTS} == set(typing.get_args(m.CoreInput))
    assert {type(x) for x in OUTPUTS} == set(typing.get_args(m.CoreOutput))
    tags = [t.__struct_config__.tag for t in typing.get_args(m.CoreInput) + typing.get_args(m.CoreOutput)]
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize("msg", INPUTS, ids=lambda x: type(x).__name__)
def test_inputs_round_trip(msg):
    back = m.decode_input(m.encode(msg))
    assert type(back) is type(msg) and back == msg


@pytest.mark.parametrize("msg", OUTPUTS, ids=lambda x: type(x).__name__)
def test_outputs_round_trip(msg):
    back = m.decode_output(m.encode(msg))
    assert type(back) is type(msg) and back == msg


def test_payload_dataclasses_are_rebuilt_with_their_types():
    req = m.decode_input(m.encode(m.AddRequest(_request()))).request
    assert isinstance(req.sampling_params, SamplingParams) and req.sampling_params.stop == ["END"]
    assert isinstance(req.sampling_params.structured_outputs, StructuredOutputsParams)
    assert req.sampling_params.logit_bias == {3: 1.5}              # int keys stay ints
    assert isinstance(req.lora_request, LoRARequest)
    out = m.decode_output(m.encode(OUTPUTS[2]))
    st = out.stats
    assert isinstance(st.queue, QueueState) and st.queue.waiting_by_priority[5] == (2, 7)
    assert isinstance(st.structured_outputs, StructuredOutputStats) and isinstance(st.eplb, EplbStats)
    assert st.step_timing.decode_points == [(1.0, 0.02), (8.0, 0.05)] and st.step_timing.ready == \
        _stats().step_timing.ready
    assert isinstance(out.outputs[0].new_logprobs[0], TokenLogprobs) and out.outputs[0].new_logprobs[1] is None
    assert isinstance(m.decode_output(m.encode(OUTPUTS[0])).info.stats, EngineStats)


def test_numpy_scalars_travel_as_numbers():
    o = EngineCoreOutput("r", [np.int64(5), 6])
    st = EngineStats(num_running=np.int64(2), kv_cache_usage=np.float32(0.5))
    back = m.decode_output(m.encode(m.Outputs([o], st, 1)))
    assert back.outputs[0].new_token_ids == [5, 6] and back.stats.num_running == 2 and back.stats.kv_cache_usage == 0.5


def test_wrong_kinds_and_types_are_refused():
    with pytest.raises(msgspec.ValidationError):
        m.decode_input(m.encode(m.Ready(m.CoreInfo(1, 1, 1))))       # an output kind on the input socket
    with pytest.raises(msgspec.ValidationError):
        m.decode_input(msgspec.msgpack.encode(["abort", "not-a-list"]))
    with pytest.raises(msgspec.ValidationError):
        m.decode_input(msgspec.msgpack.encode(["nonsense", 1]))
    with pytest.raises(msgspec.ValidationError):                     # SamplingParams validates on arrival
        bad = msgspec.msgpack.decode(m.encode(m.AddRequest(_request())))
        bad[1]["sampling_params"]["temperature"] = -1.0
        m.decode_input(msgspec.msgpack.encode(bad))
    with pytest.raises(msgspec.DecodeError):
        m.decode_output(b"\xc1")
    with pytest.raises(TypeError):
        m.encode(m.Invariants(1, {"x": object()}))


def test_no_sender_builds_tuple_messages():
    """Every ``_send(...)`` / ``dumps(...)`` / ``messages.encode(...)`` in the package passes a struct, and the API
    process and engine core pickle nothing (the core's own pipe to its workers, executor/mp.py, is not this
    transport)."""
    bad = []
    for path in PKG.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args:
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                pickled = isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", "") == "pickle"
                if name in ("_send", "dumps", "encode") and isinstance(node.args[0], ast.Tuple) and not pickled:
                    bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno}")
    assert not bad, bad
    core = (PKG / "engine" / "core_proc.py").read_text() + (PKG / "engine" / "async_engine.py").read_text()
    assert "pickle" not in core
