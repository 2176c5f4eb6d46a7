"""Huge-page backing of the CPU KV pool: the same values as ordinary pages, 2 MiB-aligned
data, alive as long as a view, and off with TOKENMILL_HUGE_PAGES=0."""

from __future__ import annotations

import ctypes
import gc
import mmap

import pytest
import torch

from tokenmill.model import huge_pages
from tokenmill.model.kv_cache import KVCacheLayout, allocate_kv_caches

pytestmark = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="this Python's mmap has no MADV_HUGEPAGE "
                                "(not Linux): huge pages are never asked for")


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def _anon_huge_kib_of(addr: int) -> int:
    """AnonHugePages (KiB) of this process's mapping that holds ``addr`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_tensor_reads_zeros_is_aligned_and_outlives_its_base():
    t = huge_pages.huge_page_tensor((3, 5, 16, 2, 8), torch.bfloat16)
    assert t.shape == (3, 5, 16, 2, 8) and t.dtype == torch.bfloat16
    assert t.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert torch.equal(t, torch.zeros_like(t))
    t.fill_(1.5)
    view = t[1]
    del t
    gc.collect()
    assert torch.equal(view, torch.full((5, 16, 2, 8), 1.5, dtype=torch.bfloat16))   # the mapping is still there


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"), reason=f"transparent huge pages are "
                    f"'{_thp_mode()}' here: the kernel ignores the advice, nothing to observe")
def test_the_kernel_grants_huge_pages_on_first_touch():
    t = huge_pages.huge_page_tensor((16 << 20,), torch.uint8)     # 16 MiB: 8 huge pages
    assert _anon_huge_kib_of(t.data_ptr()) == 0                    # nothing touched yet
    t.fill_(1)
    granted = _anon_huge_kib_of(t.data_ptr())
    # a fragmented host may grant fewer than all 8: at least one (an ordinary-page mapping shows 0)
    assert granted >= 2048, f"AnonHugePages of the mapping: {granted} KiB"
    # a mapping of the same size without the advice gets none under "madvise". Not torch.ones(): the allocator
    # may place it in memory an earlier test of this process advised (glibc's heap after its mmap threshold grew),
    # which failed this check once under pytest-xdist (24 MiB of huge pages around a plain tensor).
    plain = mmap.mmap(-1, 16 << 20)
    plain.write(b"\1" * (16 << 20))
    first = ctypes.c_char.from_buffer(plain)
    try:
        assert _anon_huge_kib_of(ctypes.addressof(first)) == 0 or _thp_mode() == "always"
    finally:
        del first                                                  # the buffer export, before the mapping closes
        plain.close()


def _layout() -> KVCacheLayout:
    return KVCacheLayout(num_blocks=7, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16,
                         bytes_per_token=2 * 2 * 2 * 8 * 2, max_model_len=16)


def test_kv_pool_on_huge_pages_by_default_and_ordinary_pages_when_off(monkeypatch):
    monkeypatch.delenv("TOKENMILL_HUGE_PAGES", raising=False)
    assert huge_pages.enabled("cpu") and not huge_pages.enabled("meta")
    on = allocate_kv_caches(_layout(), torch.device("cpu"))
    assert all(c.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 for c in on)
    assert all(bool((c == 0).all()) for c in on)          # anonymous pages read as zeros, `zero` or not
    monkeypatch.setenv("TOKENMILL_HUGE_PAGES", "0")
    assert not huge_pages.enabled("cpu")
    off = allocate_kv_caches(_layout(), torch.device("cpu"), zero=True)
    assert [c.shape for c in off] == [c.shape for c in on] and all(bool((c == 0).all()) for c in off)
