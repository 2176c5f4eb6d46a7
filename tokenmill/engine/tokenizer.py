"""Tokenizer and chat template, both taken from the checkpoint (nothing is downloaded).

* GGUF file: transformers converts the embedded vocabulary/merges into a fast
  tokenizer (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``); the
  chat template is the ``tokenizer.chat_template`` metadata string.
* Hugging Face folder: ``tokenizer.json`` / ``tokenizer_config.json`` (and
  ``chat_template.jinja`` when present) via ``AutoTokenizer``.
"""

from __future__ import annotations

import hashlib
import os


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
    from transformers import AutoTokenizer

    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    gg = _split_gguf(path)
    if gg is None:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    cache = _tokenizer_cache_dir(path) if use_cache else None
    if cache and os.path.isfile(os.path.join(cache, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache, local_files_only=True)
        except Exception:  # a corrupt cache entry: rebuild below
            pass
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


def _tokenizer_cache_dir(path: str) -> str | None:
    """Cache folder for the tokenizer converted from GGUF ``path``, keyed by path, size and mtime.

    Root: ``$TOKENMILL_CACHE_DIR`` or ``~/.cache/tokenmill``; None if unusable.
    """
    try:
        st = os.stat(path)
        root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
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
        from tokenmill.model.gguf_loader import chat_template, open_gguf

        return chat_template(open_gguf(path))
    tok = tokenizer if tokenizer is not None else load_tokenizer(path)
    t = getattr(tok, "chat_template", None)
    return t if isinstance(t, str) else None
