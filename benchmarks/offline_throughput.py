"""Offline throughput: tokenmill's continuous batching vs transformers' static-batch ``generate``.

Same prompts (MT-bench first turns, chat template applied), same fixed output
length (ignore EOS), same dtype and threads, measured in one run; prints output
tokens/s of each and their ratio.

    .venv/bin/python benchmarks/offline_throughput.py --num-prompts 64 --output-len 64 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "mt_bench_questions.jsonl"


def load_prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    turns = [r["turns"][0] for r in rows]
    return [turns[i % len(turns)] for i in range(n)]


def run_tokenmill(prompts_ids: list[list[int]], output_len: int, dtype: str, max_num_seqs: int) -> float:
    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype=dtype, max_model_len=2048, max_num_seqs=max_num_seqs, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts_ids[:2], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts_ids, params)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"tokenmill:    {n} output tokens in {dt:.1f} s = {n / dt:.1f} tok/s "
          f"(preemptions: {llm.engine_core.scheduler.num_preemptions_total})")
    return n / dt


def run_transformers(prompts_ids: list[list[int]], output_len: int, dtype: str, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    from tokenmill.model.loader import default_model_path

    path = default_model_path()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 torch_dtype=torch_dtype).eval()
    total, t_total = 0, 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([prompts_ids[0]]), max_new_tokens=4, min_new_tokens=4, do_sample=False,
                       pad_token_id=0)  # warm-up
        for i in range(0, len(prompts_ids), batch_size):
            batch = prompts_ids[i:i + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for j, p in enumerate(batch):  # left padding, as generate expects for decoder-only models
                ids[j, width - len(p):] = torch.tensor(p)
                mask[j, width - len(p):] = 1
            t0 = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                                 do_sample=False, pad_token_id=0)
            t_total += time.perf_counter() - t0
            total += (out.shape[1] - width) * len(batch)
    print(f"transformers: {total} output tokens in {t_total:.1f} s = {total / t_total:.1f} tok/s "
          f"(static batches of {batch_size})")
    return total / t_total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--batch-size", type=int, default=32, help="transformers static batch size")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="tokenmill max running requests")
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    from tokenmill.tokenizer import load_tokenizer
    from tokenmill.model.loader import default_model_path

    tok = load_tokenizer(default_model_path())
    prompts = load_prompts(args.num_prompts)
    prompts_ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                      tokenize=False), add_special_tokens=False)
                   for p in prompts]
    print(f"{len(prompts_ids)} prompts, mean {sum(map(len, prompts_ids)) / len(prompts_ids):.0f} input tokens, "
          f"{args.output_len} output tokens each, dtype {args.dtype}, {torch.get_num_threads()} threads")
    tm = run_tokenmill(prompts_ids, args.output_len, args.dtype, args.max_num_seqs)
    if not args.skip_transformers:
        hf = run_transformers(prompts_ids, args.output_len, args.dtype, args.batch_size)
        print(f"ratio tokenmill / transformers: {tm / hf:.2f}x")


if __name__ == "__main__":
    main()
