"""Chained, salted block hashes."""

import pytest

from tokenmill.core.prefix_cache import (
    PrefixCacheStats,
    block_extra_keys,
    hash_block_tokens,
    update_block_hashes,
)
from tokenmill.core.request import Request
from tokenmill.sampling_params import SamplingParams


def req(tokens, salt=None, rid="r"):
    return Request(rid, tokens, SamplingParams(), cache_salt=salt)


def test_hash_is_sha256_digest_and_deterministic():
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == 32
    assert h == hash_block_tokens(None, [1, 2, 3, 4])
    assert h != hash_block_tokens(None, [1, 2, 3, 5])
    assert h != hash_block_tokens(h, [1, 2, 3, 4])  # parent matters
    assert h != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))


def test_encoding_is_unambiguous():
    # Token boundaries, string vs int keys and key boundaries never collide.
    assert hash_block_tokens(None, [12, 3]) != hash_block_tokens(None, [1, 23])
    assert hash_block_tokens(None, [1], ("1",)) != hash_block_tokens(None, [1], (1,))
    assert hash_block_tokens(None, [1], ("ab", "c")) != hash_block_tokens(None, [1], ("a", "bc"))
    with pytest.raises(TypeError):
        hash_block_tokens(None, [1], (1.5,))


def test_chain_early_token_changes_all_later_hashes():
    a = req(list(range(12)))
    b = req([99] + list(range(1, 12)))
    c = req(list(range(4)) + [99] + list(range(5, 12)))
    ha, hb, hc = (update_block_hashes(r, 4) for r in (a, b, c))
    assert len(ha) == 3
    assert all(x != y for x, y in zip(ha, hb))  # block 0 differs -> every hash differs
    assert hc[0] == ha[0] and hc[1] != ha[1] and hc[2] != ha[2]
    assert ha[1] == hash_block_tokens(ha[0], [4, 5, 6, 7])


def test_salt_changes_every_hash_and_only_keys_first_block():
    plain = req(list(range(12)))
    salted = req(list(range(12)), salt="tenant-a")
    other = req(list(range(12)), salt="tenant-b")
    hp, hs, ho = (update_block_hashes(r, 4) for r in (plain, salted, other))
    assert all(x != y for x, y in zip(hp, hs))
    assert all(x != y for x, y in zip(hs, ho))
    assert block_extra_keys(salted, 0) == ("tenant-a",)
    assert block_extra_keys(salted, 1) == ()
    assert hs[0] == hash_block_tokens(None, [0, 1, 2, 3], ("tenant-a",))
    assert hs[1] == hash_block_tokens(hs[0], [4, 5, 6, 7])


def test_update_is_incremental_and_skips_partial_blocks():
    r = req([1, 2, 3, 4, 5, 6])
    assert len(update_block_hashes(r, 4)) == 1
    first = r.block_hashes[0]
    r.append_output_token_ids([7])
    assert len(update_block_hashes(r, 4)) == 1
    r.append_output_token_ids(8)
    hashes = update_block_hashes(r, 4)
    assert len(hashes) == 2 and hashes[0] is first
    assert hashes == update_block_hashes(req([1, 2, 3, 4, 5, 6, 7, 8]), 4)


def test_stats_hit_rate():
    s = PrefixCacheStats()
    assert s.hit_rate == 0.0
    s.queries, s.hits = 20, 8
    assert s.hit_rate == pytest.approx(0.4)
