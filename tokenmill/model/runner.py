"""Model runner: turns a :class:`SchedulerOutput` into one flattened forward pass.

All scheduled tokens of all requests (prefill chunks and decode tokens) run in
one batch ``[num_tokens, hidden_size]``; the slot mapping tells attention where
each new token's K/V goes and the block tables where each request's context
lives (PagedAttention, arXiv 2309.06180 §4.1). Inputs are built with numpy
from the scheduler's per-request lists; there is no Python loop per request per
layer.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.model.layers.attention import AttentionMetadata
from tokenmill.model.sampler import Sampler

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> torch.device:
    """``"auto"`` → cuda when available, else cpu; anything else as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes: 2 (K and V) × layers × KV heads × head dim × element size."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Owns the model, the KV cache pool and the sampler.

    Args:
        model: a decoder with ``forward(input_ids, positions, kv_caches, attn_metadata)``
            and ``compute_logits(hidden)`` (see :mod:`tokenmill.model.llama`).
        arch: the model's :class:`~tokenmill.model.loader.ModelArchConfig`.
        config: engine config (block size, pool size, max_model_len, seed).
        device: torch device of the model and cache.
        dtype: dtype of the KV cache (the model's dtype).
        eos_token_ids: the model's end-of-sequence ids.

    Attributes:
        kv_caches: per layer ``[2, num_kv_blocks, block_size, num_kv_heads, head_dim]``.
        num_kv_blocks: blocks in the pool.
        max_model_len: context limit in tokens.
    """

    def __init__(self, model: torch.nn.Module, arch, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, eos_token_ids: list[int]) -> None:
        self.model = model
        self.arch = arch
        self.config = config
        self.device = device
        self.dtype = dtype
        self.eos_token_ids = list(eos_token_ids)
        self.block_size = config.cache.block_size
        model_len = arch.max_position_embeddings
        self.max_model_len = int(config.model.max_model_len or model_len)
        if self.max_model_len > model_len:
            logger.warning("max_model_len %d exceeds the model's context length %d", self.max_model_len, model_len)
        self.bytes_per_token = kv_bytes_per_token(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, dtype)
        if config.cache.num_kv_blocks is not None:
            self.num_kv_blocks = int(config.cache.num_kv_blocks)
        else:
            self.num_kv_blocks = max(1, config.cache.kv_cache_memory_bytes // (self.bytes_per_token * self.block_size))
        shape = (2, self.num_kv_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]
        pool_tokens = self.num_kv_blocks * self.block_size
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        logger.info(
            "KV cache: %d bytes/token (2 x %d layers x %d KV heads x %d head dim x %d B), %d blocks x %d tokens = "
            "%d tokens (%.1f MiB); %.2f requests fit at max_model_len=%d",
            self.bytes_per_token, arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim,
            torch.empty((), dtype=dtype).element_size(), self.num_kv_blocks, self.block_size, pool_tokens,
            pool_tokens * self.bytes_per_token / 2**20, self.num_kv_blocks / blocks_per_seq, self.max_model_len)
        self.sampler = Sampler(seed=config.model.seed, device=device)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "ModelRunner":
        """Load the checkpoint named by ``config.model`` and build the runner.

        Raises:
            FileNotFoundError, ValueError: from the loader (missing file,
                unsupported architecture or dtype).
        """
        from tokenmill.model.loader import load_model, resolve_dtype

        device = resolve_device(config.model.device)
        configure_threads(device)
        t0 = time.perf_counter()
        loaded = load_model(config.model.model, dtype=config.model.dtype, device=device)
        logger.info("loaded %s (%s) in %.1f s on %s", loaded.name, loaded.arch.architecture,
                    time.perf_counter() - t0, device)
        dtype = resolve_dtype(config.model.dtype, device)
        runner = cls(loaded.model, loaded.arch, config, device, dtype, loaded.eos_token_ids)
        runner.loaded = loaded
        return runner

    # -- inputs ----------------------------------------------------------------
    def prepare_inputs(self, so: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Flatten the step's requests into model inputs.

        Returns:
            input_ids ``[num_tokens]`` int64, positions ``[num_tokens]`` int64,
            attention metadata, and ``logits_indices`` (numpy, ``[num_sampling_reqs]``):
            the row of each sampling request's last token.
        """
        reqs = so.scheduled
        bs = self.block_size
        query_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        starts = np.fromiter((r.num_computed_tokens for r in reqs), dtype=np.int64, count=len(reqs))
        qsl = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        num_tokens = int(qsl[-1])
        seq_lens = starts + query_lens
        token_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=num_tokens)
        req_idx = np.repeat(np.arange(len(reqs)), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - qsl[:-1][req_idx] + starts[req_idx]
        max_blocks = max(len(r.block_ids) for r in reqs)
        block_tables = np.zeros((len(reqs), max_blocks), dtype=np.int64)
        for i, r in enumerate(reqs):
            block_tables[i, : len(r.block_ids)] = r.block_ids
        slot_mapping = block_tables[req_idx, positions // bs] * bs + positions % bs
        sample_mask = np.fromiter((r.sample for r in reqs), dtype=bool, count=len(reqs))
        logits_indices = (qsl[1:] - 1)[sample_mask]
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables.astype(np.int32)).to(dev),
            query_lens=query_lens.tolist(),
            seq_lens_list=seq_lens.tolist(),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            block_size=bs,
        )
        return torch.from_numpy(token_ids).to(dev), torch.from_numpy(positions).to(dev), md, logits_indices

    # -- the step ----------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one forward pass over every scheduled token and sample where asked.

        Returns:
            one sampled token (and optional logprobs) per request whose
            ``sample`` flag is set, in batch order.
        """
        if so.is_empty:
            return ModelRunnerOutput()
        input_ids, positions, md, logits_indices = self.prepare_inputs(so)
        hidden = self.model(input_ids, positions, self.kv_caches, md)
        sampling = [r for r in so.scheduled if r.sample]
        if not sampling:
            return ModelRunnerOutput()
        idx = torch.from_numpy(logits_indices).to(self.device)
        logits = self.model.compute_logits(hidden.index_select(0, idx)).float()
        token_ids, logprobs = self.sampler(logits, sampling)
        return ModelRunnerOutput(req_ids=[r.req_id for r in sampling], sampled_token_ids=token_ids,
                                 logprobs=logprobs)


def configure_threads(device: torch.device) -> int:
    """Set and log intra-op threads for the engine core (all cores unless TOKENMILL_NUM_THREADS says otherwise)."""
    n = int(os.environ.get("TOKENMILL_NUM_THREADS", "0")) or (os.cpu_count() or 1)
    if device.type == "cpu":
        torch.set_num_threads(n)
    logger.info("engine core: torch intra-op threads=%d, inter-op threads=%d", torch.get_num_threads(),
                torch.get_num_interop_threads())
    return torch.get_num_threads()
