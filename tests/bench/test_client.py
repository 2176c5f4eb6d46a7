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


class _DroppingServer:
    """Raw HTTP server: closes connection number ``drop`` right after reading a request (no response);
    answers every other request with a two-token SSE stream. Counts requests received."""

    SSE = (b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
           b'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n'
           b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\n\n'
           b"data: [DONE]\n\n")

    def __init__(self, drop: set[int], drop_mid_stream: bool = False) -> None:
        self.drop, self.mid = drop, drop_mid_stream
        self.connections = 0
        self.requests = 0

    async def handle(self, reader, writer) -> None:
        import asyncio

        self.connections += 1
        n = self.connections
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")][0]
                     .split(b":")[1])
        await reader.readexactly(length)
        self.requests += 1
        if n in self.drop and not self.mid:
            writer.close()
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        body = self.SSE[:40] if n in self.drop else self.SSE
        writer.write(b"%x\r\n%s\r\n" % (len(body), body))
        if n not in self.drop:
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.close()


@pytest.mark.parametrize("mid_stream", [False, True])
def test_request_dropped_before_any_response_is_retried_once(mid_stream):
    """A connection closed before the status line (a stale keep-alive socket) is retried on a new one;
    a stream broken after the response started is a failure, never retried."""
    import asyncio

    import aiohttp

    from tokenmill.bench.client import send_request

    async def run():
        srv = _DroppingServer(drop={1}, drop_mid_stream=mid_stream)
        server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        cfg = EndpointConfig(base_url=f"http://127.0.0.1:{port}", endpoint="completions", model="m")
        async with aiohttp.ClientSession() as s:
            rec = await send_request(s, cfg, "hi", 2)
        server.close()
        return srv, rec

    srv, rec = asyncio.run(run())
    if mid_stream:
        assert not rec.success and rec.error.startswith("broken stream") and not rec.retried
        assert srv.requests == 1
    else:
        assert rec.success and rec.retried and rec.output_tokens == 2 and rec.generated_text == "ab"
        assert srv.requests == 2 and srv.connections == 2
