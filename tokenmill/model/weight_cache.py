"""On-disk cache of processed weights, so a second start pages weights in instead of rebuilding them.

Loading the default GGUF model rebuilds, on every start, the same tensors: every low-bit tensor is
dequantised to the model dtype, q/k rows are un-permuted, q/k/v and gate/up shards are fused, and the
GGUF's codes are repacked into the tile layout of our low-bit kernel
(:class:`~tokenmill.quantization.lowbit.LowBitWeight`). :func:`save` writes the result of that work (the
model's parameters in their final dtype and the packed low-bit codes) to one file; :func:`load` maps
the file (``mmap``, private copy-on-write) and hands out tensors that view it, so loading costs a page-in
of what is used, not a conversion. oneDNN's prepacked weights cannot be cached (they are opaque tensors
with no Python constructor from bytes); the model runner packs them in the background instead
(:func:`tokenmill.model.layers.linear.pack_linear_weights`).

Location: ``$TOKENMILL_CACHE_DIR/weights`` or ``~/.cache/tokenmill/weights``. One file per checkpoint
and recipe, named ``<checkpoint hash>-<key hash>.tmw``; the key covers the checkpoint files' identity
(absolute path, size, mtime in ns), the recipe (dtype, device, low-bit codes on/off, kernel ISA variant,
the config's kernel switches that change the weights) and the versions of tokenmill, torch and this format.
A new entry for a checkpoint removes that checkpoint's *stale* entries (written for other checkpoint file
identities or other tokenmill/torch/format versions: no start can hit them again), keeps its entries for
other recipes of the same files and versions (another dtype, low-bit on/off, other weight-changing kernel
switches) up to ``TOKENMILL_WEIGHT_CACHE_ENTRIES`` per checkpoint, the most recently used first (a hit
refreshes the entry's mtime), and removes every entry whose checkpoint files are gone (a deleted or moved
model, a test's temporary checkpoint): without those rules the folder only grew (6.3 GB of orphans after a
few weeks of test runs on one machine). Keeping one entry per checkpoint (until 2026-12-03) made two
recipes used in turn rebuild each other: the test suite rebuilt the default model's entry 17 times in a
run, 94 CPU-s (AVX2 EPYC).

File layout (little-endian)::

    b"TMWCACHE"  u64 header_len  header (JSON, UTF-8)  zero padding to 64  tensor data (each at a 64-byte offset)

The header holds the key, the data size, every tensor's name, dtype, shape and offset, and how the
low-bit weights are assembled from them. A file is written under a temporary name, flushed (``fsync``)
and renamed into place, so concurrent starts never see a partial file (both may write; the last rename
wins, both files are complete). A file whose magic, header, key, version or length is wrong is reported
with a warning and rebuilt. Tensor data is not checksummed (that would cost a full read per start).

Switches: ``--no-weight-cache`` (``ModelConfig.weight_cache``) or ``TOKENMILL_WEIGHT_CACHE=0``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tokenmill import envs
import tokenmill
from tokenmill.quantization.lowbit import LowBitWeight

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = b"TMWCACHE"
ENV_SWITCH = "TOKENMILL_WEIGHT_CACHE"
_ALIGN = 64
_STALE_TMP_S = 3600   # a temporary file this old belongs to no live writer
# The kernel switches that change the processed weights are part of the key: those declared with
# ``in_weight_key`` in tokenmill/envs.py, as the engine config holds them (CpuKernelSwitches.weight_key()).
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8,
                               torch.int16, torch.int32, torch.int64, torch.bool)}
_BUFFER = "buffer/"


class CorruptCacheError(ValueError):
    """A cache file that cannot be used (bad magic, header, key, version or length)."""


def cache_enabled(flag: bool = True) -> bool:
    """``flag`` (``--weight-cache``) and not ``TOKENMILL_WEIGHT_CACHE=0``."""
    return bool(flag) and envs.TOKENMILL_WEIGHT_CACHE


def cache_root() -> str:
    """``$TOKENMILL_CACHE_DIR/weights`` or ``~/.cache/tokenmill/weights``."""
    return os.path.join(envs.TOKENMILL_CACHE_DIR, "weights")


def checkpoint_files(kind: str, path: str) -> list[str]:
    """The files whose identity keys a checkpoint: the GGUF file, or a folder's config and weight files."""
    if kind == "gguf":
        return [path]
    names = sorted(n for n in os.listdir(path) if n.endswith((".safetensors", ".json", ".bin")))
    return [os.path.join(path, n) for n in names]


def _versions() -> dict[str, str]:
    return {"tokenmill": tokenmill.__version__, "torch": torch.__version__, "format": str(FORMAT_VERSION)}


def cache_key(kind: str, path: str, recipe: dict[str, Any], switches: dict[str, Any]) -> tuple[str, str]:
    """``(file path of the entry, full key)`` for a checkpoint and recipe.

    ``switches``: the kernel switches that change the processed weights, from the engine config
    (``config.cpu_kernels.weight_key()``, :class:`tokenmill.kernel_plan.CpuKernelSwitches`).

    Raises:
        OSError: a checkpoint file cannot be stat-ed.
    """
    ident = []
    for f in checkpoint_files(kind, path):
        st = os.stat(f)
        ident.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
    key = json.dumps({"files": ident, "recipe": recipe, "switches": switches, "versions": _versions()},
                     sort_keys=True)
    ckpt = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return os.path.join(cache_root(), f"{ckpt}-{digest}.tmw"), key


@dataclass
class CachedWeights:
    """What :func:`load` returns: parameter tensors (views of the mapped file) and low-bit weights.

    Attributes:
        params: parameter name (``model.layers.0.self_attn.qkv_proj.weight``) -> tensor.
        lowbit: module name -> :class:`~tokenmill.quantization.lowbit.LowBitWeight`, or None.
        kv_scales: layer index -> ``(k, v, source)`` of checkpoint KV-cache scales.
        nbytes: bytes of tensor data in the file.
    """

    params: dict[str, torch.Tensor]
    lowbit: dict[str, Any] | None
    kv_scales: dict[int, tuple[float, float, str]]
    nbytes: int


def save(file: str, key: str, model: nn.Module, lowbit: dict[str, Any] | None) -> int:
    """Write ``model``'s parameters and the low-bit weights to ``file`` atomically; returns bytes written.

    Then prunes the folder (see the module docstring): this checkpoint's stale entries (other file
    identities or versions), its other recipes beyond ``TOKENMILL_WEIGHT_CACHE_ENTRIES`` (least recently
    used first), orphans and abandoned temporary files. Errors are the caller's to log (the cache is
    optional).

    Raises:
        OSError: the directory or file cannot be written.
        ValueError: a tensor of an unsupported dtype, or a parameter still on the meta device.
    """
    tensors: list[tuple[str, torch.Tensor]] = [(n, p.detach()) for n, p in model.named_parameters()]
    tensors += [(_BUFFER + n, b) for n, b in model.named_buffers() if b is not None]
    lb_meta: dict[str, Any] = {}
    for mod, w in (lowbit or {}).items():
        names = {}
        for part in ("codes", "scale", "min"):
            t = getattr(w, part)
            if t is not None:
                names[part] = f"lowbit/{mod}/{part}"
                tensors.append((names[part], t))
        lb_meta[mod] = {"out": w.out_features, "in": w.in_features, "bits": w.bits, "group": w.group,
                        "fmt": w.fmt, **names}
    kv = {}
    for name, m in model.named_modules():
        sc = getattr(m, "kv_scales", None)
        if sc is not None and getattr(sc, "source", "default") == "checkpoint" and name.startswith("model.layers."):
            kv[name.split(".")[2]] = [sc.k, sc.v, sc.source]
    entries, offset = [], 0
    for name, t in tensors:
        if t.device.type == "meta" or str(t.dtype) not in _DTYPES:
            raise ValueError(f"cannot cache {name}: {t.dtype} on {t.device}")
        offset = -(-offset // _ALIGN) * _ALIGN
        nbytes = t.numel() * t.element_size()
        entries.append([name, str(t.dtype), list(t.shape), offset, nbytes])
        offset += nbytes
    header = json.dumps({"version": FORMAT_VERSION, "key": key, "data_bytes": offset, "tensors": entries,
                         "lowbit": lb_meta if lowbit is not None else None, "kv_scales": kv}).encode()
    start = -(-(len(MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN
    folder = os.path.dirname(file)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".tmw", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(header)) + header)
            f.write(b"\0" * (start - f.tell()))
            for (name, _, _, off, nbytes), (_, t) in zip(entries, tensors):
                f.write(b"\0" * (start + off - f.tell()))
                if nbytes:
                    f.write(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    prefix = os.path.basename(file).split("-")[0] + "-"
    now = time.time()
    mine = json.loads(key)
    siblings: list[tuple[float, str]] = []    # this checkpoint's entries for other recipes: (last use, path)
    for other in os.listdir(folder):
        full = os.path.join(folder, other)
        try:
            if other.startswith(prefix) and other.endswith(".tmw") and other != os.path.basename(file):
                theirs = _read_key(full)
                if theirs is not None and all(theirs.get(k) == mine.get(k) for k in ("files", "versions")):
                    siblings.append((os.stat(full).st_mtime, full))   # another recipe of the same files
                else:
                    os.unlink(full)       # stale: other checkpoint files or versions, or unreadable
            elif other.startswith(".tmp-") and now - os.stat(full).st_mtime > _STALE_TMP_S:
                os.unlink(full)           # left by a writer that was killed
            elif other.endswith(".tmw") and other != os.path.basename(file) and _orphaned(full):
                os.unlink(full)           # its checkpoint files no longer exist
        except OSError:
            pass
    for _, full in sorted(siblings, reverse=True)[max(envs.TOKENMILL_WEIGHT_CACHE_ENTRIES - 1, 0):]:
        try:
            os.unlink(full)               # beyond the per-checkpoint limit: the least recently used go
        except OSError:
            pass
    return start + offset


def _read_key(file: str) -> dict[str, Any] | None:
    """The key (decoded) in the header of the cache entry ``file``; None for an unreadable or foreign file.
    Reads the header only."""
    try:
        with open(file, "rb") as f:
            head = f.read(len(MAGIC) + 8)
            if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
                return None
            (hlen,) = struct.unpack("<Q", head[len(MAGIC):])
            if hlen > 1 << 26:
                return None
            key = json.loads(json.loads(f.read(hlen))["key"])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return key if isinstance(key, dict) else None


def _orphaned(file: str) -> bool:
    """True when ``file`` is a cache entry whose checkpoint files are all gone (reads its header only).

    An unreadable or foreign file is not called orphaned (left alone).
    """
    key = _read_key(file)
    try:
        files = [entry[0] for entry in key["files"]] if key is not None else []
    except (KeyError, TypeError, IndexError):
        return False
    return bool(files) and not any(os.path.exists(p) for p in files)


def load(file: str, key: str) -> CachedWeights:
    """Map ``file`` and return its tensors (views of the private copy-on-write mapping).

    Raises:
        FileNotFoundError: no entry.
        CorruptCacheError: the entry is unusable (wrong magic, header, version, key or length).
    """
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
            raise CorruptCacheError("bad magic")
        (hlen,) = struct.unpack("<Q", head[len(MAGIC):])
        if hlen > size:
            raise CorruptCacheError("header longer than the file")
        try:
            header = json.loads(f.read(hlen))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCacheError(f"unreadable header ({e})") from e
        if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
            raise CorruptCacheError("format version differs")
        if header.get("key") != key:
            raise CorruptCacheError("key differs")
        start = -(-(len(MAGIC) + 8 + hlen) // _ALIGN) * _ALIGN
        if size != start + int(header["data_bytes"]):
            raise CorruptCacheError(f"file is {size} bytes, expected {start + int(header['data_bytes'])}")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    try:
        os.utime(file)          # last use: the per-checkpoint limit keeps the most recently used recipes
    except OSError:
        pass                    # a read-only cache still serves
    out: dict[str, torch.Tensor] = {}
    try:
        for name, dtype, shape, off, nbytes in header["tensors"]:
            dt = _DTYPES[dtype]
            if nbytes == 0:
                out[name] = torch.empty(shape, dtype=dt)
                continue
            t = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=start + off)
            out[name] = t.view(dt).reshape(shape)
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CorruptCacheError(f"bad tensor table ({e})") from e
    lowbit = None
    if header.get("lowbit") is not None:
        lowbit = {}
        for mod, m in header["lowbit"].items():
            lowbit[mod] = LowBitWeight(m["out"], m["in"], m["bits"], m["group"], out.pop(m["codes"]),
                                       out.pop(m["scale"]), out.pop(m["min"]) if "min" in m else None, m["fmt"])
    kv = {int(i): (float(k), float(v), str(s)) for i, (k, v, s) in header.get("kv_scales", {}).items()}
    return CachedWeights(params=out, lowbit=lowbit, kv_scales=kv, nbytes=int(header["data_bytes"]))


def install(model: nn.Module, cached: CachedWeights) -> None:
    """Give ``model`` (built on the meta device) the cached parameters, in place.

    Raises:
        CorruptCacheError: a parameter is missing from the cache, has another shape, or a cached one
            has no place in the model.
    """
    params = dict(model.named_parameters())
    buffers = {n[len(_BUFFER):]: t for n, t in cached.params.items() if n.startswith(_BUFFER)}
    cached_params = {n: t for n, t in cached.params.items() if not n.startswith(_BUFFER)}
    missing = [n for n in params if n not in cached_params]
    extra = [n for n in cached_params if n not in params]
    if missing or extra:
        raise CorruptCacheError(f"parameters differ from the model: missing {missing[:3]}, extra {extra[:3]}")
    for name, p in params.items():
        t = cached_params[name]
        if tuple(t.shape) != tuple(p.shape):
            raise CorruptCacheError(f"{name}: cached shape {tuple(t.shape)} != {tuple(p.shape)}")
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    for name, t in buffers.items():
        mod_name, _, leaf = name.rpartition(".")
        try:
            mod = model.get_submodule(mod_name) if mod_name else model
        except AttributeError as e:
            raise CorruptCacheError(f"cached buffer {name} has no place in the model") from e
        mod._buffers[leaf] = t
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
            if t is not None and t.device.type == "meta"]
    if left:
        raise CorruptCacheError(f"the cache does not hold {left[:3]}")
    for i, (k, v, source) in cached.kv_scales.items():
        sc = model.model.layers[i].self_attn.kv_scales
        sc.k, sc.v, sc.source = k, v, source
