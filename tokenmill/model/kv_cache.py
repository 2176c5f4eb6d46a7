"""KV cache sizing and allocation for the model runner.

The paged KV cache (PagedAttention, arXiv 2309.06180 §4.1) is one
preallocated pool of fixed-size blocks per layer. :func:`plan_kv_cache` turns
the cache config (``--kv-cache-memory`` bytes or ``--num-kv-blocks``) and the
model geometry into a :class:`KVCacheLayout` and logs what it means (bytes per
token, pool size in tokens, requests that fit at ``max_model_len``);
:func:`allocate_kv_caches` allocates the tensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenmill.config import CacheConfig
from tokenmill import envs
from tokenmill.model import huge_pages

logger = logging.getLogger(__name__)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes: 2 (K and V) × layers × KV heads × head dim × element size."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVCacheLayout:
    """Geometry of the KV pool.

    Attributes:
        num_blocks: blocks the scheduler may hand out (ids ``0 .. num_blocks - 1``);
            one more scratch block (id ``num_blocks``) is allocated for padding rows.
        block_size: tokens per block.
        num_layers, num_kv_heads, head_dim: model geometry.
        dtype: element type of the cache.
        bytes_per_token: KV bytes of one token over all layers.
        max_model_len: context limit in tokens.
    """

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    bytes_per_token: int
    max_model_len: int

    @property
    def blocks_per_seq(self) -> int:
        """Blocks one request at ``max_model_len`` needs (the block-table width)."""
        return -(-self.max_model_len // self.block_size)

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """Per-layer cache shape ``[2, num_blocks + 1, block_size, num_kv_heads, head_dim]``."""
        return (2, self.num_blocks + 1, self.block_size, self.num_kv_heads, self.head_dim)


def plan_kv_cache(cache: CacheConfig, arch, dtype: torch.dtype, max_model_len: int) -> KVCacheLayout:
    """Size the pool from ``cache.num_kv_blocks`` or ``cache.kv_cache_memory_bytes`` and log the result.

    Args:
        cache: the cache config (block size and pool size).
        arch: the model's :class:`~tokenmill.model.arch_config.ModelArchConfig`.
        dtype: element type of the cache.
        max_model_len: context limit in tokens.

    Returns:
        the layout; at least one block. Warns when one request at
        ``max_model_len`` does not fit (such requests are refused with 400).
    """
    bpt = kv_bytes_per_token(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, dtype)
    if cache.num_kv_blocks is not None:
        num_blocks = int(cache.num_kv_blocks)
    else:
        num_blocks = max(1, cache.kv_cache_memory_bytes // (bpt * cache.block_size))
    layout = KVCacheLayout(num_blocks=num_blocks, block_size=cache.block_size, num_layers=arch.num_hidden_layers,
                           num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim, dtype=dtype,
                           bytes_per_token=bpt, max_model_len=max_model_len)
    pool_tokens = num_blocks * cache.block_size
    logger.info(
        "KV cache (%s): %d bytes/token (2 x %d layers x %d KV heads x %d head dim x %d B), %d blocks x %d "
        "tokens = %d tokens (%.1f MiB, + 1 scratch block); %.2f requests fit at max_model_len=%d",
        str(dtype).replace("torch.", ""), bpt, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
        torch.empty((), dtype=dtype).element_size(), num_blocks, cache.block_size, pool_tokens,
        pool_tokens * bpt / 2**20, num_blocks / layout.blocks_per_seq, max_model_len)
    if num_blocks < layout.blocks_per_seq:
        logger.warning(
            "the KV cache holds %d tokens, less than max_model_len=%d: requests longer than the pool "
            "will be refused (400); raise --kv-cache-memory / --num-kv-blocks or lower --max-model-len",
            pool_tokens, max_model_len)
    return layout


def allocate_kv_caches(layout: KVCacheLayout, device: torch.device, zero: bool = False) -> list[torch.Tensor]:
    """One tensor of :attr:`KVCacheLayout.shape` per layer, on ``device``, left uninitialised unless ``zero``.

    No zeroing pass is needed (it took ~1.1 s of start-up for the default 1 GiB pool, and on CPU an
    untouched allocation costs no memory until a block is written): attention reads only the
    positions ``< seq_len`` of each request, all written before they are read (this step's K/V are
    written before attention runs), and the padding rows of a compiled step write to the scratch
    block, which no request reads. The CPU decode and prefill kernels loop over exactly those
    positions; SDPA prefill gathers exactly them; the torch decode path, which gathers up to the
    longest context of the batch, zeroes V past each request's length before the probability-weighted
    sum (a masked position has probability 0, and 0 x NaN would be NaN). ``tests/model/test_kv_cache_nan.py``
    fills the pool with NaN and checks every path against a zeroed pool.
    ``TOKENMILL_KV_CACHE_ZERO=1`` (or ``zero=True``) zeroes it anyway. On CPU each layer's tensor is its own
    mapping on transparent huge pages (:mod:`tokenmill.model.huge_pages`; a served request's blocks are scattered
    over the pool, and decode attention B=64 measured 1.05-1.16x faster on them, AVX2 EPYC), which read as zeros.
    """
    zero = zero or envs.TOKENMILL_KV_CACHE_ZERO
    per_layer = torch.Size(layout.shape).numel() * torch.empty((), dtype=layout.dtype).element_size()
    huge = huge_pages.enabled(device)
    logger.info("allocating the KV cache: %d layers x %.1f MiB%s%s", layout.num_layers, per_layer / 2**20,
                " (zeroed)" if zero else " (not zeroed: untouched pages cost nothing until written)",
                ", transparent huge pages asked for" if huge else "")
    if huge:    # anonymous mappings read as zeros: `zero` needs no pass
        return [huge_pages.huge_page_tensor(layout.shape, layout.dtype) for _ in range(layout.num_layers)]
    make = torch.zeros if zero else torch.empty
    return [make(layout.shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
