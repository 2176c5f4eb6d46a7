"""Unit tests without any process: protocol validation, admission control, flags, metrics."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from tokenmill.config import EngineConfig
from tokenmill.metrics.stats import EngineStats
from tokenmill.metrics.log_stats import LoggingStatLogger
from tokenmill.metrics.prometheus import (ITL_BUCKETS, REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, PrometheusStatLogger,
                                          build_1_2_5_buckets)
from tokenmill.metrics.stats import FinishedRequestStats, IterationStats
from tokenmill.server.admission import MAX_RETRY_AFTER, AdmissionController, ServiceRate, retry_after_seconds
from tokenmill.server.cli_args import add_serve_args, config_from_args
from tokenmill.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_param_from_loc


# -- protocol ------------------------------------------------------------------
def test_completion_request_maps_vllm_extras():
    r = CompletionRequest(prompt="x", max_tokens=8, temperature=0, top_k=5, min_p=0.1, repetition_penalty=1.2,
                          ignore_eos=True, min_tokens=2, stop_token_ids=[7], include_stop_str_in_output=True,
                          seed=3, stop="END", logprobs=2, priority=1, cache_salt="s")
    r.check()
    p = r.sampling_params(8, r.logprobs)
    assert (p.max_tokens, p.temperature, p.top_k, p.min_p, p.repetition_penalty) == (8, 0, 5, 0.1, 1.2)
    assert p.ignore_eos and p.min_tokens == 2 and p.stop_token_ids == [7] and p.include_stop_str_in_output
    assert p.stop == ["END"] and p.seed == 3 and p.logprobs == 2


@pytest.mark.parametrize("field,value", [("temperature", -0.5), ("top_p", 1.5), ("min_p", 2.0),
                                         ("repetition_penalty", 0.0), ("presence_penalty", 3.0), ("top_k", -5)])
def test_out_of_range_values_name_the_field(field, value):
    """Ranges are pydantic constraints (so the OpenAPI schema states them); the error names the field."""
    with pytest.raises(ValidationError) as e:
        CompletionRequest(prompt="x", **{field: value})
    assert error_param_from_loc(e.value.errors()[0]["loc"]) == field


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                                   "frequency_penalty", "logit_bias"])
@pytest.mark.parametrize("request_cls", [CompletionRequest, ChatCompletionRequest])
def test_nan_and_infinity_are_refused_as_not_finite(request_cls, field, value):
    """Python's JSON parser reads ``NaN`` / ``Infinity``: they are refused while parsing, naming the field and
    saying why (a NaN compared with a range read "should be less than or equal to 1", and an infinity within a
    one-sided range passed parsing)."""
    body = {"messages": [{"role": "user", "content": "x"}]} if request_cls is ChatCompletionRequest else {"prompt": "x"}
    body[field] = {"5": value} if field == "logit_bias" else value
    with pytest.raises(ValidationError) as e:
        request_cls(**body)
    err = e.value.errors()[0]
    assert error_param_from_loc(err["loc"]).startswith(field) and "finite" in err["msg"], err


def test_completion_checks():
    for kw, param in [({"best_of": 3}, "best_of"), ({"stream_options": {"include_usage": True}}, "stream_options"),
                      ({"max_tokens": 0}, "max_tokens")]:   # cross-field rules: checked after parsing
        body = {"prompt": "x", **kw}
        with pytest.raises(APIError) as e:
            CompletionRequest(**body).check()
        assert e.value.param == param, kw
    for kw, param in [({"suffix": "s"}, "suffix"), ({"logprobs": 21}, "logprobs"), ({"n": 0}, "n"),
                      ({"prompt": []}, "prompt"), ({"max_tokens": -1, "echo": True}, "max_tokens"),
                      ({"logit_bias": {"x": 1.0}}, "logit_bias"), ({"logit_bias": {"1": 101.0}}, "logit_bias"),
                      ({"stop_token_ids": [-1]}, "stop_token_ids")]:   # in the schema
        with pytest.raises(ValidationError) as e:
            CompletionRequest(**{"prompt": "x", **kw})
        assert error_param_from_loc(e.value.errors()[0]["loc"]).startswith(param), kw
    r = CompletionRequest(prompt=[[1, 2], [3]], stop_token_ids=[5], logit_bias={"7": 1.5})
    assert r.token_id_fields() == [("stop_token_ids", [5]), ("logit_bias", [7]), ("prompt", [1, 2]), ("prompt", [3])]
    assert r.sampling_params(4, None).logit_bias == {7: 1.5}
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=3)
    CompletionRequest(prompt="x", max_tokens=0, echo=True).check()     # the prompt back, nothing generated


def test_chat_checks_and_max_tokens():
    msgs = [{"role": "user", "content": "hi"}]
    r = ChatCompletionRequest(messages=msgs, max_tokens=5, max_completion_tokens=9, logprobs=True, top_logprobs=3)
    r.check()
    assert r.requested_max_tokens == 9 and r.num_logprobs == 3
    assert ChatCompletionRequest(messages=msgs).num_logprobs is None
    bad = [({"top_logprobs": 2}, "top_logprobs"),
           ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
           ({"add_generation_prompt": False, "continue_final_message": True}, "continue_final_message")]
    for kw, param in bad:
        with pytest.raises(APIError) as e:
            ChatCompletionRequest(messages=msgs, **kw).check()
        assert e.value.param == param, kw
    for kw, param in [({"tools": [{"type": "function"}]}, "tools"), ({"max_completion_tokens": 0}, "max_completion_tokens"),
                      ({"response_format": {"type": "xml"}}, "response_format")]:
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest(messages=msgs, **kw)
        assert error_param_from_loc(e.value.errors()[0]["loc"]).startswith(param), kw
    parts = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}])
    assert parts.messages[0].text() == "a\nb"
    with pytest.raises(ValidationError):   # only text parts, stated in the schema
        ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}])


def test_error_shape_and_param_from_loc():
    e = APIError("nope", 404, param="model")
    assert e.to_dict() == {"error": {"message": "nope", "type": "NotFoundError", "param": "model", "code": 404}}
    assert error_param_from_loc(("body", "messages", 0, "role")) == "messages[0].role"
    assert error_param_from_loc(("body", "prompt", "list[int]", 0)) == "prompt[0]"
    assert error_param_from_loc(("body", "prompt", "str")) == "prompt"


# -- admission control -----------------------------------------------------------
def test_retry_after_estimate():
    assert retry_after_seconds(5, None) == 1  # nothing measured yet: probe again soon
    assert retry_after_seconds(5, 2.0) == 3  # 5 requests at 2/s: 2.5 s, rounded up
    assert retry_after_seconds(1, 100.0) == 1
    assert retry_after_seconds(10_000, 1.0) == MAX_RETRY_AFTER


def test_service_rate_window():
    r = ServiceRate(window=10)
    assert r.rate(now=0) is None
    for t in range(10):
        r.add(2, now=float(t))
    assert r.rate(now=10.0) == pytest.approx(20 / 10)
    assert r.rate(now=10.5) == pytest.approx(18 / 9.5)  # the event at t=0 left the window
    assert r.rate(now=100.0) is None


def test_admission_controller():
    ac = AdmissionController(max_waiting_requests=4, max_waiting_tokens=1000)
    assert ac.check(3, 10, 1, 10, now=0) is None
    ref = ac.check(4, 10, 1, 10, now=0)
    assert ref is not None and ref.retry_after == 1 and "4" in ref.message
    ac.request_rate.add(10, now=0.0)
    ac.request_rate.add(10, now=5.0)  # 20 requests over 5 s = 4/s
    assert ac.check(10, 10, 1, 10, now=5.0).retry_after == 2  # 7 over the cap at 4/s
    assert ac.check(0, 995, 1, 10, now=5.0) is not None  # the token cap
    assert not AdmissionController().enabled and AdmissionController().check(10**6, 10**9) is None
    # It learns from requests reaching their first token.
    ac2 = AdmissionController(max_waiting_requests=1)
    ac2.record(None, IterationStats(num_prompt_tokens=30, time_to_first_tokens=[0.1, 0.2, 0.3]))
    assert ac2.request_rate.rate() == pytest.approx(3.0)


# -- serve flags -------------------------------------------------------------------
def _parse(argv):
    return config_from_args(add_serve_args(argparse.ArgumentParser()).parse_args(argv))


def test_flags_default_to_the_config_defaults():
    assert _parse([]) == EngineConfig()


def test_vllm_flag_names():
    c = _parse(["m.gguf", "--max-model-len", "1024", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                "--block-size", "32", "--num-kv-blocks", "100", "--kv-cache-memory", "1GiB",
                "--no-enable-prefix-caching", "--scheduling-policy", "priority", "--served-model-name", "x",
                "--api-key", "k", "--dtype", "bfloat16", "--seed", "7", "--port", "9000", "--host", "0.0.0.0",
                "--max-num-waiting-requests", "3", "--max-num-waiting-tokens", "999",
                "--long-prefill-token-threshold", "256"])
    assert c.model.model == "m.gguf" and c.model.max_model_len == 1024 and c.model.dtype == "bfloat16"
    assert c.scheduler.max_num_seqs == 8 and c.scheduler.max_num_batched_tokens == 512
    assert c.cache.block_size == 32 and c.cache.num_kv_blocks == 100 and c.cache.kv_cache_memory == "1GiB"
    assert c.cache.enable_prefix_caching is False and c.scheduler.scheduling_policy == "priority"
    assert c.model.served_model_name == "x" and c.server.api_key == "k" and c.model.seed == 7
    assert (c.server.host, c.server.port) == ("0.0.0.0", 9000)
    assert c.scheduler.max_num_waiting_requests == 3 and c.scheduler.max_num_waiting_tokens == 999
    assert c.scheduler.long_prefill_token_threshold == 256
    assert _parse(["--model", "a.gguf"]).model.model == "a.gguf"
    with pytest.raises(ValueError):
        _parse(["a.gguf", "--model", "b.gguf"])
    with pytest.raises(SystemExit):
        _parse(["--scheduling-policy", "lifo"])


def test_help_mentions_every_flag_with_default():
    text = add_serve_args(argparse.ArgumentParser()).format_help()
    for flag in ["--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--block-size",
                 "--kv-cache-memory", "--num-kv-blocks", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--scheduling-policy", "--served-model-name", "--api-key", "--dtype", "--seed", "--host", "--port",
                 "--max-num-waiting-requests"]:
        assert flag in text, flag
    assert "[default: 128]" in text and "[default: 16]" in text


def test_generate_flags_leave_out_server_only_knobs():
    """``tokenmill generate`` has no HTTP server: no host/port/api-key, no admission control (429)."""
    parser = add_serve_args(argparse.ArgumentParser(), include_server=False)
    text = parser.format_help()
    for flag in ["--max-num-seqs", "--max-num-batched-tokens", "--block-size", "--scheduling-policy", "--dtype"]:
        assert flag in text, flag
    for flag in ["--max-num-waiting-requests", "--max-num-waiting-tokens", "--api-key", "--port"]:
        assert flag not in text, flag
    c = config_from_args(parser.parse_args(["--max-num-seqs", "4"]))
    assert c.scheduler.max_num_seqs == 4 and c.scheduler.max_num_waiting_requests is None


# -- metrics -------------------------------------------------------------------------
def test_vllm_buckets():
    assert TTFT_BUCKETS[:4] == [0.001, 0.005, 0.01, 0.02] and TTFT_BUCKETS[-1] == 2560.0
    assert ITL_BUCKETS[0] == 0.01 and ITL_BUCKETS[-1] == 80.0
    assert REQUEST_LATENCY_BUCKETS[0] == 0.3 and REQUEST_LATENCY_BUCKETS[-1] == 7680.0
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_prometheus_exporter_counts_and_parses():
    prom = PrometheusStatLogger("m", 2048)
    prom.record(EngineStats(num_running=2, num_waiting=1, kv_cache_usage=0.25, num_preemptions_total=1,
                            prefix_cache_queries=100, prefix_cache_hits=40, num_steps=1, last_schedule_time=0.001),
                IterationStats(num_prompt_tokens=100, num_generation_tokens=3, time_to_first_tokens=[0.2],
                               inter_token_latencies=[0.05, 0.06],
                               finished=[FinishedRequestStats("stop", 1.0, 0.1, 0.2, 0.7, 100, 3, 16)]))
    prom.record(EngineStats(num_preemptions_total=3, prefix_cache_queries=150, prefix_cache_hits=40, num_steps=2),
                None)
    samples = {}
    for fam in text_string_to_metric_families(prom.render().decode()):
        for s in fam.samples:
            assert s.labels.get("model_name") == "m"
            samples[(s.name, s.labels.get("finished_reason"), s.labels.get("le"))] = s.value
    assert samples[("tokenmill:num_requests_running", None, None)] == 0  # latest snapshot wins
    assert samples[("tokenmill:num_preemptions_total", None, None)] == 3
    assert samples[("tokenmill:prefix_cache_queries_total", None, None)] == 150
    assert samples[("tokenmill:prefix_cache_hits_total", None, None)] == 40
    assert samples[("tokenmill:prompt_tokens_total", None, None)] == 100
    assert samples[("tokenmill:request_success_total", "stop", None)] == 1
    assert samples[("tokenmill:request_success_total", "length", None)] == 0
    assert samples[("tokenmill:inter_token_latency_seconds_count", None, None)] == 2
    assert samples[("tokenmill:time_to_first_token_seconds_bucket", None, "0.25")] == 1
    assert samples[("tokenmill:scheduler_time_seconds_count", None, None)] == 2
    assert not any(name.endswith("_created") for name, _, _ in samples)


def test_stats_log_line():
    log = LoggingStatLogger(interval=10)
    log.record(EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.5, prefix_cache_queries=100,
                           prefix_cache_hits=25), IterationStats(num_prompt_tokens=200, num_generation_tokens=50))
    line = log.summary(now=log._last_time + 10)
    assert "prompt 20.0 tok/s" in line and "generation 5.0 tok/s" in line
    assert "running 3, waiting 2" in line and "KV cache 50.0%" in line and "hit rate 25.0%" in line


def test_cli_config_errors_are_one_line_and_exit_2(capsys, monkeypatch):
    from tokenmill import cli

    assert cli.main(["serve", "--block-size", "0"]) == 2
    assert "tokenmill serve: error: block_size must be > 0" in capsys.readouterr().err
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "abc")
    assert cli.main(["generate", "hi"]) == 2
    err = capsys.readouterr().err
    assert "tokenmill generate: error: TOKENMILL_CPU_INT4_MAX_TOKENS must be a non-negative integer" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("message, param", [
    ({"role": "wizard", "content": "hi"}, "messages[0].role"),
    ({"role": "user"}, "messages[0].content"),
    ({"role": "system", "content": None}, "messages[0].content"),
])
def test_chat_message_role_and_content_are_checked(message, param):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(model="m", messages=[message])
    assert param in {error_param_from_loc(err["loc"]) for err in e.value.errors()}
    # an assistant message may have null content (OpenAI allows it with tool calls)
    ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "q"}, {"role": "assistant"}])


@pytest.mark.parametrize("prompt", [[-1], [[3, -2]]])
def test_negative_token_id_names_the_problem(prompt):
    with pytest.raises(ValidationError) as e:
        CompletionRequest(model="m", prompt=prompt)
    msgs = [err["msg"] for err in e.value.errors()]
    assert any("out of range" in m for m in msgs), msgs


def test_gemm_shape_caches_bounded_unless_the_user_set_them(monkeypatch):
    from tokenmill.server.launch import GEMM_SHAPE_CACHE_CAPACITY, bound_gemm_shape_caches

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "512")
    bound_gemm_shape_caches()
    import os

    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(GEMM_SHAPE_CACHE_CAPACITY)
    assert os.environ["LRU_CACHE_CAPACITY"] == "512"


def test_offline_llm_bounds_gemm_shape_caches_too(monkeypatch, tmp_path):
    """``LLM(...)`` sets the same bound as ``tokenmill serve`` before its engine core loads."""
    import os

    from tokenmill import LLM
    from tokenmill.config import GEMM_SHAPE_CACHE_CAPACITY

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    with pytest.raises((ValueError, FileNotFoundError)):
        LLM(str(tmp_path / "missing.gguf"))   # the bound is set before the model loads (and fails here)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(GEMM_SHAPE_CACHE_CAPACITY)
    assert os.environ["LRU_CACHE_CAPACITY"] == str(GEMM_SHAPE_CACHE_CAPACITY)
