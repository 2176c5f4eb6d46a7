"""Benchmark workloads: ``random``, ``prefix-repetition``, ``mt-bench``, ``jsonl``.

Each builder returns a list of :class:`SampleRequest`. A sample is either a
single request or a conversation: its first request is sent at its arrival
time and each follow-up user turn is sent as soon as the previous answer has
streamed in, resending the whole history (earlier turns and the answers the
server actually gave). ``num_prompts`` always counts *requests*, follow-up
turns included.

Token lengths are measured with the benchmark tokenizer (see
:mod:`tokenmill.bench.tokenizer`).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

logger = logging.getLogger(__name__)

Message = dict[str, str]

DATASETS: tuple[str, ...] = ("random", "prefix-repetition", "mt-bench", "jsonl")

# vLLM's defaults for the random and prefix-repetition workloads.
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
DEFAULT_PREFIX_REPETITION_PREFIX_LEN = 256
DEFAULT_PREFIX_REPETITION_SUFFIX_LEN = 256
DEFAULT_NUM_PREFIXES = 10


@dataclass
class SampleRequest:
    """One request (or conversation) of a workload.

    Attributes:
        prompt: prompt text (completions) or a list of chat messages
            ``[{"role": ..., "content": ...}]``.
        prompt_len: prompt length in tokens (benchmark tokenizer; chat
            messages are counted after the chat template).
        expected_output_len: ``max_tokens`` to request, tokens.
        follow_ups: further user turns, sent one after another.
    """

    prompt: str | list[Message]
    prompt_len: int
    expected_output_len: int
    follow_ups: tuple[str, ...] = field(default_factory=tuple)

    @property
    def num_requests(self) -> int:
        """Requests this sample sends (1 + follow-up turns)."""
        return 1 + len(self.follow_ups)


def default_mt_bench_path() -> Path:
    """The MT-bench questions: ``shared/data/mt_bench_questions.jsonl`` next to (or inside) the
    checkout when present, else the copy bundled in ``tokenmill/bench/data``."""
    repo = Path(__file__).resolve().parents[2]
    for cand in (repo.parent / "shared" / "data", repo / "shared" / "data"):
        if (cand / "mt_bench_questions.jsonl").is_file():
            return cand / "mt_bench_questions.jsonl"
    return Path(__file__).resolve().parent / "data" / "mt_bench_questions.jsonl"


# ----------------------------------------------------------------- tokens ---

def count_tokens(tokenizer: Any, text: str) -> int:
    """Tokens in ``text`` without special tokens added."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def render_chat(tokenizer: Any, messages: Sequence[Message]) -> str:
    """Render chat messages into a prompt string (for the completions endpoint).

    Uses the tokenizer's chat template with the generation prompt appended;
    without a template, falls back to ``"role: content"`` lines.
    """
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines) + "\nassistant:"


def chat_prompt_len(tokenizer: Any, messages: Sequence[Message]) -> int:
    """Prompt tokens of chat messages after the chat template."""
    return count_tokens(tokenizer, render_chat(tokenizer, messages))


def _allowed_token_ids(tokenizer: Any) -> np.ndarray:
    """Ordinary vocabulary ids (special and added tokens excluded)."""
    vocab = len(tokenizer)
    banned = set(getattr(tokenizer, "all_special_ids", []) or [])
    banned.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    ids = np.array([i for i in range(vocab) if i not in banned], dtype=np.int64)
    if ids.size == 0:
        raise ValueError("tokenizer has no ordinary tokens to sample")
    return ids


class RandomTextGenerator:
    """Builds texts of an exact token length from random vocabulary ids.

    Random ids are decoded to text; since re-encoding decoded text can merge or
    split tokens, the text is re-encoded and trimmed or extended (up to
    ``max_rounds`` times) until its length matches. The reached length is
    returned so callers report the true count.
    """

    def __init__(self, tokenizer: Any, rng: np.random.Generator, max_rounds: int = 10):
        self.tokenizer = tokenizer
        self.rng = rng
        self.max_rounds = max_rounds
        self.allowed = _allowed_token_ids(tokenizer)

    def ids(self, n: int) -> list[int]:
        """``n`` random ordinary token ids."""
        return self.rng.choice(self.allowed, size=max(0, n)).tolist()

    def text(self, target_len: int, prefix: str = "") -> tuple[str, int]:
        """Random text ``t`` such that ``prefix + t`` has ``target_len`` tokens.

        Args:
            target_len: wanted token count of ``prefix + t`` (≥ prefix's own).
            prefix: fixed leading text (a shared prefix).

        Returns:
            ``(prefix + t, actual token count)``.
        """
        tok = self.tokenizer
        base = count_tokens(tok, prefix) if prefix else 0
        body = self.ids(max(0, target_len - base))
        full = prefix + tok.decode(body)
        n = count_tokens(tok, full)
        for _ in range(self.max_rounds):
            if n == target_len:
                break
            if n > target_len:
                body = body[: max(0, len(body) - (n - target_len))]
            else:
                body = body + self.ids(target_len - n)
            full = prefix + tok.decode(body)
            n = count_tokens(tok, full)
        return full, n


def _lengths(rng: np.random.Generator, num: int, mean: int, range_ratio: float) -> np.ndarray:
    """Integer lengths uniform in [mean·(1−r), mean·(1+r)] (vLLM's range ratio)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    lo = int(math.floor(mean * (1.0 - range_ratio)))
    hi = int(math.ceil(mean * (1.0 + range_ratio)))
    return rng.integers(lo, hi + 1, size=num)


# --------------------------------------------------------------- datasets ---

def random_dataset(tokenizer: Any, num_prompts: int, input_len: int = DEFAULT_INPUT_LEN,
                   output_len: int = DEFAULT_OUTPUT_LEN, range_ratio: float = 0.0,
                   prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """Random-token prompts (vLLM's ``random`` dataset).

    Each prompt is a shared random prefix of ``prefix_len`` tokens followed by
    ``input_len`` random tokens (±``range_ratio``); output lengths are
    ``output_len`` (±``range_ratio``) tokens. Use ``--ignore-eos`` to make the
    server produce exactly that many.

    Args:
        tokenizer: benchmark tokenizer.
        num_prompts: number of requests.
        input_len: tokens after the prefix (mean).
        output_len: ``max_tokens`` (mean).
        range_ratio: relative half-width of the uniform length ranges, [0, 1).
        prefix_len: tokens of the prefix shared by every request.
        seed: RNG seed; the same seed gives the same prompts.
    """
    rng = np.random.default_rng(seed)
    gen = RandomTextGenerator(tokenizer, rng)
    prefix = gen.text(prefix_len)[0] if prefix_len > 0 else ""
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    base = count_tokens(tokenizer, prefix) if prefix else 0
    out: list[SampleRequest] = []
    for i in range(num_prompts):
        text, n = gen.text(base + int(in_lens[i]), prefix)
        out.append(SampleRequest(text, n, max(1, int(out_lens[i]))))
    return out


def prefix_repetition_dataset(tokenizer: Any, num_prompts: int,
                              prefix_len: int = DEFAULT_PREFIX_REPETITION_PREFIX_LEN,
                              suffix_len: int = DEFAULT_PREFIX_REPETITION_SUFFIX_LEN,
                              num_prefixes: int = DEFAULT_NUM_PREFIXES,
                              output_len: int = DEFAULT_OUTPUT_LEN, range_ratio: float = 0.0,
                              seed: int = 0) -> list[SampleRequest]:
    """``num_prefixes`` shared prefixes, each followed by unique suffixes.

    Request ``i`` uses prefix ``i mod num_prefixes`` (so each prefix is reused
    about ``num_prompts / num_prefixes`` times), then the order is shuffled.
    Exercises prefix caching (vLLM's ``prefix_repetition`` dataset).

    Args:
        prefix_len: tokens per shared prefix.
        suffix_len: unique tokens per request after its prefix (mean).
        num_prefixes: number of distinct prefixes (≥ 1).
        output_len: ``max_tokens`` (mean); other args as :func:`random_dataset`.
    """
    if num_prefixes < 1:
        raise ValueError("--num-prefixes must be ≥ 1")
    rng = np.random.default_rng(seed)
    gen = RandomTextGenerator(tokenizer, rng)
    prefixes = [gen.text(prefix_len)[0] for _ in range(num_prefixes)]
    suf_lens = _lengths(rng, num_prompts, suffix_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    out: list[SampleRequest] = []
    for i in range(num_prompts):
        p = prefixes[i % num_prefixes]
        text, n = gen.text(count_tokens(tokenizer, p) + int(suf_lens[i]), p)
        out.append(SampleRequest(text, n, max(1, int(out_lens[i]))))
    order = rng.permutation(len(out))
    return [out[j] for j in order]


def _take_requests(samples: list[SampleRequest], num_prompts: int, rng: np.random.Generator,
                   name: str) -> list[SampleRequest]:
    """Shuffle conversations and take them until ``num_prompts`` requests.

    Conversations are reused (cycled) when the source is too small; the last
    conversation's follow-ups are cut so the request count is exact.
    """
    if not samples:
        raise ValueError(f"{name}: no usable prompts")
    order = rng.permutation(len(samples)).tolist()
    out: list[SampleRequest] = []
    total = 0
    k = 0
    while total < num_prompts:
        if k and k % len(order) == 0:
            logger.info("%s: reusing prompts (%d available)", name, len(samples))
        s = samples[order[k % len(order)]]
        k += 1
        room = num_prompts - total
        if s.num_requests > room:
            s = SampleRequest(s.prompt, s.prompt_len, s.expected_output_len, s.follow_ups[: room - 1])
        out.append(s)
        total += s.num_requests
    return out


def mt_bench_dataset(tokenizer: Any, num_prompts: int, path: str | Path | None = None,
                     output_len: int | None = None, multi_turn: bool = False,
                     seed: int = 0) -> list[SampleRequest]:
    """MT-bench's 80 real user prompts as chat requests.

    Args:
        tokenizer: benchmark tokenizer (prompt lengths after chat template).
        num_prompts: number of requests (follow-up turns included).
        path: the questions file (default :func:`default_mt_bench_path`);
            lines ``{"question_id", "category", "turns": [str, str]}``.
        output_len: ``max_tokens`` per request (default 128).
        multi_turn: send each question as a two-turn conversation; turn 2
            resends turn 1 and the server's answer to it.
        seed: shuffle seed.
    """
    path = Path(path) if path else default_mt_bench_path()
    if not path.is_file():
        raise FileNotFoundError(f"MT-bench questions not found at {path}; pass --dataset-path")
    max_tokens = output_len or DEFAULT_OUTPUT_LEN
    samples = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        turns = [t for t in json.loads(line).get("turns", []) if isinstance(t, str) and t.strip()]
        if not turns:
            continue
        msgs = [{"role": "user", "content": turns[0]}]
        samples.append(SampleRequest(msgs, chat_prompt_len(tokenizer, msgs), max_tokens,
                                     tuple(turns[1:]) if multi_turn else ()))
    return _take_requests(samples, num_prompts, np.random.default_rng(seed), "mt-bench")


def _norm_role(role: str) -> str:
    role = (role or "").lower()
    return {"human": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
            "bing": "assistant", "model": "assistant"}.get(role, role)


def _conversation_sample(tokenizer: Any, msgs: list[Message], output_len: int | None,
                         multi_turn: bool) -> SampleRequest | None:
    """A sample from a message list: the first user turn (with any leading
    system messages) is the prompt; the answer that follows it sets the output
    length; with ``multi_turn`` the later user turns are follow-ups."""
    head: list[Message] = []
    i = 0
    while i < len(msgs) and msgs[i]["role"] == "system":
        head.append(msgs[i])
        i += 1
    if i >= len(msgs) or msgs[i]["role"] != "user" or not msgs[i]["content"].strip():
        return None
    head.append(msgs[i])
    rest = msgs[i + 1:]
    ref_len = None
    if rest and rest[0]["role"] == "assistant":
        ref_len = count_tokens(tokenizer, rest[0]["content"])
    max_tokens = output_len or (ref_len if ref_len and ref_len > 0 else DEFAULT_OUTPUT_LEN)
    follow = tuple(m["content"] for m in rest if m["role"] == "user") if multi_turn else ()
    return SampleRequest(head, chat_prompt_len(tokenizer, head), max_tokens, follow)


def parse_jsonl_record(tokenizer: Any, rec: Any, output_len: int | None,
                       multi_turn: bool) -> SampleRequest | None:
    """Turn one record of a user's file into a sample (``None`` to skip).

    Accepted records: a JSON string (prompt text); ``{"prompt": str}`` with
    optional ``"output_len"``/``"max_tokens"``; ShareGPT
    ``{"conversations": [{"from": "human"|"gpt", "value": str}, ...]}``; or
    OpenAI-style ``{"messages": [{"role", "content"}, ...]}``.
    ``output_len`` (``--output-len``) overrides any length in the file.
    """
    if isinstance(rec, str):
        rec = {"prompt": rec}
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("prompt"), str):
        text = rec["prompt"]
        if not text.strip():
            return None
        n = output_len or rec.get("output_len") or rec.get("max_tokens") or DEFAULT_OUTPUT_LEN
        return SampleRequest(text, count_tokens(tokenizer, text), int(n))
    conv = rec.get("conversations") or rec.get("conversation") or rec.get("messages")
    if isinstance(conv, list):
        msgs = []
        for m in conv:
            if not isinstance(m, dict):
                continue
            role = _norm_role(m.get("role") or m.get("from") or "")
            content = m.get("content") if "content" in m else m.get("value")
            if role in ("system", "user", "assistant") and isinstance(content, str):
                msgs.append({"role": role, "content": content})
        return _conversation_sample(tokenizer, msgs, output_len, multi_turn)
    return None


def jsonl_dataset(tokenizer: Any, path: str | Path, num_prompts: int,
                  output_len: int | None = None, multi_turn: bool = False,
                  seed: int = 0) -> list[SampleRequest]:
    """A user's own prompts: JSON lines, or one JSON array (ShareGPT files).

    See :func:`parse_jsonl_record` for the accepted records. Records that give
    no usable prompt are skipped (and counted in a log message).

    Raises:
        FileNotFoundError: when ``path`` does not exist.
        ValueError: when no record is usable.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--dataset-path {path}: no such file")
    raw = path.read_text(encoding="utf-8")
    stripped = raw.lstrip()
    if stripped.startswith("["):
        records = json.loads(stripped)
    else:
        records = [json.loads(line) for line in raw.splitlines() if line.strip()]
    samples = [s for rec in records
               if (s := parse_jsonl_record(tokenizer, rec, output_len, multi_turn)) is not None]
    if len(samples) < len(records):
        logger.info("jsonl: skipped %d of %d records without a usable prompt",
                    len(records) - len(samples), len(records))
    return _take_requests(samples, num_prompts, np.random.default_rng(seed), f"jsonl {path.name}")


def build_dataset(name: str, tokenizer: Any, num_prompts: int, *, input_len: int | None = None,
                  output_len: int | None = None, range_ratio: float = 0.0,
                  prefix_len: int | None = None, num_prefixes: int = DEFAULT_NUM_PREFIXES,
                  dataset_path: str | None = None, multi_turn: bool = False,
                  seed: int = 0) -> list[SampleRequest]:
    """Build the named workload with the CLI's defaults (see each builder).

    ``input_len`` is the random prompt length (``random``) or the unique
    suffix length (``prefix-repetition``); ``prefix_len`` defaults to 0 for
    ``random`` and 256 for ``prefix-repetition``.

    Raises:
        ValueError: on an unknown dataset name or a missing ``dataset_path``.
    """
    if num_prompts < 1:
        raise ValueError("--num-prompts must be ≥ 1")
    if name == "random":
        return random_dataset(tokenizer, num_prompts, input_len or DEFAULT_INPUT_LEN,
                              output_len or DEFAULT_OUTPUT_LEN, range_ratio, prefix_len or 0, seed)
    if name == "prefix-repetition":
        return prefix_repetition_dataset(
            tokenizer, num_prompts,
            DEFAULT_PREFIX_REPETITION_PREFIX_LEN if prefix_len is None else prefix_len,
            input_len or DEFAULT_PREFIX_REPETITION_SUFFIX_LEN, num_prefixes,
            output_len or DEFAULT_OUTPUT_LEN, range_ratio, seed)
    if name == "mt-bench":
        return mt_bench_dataset(tokenizer, num_prompts, dataset_path, output_len, multi_turn, seed)
    if name == "jsonl":
        if not dataset_path:
            raise ValueError("--dataset jsonl needs --dataset-path FILE")
        return jsonl_dataset(tokenizer, dataset_path, num_prompts, output_len, multi_turn, seed)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
