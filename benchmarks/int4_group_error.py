"""Per-layer error of ``--quantization int4`` at each group size on the default model (no timing).

For every linear layer of SmolLM2-135M (its GGUF weights dequantised to float32, the reference of
``benchmarks/quant_accuracy.py``), quantised with :func:`tokenmill.quantization.methods.quantize_int4` at groups of
32, 64 and 128 inputs (where the group divides the layer's inputs):

* relative weight error ``||dequant(W) - W|| / ||W||`` (mean over the layers of a kind);
* whether every element is within half a step of its group (``(max - min) / 30``: int4's round-to-nearest bound);
* the low-bit kernel's output against ``x · dequant(W)ᵀ`` (largest relative difference over the layers, 4 random
  rows): the packed path and the dequantised path must agree whatever the group.

Prints one line per layer kind, e.g.::

    qkv_proj  in 576  Q4_1  30 layers  g32: 0.0000 ok 4e-07  g64: 0.0820 ok 5e-07

Usage: ``python benchmarks/int4_group_error.py [--model PATH]``
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tokenmill.model.loader import load_model  # noqa: E402
from tokenmill.quantization.lowbit import lowbit_linear  # noqa: E402
from tokenmill.quantization.methods import quantize_int4  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    ap.add_argument("--groups", default="32,64,128")
    args = ap.parse_args()
    torch.set_num_threads(1)
    groups = [int(g) for g in args.groups.split(",")]
    print(f"# {platform.processor() or platform.machine()}, load average {os.getloadavg()[0]:.1f}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    lm = load_model(args.model, dtype="float32", with_tokenizer=False, lowbit=True, weight_cache=False)
    source = {k: v.fmt for k, v in (lm.lowbit_weights or {}).items()}
    stats: dict[tuple, dict[int, list[tuple[float, bool, float]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    gen = torch.Generator().manual_seed(0)
    for name, mod in lm.model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        w = mod.weight.detach().float()
        n, k = w.shape
        x = torch.randn(4, k, generator=gen)
        for g in groups:
            if k % g:
                continue
            lw = quantize_int4(w, g)
            d = lw.dequantize()
            gw = w.reshape(n, -1, g)
            step = ((gw.amax(-1) - gw.amin(-1)) / 15).repeat_interleave(g, 1)
            ok = bool(((d - w).abs() <= step / 2 + 1e-6).all())
            dense = x @ d.t()
            kern = ((lowbit_linear(x, lw) - dense).norm() / dense.norm()).item()
            stats[(name.rsplit(".", 1)[-1], k, source.get(name, "dense"))][g].append(
                ((d - w).norm().item() / w.norm().item(), ok, kern))
    for (kind, k, src), by_g in sorted(stats.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        count = len(next(iter(by_g.values())))
        cells = [f"g{g}: {sum(r[0] for r in v) / len(v):.4f} {'ok' if all(r[1] for r in v) else 'OVER'} "
                 f"{max(r[2] for r in v):.0e}" for g, v in sorted(by_g.items())]
        print(f"{kind:13s} in {k:5d}  {src:5s} {count:3d} layers  " + "  ".join(cells))
    print("columns per group: mean relative weight error, within half a step (ok/OVER), kernel vs dequantised")


if __name__ == "__main__":
    main()
