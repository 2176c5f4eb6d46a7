"""tokenmill/envs.py is the only reader of TOKENMILL_* environment switches, and it declares every one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tokenmill import envs

ROOT = Path(__file__).resolve().parents[1]
ENVS = ROOT / "tokenmill" / "envs.py"
# The repository's before-stop hook greps this outside tokenmill/envs.py.
HOOK = re.compile(r"""(environ(\.get)?[\[(]|getenv\()\s*f?["']TOKENMILL_""")
NAME = re.compile(r"\bTOKENMILL_[A-Z0-9_]*[A-Z0-9]\b")
# Names that are not switches: include guards in tokenmill/model/csrc/*.h, a tuple in benchmarks/compare_engines.py.
# Not environment switches: C header guards, and compile-time -D macros of the kernels that only tests and
# benchmarks/attention_bits_ab.py --define set (DECODE_SPLIT: a tried-and-reverted item, named in the benchmark docs).
NOT_SWITCHES = {"TOKENMILL_COMMON_H", "TOKENMILL_VEC_H", "TOKENMILL_ISAS", "TOKENMILL_DECODE_VEC_ITEM",
                "TOKENMILL_DECODE_SPLIT"}
ENVIRON_CALLS = {"get", "pop", "setdefault", "__getitem__"}


def _py_files(*dirs: str) -> list[Path]:
    return [p for d in dirs for p in sorted((ROOT / d).rglob("*.py")) if p != ENVS]


def test_no_direct_environ_read_of_a_tokenmill_switch():
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
           for p in _py_files("tokenmill", "tests", "benchmarks", "scripts")
           for i, line in enumerate(p.read_text().splitlines(), 1) if HOOK.search(line)]
    assert not bad, "read TOKENMILL_* switches through tokenmill.envs:\n" + "\n".join(bad)


def _environ_key_uses(tree: ast.Module) -> list[tuple[int, ast.expr]]:
    """(line, key expression) of every ``os.environ[...]``, ``os.environ.get/pop/setdefault(...)`` and
    ``os.getenv(...)`` in ``tree``."""
    def is_environ(node: ast.expr) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
            isinstance(node, ast.Name) and node.id == "environ")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            out.append((node.lineno, node.slice))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr in ENVIRON_CALLS and is_environ(f.value)) or (
                    f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os"):
                out.append((node.lineno, node.args[0]))
    return out


def test_no_environ_access_through_a_named_constant():
    """Catches ``X = "TOKENMILL_..."; os.environ.get(X)`` too, which the hook's grep cannot see."""
    bad = []
    for p in _py_files("tokenmill"):
        tree = ast.parse(p.read_text())
        consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                  for t in n.targets if isinstance(t, ast.Name)}
        for line, key in _environ_key_uses(tree):
            value = key.value if isinstance(key, ast.Constant) else consts.get(getattr(key, "id", None))
            if isinstance(value, str) and value.startswith("TOKENMILL_"):
                bad.append(f"{p.relative_to(ROOT)}:{line}: {value}")
    assert not bad, "read TOKENMILL_* switches through tokenmill.envs:\n" + "\n".join(bad)


def test_every_switch_named_anywhere_is_declared():
    texts = [p for p in _py_files("tokenmill", "tests", "benchmarks") if p != Path(__file__).resolve()]
    texts += [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md", *sorted((ROOT / "scripts").iterdir())]
    names = {n for p in texts if p.is_file() for n in NAME.findall(p.read_text(errors="replace"))}
    unknown = sorted(names - set(envs.VARS) - NOT_SWITCHES)
    assert not unknown, f"declare these in tokenmill/envs.py: {unknown}"


def test_declarations_are_complete():
    for v in envs.VARS.values():
        assert v.name.startswith("TOKENMILL_") and v.doc and v.type and v.group, v
        assert "\n" not in v.doc


def test_values_are_read_lazily(monkeypatch):
    monkeypatch.delenv("TOKENMILL_CPU_INT4_MAX_TOKENS", raising=False)
    assert envs.TOKENMILL_CPU_INT4_MAX_TOKENS == 8 == envs.var("TOKENMILL_CPU_INT4_MAX_TOKENS").default
    monkeypatch.setenv("TOKENMILL_CPU_INT4_MAX_TOKENS", "16")
    assert envs.TOKENMILL_CPU_INT4_MAX_TOKENS == 16 and envs.raw("TOKENMILL_CPU_INT4_MAX_TOKENS") == "16"
    monkeypatch.setenv("TOKENMILL_CPU_STEP_GRAPH", "0")
    assert envs.TOKENMILL_CPU_STEP_GRAPH is False
    monkeypatch.setenv("TOKENMILL_DEBUG_ENDPOINTS", "yes")       # only "1" turns it on
    assert envs.TOKENMILL_DEBUG_ENDPOINTS is False


def test_cache_dir_default_is_under_the_home_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENMILL_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert envs.TOKENMILL_CACHE_DIR == str(tmp_path / ".cache" / "tokenmill")
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", "")                 # empty: the default too
    assert envs.TOKENMILL_CACHE_DIR == str(tmp_path / ".cache" / "tokenmill")


@pytest.mark.parametrize("name, bad", [("TOKENMILL_CPU_INT4_MAX_TOKENS", "-1"),
                                       ("TOKENMILL_CPU_INT8_ACT_MAX_TOKENS", "many"),
                                       ("TOKENMILL_CPU_STEP_GRAPH_MAX_TOKENS", "0"),
                                       ("TOKENMILL_INT4_GROUP_SIZE", "30")])
def test_bad_values_raise_naming_the_switch(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=name):
        envs.get(name)


def test_undeclared_names_are_refused():
    with pytest.raises(KeyError, match="not a declared"):
        envs.get("TOKENMILL_NO_SUCH_SWITCH")
    with pytest.raises(AttributeError):
        envs.TOKENMILL_NO_SUCH_SWITCH  # noqa: B018


def test_weight_cache_key_reads_the_config_switches(monkeypatch, tmp_path):
    """The weight switches reach the cache key through the config: the environment is read once, when the
    config is built (EngineConfig.cpu_kernels), and each one changes the key."""
    import dataclasses

    from tokenmill.config import EngineConfig
    from tokenmill.kernel_plan import CpuKernelSwitches
    from tokenmill.model import weight_cache

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    for v in envs.VARS.values():
        if v.in_weight_key:
            monkeypatch.delenv(v.name, raising=False)
    switches = EngineConfig().cpu_kernels
    assert switches == CpuKernelSwitches()
    _, base = weight_cache.cache_key("gguf", str(gguf), {}, switches.weight_key())
    weighty = {f.metadata["env"]: f.name for f in dataclasses.fields(CpuKernelSwitches)
               if envs.var(f.metadata["env"]).in_weight_key}
    assert set(weighty) == {v.name for v in envs.VARS.values() if v.in_weight_key} == {
        "TOKENMILL_CPU_ISA", "TOKENMILL_CPU_BF16", "TOKENMILL_CPU_LOWBIT_KERNEL", "TOKENMILL_CPU_PACKED_LINEAR",
        "TOKENMILL_CPU_INT4_MAX_TOKENS"}
    for name, value in [("TOKENMILL_CPU_ISA", "scalar"), ("TOKENMILL_CPU_BF16", "0"),
                        ("TOKENMILL_CPU_LOWBIT_KERNEL", "0"), ("TOKENMILL_CPU_PACKED_LINEAR", "0"),
                        ("TOKENMILL_CPU_INT4_MAX_TOKENS", "0")]:
        monkeypatch.setenv(name, value)
        config = EngineConfig()
        monkeypatch.delenv(name)        # read once, when the config was built: it keeps the value
        assert getattr(config.cpu_kernels, weighty[name]) == envs.var(name).parse(value)
        assert weight_cache.cache_key("gguf", str(gguf), {}, config.cpu_kernels.weight_key())[1] != base, name
        assert config.replace(max_num_seqs=3).cpu_kernels == config.cpu_kernels   # replace() carries them
