"""Tokenizer and chat template, both taken from the checkpoint (nothing is downloaded).

* GGUF file: transformers converts the embedded vocabulary/merges into a fast
  tokenizer (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``); the
  chat template is the ``tokenizer.chat_template`` metadata string.
* Hugging Face folder: ``tokenizer.json`` / ``tokenizer_config.json`` (and
  ``chat_template.jinja`` when present) via ``AutoTokenizer``.

Also :class:`TokenStrings`, the text and bytes of single tokens that logprobs
report. Used by the engine, the server and the offline API; imports no model
code (GGUF metadata is read with the ``gguf`` library directly).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from tokenmill import envs


def _split_gguf(path: str) -> tuple[str, str] | None:
    if os.path.isfile(path) and path.endswith(".gguf"):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    return None


def load_tokenizer(path: str, use_cache: bool = True):
    """Load the fast tokenizer of a GGUF file or a Hugging Face folder, offline.

    Converting a GGUF vocabulary takes seconds (transformers re-parses the
    file), so the converted tokenizer is saved once under
    ``~/.cache/tokenmill/tokenizers/`` (or ``$TOKENMILL_CACHE_DIR``), keyed by
    the file's path, size and mtime, and reloaded from there next time
    (``use_cache=False`` skips the cache).

    Returns:
        a ``transformers.PreTrainedTokenizerFast`` with ``chat_template`` set
        when the checkpoint has one.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        OSError / ValueError: transformers cannot build a tokenizer from it.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    gg = _split_gguf(path)
    if gg is None:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    cache = _tokenizer_cache_dir(path) if use_cache else None
    if cache and os.path.isfile(os.path.join(cache, "tokenizer.json")):
        try:
            return _load_fast_tokenizer(cache)
        except Exception:  # a corrupt cache entry: rebuild below
            pass
    from transformers import AutoTokenizer

    folder, name = gg
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    if not getattr(tok, "chat_template", None):
        template = load_chat_template(path)
        if template:
            tok.chat_template = template
    if cache:
        try:
            tmp = f"{cache}.tmp{os.getpid()}"
            tok.save_pretrained(tmp)
            os.replace(tmp, cache)
        except OSError:  # read-only home, race with another process: the cache is optional
            pass
    return tok


def _load_fast_tokenizer(folder: str):
    """A tokenizer we saved (``tokenizer.json`` + config), without ``AutoTokenizer`` when its class allows.

    ``AutoTokenizer`` imports transformers' model configuration code, which imports torch (~2-4 s of the
    API process's start-up, which otherwise never needs torch). A converted GGUF tokenizer is saved with
    transformers' generic fast class (``TokenizersBackend`` / ``PreTrainedTokenizerFast``), which loads
    directly from ``tokenization_utils_fast``; any other class goes through ``AutoTokenizer``.
    """
    import json

    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        cls_name = json.load(f).get("tokenizer_class")
    if cls_name in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        from transformers.tokenization_utils_fast import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _tokenizer_cache_dir(path: str) -> str | None:
    """Cache folder for the tokenizer converted from GGUF ``path``, keyed by path, size and mtime.

    Root: ``$TOKENMILL_CACHE_DIR`` or ``~/.cache/tokenmill``; None if unusable.
    """
    try:
        st = os.stat(path)
        root = envs.TOKENMILL_CACHE_DIR
        key = hashlib.sha256(f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:24]
        d = os.path.join(root, "tokenizers", key)
        os.makedirs(os.path.dirname(d), exist_ok=True)
        return d
    except OSError:
        return None


def load_chat_template(path: str, tokenizer=None) -> str | None:
    """The checkpoint's chat template (Jinja source) or None.

    For a GGUF file: metadata ``tokenizer.chat_template``. For a folder:
    ``tokenizer.chat_template`` of the given (or freshly loaded) tokenizer.
    """
    if _split_gguf(path) is not None:
        import gguf

        field = gguf.GGUFReader(path, "r").fields.get("tokenizer.chat_template")
        return None if field is None else field.contents()
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    t = getattr(tok, "chat_template", None)
    return t if isinstance(t, str) else None


def _byte_level_alphabet() -> dict[int, str]:
    """Byte → printable character map of byte-level BPE vocabularies (GPT-2 style).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes map, in
    order, to code points 256, 257, ...
    """
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    keep_set = set(keep)
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep_set:
            table[b] = chr(256 + extra)
            extra += 1
    return table


class TokenStrings:
    """Text and raw bytes of single tokens, for logprobs (cached per id).

    For byte-level BPE vocabularies the bytes are exact (a token may hold part
    of a UTF-8 character; its text then contains U+FFFD, as in vLLM/OpenAI);
    otherwise the token is decoded on its own.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._char_to_byte = {c: b for b, c in _byte_level_alphabet().items()}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """``(text, utf8 bytes)`` of one token."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if isinstance(piece, str) and piece and all(ch in self._char_to_byte for ch in piece):
            raw = bytes(self._char_to_byte[ch] for ch in piece)
            out = (raw.decode("utf-8", errors="replace"), list(raw))
        else:
            text = self.tokenizer.decode([int(token_id)])
            out = (text, list(text.encode("utf-8")))
        if len(self._cache) < 200_000:
            self._cache[token_id] = out
        return out


_TOOLS_CACHE: dict[str, bool] = {}


def template_accepts_tools(template: str) -> bool:
    """True when a Jinja chat template reads the ``tools`` variable (it renders tool definitions itself).

    Templates that do not are given the tools in a system message by the server (see
    docs/guide/structured_outputs.md). The answer is cached per template text.

    Raises:
        Nothing: a template this Jinja cannot parse (an extension tag) is searched for the word ``tools``.
    """
    hit = _TOOLS_CACHE.get(template)
    if hit is None:
        import re

        import jinja2
        import jinja2.meta

        try:
            env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
            hit = "tools" in jinja2.meta.find_undeclared_variables(env.parse(template))
        except jinja2.TemplateSyntaxError:
            hit = re.search(r"\btools\b", template) is not None
        if len(_TOOLS_CACHE) < 64:
            _TOOLS_CACHE[template] = hit
    return hit
