"""Accuracy, memory and speed of each weight format (and KV cache dtype) against the float32 reference.

For every format the model is loaded the way the server loads it (``ModelRunner.from_config``) and driven
through its paged KV cache; decode steps carry ``--chunk`` (8) sequences and, for a GGUF's small-step low-bit
path, prefill steps ``--chunk`` tokens too, so its own codes are what runs:

* on the 80 MT-bench first turns (chat template applied; ``tokenmill/bench/data/mt_bench_questions.jsonl``):
  top-1 next-token agreement with the reference at every prompt position, mean KL(reference || format) of the
  next-token distribution (nats), and greedy-continuation agreement over ``--greedy-tokens`` (64) tokens
  (share of positions before the first token that differs from the reference's continuation, mean over prompts);
* on a held text (the 80 MT-bench *second* turns, joined; not used above): perplexity;
* memory: weight bytes (and bytes read per small step), KV bytes per token, requests fitting in 1 GiB of KV
  cache at ``--context`` tokens;
* with ``--serve``: output tok/s at concurrency 1 and 64 from ``tokenmill bench serve`` against ``tokenmill serve``
  started with the format's flags (random prompts of 100 tokens, 64 output tokens, greedy, EOS ignored).

"Effectively lossless" (threshold fixed before measuring, README "Quantisation"): top-1 agreement >= 99%,
mean KL <= 0.005 nats, perplexity within 1% of the reference, greedy agreement >= 90%.

    python benchmarks/quant_accuracy.py [--formats float32,bfloat16,gguf-lowbit,int8,w8a8,int4]
                                        [--num-prompts 80] [--greedy-tokens 64] [--serve] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokenmill.config import EngineConfig  # noqa: E402

LOSSLESS = {"top1": 0.99, "kl": 0.005, "ppl_ratio": 1.01, "greedy": 0.90}

# label -> (engine kwargs, environment)
FORMATS: dict[str, tuple[dict, dict]] = {
    "float32": ({"dtype": "float32"}, {"TOKENMILL_CPU_INT4_MAX_TOKENS": "0"}),
    "bfloat16": ({"dtype": "bfloat16"}, {"TOKENMILL_CPU_INT4_MAX_TOKENS": "0"}),
    "gguf-lowbit": ({"dtype": "float32"}, {"TOKENMILL_CPU_INT4_MAX_TOKENS": "8"}),
    "gguf-lowbit-bf16": ({"dtype": "bfloat16"}, {"TOKENMILL_CPU_INT4_MAX_TOKENS": "8"}),
    "int8": ({"dtype": "float32", "quantization": "int8"}, {}),
    "w8a8": ({"dtype": "float32", "quantization": "w8a8"}, {}),
    "int4": ({"dtype": "float32", "quantization": "int4"}, {}),
    "int4-g32": ({"dtype": "float32", "quantization": "int4"}, {"TOKENMILL_INT4_GROUP_SIZE": "32"}),
}
KV_DTYPES = ("fp8", "fp8_e5m2", "int8")


@contextlib.contextmanager
def env(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_questions(n: int) -> tuple[list[str], list[str]]:
    path = REPO / "tokenmill" / "bench" / "data" / "mt_bench_questions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    first = [r["turns"][0] for r in rows]
    second = [r["turns"][1] for r in rows if len(r["turns"]) > 1]
    return first, second


class Driver:
    """Feeds sequences through a runner's model and paged KV cache in steps of at most ``chunk`` tokens."""

    def __init__(self, runner, chunk: int, prefill_chunk: int | None = None) -> None:
        self.runner, self.chunk = runner, chunk
        self.prefill_chunk = prefill_chunk or chunk
        self.bs = runner.block_size

    def _tables(self, lens: list[int]) -> list[list[int]]:
        tables, nxt = [], 0
        for n in lens:
            k = -(-n // self.bs)
            tables.append(list(range(nxt, nxt + k)))
            nxt += k
        if nxt > self.runner.num_kv_blocks:
            raise ValueError("KV pool too small for this batch; raise --kv-blocks")
        return tables

    @torch.inference_mode()
    def step(self, computed: list[int], new: list[list[int]], tables) -> torch.Tensor:
        from tokenmill.model.layers.attention import build_attention_metadata

        md, pos = build_attention_metadata(computed, [len(t) for t in new], tables, self.bs)
        ids = torch.tensor([t for toks in new for t in toks], dtype=torch.long)
        model = self.runner.model
        return model.compute_logits(model(ids, pos, self.runner.kv_caches, md)).float()

    def prompt_logits(self, ids: list[int]) -> torch.Tensor:
        """``[len(ids), vocab]`` float32 logits, computed ``chunk`` tokens per step."""
        tables = self._tables([len(ids)])
        out = []
        c = self.prefill_chunk
        for s in range(0, len(ids), c):
            out.append(self.step([s], [ids[s:s + c]], tables))
        return torch.cat(out)

    def run(self, prompts: list[list[int]], n: int) -> tuple[list[torch.Tensor], list[list[int]]]:
        """Teacher-forced logits of every prompt (``[len, vocab]``) and greedy continuations of ``n`` tokens.

        Prompts are prefilled ``chunk`` tokens per step; their continuations decode ``chunk`` sequences per step.
        """
        logits_all, res = [], []
        for g in range(0, len(prompts), self.chunk):
            group = prompts[g:g + self.chunk]
            tables = self._tables([len(p) + n for p in group])
            last = []
            for i, p in enumerate(group):
                c = self.prefill_chunk
                rows = [self.step([s], [p[s:s + c]], [tables[i]]) for s in range(0, len(p), c)]
                logits_all.append(torch.cat(rows))
                last.append(int(rows[-1][-1].argmax()))
            outs = [[t] for t in last]
            for k in range(1, n):
                computed = [len(p) + k - 1 for p in group]
                logits = self.step(computed, [[o[-1]] for o in outs], tables)
                for o, row in zip(outs, logits):
                    o.append(int(row.argmax()))
            res += outs
        return logits_all, res


def build_runner(kwargs: dict, environ: dict, kv_blocks: int, max_len: int):
    from tokenmill.model.runner import ModelRunner

    with env(environ):
        cfg = EngineConfig.from_kwargs(num_kv_blocks=kv_blocks, block_size=16, max_model_len=max_len,
                                       max_num_seqs=64, **kwargs)
        return ModelRunner.from_config(cfg, with_tokenizer=True)


def evaluate(label: str, runner, prompts, held, greedy_n: int, chunk: int, ref: dict | None,
             prefill_chunk: int | None = None) -> dict:
    drv = Driver(runner, chunk, prefill_chunk)
    t0 = time.perf_counter()
    logits, cont = drv.run(prompts, greedy_n)
    held_logits = drv.prompt_logits(held)
    nll = torch.nn.functional.cross_entropy(held_logits[:-1], torch.tensor(held[1:]))
    res = {"format": label, "ppl": math.exp(nll.item()), "seconds": time.perf_counter() - t0,
           "weight_bytes": runner.weight_bytes, "kv_bytes_per_token": runner.bytes_per_token,
           "_logits": logits, "_cont": cont}
    if ref is not None:
        agree = total = 0
        kls = []
        for a, b in zip(ref["_logits"], logits):
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
            lp, lq = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
            kls.append((lp.exp() * (lp - lq)).sum(-1))
        res["top1"] = agree / total
        res["kl"] = torch.cat(kls).mean().item()
        res["ppl_ratio"] = res["ppl"] / ref["ppl"]
        if greedy_n:
            shares = []
            for x, y in zip(ref["_cont"], cont):
                k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), len(x))
                shares.append(k / len(x))
            res["greedy"] = sum(shares) / len(shares)
        res["lossless"] = all(res[k] >= v if k in ("top1", "greedy") else res[k] <= v
                              for k, v in LOSSLESS.items() if k in res)
    return res


def serve_throughput(kwargs: dict, environ: dict, concurrencies: list[int], prompts_per: dict[int, int],
                     threads: int, log_dir: Path) -> dict[int, float]:
    """Output tok/s from ``tokenmill bench serve`` against a ``tokenmill serve`` with these settings."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from compare_engines import Server, free_port  # noqa: E402

    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--max-model-len", "1024",
           "--max-num-seqs", "64"]
    for k, v in kwargs.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    e = dict(os.environ, **environ, TOKENMILL_NUM_THREADS=str(threads))
    server = Server("tokenmill", cmd, e, port, log_dir / f"serve_{port}.log")
    out = {}
    try:
        server.start(600)
        for c in concurrencies:
            res_file = log_dir / f"bench_{port}_{c}.json"
            subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", server.base_url,
                            "--dataset", "random", "--input-len", "100", "--output-len", "64", "--ignore-eos",
                            "--temperature", "0", "--max-concurrency", str(c), "--num-prompts",
                            str(prompts_per[c]), "--num-warmups", "1", "--disable-tqdm", "--save-result",
                            str(res_file)], check=True, cwd=str(REPO), capture_output=True, timeout=3600)
            out[c] = json.loads(res_file.read_text())["output_throughput"]
    finally:
        server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", default="float32,bfloat16,gguf-lowbit,int8,w8a8,int4",
                    help=f"comma-separated, from {', '.join(FORMATS)} (+ kv-<dtype> when --kv-cache-dtype exists)")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--held-tokens", type=int, default=512, help="tokens of the held text (perplexity)")
    ap.add_argument("--chunk", type=int, default=8, help="decoding sequences per step (and prefill tokens per "
                    "step for formats whose low-bit path serves only small steps)")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="prefill tokens per step for the other formats")
    ap.add_argument("--context", type=int, default=2048, help="context for 'requests fitting in 1 GiB'")
    ap.add_argument("--serve", action="store_true", help="also measure output tok/s with tokenmill bench serve")
    ap.add_argument("--serve-prompts", default="1:8,64:128", help="concurrency:num_prompts pairs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--ref-file", help="reuse the float32 reference's results from this file (written when absent), "
                    "so formats can run in separate processes")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    has_kv_dtype = "kv_cache_dtype" in {f for sec in ("model", "cache") for f in
                                         getattr(EngineConfig.from_kwargs(), sec).__dataclass_fields__}
    formats = dict(FORMATS)
    if has_kv_dtype:
        for d in KV_DTYPES:
            formats[f"kv-{d}"] = ({"dtype": "float32", "kv_cache_dtype": d}, {"TOKENMILL_CPU_INT4_MAX_TOKENS": "0"})
    wanted = [f.strip() for f in args.formats.split(",") if f.strip()]
    if "float32" not in wanted:
        wanted.insert(0, "float32")
    first, second = load_questions(args.num_prompts)
    tok = None
    results = []
    ref = None
    print(f"# {platform.processor() or platform.machine()}, threads {args.threads}, load average "
          f"{os.getloadavg()[0]:.1f}, {len(first)} MT-bench first turns, held text = second turns, "
          f"chunk {args.chunk}", flush=True)
    if args.ref_file and os.path.exists(args.ref_file):
        ref = torch.load(args.ref_file, weights_only=False)
        results.append(ref)
        wanted = [w for w in wanted if w != "float32"]
        prompts, held = ref["_prompts"], ref["_held"]
        tok = True
    for label in wanted:
        if label not in formats:
            raise SystemExit(f"unknown format {label!r}; choose from {', '.join(formats)}")
        kwargs, environ = formats[label]
        try:
            runner = build_runner(kwargs, environ, 512, 1024)
        except ValueError as e:
            print(f"{label}: skipped ({e})", flush=True)
            continue
        if tok is None:
            tok = runner.loaded.tokenizer
            prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                          tokenize=False), add_special_tokens=False) for q in first]
            held = tok.encode("\n\n".join(second))[:args.held_tokens]
        with env(environ):
            small = runner.lowbit_max_tokens > 0       # a GGUF's codes serve only small steps: prefill in them too
            r = evaluate(label, runner, prompts, held, args.greedy_tokens, args.chunk, ref,
                         None if small else args.prefill_chunk)
        if ref is None:
            ref = r
            if args.ref_file:
                torch.save(dict(r, _prompts=prompts, _held=held), args.ref_file)
        wb = r["weight_bytes"]
        r["weight_mib"] = sum(wb.values()) / 2**20
        r["requests_per_gib"] = (1 << 30) / (r["kv_bytes_per_token"] * args.context)
        if args.serve:
            pairs = dict(tuple(int(x) for x in p.split(":")) for p in args.serve_prompts.split(","))
            r["tok_s"] = serve_throughput(kwargs, environ, list(pairs), pairs, args.threads,
                                          Path("/tmp") / "quant_accuracy")
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("_")}), flush=True)
        results.append(r)
        del runner
    head = ("| format | top-1 agree | mean KL (nats) | ppl (ratio) | greedy 64 agree | weights MiB | KV B/token | "
            f"req/GiB @{args.context} |" + (" tok/s c=1 | tok/s c=64 |" if args.serve else "") + " lossless |")
    print("\n" + head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in results:
        cells = [r["format"], f"{r.get('top1', 1):.2%}", f"{r.get('kl', 0):.4f}",
                 f"{r['ppl']:.3f} ({r.get('ppl_ratio', 1):.3f})", f"{r.get('greedy', 1):.1%}" if args.greedy_tokens else "-",
                 f"{r['weight_mib']:.0f}", f"{r['kv_bytes_per_token']}", f"{r['requests_per_gib']:.1f}"]
        if args.serve:
            cells += [f"{r['tok_s'].get(c, float('nan')):.1f}" for c in (1, 64)]
        cells.append("reference" if r is ref else ("yes" if r.get("lossless") else "no"))
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if not k.startswith("_")}
                                               for r in results], indent=1))


if __name__ == "__main__":
    main()
