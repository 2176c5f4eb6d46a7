"""GGUF block types as group-wise codes: the codes rebuild ggml's own dequantisation exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tokenmill.quantization.gguf import SUPPORTED, GroupCodes, block_codes, merge_shards  # noqa: E402
from tokenmill.quantization.lowbit import LowBitWeight  # noqa: E402

# block size (weights), block bytes, offsets of float16 fields
SPEC = {"Q4_0": (32, 18, [0]), "Q4_1": (32, 20, [0, 2]), "Q5_0": (32, 22, [0]), "Q5_1": (32, 24, [0, 2]),
        "Q8_0": (32, 34, [0]), "Q4_K": (256, 144, [0, 2]), "Q6_K": (256, 210, [208])}


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random block bytes with finite float16 scales (every code pattern occurs)."""
    rng = np.random.default_rng(seed)
    bk, bs, f16 = SPEC[qtype]
    raw = rng.integers(0, 256, (rows, cols // bk, bs), dtype=np.uint8)
    for o in f16:
        d = rng.uniform(-0.1, 0.1, (rows, cols // bk)).astype(np.float16)
        raw[..., o:o + 2] = d.view(np.uint8).reshape(rows, cols // bk, 2)
    return raw


@pytest.mark.parametrize("qtype", SUPPORTED)
def test_codes_rebuild_ggml_dequantisation_exactly(qtype):
    rows, cols = 16, 512
    raw = random_blocks(qtype, rows, cols)
    ref = gguf.quants.dequantize(raw.reshape(rows, -1), Q[qtype]).reshape(rows, cols)
    gc = block_codes(raw, qtype, rows, cols)
    assert gc.bits == (4 if qtype.startswith("Q4") else 8) and gc.group == (16 if qtype == "Q6_K" else 32)
    np.testing.assert_array_equal(gc.dequantize().numpy(), ref)
    packed = LowBitWeight.from_codes(gc.codes, gc.scale, gc.min, gc.bits, qtype)   # and after packing
    np.testing.assert_array_equal(packed.dequantize().numpy(), ref)
    per_weight = gc.bits / 8 + (4 if gc.min is None else 8) / gc.group     # codes + float32 scale (+ min)
    assert packed.nbytes == rows * cols * per_weight


def test_merge_shards_of_mixed_formats_is_exact():
    rows = 4
    parts = [block_codes(random_blocks(t, rows, 256, seed=i), t, rows, 256)
             for i, t in enumerate(("Q4_K", "Q6_K", "Q8_0"))]
    m = merge_shards(parts)
    assert m.bits == 8 and m.group == 16 and m.min is not None and m.fmt == "Q4_K+Q6_K+Q8_0"
    torch.testing.assert_close(m.dequantize(), torch.cat([p.dequantize() for p in parts]), rtol=0, atol=0)


def test_wrong_size_and_type_are_rejected():
    with pytest.raises(ValueError, match="do not hold"):
        block_codes(np.zeros(100, np.uint8), "Q4_0", 2, 64)
    with pytest.raises(ValueError, match="no low-bit kernel format"):
        block_codes(np.zeros(100, np.uint8), "Q2_K", 2, 256)
