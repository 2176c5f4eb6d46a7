"""Block hashing for prefix caching: chained, salted, collision-safe.

Each *full* block of a request's token sequence is identified by

    hash_i = SHA-256(tag || hash_{i-1} || token ids of block i || extra keys_i)

(the idea of vLLM v1's ``kv_cache_utils.hash_block_tokens``; the chain makes a
block's identity depend on the whole prefix, as in PagedAttention's
"sharing" of §4.4, arXiv 2309.06180, and SGLang's RadixAttention, arXiv
2312.07104 §3). The extra keys of the *first* block carry the request's
``cache_salt``; since every later hash contains its parent's, a salt changes
every hash of the chain, so requests with different salts never share blocks. A LoRA adapter's
key (``LoRARequest.prefix_cache_key``: its name and content hash, else its id) joins the same extra keys: requests of different adapters never share blocks either.

Verification of a hit: the cache index is keyed by the full 32-byte SHA-256
digest of a canonical, length-prefixed byte encoding (no Python ``hash()``,
no separators that could be confused). Finding a block whose digest equals the
one computed from the request's own prefix therefore means the same tokens
and salt with the collision resistance of SHA-256 (a chance near 2**-128 even
over billions of blocks); no per-block token copy is stored. This is the
choice vLLM made for its ``sha256`` prefix-caching hash option.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from tokenmill.core.request import Request

BlockHash = bytes
"""A 32-byte SHA-256 digest identifying a full block and its whole prefix."""

_TAG = b"tokenmill-kv-block-v1"
_NO_PARENT = b"\x00" * 32


def _encode_extra(keys: Sequence[object]) -> bytes:
    out = [struct.pack("<I", len(keys))]
    for k in keys:
        if isinstance(k, str):
            b = k.encode("utf-8")
            out.append(b"s" + struct.pack("<I", len(b)) + b)
        elif isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"extra hash keys must be str or int, got {type(k).__name__}")
        else:
            out.append(b"i" + struct.pack("<q", k))
    return b"".join(out)


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: Sequence[object] = ()) -> BlockHash:
    """Hash one full block, chained to its parent block's hash.

    Args:
        parent_hash: hash of the previous block, or None for the first block.
        token_ids: the block's ``[block_size]`` token ids (ints in [0, 2**63)).
        extra_keys: extra identity (str or int values), e.g. ``(cache_salt,)``.

    Returns:
        a 32-byte SHA-256 digest.

    Raises:
        TypeError: an extra key is neither str nor int.
        struct.error: a token id does not fit a signed 64-bit integer.
    """
    h = hashlib.sha256(_TAG)
    h.update(_NO_PARENT if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(_encode_extra(extra_keys))
    return h.digest()


def block_extra_keys(request: Request, block_index: int) -> tuple[object, ...]:
    """Extra hash keys of block ``block_index``: the cache salt and the LoRA adapter id on block 0 only
    (they then chain), so requests of different adapters (or salts) never share blocks."""
    if block_index != 0:
        return ()
    keys: tuple[object, ...] = () if request.cache_salt is None else (request.cache_salt,)
    lora = getattr(request, "lora_request", None)
    if lora is not None:     # its name and content when known (a router can compute it), else its id
        key = getattr(lora, "prefix_cache_key", None)
        keys += (key if key is not None else int(lora.lora_int_id),)
    return keys


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` with the hashes of newly full blocks.

    Incremental: only blocks that became full since the last call are hashed
    (O(new tokens)). Call it after tokens are appended to the request.

    Returns:
        ``request.block_hashes`` (one hash per full block of ``all_token_ids``).
    """
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[i - 1] if i > 0 else None
        hashes.append(hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size],
                                        block_extra_keys(request, i)))
    return hashes


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters since start (or the last reset).

    Counted on a request's first scheduling only: tokens recomputed after a
    preemption are neither queries nor hits.

    Attributes:
        requests: requests looked up.
        queries: prompt tokens looked up, in tokens.
        hits: of those, tokens served from cached blocks, in tokens.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """hits / queries (0.0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0
