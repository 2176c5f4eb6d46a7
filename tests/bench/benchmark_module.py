"""Import a script under ``benchmarks/`` as a module (the folder is not a package), for tests of its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/{name}.py`` loaded as the module ``_bench_{name}`` (registered in ``sys.modules``, so
    dataclasses and pickling inside it resolve).

    Raises:
        FileNotFoundError: no such script.
    """
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
