"""The processed-weight cache: a second load maps the first load's result; the runner's output is unchanged."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

pytest.importorskip("gguf")

from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.kernel_plan import CpuKernelSwitches  # noqa: E402
from tokenmill.model import gguf_loader, weight_cache  # noqa: E402
from tokenmill.model.layers.attention import AttentionMetadata  # noqa: E402
from tokenmill.model.layers.linear import PackedLinear, wait_for_packing  # noqa: E402
from tokenmill.model.loader import load_model  # noqa: E402
from tokenmill.model.runner import ModelRunner  # noqa: E402
from tests.model.test_gguf import write_tiny_gguf  # noqa: E402


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv(weight_cache.ENV_SWITCH, raising=False)
    return tmp_path / "cache" / "weights"


@pytest.fixture
def gguf_path(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, with_tokenizer=True)
    return str(path)


def _runner(path: str, **kw) -> ModelRunner:
    cfg = EngineConfig.from_kwargs(model=path, dtype="float32", num_kv_blocks=16, block_size=4, max_model_len=64,
                                   max_num_seqs=4, max_num_batched_tokens=32, **kw)
    return ModelRunner.from_config(cfg, with_tokenizer=False)


def _logits(r: ModelRunner, n: int) -> torch.Tensor:
    ids, pos = torch.arange(5, 5 + n), torch.arange(n)
    md = AttentionMetadata(slot_mapping=torch.arange(n), query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                           seq_lens=torch.tensor([n], dtype=torch.int32),
                           block_tables=torch.tensor([list(range(-(-n // 4)))], dtype=torch.int32),
                           query_lens=[n], seq_lens_list=[n], max_query_len=n, max_seq_len=n, block_size=4)
    with torch.inference_mode():
        return r.model.compute_logits(r.model(ids, pos, r.kv_caches, md))


def _entries(cache_dir) -> list[str]:
    return sorted(f for f in os.listdir(cache_dir) if f.endswith(".tmw")) if os.path.isdir(cache_dir) else []


def test_second_load_maps_the_cache_and_gives_the_same_outputs(cache_dir, gguf_path, monkeypatch, caplog):
    cold = _runner(gguf_path)
    assert len(_entries(cache_dir)) == 1

    def no_conversion(*a, **k):
        raise AssertionError("a cache hit must not convert the checkpoint")

    monkeypatch.setattr(gguf_loader, "iter_gguf_weights", no_conversion)
    with caplog.at_level(logging.INFO, logger="tokenmill.model.loader"):
        warm = _runner(gguf_path)
    assert "processed-weight cache" in caplog.text
    for n in (3, 12):    # a low-bit small step and a oneDNN step
        assert torch.equal(_logits(cold, n), _logits(warm, n))
    low = lambda r: sorted(n for n, m in r.model.named_modules() if isinstance(m, PackedLinear) and m.lowbit_max_rows)
    assert low(cold) == low(warm) and warm.lowbit_max_tokens == cold.lowbit_max_tokens
    assert wait_for_packing(warm.model, 60)
    assert all(m.packed_weight is not None for m in warm.model.modules() if isinstance(m, PackedLinear))
    # the parameters view the mapped file (no copy)
    assert warm.model.model.embed_tokens.weight.untyped_storage().nbytes() > 0


def test_disabled_by_flag_or_environment(cache_dir, gguf_path, monkeypatch):
    _runner(gguf_path, weight_cache=False)
    assert _entries(cache_dir) == []
    monkeypatch.setenv(weight_cache.ENV_SWITCH, "0")
    _runner(gguf_path)
    assert _entries(cache_dir) == []


@pytest.mark.parametrize("damage", ["truncate", "garbage", "header"])
def test_corrupt_entry_is_rebuilt_with_a_warning(cache_dir, gguf_path, caplog, damage):
    ref = _logits(_runner(gguf_path), 3)
    (entry,) = _entries(cache_dir)
    path = os.path.join(cache_dir, entry)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        if damage == "truncate":
            f.truncate(size - 100)
        elif damage == "garbage":
            f.write(b"not a cache file at all")
        else:
            f.seek(16)
            f.write(b"{{{{")
    with caplog.at_level(logging.WARNING, logger="tokenmill.model.loader"):
        r = _runner(gguf_path)
    assert "unusable" in caplog.text and "rebuilding" in caplog.text
    assert torch.equal(_logits(r, 3), ref)
    assert os.path.getsize(path) == size        # rewritten whole
    weight_cache.load(path, _key_of(path))      # and loads again


def _key_of(path: str) -> str:
    import json
    import struct

    with open(path, "rb") as f:
        f.read(8)
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))["key"]


def test_key_follows_the_file_and_recipe_and_stale_entries_go(cache_dir, gguf_path):
    load_model(gguf_path, dtype="float32", with_tokenizer=False)
    first = _entries(cache_dir)
    load_model(gguf_path, dtype="bfloat16", with_tokenizer=False)   # another recipe: another entry, both kept
    assert len(_entries(cache_dir)) == 2 and set(first) < set(_entries(cache_dir))
    recipe = {"kind": "gguf", "dtype": "torch.bfloat16", "device": "cpu", "lowbit": False, "redundant_experts": 0}
    entries = lambda: [os.path.join(cache_dir, e) for e in _entries(cache_dir)]  # noqa: E731
    assert weight_cache.cache_key("gguf", gguf_path, recipe, CpuKernelSwitches.from_env().weight_key())[0] in entries()
    st = os.stat(gguf_path)
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))      # the file changed: a new key
    assert weight_cache.cache_key("gguf", gguf_path, recipe, CpuKernelSwitches.from_env().weight_key())[0] not in entries()
    load_model(gguf_path, dtype="float32", with_tokenizer=False)   # its write removes both stale entries
    assert len(_entries(cache_dir)) == 1 and not set(first) & set(_entries(cache_dir))


def test_recipes_of_one_checkpoint_are_kept_up_to_the_limit_least_recently_used_first(cache_dir, gguf_path,
                                                                                       monkeypatch, caplog):
    """Recipes used in turn (the test suite's float32 and bfloat16 starts) each keep their entry; beyond
    ``TOKENMILL_WEIGHT_CACHE_ENTRIES`` per checkpoint the least recently used (a hit counts as a use) goes."""
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE_ENTRIES", "2")
    recipes = [dict(dtype="float32"), dict(dtype="bfloat16"), dict(dtype="float32", lowbit=True)]

    def hit(**kw) -> bool:
        with caplog.at_level(logging.INFO, logger="tokenmill.model.loader"):
            caplog.clear()
            load_model(gguf_path, with_tokenizer=False, **kw)
            return any("mapped from the processed-weight cache" in r.getMessage() for r in caplog.records)

    assert not hit(**recipes[0]) and not hit(**recipes[1])
    assert len(_entries(cache_dir)) == 2
    assert hit(**recipes[0]) and hit(**recipes[1])                 # both hit: no rebuild when alternating
    assert hit(**recipes[0])                                       # ... and this hit makes bfloat16 the LRU one
    bf16 = weight_cache.cache_key("gguf", gguf_path, {"kind": "gguf", "dtype": "torch.bfloat16", "device": "cpu",
                                                      "lowbit": False, "redundant_experts": 0},
                                  CpuKernelSwitches.from_env().weight_key())[0]
    assert os.path.basename(bf16) in _entries(cache_dir)
    assert not hit(**recipes[2])                                   # a third recipe: the LRU entry goes
    assert len(_entries(cache_dir)) == 2 and os.path.basename(bf16) not in _entries(cache_dir)
    assert hit(**recipes[0]) and hit(**recipes[2])
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE_ENTRIES", "1")
    assert not hit(**recipes[1])
    assert _entries(cache_dir) == [os.path.basename(bf16)]         # 1: only the latest recipe


def test_entries_of_deleted_checkpoints_are_pruned_on_the_next_write(cache_dir, gguf_path, tmp_path):
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, with_tokenizer=True)
    load_model(str(other), dtype="float32", with_tokenizer=False)
    (cache_dir / "foreign.tmw").write_bytes(b"not a cache entry")          # unreadable: left alone
    assert len(_entries(cache_dir)) == 2
    os.remove(other)                                                        # its entry is now an orphan
    load_model(gguf_path, dtype="float32", with_tokenizer=False)            # a write prunes it
    entries = _entries(cache_dir)
    assert len(entries) == 2 and "foreign.tmw" in entries
    assert weight_cache._orphaned(str(cache_dir / [e for e in entries if e != "foreign.tmw"][0])) is False


def test_concurrent_writers_leave_one_complete_entry(cache_dir, gguf_path):
    loaded = load_model(gguf_path, dtype="float32", with_tokenizer=False, weight_cache=False)
    file, key = weight_cache.cache_key("gguf", gguf_path, {"test": 1}, {})
    errors = []

    def write():
        try:
            weight_cache.save(file, key, loaded.model, None)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=write) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [f for f in os.listdir(cache_dir)] == [os.path.basename(file)]   # no temporary file left
    cached = weight_cache.load(file, key)
    for name, p in loaded.model.named_parameters():
        assert torch.equal(cached.params[name], p)


def test_first_load_reports_progress(cache_dir, gguf_path, caplog):
    with caplog.at_level(logging.INFO, logger="tokenmill.model.loader"):
        load_model(gguf_path, dtype="float32", with_tokenizer=False)
    n = len(gguf_loader.open_gguf(gguf_path).tensors)
    assert f"loading weights: {n}/{n} tensors" in caplog.text
    assert "wrote the processed-weight cache" in caplog.text


def test_api_side_tokenizer_load_does_not_import_torch(tmp_path, monkeypatch):
    """The server's API process never needs torch: the HTTP stack and a cached GGUF tokenizer load without it."""
    import subprocess
    import sys

    from tokenmill.tokenizer import load_tokenizer

    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path, with_tokenizer=True)
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    want = load_tokenizer(str(path)).encode("aa bb c")         # converts and caches it (imports torch here)
    code = ("import sys; import tokenmill.server.launch, tokenmill.server.app; "
            "from tokenmill.tokenizer import load_tokenizer; "
            f"ids = load_tokenizer({str(path)!r}).encode('aa bb c'); "
            "print(ids, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TOKENMILL_CACHE_DIR": str(tmp_path / "cache")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"{want} False"
