"""CPU memory on transparent huge pages (2 MiB), for the KV pool.

Decode reads, per request, its KV blocks, scattered over the pool (16-token blocks: 6 KiB per layer for SmolLM2's 3
x 64 bfloat16 K). On 4 KiB pages that is a TLB miss and a page walk every block or two, and the hardware prefetchers
stop at every page edge; on a 2 MiB page one TLB entry covers ~340 such blocks. Linux grants huge pages to an
anonymous mapping on first touch when ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``
(the usual default) and the mapping is advised ``MADV_HUGEPAGE``; elsewhere the advice is ignored and the memory is
ordinary pages (untouched pages cost nothing, and read as zeros, as with ``torch.empty``).

Measured (AVX2 EPYC, 2 cores, 2026-12-03; ``benchmarks/huge_pages_ab.py``,
docs/benchmarks/2026-12-03-huge-pages-avx2.md; both arms alternating in one process): decode attention B=64 over the default-sized scattered bfloat16 pool
1.05-1.16x, the whole decode step B=64 1.03-1.07x, B=1 0.95-1.05x (neutral); sequential reads up to 1.13x. Measured
on the AVX2 kind only; the mechanism (TLB reach, page-bounded prefetchers) is not ISA-specific. The weights (read
once per step, in order) were tried on huge pages too: B=1 decode 0.92-1.06x, no gain, so they stay file-mapped.
``TOKENMILL_HUGE_PAGES=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import mmap

import torch

from tokenmill import envs

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20


def enabled(device: torch.device | str = "cpu") -> bool:
    """True where allocations should ask for huge pages: a CPU device, ``TOKENMILL_HUGE_PAGES`` on, and a
    Python whose ``mmap`` knows ``MADV_HUGEPAGE`` (Linux)."""
    return torch.device(device).type == "cpu" and envs.TOKENMILL_HUGE_PAGES and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_buffer(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous private mapping with ``nbytes`` usable bytes starting at a 2 MiB boundary, advised
    ``MADV_HUGEPAGE``: returns ``(mapping, offset)``, the usable bytes being ``mapping[offset:offset + nbytes]``.

    The mapping is ``nbytes`` + 2 MiB long (the alignment slack is never touched, so it costs no memory). A
    failed ``madvise`` (a kernel without transparent huge pages) leaves ordinary pages and is logged at debug.

    Raises:
        OSError: the mapping could not be made (out of address space or memory).
    """
    nbytes = max(1, int(nbytes))
    mm = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    offset = -addr % HUGE_PAGE_BYTES          # addr is page aligned, so offset is too
    try:
        mm.madvise(mmap.MADV_HUGEPAGE, offset, nbytes)
    except (OSError, AttributeError) as e:
        logger.debug("madvise(MADV_HUGEPAGE) failed: %s", e)
    return mm, offset


def huge_page_tensor(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised (zero-reading) CPU tensor of ``shape`` / ``dtype`` on its own huge-page mapping
    (:func:`huge_page_buffer`); the mapping lives as long as the tensor or any view of it.

    Raises:
        OSError: as :func:`huge_page_buffer`.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = torch.Size(shape).numel() * elem
    mm, offset = huge_page_buffer(nbytes)
    return torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
