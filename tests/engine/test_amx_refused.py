"""When Linux refuses the AMX tile state, the kernels run their vector paths and give the
same results.

A process gets the tile registers only after asking (arch_prctl ARCH_REQ_XCOMP_PERM); an
old kernel, a container's seccomp profile or a hypervisor can refuse, and the kernels
must then stay on AVX-512 (amx.c asks once). Here a child process installs a seccomp
filter that fails exactly that request with EPERM - the refusal a real system gives -
before torch or the kernels load, and runs the int8 linear and bf16 attention on fixed
inputs; another child runs them unfiltered. On a CPU with AMX the second child takes the
tiles, so the two paths are compared; on other CPUs both take the vector paths and the
test still checks the refusal is reported.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

_CHILD = r"""
import ctypes, json, sys

REFUSE = sys.argv[2] == "refuse"
if REFUSE:
    # A classic BPF program over seccomp_data {nr, arch, ip, args[6]}: on x86-64,
    # arch_prctl(ARCH_REQ_XCOMP_PERM, ...) returns EPERM, every other call is allowed.
    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte),
                    ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Insn))]

    LOAD, JEQ, RET = 0x20, 0x15, 0x06
    ALLOW, EPERM = 0x7FFF0000, 0x00050000 | 1
    insns = [
        (LOAD, 0, 0, 4), (JEQ, 1, 0, 0xC000003E),  # arch == x86-64, else allow
        (RET, 0, 0, ALLOW),
        (LOAD, 0, 0, 0), (JEQ, 0, 3, 158),  # nr == arch_prctl
        (LOAD, 0, 0, 16), (JEQ, 0, 1, 0x1023),  # args[0] == ARCH_REQ_XCOMP_PERM
        (RET, 0, 0, EPERM),
        (RET, 0, 0, ALLOW),
    ]
    table = (Insn * len(insns))(*[Insn(*i) for i in insns])
    program = Program(len(insns), table)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0, "PR_SET_NO_NEW_PRIVS"
    assert libc.prctl(22, 2, ctypes.byref(program), 0, 0) == 0, "PR_SET_SECCOMP"
    # The filter holds: the request itself now fails with EPERM (1).
    assert libc.syscall(158, 0x1023, 18) == -1 and ctypes.get_errno() == 1

import torch
from safetensors.torch import save_file
from tokenmill.engine.kernels import native_library
from tokenmill.engine.kernels.int8_linear import int8_linear, pack_int8_weight
from tokenmill.engine.kernels.paged_attention import (
    AttentionEntries, native_paged_attention, to_native_layout,
)
from tokenmill.engine.quant.int8 import quantize_weight

limits = native_library().limits
tensors = {}
gen = torch.Generator().manual_seed(0)
if limits.int8_linear_isa is not None:
    packed = pack_int8_weight(*quantize_weight(torch.randn(960, 576, generator=gen)),
                              torch.randn(960, generator=gen))
    x = torch.randn(100, 576, generator=gen).bfloat16()
    tensors["int8_linear"] = int8_linear(x, packed)

# One layer of SmolLM2's attention: a 40-token prompt chunk and one continuing 60 cached
# positions (16-row groups: tiles where permitted), and a decoding token.
blocks, heads, kv_heads, dim, bs = 40, 9, 3, 64, 16
k = torch.randn(blocks, kv_heads, dim, bs, generator=gen).bfloat16()
v = torch.randn(blocks, kv_heads, bs, dim, generator=gen).bfloat16()
k, v = to_native_layout(k, v)
chunks = [(0, 40, 40, [3, 7, 1]), (40, 24, 84, [0, 9, 4, 12, 20, 2]), (64, 1, 30, [5, 6])]
def t(values):
    return torch.tensor(values, dtype=torch.int64)
tables = torch.zeros(len(chunks), 6, dtype=torch.int64)
for i, chunk in enumerate(chunks):
    tables[i, : len(chunk[3])] = t(chunk[3])
entries = AttentionEntries(
    rows=t([c[0] for c in chunks]), queries=t([c[1] for c in chunks]),
    contexts=t([c[2] for c in chunks]), block_tables=tables,
    group_starts=t(list(range(len(chunks) + 1))), group_shared_blocks=t([0] * len(chunks)),
)
q = torch.randn(65, heads, dim, generator=gen).bfloat16()
tensors["attention"] = native_paged_attention(q, k, v, entries, dim**-0.5)
save_file(tensors, sys.argv[1])
print("LIMITS " + json.dumps({
    "int8_linear_isa": limits.int8_linear_isa,
    "bf16_attention_amx": limits.bf16_attention_amx,
    "q4_linear_tiles": limits.q4_linear_tiles,
    "vision_attention_amx": limits.vision_attention_amx,
}))
"""


def _run(tmp_path, mode: str) -> tuple[dict, dict[str, torch.Tensor]]:
    out = tmp_path / f"{mode}.safetensors"
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(out), mode],
        env=dict(os.environ),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("LIMITS "))
    return json.loads(line.removeprefix("LIMITS ")), load_file(out)


@pytest.mark.skipif(
    sys.platform != "linux" or platform.machine() != "x86_64",
    reason="seccomp filters and arch_prctl are Linux x86-64's",
)
def test_a_refused_tile_state_keeps_the_vector_paths_with_the_same_results(tmp_path):
    granted_limits, granted = _run(tmp_path, "grant")
    refused_limits, refused = _run(tmp_path, "refuse")
    print(f"\nunfiltered: {granted_limits}; AMX refused: {refused_limits}")
    assert refused_limits["bf16_attention_amx"] is False
    assert "amx" not in (refused_limits["int8_linear_isa"] or "")
    assert refused_limits["q4_linear_tiles"] is False  # the gguf layers keep the integer product
    assert refused_limits["vision_attention_amx"] is False  # the towers keep PyTorch's sdpa
    assert refused.keys() == granted.keys()
    if "int8_linear" in granted:  # both paths sum the same integers, one epilogue
        assert torch.equal(refused["int8_linear"], granted["int8_linear"])
    # Tiles and dot products sum in different orders: fp32 rounding, then bf16 output.
    torch.testing.assert_close(
        refused["attention"].float(), granted["attention"].float(), atol=2e-2, rtol=2e-2
    )
