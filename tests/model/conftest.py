"""Shared helpers for the model-side tests: tiny configs and a paged-cache driver."""

from __future__ import annotations

import random

import pytest
import torch

from tokenmill.model.arch_config import ModelArchConfig
from tokenmill.model.layers.attention import build_attention_metadata


def tiny_arch(variant: str = "llama", **overrides) -> ModelArchConfig:
    """A 2-layer, hidden-64 config; ``variant`` in llama / qwen2 (qkv bias) / qwen3 (q/k norm)."""
    base = dict(
        architecture={"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[variant],
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=96, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=variant != "qwen2",
        attention_bias=variant == "qwen2", qk_norm=variant == "qwen3", bos_token_id=1, eos_token_id=2,
    )
    if variant == "qwen3":
        base["head_dim"] = 24  # head_dim != hidden / heads, as in real Qwen3
    base.update(overrides)
    return ModelArchConfig(**base)


class PagedRunner:
    """Drives a model through a paged KV cache with shuffled, non-contiguous block ids.

    Each request gets its own randomly chosen blocks from one shared pool, so
    a bug that mixes requests or assumes contiguous blocks shows up.
    """

    def __init__(self, model, arch: ModelArchConfig, num_blocks: int = 64, block_size: int = 4, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
        self.model, self.block_size = model, block_size
        self.caches = [torch.zeros(2, num_blocks, block_size, arch.num_key_value_heads, arch.head_dim,
                                   dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.device = device

    def step(self, work: list[tuple[str, list[int]]], last_only: bool = False) -> torch.Tensor:
        """Run one flattened step; ``work`` = [(req_id, new token ids)].

        Returns logits ``[num_tokens, vocab]``, or ``[num_reqs, vocab]`` for
        each request's last token when ``last_only``.
        """
        for rid, toks in work:
            self.computed.setdefault(rid, 0)
            table = self.tables.setdefault(rid, [])
            need = -(-(self.computed[rid] + len(toks)) // self.block_size)
            while len(table) < need:
                table.append(self.free.pop())
        md, pos = build_attention_metadata([self.computed[r] for r, _ in work], [len(t) for _, t in work],
                                           [self.tables[r] for r, _ in work], self.block_size, self.device)
        ids = torch.tensor([t for _, toks in work for t in toks], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            hidden = self.model(ids, pos, self.caches, md)
            if last_only:
                hidden = hidden[md.query_start_loc[1:].long() - 1]
            logits = self.model.compute_logits(hidden)
        for rid, toks in work:
            self.computed[rid] += len(toks)
        return logits


@pytest.fixture
def paged_runner():
    return PagedRunner


@pytest.fixture
def make_tiny_arch():
    return tiny_arch
