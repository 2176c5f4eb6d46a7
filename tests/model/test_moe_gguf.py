"""MoE GGUF files (``ffn_gate_inp`` + ``ffn_{gate,up,down}_exps``): written from the tiny transformers
Mixtral / Qwen3-MoE with gguf's GGUFWriter, loaded by tokenmill, compared with the safetensors load.

Tolerances: F32 GGUF vs safetensors ``atol=1e-5`` (same values); Q8_0 GGUF vs transformers
run on the Q8_0-rounded weights ``atol=2e-4, rtol=1e-4`` (float32).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.model.tiny_moe import VOCAB, save_tiny_moe, tiny_moe_model
from tokenmill.model.loader import load_arch_config, load_model

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from gguf import GGMLQuantizationType as Q  # noqa: E402


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order for ``llama`` files (rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _roundtrip(a: np.ndarray, qt) -> np.ndarray:
    return a if qt == Q.F32 else gguf.quants.dequantize(gguf.quants.quantize(a, qt), qt)


def write_moe_gguf(path, hf, family: str, qt=Q.F32) -> dict[str, np.ndarray]:
    """Write ``hf`` (transformers model, float32) as a llama.cpp-style MoE GGUF with a small gpt2 tokenizer.

    Linear weights and experts in ``qt``; norms and the router in F32. Returns the HF-named weights as
    they read back (quantised and dequantised), for the reference model.
    """
    cfg = hf.config
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    llama = family == "mixtral"
    arch = "llama" if llama else "qwen3moe"
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim or cfg.hidden_size // cfg.num_attention_heads
    inter = cfg.intermediate_size if llama else cfg.moe_intermediate_size
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(hd)
    w.add_key_length(hd)
    w.add_value_length(hd)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not llama:
        w.add_expert_feed_forward_length(inter)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB - 3)])
    w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
    w.add_token_merges(["a a", "b b"])
    back: dict[str, np.ndarray] = {}

    def put(name: str, hf_name: str, arr: np.ndarray, q=qt, permute: int = 0) -> None:
        stored = _permute(arr, permute) if permute else arr
        if q == Q.F32:
            w.add_tensor(name, np.ascontiguousarray(stored))
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(stored), q), raw_dtype=q)
        rt = _roundtrip(np.ascontiguousarray(stored), q)
        if permute:    # the value the loader will un-permute to
            rt = rt.reshape(permute, hd // 2, 2, *arr.shape[1:]).swapaxes(1, 2).reshape(arr.shape)
        back[hf_name] = rt

    put("token_embd.weight", "model.embed_tokens.weight", sd["model.embed_tokens.weight"])
    put("output_norm.weight", "model.norm.weight", sd["model.norm.weight"], Q.F32)
    put("output.weight", "lm_head.weight", sd["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        put(b + "attn_norm.weight", p + "input_layernorm.weight", sd[p + "input_layernorm.weight"], Q.F32)
        put(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", sd[p + "post_attention_layernorm.weight"],
            Q.F32)
        put(b + "attn_q.weight", p + "self_attn.q_proj.weight", sd[p + "self_attn.q_proj.weight"],
            permute=heads if llama else 0)
        put(b + "attn_k.weight", p + "self_attn.k_proj.weight", sd[p + "self_attn.k_proj.weight"],
            permute=kv if llama else 0)
        put(b + "attn_v.weight", p + "self_attn.v_proj.weight", sd[p + "self_attn.v_proj.weight"])
        put(b + "attn_output.weight", p + "self_attn.o_proj.weight", sd[p + "self_attn.o_proj.weight"])
        if not llama:
            for n in ("q", "k"):
                put(b + f"attn_{n}_norm.weight", p + f"self_attn.{n}_norm.weight", sd[p + f"self_attn.{n}_norm.weight"],
                    Q.F32)
        if p + "mlp.gate.weight" in sd:          # MoE layer: transformers holds the experts stacked
            gate_up, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
            put(b + "ffn_gate_inp.weight", p + "mlp.gate.weight", sd[p + "mlp.gate.weight"], Q.F32)
            put(b + "ffn_gate_exps.weight", p + "gate_exps", gate_up[:, :inter])
            put(b + "ffn_up_exps.weight", p + "up_exps", gate_up[:, inter:])
            put(b + "ffn_down_exps.weight", p + "mlp.experts.down_proj", down)
            back[p + "mlp.experts.gate_up_proj"] = np.concatenate([back.pop(p + "gate_exps"),
                                                                   back.pop(p + "up_exps")], axis=1)
        else:                                    # a dense layer (Qwen3-MoE mlp_only_layers)
            for n, g in (("gate", "gate"), ("up", "up"), ("down", "down")):
                put(b + f"ffn_{g}.weight", p + f"mlp.{n}_proj.weight", sd[p + f"mlp.{n}_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return back


def _logits(model, arch, ids, paged_runner):
    return paged_runner(model, arch).step([("x", ids)])


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_f32_gguf_equals_safetensors(tmp_path, paged_runner, family):
    # llama.cpp's qwen3moe always renormalises the top-k weights (no GGUF key says otherwise): so does the HF model
    kw = {} if family == "mixtral" else {"norm_topk_prob": True}
    hf = tiny_moe_model(family, seed=6, **kw)
    folder = save_tiny_moe(tmp_path / "hf", family, seed=6, **kw)
    path = tmp_path / f"{family}.gguf"
    write_moe_gguf(path, hf, family)
    a, b = load_arch_config(str(path)), load_arch_config(folder)
    assert a.architecture == b.architecture and a.num_experts == 8 and a.num_experts_per_tok == 2
    assert a.moe_intermediate_size == 32 and a.norm_topk_prob and b.norm_topk_prob
    assert a.moe_layer_mask == b.moe_layer_mask and a.qk_norm == b.qk_norm
    ids = torch.randint(3, VOCAB, (33,), generator=torch.Generator().manual_seed(0)).tolist()
    g = load_model(str(path), dtype="float32", with_tokenizer=False)
    s = load_model(folder, dtype="float32", with_tokenizer=False)
    got = _logits(g.model, g.arch, ids, paged_runner)
    torch.testing.assert_close(got, _logits(s.model, s.arch, ids, paged_runner), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(got, hf(torch.tensor([ids])).logits[0], atol=2e-4, rtol=1e-4)
    _greedy_equal(str(path), folder)


def _greedy_equal(gguf_path: str, folder: str) -> None:
    from tokenmill import LLM, SamplingParams

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (6, 21, 11)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = dict(dtype="float32", block_size=4, num_kv_blocks=48, max_num_batched_tokens=16, max_num_seqs=4)
    outs = []
    for model in (gguf_path, folder):
        with LLM(model, **engine) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert outs[0] == outs[1]


def test_q8_0_gguf_matches_transformers_on_rounded_weights(tmp_path, paged_runner):
    """Q8_0 experts ``[E, I, H]`` / ``[E, H, I]`` dequantise to the values gguf's own codec gives."""
    hf = tiny_moe_model("mixtral", seed=8)
    path = tmp_path / "q8.gguf"
    back = write_moe_gguf(path, hf, "mixtral", qt=Q.Q8_0)
    with torch.no_grad():
        sd = hf.state_dict()
        for name, arr in back.items():
            sd[name].copy_(torch.from_numpy(arr).reshape(sd[name].shape))
    lm = load_model(str(path), dtype="float32", with_tokenizer=False)
    ids = torch.randint(3, VOCAB, (27,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(lm.model, lm.arch, ids, paged_runner), want, atol=2e-4, rtol=1e-4)
