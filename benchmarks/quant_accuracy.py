"""Accuracy, memory and speed of each weight format and KV cache dtype against the float32 reference.

For every row the model is loaded the way the server loads it (``ModelRunner.from_config``) and driven
through its paged KV cache. Steps pack several sequences (prefill chunks of several prompts in one step,
decodes of ``--decode-batch`` sequences), at most ``--step-tokens`` (2048) tokens per step -- except for a GGUF's
small-step low-bit rows, whose steps carry at most the engine's small-step limit (8) tokens so that its own codes
are what runs. Measured:

* on the 80 MT-bench first turns (chat template applied; ``tokenmill/bench/data/mt_bench_questions.jsonl``):
  top-1 next-token agreement with the reference at every prompt position, mean KL(reference || row) of the
  next-token distribution (nats), and greedy-continuation agreement over ``--greedy-tokens`` (64) tokens
  (share of positions before the first token that differs from the reference's continuation, mean over prompts);
* on a held text (the 80 MT-bench *second* turns, joined, ``--held-tokens`` tokens; not used above): perplexity,
  plus top-1 agreement and mean KL at its positions;
* memory: weight bytes, KV bytes per token, requests fitting in 1 GiB of KV cache at ``--context`` tokens;
* ``--mode serve``: output tok/s at concurrency 1 and 64 from ``tokenmill bench serve`` against a ``tokenmill
  serve`` started with the row's flags (random prompts of 100 tokens, 64 output tokens, greedy, EOS ignored).

The reference (float32, dense) is computed once and kept in ``--ref-file``; each row's results are merged into
``--json`` as soon as they exist, so a rerun skips the rows already there (``--redo`` measures them again) and
accuracy (not timing-sensitive: run it niced) and tok/s (a timing: run it alone) can run as separate invocations.

"Effectively lossless" (threshold fixed before measuring, docs/benchmarks/quant_accuracy.md): top-1 agreement
>= 99%, mean KL <= 0.005 nats, perplexity within 1% of the reference, greedy agreement >= 90%.

    python benchmarks/quant_accuracy.py [--rows float32,bfloat16,gguf-lowbit,int8,...,kv-int8] [--num-prompts 80]
        [--greedy-tokens 64] [--mode accuracy|serve|table] [--json OUT] [--ref-file REF]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tokenmill.config import EngineConfig  # noqa: E402

LOSSLESS = {"top1": 0.99, "kl": 0.005, "ppl_ratio": 1.01, "greedy": 0.90}

_DENSE = {"TOKENMILL_CPU_INT4_MAX_TOKENS": "0"}
# label -> (engine kwargs, environment). Weight formats, then KV cache dtypes (float32 dense weights).
ROWS: dict[str, tuple[dict, dict]] = {
    "float32": ({"dtype": "float32"}, _DENSE),
    "bfloat16": ({"dtype": "bfloat16"}, _DENSE),
    "gguf-lowbit": ({"dtype": "float32"}, {"TOKENMILL_CPU_INT4_MAX_TOKENS": "8"}),
    "gguf-lowbit-bf16": ({"dtype": "bfloat16"}, {"TOKENMILL_CPU_INT4_MAX_TOKENS": "8"}),
    "int8": ({"dtype": "float32", "quantization": "int8"}, {}),
    "w8a8": ({"dtype": "float32", "quantization": "w8a8"}, {}),
    "int4": ({"dtype": "float32", "quantization": "int4"}, {}),
    # int4's default groups are 32 inputs; a larger TOKENMILL_INT4_GROUP_SIZE is the largest group a layer takes
    # (SmolLM2's 576-input layers take 64 under 128: 128 does not divide 576)
    "int4-g64": ({"dtype": "float32", "quantization": "int4"}, {"TOKENMILL_INT4_GROUP_SIZE": "64"}),
    "int4-g128": ({"dtype": "float32", "quantization": "int4"}, {"TOKENMILL_INT4_GROUP_SIZE": "128"}),
    "kv-fp8": ({"dtype": "float32", "kv_cache_dtype": "fp8"}, _DENSE),
    "kv-fp8+scales": ({"dtype": "float32", "kv_cache_dtype": "fp8", "calculate_kv_scales": True}, _DENSE),
    "kv-fp8_e5m2": ({"dtype": "float32", "kv_cache_dtype": "fp8_e5m2"}, _DENSE),
    "kv-fp8_e5m2+scales": ({"dtype": "float32", "kv_cache_dtype": "fp8_e5m2", "calculate_kv_scales": True},
                           _DENSE),
    "kv-int8": ({"dtype": "float32", "kv_cache_dtype": "int8"}, _DENSE),   # int8 always calculates its scales
}
SMALL_STEP_ROWS = ("gguf-lowbit", "gguf-lowbit-bf16")


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
    """First turns of the first ``n`` MT-bench questions, and the second turns of all 80 (the held text)."""
    path = REPO / "tokenmill" / "bench" / "data" / "mt_bench_questions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first = [r["turns"][0] for r in rows[:n]]
    second = [r["turns"][1] for r in rows if len(r["turns"]) > 1]
    return first, second


# ------------------------------------------------------------------ stepping ---

def pack_steps(lens: list[int], max_tokens: int, max_seqs: int | None = None) -> list[list[tuple[int, int, int]]]:
    """Teacher-forcing schedule: every sequence fed whole, in order, steps of at most ``max_tokens`` tokens.

    A step takes the next sequences' remaining tokens until the budget (or ``max_seqs`` sequences) is used; a
    sequence that does not fit is cut and continues in the next step (chunked prefill).

    Args:
        lens: tokens per sequence (each >= 1).
        max_tokens: token budget per step (>= 1).
        max_seqs: sequences per step (None: no limit).

    Returns:
        steps, each a list of ``(sequence index, start, end)`` token ranges.

    Raises:
        ValueError: a length < 1 or a budget < 1.
    """
    if max_tokens < 1 or (max_seqs is not None and max_seqs < 1):
        raise ValueError("max_tokens and max_seqs must be >= 1")
    if any(n < 1 for n in lens):
        raise ValueError("every sequence needs at least one token")
    steps, i, pos = [], 0, 0
    while i < len(lens):
        step, budget = [], max_tokens
        while i < len(lens) and budget > 0 and (max_seqs is None or len(step) < max_seqs):
            take = min(budget, lens[i] - pos)
            step.append((i, pos, pos + take))
            budget -= take
            pos += take
            if pos == lens[i]:
                i, pos = i + 1, 0
        steps.append(step)
    return steps


class Driver:
    """Feeds sequences through a runner's model and paged KV cache (no scheduler: fixed schedules).

    Args:
        runner: a :class:`~tokenmill.model.runner.ModelRunner`.
        step_tokens: most tokens per step (prefill packing; a GGUF's codes need steps <= its small-step limit).
        decode_batch: sequences per decode step (at most ``step_tokens``).
    """

    def __init__(self, runner, step_tokens: int, decode_batch: int) -> None:
        self.runner, self.step_tokens = runner, step_tokens
        self.decode_batch = max(1, min(decode_batch, step_tokens))
        self.bs = runner.block_size

    def tables(self, lens: list[int]) -> list[list[int]]:
        """Disjoint block tables holding ``lens[i]`` tokens each. Raises ValueError: the pool is too small."""
        tables, nxt = [], 0
        for n in lens:
            k = -(-n // self.bs)
            tables.append(list(range(nxt, nxt + k)))
            nxt += k
        if nxt > self.runner.num_kv_blocks:
            raise ValueError(f"KV pool of {self.runner.num_kv_blocks} blocks too small: {nxt} needed")
        return tables

    @torch.inference_mode()
    def step(self, computed: list[int], new: list[list[int]], tables) -> torch.Tensor:
        """One forward step; ``[sum(len(new[i])), vocab]`` float32 logits."""
        from tokenmill.model.layers.attention import build_attention_metadata

        md, pos = build_attention_metadata(computed, [len(t) for t in new], tables, self.bs)
        ids = torch.tensor([t for toks in new for t in toks], dtype=torch.long)
        model = self.runner.model
        return model.compute_logits(model(ids, pos, self.runner.kv_caches, md)).float()

    def teacher_force(self, seqs: list[list[int]], tables, on_done: Callable[[int, torch.Tensor], None]) -> None:
        """Feed every sequence whole (steps from :func:`pack_steps`); ``on_done(i, logits [len_i, vocab])`` as
        soon as sequence ``i`` is complete (so only one step's and one sequence's logits are held at a time)."""
        parts: dict[int, list[torch.Tensor]] = {}
        for step in pack_steps([len(s) for s in seqs], self.step_tokens):
            logits = self.step([a for _, a, _ in step], [seqs[i][a:b] for i, a, b in step], [tables[i] for i, _, _ in step])
            off = 0
            for i, a, b in step:
                parts.setdefault(i, []).append(logits[off:off + b - a])
                off += b - a
                if b == len(seqs[i]):
                    rows = parts.pop(i)
                    on_done(i, rows[0] if len(rows) == 1 else torch.cat(rows))

    def greedy(self, prompts: list[list[int]], first: list[int], n: int, tables) -> list[list[int]]:
        """Greedy continuations of ``n`` tokens after teacher-forced prompts whose first new token is ``first``;
        ``decode_batch`` sequences per step."""
        outs = [[t] for t in first]
        for g in range(0, len(prompts), self.decode_batch):
            idx = list(range(g, min(g + self.decode_batch, len(prompts))))
            for k in range(1, n):
                logits = self.step([len(prompts[i]) + k - 1 for i in idx], [[outs[i][-1]] for i in idx],
                                   [tables[i] for i in idx])
                for i, row in zip(idx, logits):
                    outs[i].append(int(row.argmax()))
        return outs


# ------------------------------------------------------------------ metrics ---

@dataclass
class Agreement:
    """Running top-1 agreement and KL(reference || row) over positions."""

    agree: int = 0
    positions: int = 0
    kl_sum: float = 0.0

    def add(self, ref_logprobs: torch.Tensor, logits: torch.Tensor) -> None:
        """``ref_logprobs``: ``[n, vocab]`` log-softmax of the reference; ``logits``: ``[n, vocab]`` of the row."""
        lq = torch.log_softmax(logits.float(), -1)
        self.agree += int((ref_logprobs.argmax(-1) == lq.argmax(-1)).sum())
        self.positions += int(ref_logprobs.shape[0])
        self.kl_sum += float((ref_logprobs.exp() * (ref_logprobs - lq)).sum(-1).clamp_min(0).sum())

    @property
    def top1(self) -> float:
        return self.agree / self.positions if self.positions else math.nan

    @property
    def kl(self) -> float:
        return self.kl_sum / self.positions if self.positions else math.nan


def greedy_agreement(ref: list[list[int]], got: list[list[int]]) -> float:
    """Mean over sequences of the share of positions before the first token that differs from the reference."""
    shares = []
    for x, y in zip(ref, got):
        k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        shares.append(k / len(x) if x else 1.0)
    return sum(shares) / len(shares) if shares else math.nan


def is_lossless(r: dict) -> bool:
    """Every threshold of :data:`LOSSLESS` present in ``r`` is met."""
    return all(r[k] >= v if k in ("top1", "greedy") else r[k] <= v for k, v in LOSSLESS.items() if k in r)


@dataclass
class Reference:
    """The float32 reference: prompts, held text, log-probabilities at every position, greedy continuations."""

    prompts: list[list[int]]
    held: list[int]
    logprobs: list[torch.Tensor]          # per prompt [len, vocab]
    held_logprobs: torch.Tensor           # [len(held), vocab]
    cont: list[list[int]]
    ppl: float
    meta: dict = field(default_factory=dict)


def evaluate(runner, prompts: list[list[int]], held: list[int], greedy_n: int, step_tokens: int,
             decode_batch: int, ref: Reference | None) -> tuple[dict, Reference | None]:
    """Teacher-forced logits of every prompt and the held text, greedy continuations; metrics against ``ref``.

    Returns ``(metrics, reference)``: with ``ref`` None this run *is* the reference (its log-probabilities are
    kept and returned); otherwise only running sums are kept.
    """
    drv = Driver(runner, step_tokens, decode_batch)
    seqs = prompts + [held]
    tables = drv.tables([len(p) + greedy_n for p in prompts] + [len(held)])
    t0 = time.perf_counter()
    first = [0] * len(prompts)
    keep: dict[int, torch.Tensor] = {}
    on_prompts, on_held = Agreement(), Agreement()
    nll = [0.0]

    def done(i: int, logits: torch.Tensor) -> None:
        if i < len(prompts):
            first[i] = int(logits[-1].argmax())
        else:
            nll[0] = float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(held[1:]), reduction="sum"))
        if ref is None:
            keep[i] = torch.log_softmax(logits, -1)
        else:
            (on_prompts if i < len(prompts) else on_held).add(
                ref.logprobs[i] if i < len(prompts) else ref.held_logprobs, logits)

    drv.teacher_force(seqs, tables, done)
    cont = drv.greedy(prompts, first, greedy_n, tables) if greedy_n else [[] for _ in prompts]
    res = {"ppl": math.exp(nll[0] / max(1, len(held) - 1)), "seconds": time.perf_counter() - t0,
           "positions": sum(len(p) for p in prompts), "held_positions": len(held)}
    if ref is None:
        reference = Reference(prompts, held, [keep[i] for i in range(len(prompts))], keep[len(prompts)], cont,
                              res["ppl"])
        return res, reference
    res.update(top1=on_prompts.top1, kl=on_prompts.kl, top1_held=on_held.top1, kl_held=on_held.kl,
               ppl_ratio=res["ppl"] / ref.ppl)
    if greedy_n:
        res["greedy"] = greedy_agreement(ref.cont, cont)
    res["lossless"] = is_lossless(res)
    return res, None


def encode_texts(num_prompts: int, held_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Token ids of the MT-bench first turns (chat template, generation prompt) and of the held text."""
    from tokenmill.model.loader import default_model_path
    from tokenmill.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    first, second = load_questions(num_prompts)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  tokenize=False), add_special_tokens=False) for q in first]
    return prompts, tok.encode("\n\n".join(second))[:held_tokens]


def build_runner(kwargs: dict, environ: dict, kv_blocks: int, max_len: int, max_num_seqs: int = 128,
                 threads: int | None = None, with_tokenizer: bool = True):
    """A :class:`~tokenmill.model.runner.ModelRunner` as the server builds it, with ``threads`` intra-op threads.

    ``ModelRunner.from_config`` sets the engine core's threads (``TOKENMILL_NUM_THREADS``, else one per usable
    CPU), so ``threads`` is passed that way: setting torch's threads before building the runner is overridden.
    (Until 2026-12-01 this script's ``--threads 1`` was overridden so: every accuracy row ran two intra-op threads,
    and on a shared 2-core machine each small decode step's parallel regions waited for a descheduled second
    thread -- decode steps 5-10x slower in CPU time; the reason rows took 30-50 min.)
    """
    from tokenmill.model.runner import ModelRunner

    extra = {} if threads is None else {"TOKENMILL_NUM_THREADS": str(threads)}
    with env({**environ, **extra}):
        cfg = EngineConfig.from_kwargs(num_kv_blocks=kv_blocks, block_size=16, max_model_len=max_len,
                                       max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, **kwargs)
        runner = ModelRunner.from_config(cfg, with_tokenizer=with_tokenizer)
    if threads is not None and torch.get_num_threads() != threads:
        raise RuntimeError(f"the runner runs {torch.get_num_threads()} intra-op threads, {threads} asked")
    return runner


# ------------------------------------------------------------------ tok/s ---

def serve_argv(kwargs: dict) -> list[str]:
    """Engine kwargs → ``tokenmill serve`` flags (a True bool is a bare flag, False is left out)."""
    out: list[str] = []
    for k, v in kwargs.items():
        flag = f"--{k.replace('_', '-')}"
        if isinstance(v, bool):
            out += [flag] if v else []
        else:
            out += [flag, str(v)]
    return out


def serve_throughput(kwargs: dict, environ: dict, pairs: dict[int, int], threads: int,
                     log_dir: Path) -> dict[str, float]:
    """Output tok/s (and load average) from ``tokenmill bench serve`` against a ``tokenmill serve`` with these
    settings; ``pairs``: concurrency → number of prompts."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from compare_engines import Server, free_port  # noqa: E402

    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--max-model-len", "1024",
           "--max-num-seqs", str(max(pairs))] + serve_argv(kwargs)
    e = dict(os.environ, **environ, TOKENMILL_NUM_THREADS=str(threads))
    server = Server("tokenmill", cmd, e, port, log_dir / f"serve_{port}.log")
    out: dict[str, float] = {}
    try:
        server.start(600)
        for c, n in pairs.items():
            res_file = log_dir / f"bench_{port}_{c}.json"
            subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", server.base_url,
                            "--dataset", "random", "--input-len", "100", "--output-len", "64", "--ignore-eos",
                            "--temperature", "0", "--max-concurrency", str(c), "--num-prompts", str(n),
                            "--num-warmups", "1", "--disable-tqdm", "--save-result", str(res_file)],
                           check=True, cwd=str(REPO), capture_output=True, timeout=3600)
            out[str(c)] = json.loads(res_file.read_text())["output_throughput"]
            out[f"load_{c}"] = os.getloadavg()[0]
    finally:
        server.stop()
    return out


# ------------------------------------------------------------------ results file ---

def load_results(path: str | None) -> dict[str, dict]:
    """Rows already measured (``--json``), keyed by label."""
    if not path or not os.path.exists(path):
        return {}
    return {r["format"]: r for r in json.loads(Path(path).read_text())}


def save_results(path: str | None, rows: dict[str, dict], labels: list[str] | None = None) -> None:
    """Write ``rows`` to ``path``; with ``labels``, only those rows replace the file's (under a lock), so several
    processes measuring different rows can share one results file."""
    if not path:
        return
    import fcntl

    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged = load_results(path) if labels is not None else {}
        for k in (labels if labels is not None else rows):   # field-wise: tok/s and accuracy come separately
            merged[k] = {**merged.get(k, {}), **rows[k]}
        order = [k for k in ROWS if k in merged] + [k for k in merged if k not in ROWS]
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps([merged[k] for k in order], indent=1))
        os.replace(tmp, path)
        rows.update(merged)


def table(rows: dict[str, dict], context: int) -> str:
    """The table of docs/benchmarks/quant_accuracy.md (rows in :data:`ROWS` order)."""
    head = ("| row | top-1 agree (prompts / held) | mean KL nats (prompts / held) | ppl (ratio) | greedy 64 agree | "
            f"weights MiB | KV B/token | req/GiB @{context} | tok/s c=1 | tok/s c=64 | lossless |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label in [k for k in ROWS if k in rows] + [k for k in rows if k not in ROWS]:
        r = rows[label]
        ref = label == "float32"
        ts = r.get("tok_s", {})
        mark = " †" if r.get("tok_s_series") else ""      # tok/s from another series than the table's (docs/benchmarks/quant_accuracy.md)
        speed = [f"{ts['1']:.1f}{mark}" if "1" in ts else "-", f"{ts['64']:.1f}{mark}" if "64" in ts else "-"]
        if "ppl" not in r:               # tok/s measured, accuracy not (yet)
            lines.append("| " + " | ".join([label] + ["-"] * 7 + speed + ["not measured"]) + " |")
            continue
        cells = [label,
                 "100% (ref)" if ref else f"{r['top1']:.2%} / {r['top1_held']:.2%}",
                 "0" if ref else f"{r['kl']:.4f} / {r['kl_held']:.4f}",
                 f"{r['ppl']:.3f} ({r.get('ppl_ratio', 1.0):.3f})",
                 "100%" if ref else (f"{r['greedy']:.1%}" if "greedy" in r else "-"),
                 f"{r['weight_mib']:.0f}", f"{r['kv_bytes_per_token']}", f"{r['requests_per_gib']:.1f}",
                 *speed,
                 "reference" if ref else ("**yes**" if r.get("lossless") else "no")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------ main ---

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", "--formats", dest="rows", default=",".join(ROWS),
                    help=f"comma-separated, from {', '.join(ROWS)}")
    ap.add_argument("--mode", default="accuracy", choices=("accuracy", "serve", "table"),
                    help="accuracy: accuracy + memory; serve: tok/s of rows (merged into --json); table: print")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--held-tokens", type=int, default=512, help="tokens of the held text (perplexity)")
    ap.add_argument("--step-tokens", type=int, default=2048, help="most tokens per step (prefill packing)")
    ap.add_argument("--decode-batch", type=int, default=80, help="sequences per decode step")
    ap.add_argument("--context", type=int, default=2048, help="context for 'requests fitting in 1 GiB'")
    ap.add_argument("--serve-prompts", default="1:8,64:128", help="concurrency:num_prompts pairs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="quant_accuracy.json", help="results file (read, merged, rewritten)")
    ap.add_argument("--ref-file", default="/tmp/quant_accuracy_ref.pt", help="the float32 reference (computed "
                    "when absent or made with other settings)")
    ap.add_argument("--redo", action="store_true", help="measure rows already in --json again")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    wanted = [f.strip() for f in args.rows.split(",") if f.strip()]
    bad = [w for w in wanted if w not in ROWS]
    if bad:
        raise SystemExit(f"unknown row(s) {bad}; choose from {', '.join(ROWS)}")
    rows = load_results(args.json)
    if args.mode == "table":
        print(table(rows, args.context))
        return
    print(f"# {platform.processor() or platform.machine()}, threads {args.threads}, load average "
          f"{os.getloadavg()[0]:.1f}, mode {args.mode}", flush=True)
    if args.mode == "serve":
        pairs = dict(tuple(int(x) for x in p.split(":")) for p in args.serve_prompts.split(","))
        for label in wanted:
            rows.setdefault(label, {"format": label})
            kwargs, environ = ROWS[label]
            t0 = time.perf_counter()
            rows[label]["tok_s"] = serve_throughput(kwargs, environ, pairs, args.threads, Path("/tmp/quant_accuracy"))
            rows[label]["serve_prompts"] = args.serve_prompts
            print(f"{label}: {rows[label]['tok_s']} ({time.perf_counter() - t0:.0f} s)", flush=True)
            save_results(args.json, rows, [label])
        print(table(rows, args.context))
        return

    meta = {"num_prompts": args.num_prompts, "greedy_tokens": args.greedy_tokens, "held_tokens": args.held_tokens}
    ref: Reference | None = None
    if args.ref_file and os.path.exists(args.ref_file):
        ref = torch.load(args.ref_file, weights_only=False)
        if ref.meta != meta:
            print(f"{args.ref_file}: made with {ref.meta}, recomputing", flush=True)
            ref = None
    if ref is None or "float32" not in rows or args.redo and "float32" in wanted:
        wanted = ["float32"] + [w for w in wanted if w != "float32"]
    if ref is not None:
        prompts, held = ref.prompts, ref.held
    else:
        prompts, held = encode_texts(args.num_prompts, args.held_tokens)
    need = sum(-(-(len(p) + args.greedy_tokens) // 16) for p in prompts) + -(-len(held) // 16)
    for label in wanted:
        measured = "ppl" in rows.get(label, {})          # (a row with only tok/s is not measured yet)
        if measured and not args.redo and not (label == "float32" and ref is None):
            continue
        kwargs, environ = ROWS[label]
        try:
            runner = build_runner(kwargs, environ, need, 2048, threads=args.threads)
        except ValueError as e:
            print(f"{label}: skipped ({e})", flush=True)
            continue
        small = label in SMALL_STEP_ROWS
        if small and runner.lowbit_max_tokens <= 0:
            print(f"{label}: skipped (no small-step low-bit path on this machine)", flush=True)
            continue
        step_tokens = runner.lowbit_max_tokens if small else args.step_tokens
        with env(environ):
            res, new_ref = evaluate(runner, prompts, held, args.greedy_tokens, step_tokens, args.decode_batch,
                                    None if label == "float32" else ref)
        if new_ref is not None:
            new_ref.meta = meta
            ref = new_ref
            if args.ref_file:
                torch.save(ref, args.ref_file)
        wb = runner.weight_bytes
        res.update(format=label, flags=serve_argv(kwargs), env=environ, step_tokens=step_tokens,
                   decode_batch=min(args.decode_batch, step_tokens), weight_bytes=wb,
                   weight_mib=sum(wb.values()) / 2**20, kv_bytes_per_token=runner.bytes_per_token,
                   requests_per_gib=(1 << 30) / (runner.bytes_per_token * args.context),
                   num_prompts=len(prompts), greedy_tokens=args.greedy_tokens, held_tokens=len(held),
                   load_avg=os.getloadavg()[0], threads=args.threads,
                   date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
        rows[label] = res
        save_results(args.json, rows, [label])
        print(json.dumps({k: v for k, v in res.items() if k not in ("weight_bytes", "env", "flags")}), flush=True)
        del runner
    print("\n" + table(rows, args.context))


if __name__ == "__main__":
    main()
