"""SSE parsing and request bodies."""

from __future__ import annotations

import pytest

from tokenmill.bench.client import EndpointConfig, SSEParser, normalize_endpoint


def test_sse_parser_handles_split_events_crlf_comments_and_utf8():
    p = SSEParser()
    assert p.feed(b"data: {\"a\"") == []
    assert p.feed(b": 1}\n\n: ping comment\n\ndata: x") == ['{"a": 1}']
    assert p.feed(b"y\r\n\r\nevent: foo\ndata:no-space\n\n") == ["xy", "no-space"]
    snow = "☃".encode()
    assert p.feed(b"data: " + snow[:1]) == []
    assert p.feed(snow[1:] + b"\n\n") == ["☃"]
    assert p.feed(b"data: [DONE]") == []
    assert p.flush() == ["[DONE]"]


def test_sse_multi_line_data_joined():
    p = SSEParser()
    assert p.feed(b"data: a\ndata: b\n\n") == ["a\nb"]


def test_payloads():
    c = EndpointConfig(endpoint="completions", model="m", ignore_eos=True, extra_body={"top_k": 1})
    body = c.payload("hi", 7)
    assert body["prompt"] == "hi" and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["top_k"] == 1 and "temperature" not in body
    assert c.url == "http://127.0.0.1:8000/v1/completions"
    chat = EndpointConfig(base_url="http://h:1/", endpoint="chat", model="m", temperature=0.0, api_key="k")
    body = chat.payload("hi", 5)
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_completion_tokens"] == 5 and body["temperature"] == 0.0 and "ignore_eos" not in body
    assert chat.url == "http://h:1/v1/chat/completions"
    assert chat.headers()["Authorization"] == "Bearer k"
    with pytest.raises(TypeError):
        c.payload([{"role": "user", "content": "x"}], 3)


@pytest.mark.parametrize("value, expected", [
    ("completions", "completions"), ("/v1/completions", "completions"), ("openai", "completions"),
    ("chat", "chat"), ("/v1/chat/completions", "chat"), ("openai-chat", "chat")])
def test_normalize_endpoint(value, expected):
    assert normalize_endpoint(value) == expected


def test_normalize_endpoint_rejects():
    with pytest.raises(ValueError):
        normalize_endpoint("embeddings")
