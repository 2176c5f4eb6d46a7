"""Test doubles for the server: a character tokenizer and a model-free executor.

``CharTokenizer`` maps token id ``i`` to one character (ids 0–2 are special
tokens ``<pad>``, ``<bos>``, ``<eos>``; id 3 + k is ``ALPHABET[k]``).
``FakeExecutor`` samples, for every request due a token, the id that follows
the request's last token in a fixed cycle, so outputs are deterministic and
independent of batching. It sleeps ``step_time`` seconds per step so that
tests can observe requests running.
"""

from __future__ import annotations

import time

from tokenmill.core.sched_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.outputs import TokenLogprobs

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.!?é日本語😀"
SPECIAL = ["<pad>", "<bos>", "<eos>"]
EOS = 2


class CharTokenizer:
    """Minimal Hugging Face-like tokenizer: one character per token."""

    chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"
    eos_token_id = EOS
    bos_token_id = 1

    def __len__(self) -> int:
        return len(SPECIAL) + len(ALPHABET)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [3 + ALPHABET.index(ch) if ch in ALPHABET else 3 for ch in text]

    def decode(self, ids, skip_special_tokens: bool = True, clean_up_tokenization_spaces: bool = False) -> str:
        out = []
        for i in ids:
            if i < 3:
                if not skip_special_tokens:
                    out.append(SPECIAL[i])
            else:
                out.append(ALPHABET[(i - 3) % len(ALPHABET)])
        return "".join(out)

    def convert_ids_to_tokens(self, i: int) -> str:
        return SPECIAL[i] if i < 3 else ALPHABET[(i - 3) % len(ALPHABET)]

    def apply_chat_template(self, messages, chat_template=None, add_generation_prompt=True,
                            continue_final_message=False, tokenize=False, **kw) -> str:
        import jinja2

        return jinja2.Template(chat_template or self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt)


def next_token(last: int) -> int:
    """The fake model's deterministic successor of ``last`` (letters only, never EOS)."""
    return 3 + ((last - 3 + 1) % 26) if last >= 3 else 3


class FakeExecutor:
    """Model-free executor for :class:`tokenmill.engine.engine_core.EngineCore`."""

    def __init__(self, num_kv_blocks: int = 256, max_model_len: int = 512, step_time: float = 0.01) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        self.eos_token_ids = [EOS]
        self.step_time = step_time

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        time.sleep(self.step_time)
        out = ModelRunnerOutput()
        for r in so.scheduled:
            if not r.sample:
                continue
            tok = next_token(r.token_ids[-1])
            out.req_ids.append(r.req_id)
            out.sampled_token_ids.append(tok)
            lp = None
            if r.sampling_params.logprobs is not None:
                k = r.sampling_params.logprobs
                alts = [tok] + [next_token(tok + j) for j in range(k)]
                lp = TokenLogprobs(logprob=-0.5, rank=1, top_token_ids=alts[: max(k, 0)],
                                   top_logprobs=[-0.5 - j for j in range(max(k, 0))])
            out.logprobs.append(lp)
        return out


def make_fake_executor(config) -> FakeExecutor:
    """Executor factory for :class:`AsyncEngine` (runs in the spawned core process)."""
    return FakeExecutor(num_kv_blocks=config.cache.num_kv_blocks or 256,
                        max_model_len=config.model.max_model_len or 512)


def make_slow_fake_executor(config) -> FakeExecutor:
    """Like :func:`make_fake_executor` but 50 ms per step."""
    ex = make_fake_executor(config)
    ex.step_time = 0.05
    return ex


def make_raising_executor(config) -> FakeExecutor:
    """An executor whose every step raises: the core fails that step's requests and keeps running."""
    ex = make_fake_executor(config)

    def boom(so):
        raise RuntimeError("simulated model failure")

    ex.execute_model = boom  # type: ignore[method-assign]
    return ex


def make_crashing_executor(config) -> FakeExecutor:
    """An executor whose first step kills the engine core process (as a segfault or the OOM killer would)."""
    ex = make_fake_executor(config)

    def boom(so):
        import os

        os._exit(1)

    ex.execute_model = boom  # type: ignore[method-assign]
    return ex
