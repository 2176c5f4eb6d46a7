"""The router with LoRA adapters (no model): adapter names form their own pools, /v1/models keeps each
adapter's parent, and kv_aware hashes an adapter's prompt with the key its backends' block hashes carry
(so blocks of different adapters, or of an adapter and its base, never match)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.router.fake_backend import FakeBackend, RouterThread
from tokenmill.core.kv_events import BlockStored, KVEventBatch
from tokenmill.core.prefix_cache import update_block_hashes
from tokenmill.core.request import Request
from tokenmill.lora.request import LoRARequest
from tokenmill.router.app import RouterConfig
from tokenmill.router.backends import BackendSpec
from tokenmill.router.prompt import PromptTokenizer
from tokenmill.router.router import Router
from tokenmill.sampling_params import SamplingParams

SQL = {"parent": "base", "root": "/adapters/sql", "prefix_cache_key": "lora:sql:0123abcd"}


class CardBackend(FakeBackend):
    """A fake backend whose /v1/models cards carry extra fields (a LoRA server's parent/root/key)."""

    def __init__(self, name, cards: dict[str, dict], **kw) -> None:
        super().__init__(name, list(cards), **kw)
        self.cards = cards

    async def _models(self, request):
        from aiohttp import web

        return web.json_response({"object": "list", "data": [
            {"id": m, "object": "model", "owned_by": "fake", **extra} for m, extra in self.cards.items()]})


@pytest.fixture
def lora_cluster():
    started = []

    def make(policy="round_robin"):
        a = CardBackend("a", {"base": {}, "sql": SQL}).start()
        b = CardBackend("b", {"base": {}}).start()
        started.extend([a, b])
        r = RouterThread(RouterConfig(backends=[BackendSpec(a.url), BackendSpec(b.url)], policy=policy,
                                      health_check_interval=0.2, health_check_timeout=0.5)).start()
        started.append(r)
        return r, a, b

    yield make
    for s in reversed(started):
        s.stop()


@pytest.mark.parametrize("policy", ["round_robin", "prefix_aware"])
def test_adapter_names_route_to_their_backends_and_list_with_parent(lora_cluster, policy):
    r, a, b = lora_cluster(policy)
    cards = {m["id"]: m for m in httpx.get(r.url + "/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == "base" and cards["sql"]["root"] == "/adapters/sql"
    assert cards["base"]["parent"] is None
    for _ in range(4):    # only a serves the adapter; the same prompt text for the base spreads over both
        got = httpx.post(r.url + "/v1/completions", json={"model": "sql", "prompt": "w5 w6 w7"}, timeout=10)
        assert got.json()["backend"] == "a"
    base = {httpx.post(r.url + "/v1/completions", json={"model": "base", "prompt": f"w{i} w9"},
                       timeout=10).json()["backend"] for i in range(8)}
    assert base == {"a", "b"} or policy == "prefix_aware"
    # prefix_aware keeps one prefix tree per model pool: the adapter's requests did not seed the base's tree
    if policy == "prefix_aware":
        pol = r.router.policy_for("base")
        assert r.router.policy_for("sql") is not pol


def _engine_hashes(ids, block_size, lora=None, salt=None):
    req = Request("x", list(ids), SamplingParams(max_tokens=1), cache_salt=salt, lora_request=lora)
    return update_block_hashes(req, block_size)


def test_kv_aware_hashes_an_adapter_prompt_as_its_backends_do():
    """The router's chain for an adapter request equals the engine's (name + content key on block 0); the
    base's and another adapter's chains differ; events of the adapter's blocks match only its requests."""
    cfg = RouterConfig(backends=[BackendSpec("http://a"), BackendSpec("http://b")], policy="kv_aware",
                       block_size=4)
    router = Router(cfg, PromptTokenizer(None))
    a, b = router.backends
    a.healthy = b.healthy = True
    a.models, b.models = ["base", "sql"], ["base"]
    a.model_cards = {"base": {}, "sql": SQL}
    ids = list(range(10, 22))
    lora = LoRARequest("sql", 7, "/adapters/sql", content_hash="0123abcd")
    assert lora.prefix_cache_key == SQL["prefix_cache_key"]
    policy = router.policy_for("sql")

    def chain(model, salt=None):
        body = {"model": model, "prompt": ids, **({"cache_salt": salt} if salt else {})}
        return asyncio.run(router.route_input(policy, "/v1/completions", body)).block_hashes

    assert chain("sql") == _engine_hashes(ids, 4, lora)
    assert chain("sql", salt="s") == _engine_hashes(ids, 4, lora, salt="s")
    assert chain("base") == _engine_hashes(ids, 4) != chain("sql")
    other = LoRARequest("sql", 8, "/adapters/sql-v2", content_hash="ffff0000")   # same name, other weights
    assert _engine_hashes(ids, 4, other)[0] != chain("sql")[0]
    # backend a stored the adapter's blocks: an adapter request overlaps them, a base request does not
    router.index.apply(0, KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=_engine_hashes(ids, 4, lora), parent_block_hash=None, token_ids=ids, block_size=4,
        lora_id=7, lora_name="sql")]))
    assert router.index.match(chain("sql"), [0, 1]) == {0: 3, 1: 0}
    assert router.index.match(chain("base"), [0, 1]) == {0: 0, 1: 0}


def test_kv_events_carry_the_adapter_name():
    """The engine's BlockStored has vLLM's lora_id and lora_name (msgpack round trip)."""
    import msgspec

    from tokenmill.core.kv_events import decode_batch

    ev = BlockStored(block_hashes=[b"h" * 32], parent_block_hash=None, token_ids=[1, 2], block_size=2,
                     lora_id=3, lora_name="sql")
    back = decode_batch(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[ev]))).events[0]
    assert back.lora_id == 3 and back.lora_name == "sql" and back.medium is None
