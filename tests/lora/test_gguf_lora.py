"""LoRA on the packaged GGUF model (SmolLM2-135M Q4_1): the low-bit path and the CPU step graph.

The adapter is random (shapes of SmolLM2's layers), written as a PEFT folder with safetensors.
Checks: the CPU step graph stays on with LoRA and gives the eager forward's tokens (same kernel
calls, then the same delta ops); the adapter changes the output; a mixed batch equals each request
alone.
"""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.lora.request import LoRARequest

pytestmark = pytest.mark.slow

SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
          "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}


def write_adapter(folder, r: int, seed: int, layers: int = 30, std: float = 0.02) -> str:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    t = {}
    for i in range(layers):
        for mod, (fin, fout) in SHAPES.items():
            block = "mlp" if mod in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{block}.{mod}"
            t[f"{key}.lora_A.weight"] = torch.randn(r, fin, generator=g) * std * 5
            t[f"{key}.lora_B.weight"] = torch.randn(fout, r, generator=g) * std
    save_file(t, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(SHAPES), "bias": "none"}))
    return str(folder)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_lora")
    return [LoRARequest(f"a{r}", i + 1, write_adapter(root / f"a{r}", r, seed=r)) for i, r in enumerate((8, 16))]


def run(llm, loras):
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS * len(loras), sp,
                                                         lora_request=[lr for lr in loras for _ in PROMPTS])]


def test_step_graph_equals_eager_and_adapters_change_output(adapters, monkeypatch):
    loras = [None, *adapters]
    llm = LLM(dtype="float32", enable_lora=True, max_loras=2, max_model_len=512)
    assert llm.engine_core.executor.step_graph is not None and llm.engine_core.executor.lowbit_max_tokens
    graph = run(llm, loras)
    alone = [run(llm, [lr])[:len(PROMPTS)] for lr in loras]
    assert graph == [x for a in alone for x in a]          # mixed batch == each adapter alone
    del llm
    monkeypatch.setenv("TOKENMILL_CPU_STEP_GRAPH", "0")
    eager_llm = LLM(dtype="float32", enable_lora=True, max_loras=2, max_model_len=512)
    assert eager_llm.engine_core.executor.step_graph is None
    assert run(eager_llm, loras) == graph
    n = len(PROMPTS)
    assert graph[:n] != graph[n:2 * n] and graph[n:2 * n] != graph[2 * n:]


def _with_logprobs(outs):
    return [(o.outputs[0].token_ids, [(lp.logprob, lp.top_token_ids, lp.top_logprobs)
                                      for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mixed_batch_is_bit_identical_to_each_request_alone(adapters, dtype):
    """Batch invariance (the default) holds with adapters: requests of two adapters and of the base, batched
    (prefills beside decode steps, a small chunk budget so prompts split), give the token ids and logprobs of
    each request run alone, bit for bit (the delta is the row-independent C kernel in prefill and decode)."""
    llm = LLM(dtype=dtype, enable_lora=True, max_loras=2, max_model_len=512, max_num_batched_tokens=16,
              enable_prefix_caching=False)
    ex = llm.engine_core.executor
    # decode steps run the step graph wherever the low-bit codes run (bfloat16 needs oneDNN's bfloat16 GEMMs,
    # which AVX2-only CPUs lack: there both prefill and decode run the eager path, still row-independent)
    assert (ex.step_graph is not None) == bool(ex.lowbit_max_tokens)
    prompts = PROMPTS + ["A list of prime numbers: 2, 3, 5,", "SELECT name FROM users WHERE"]
    loras = [adapters[0], None, adapters[1], adapters[0], adapters[1]]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    mixed = _with_logprobs(llm.generate(prompts, sp, lora_request=loras))
    alone = [_with_logprobs(llm.generate([p], sp, lora_request=lr))[0] for p, lr in zip(prompts, loras)]
    assert mixed == alone
    assert mixed[0][0] != _with_logprobs(llm.generate([prompts[0]], sp))[0][0]    # the adapter matters
