"""The CPU a benchmark ran on, named as the figures in docs/performance.md are."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's name with its family and model numbers (CPUs of one name differ)."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" not in fields:
        return platform.processor() or platform.machine()
    flags = set(fields.get("flags", "").split())
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return (
        f"{fields['model name']} (family {fields.get('cpu family', '?')}, model "
        f"{fields.get('model', '?')}; {' '.join(isa) or 'no AVX-512'})"
    )
