"""The machine facts the kernel plan needs, probed with torch in the engine (tokenmill/kernel_plan.py).

:func:`probe` answers :class:`~tokenmill.kernel_plan.CpuFacts` for this process: the C-kernel variants the
CPU runs, native bfloat16 as oneDNN uses it, oneDNN itself, and whether the low-bit kernel loads (building
it on first use). :func:`engine_plan` resolves an engine config's :class:`~tokenmill.kernel_plan.KernelPlan`
from them; the model runner calls it once and logs the result.
"""

from __future__ import annotations

import torch

from tokenmill.kernel_plan import CpuFacts, CpuKernelSwitches, KernelPlan, plan_for_config
from tokenmill.model.layers.cpu_build import supported_isas
from tokenmill.quantization.lowbit import kernel_available


def hardware_bf16() -> bool:
    """AVX512-BF16 or AMX tiles, and oneDNN runs bfloat16 on them (else bfloat16 GEMMs are emulated)."""
    cpu = getattr(torch, "cpu", None)
    native = any(bool(getattr(cpu, name, lambda: False)())
                 for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"))
    return native and torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def probe(switches: CpuKernelSwitches | None = None, need_lowbit: bool = True) -> CpuFacts:
    """This machine's :class:`CpuFacts`. The low-bit kernel is only built and loaded (a compile on the first
    start) when ``need_lowbit`` and ``switches`` (default: all on) may use it; else it counts as absent."""
    onednn = bool(torch.backends.mkldnn.is_available())
    lowbit = False
    if need_lowbit and (switches is None or (switches.lowbit_kernel and switches.int4_max_tokens)):
        lowbit = kernel_available()
    return CpuFacts(supported_isas=supported_isas(), native_bf16=hardware_bf16(), onednn=onednn,
                    onednn_bf16=onednn and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                    lowbit_kernel=lowbit)


def engine_plan(config, device: torch.device | str, checkpoint_lowbit: bool = True) -> KernelPlan:
    """The :class:`KernelPlan` of an engine config on ``device`` (see :func:`tokenmill.kernel_plan.plan_for_config`).

    Raises:
        ValueError: a forced ISA this CPU cannot run, or an unknown dtype.
    """
    dev = torch.device(device).type
    facts = probe(config.cpu_kernels, checkpoint_lowbit) if dev == "cpu" else CpuFacts(onednn=False, onednn_bf16=False,
                                                                    lowbit_kernel=False)
    return plan_for_config(config, facts, dev, checkpoint_lowbit)
