"""Loading our C kernels must not change the process's floating-point state (flush-to-zero / denormals-are-zero)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.kernel_variants import variants
from tokenmill.model.layers import cpu_build


@pytest.mark.parametrize("isa", variants())
def test_loading_kernels_keeps_subnormals(isa: str) -> None:
    if not cpu_build.isa_supported(isa):
        pytest.skip(f"this CPU cannot run the {isa} variant")
    # A fresh interpreter: the pytest process may already have loaded a library.
    code = textwrap.dedent(f"""
        import struct
        from tokenmill.model.layers import paged_attention_cpu, fused_cpu
        from tokenmill.quantization import lowbit
        tiny = struct.unpack('d', struct.pack('Q', 1 << 52))[0]  # the smallest normal double
        before = tiny / 4 != 0.0
        libs = [paged_attention_cpu.load({isa!r}), fused_cpu.load({isa!r}), lowbit.load_kernel({isa!r})]
        assert all(l is not None for l in libs), libs
        print(before, tiny / 4 != 0.0)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"], out.stdout
