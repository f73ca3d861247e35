"""How packed.safetensors beside this script was made: one 64 x 128 layer's integer
codes, zero points and fp16 scales (random, seeded) packed by auto-round 0.15's own
packers - its GPTQ v1 packer (auto_round_extension.torch.qlinear_torch_zp, zero points
stored minus one) at 4 and 8 bits and its AWQ GEMM packer
(auto_round.export.export_to_awq.utils.WQLinear_GEMM) - in llm-compressor's virtual
environment; the tests never need auto-round:

    python make_packed.py OUT_FILE

Stored per case (gptq4, gptq8, awq4): `codes` (unsigned, int16 [n, k]), `zeros`
(unsigned, int16 [n, groups]), `scales` (fp16 [n, groups]) - the inputs - and the
packer's `qweight`, `qzeros` and `scales_out`.
"""

import sys

import torch
from auto_round.export.export_to_awq.utils import WQLinear_GEMM
from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
from safetensors.torch import save_file

N, K, GROUP = 64, 128, 32


def inputs(bits: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (N, K), generator=generator)
    # GPTQ v1 stores a zero point minus one: 0 cannot be stored, so zeros start at 1.
    zeros = torch.randint(1, top + 1, (N, K // GROUP), generator=generator)
    scales = (torch.rand(N, K // GROUP, generator=generator) * 0.02 + 0.001).half()
    groups = torch.arange(K) // GROUP
    weight = (codes - zeros[:, groups]).float() * scales.float()[:, groups]
    linear = torch.nn.Linear(K, N, bias=False)
    linear.weight.data = weight
    return codes, zeros, scales, linear


def main(out: str) -> None:
    tensors = {}
    for bits, seed in ((4, 1), (8, 2)):
        codes, zeros, scales, linear = inputs(bits, seed)
        layer = QuantLinear(bits, GROUP, K, N, False, g_idx=True)
        layer.pack(linear, scales.float(), zeros.clone(), device="cpu")
        case = f"gptq{bits}"
        tensors |= {
            f"{case}.codes": codes.to(torch.int16),
            f"{case}.zeros": zeros.to(torch.int16),
            f"{case}.scales": scales,
            f"{case}.qweight": layer.qweight,
            f"{case}.qzeros": layer.qzeros,
            f"{case}.scales_out": layer.scales,
        }
    codes, zeros, scales, linear = inputs(4, 3)
    awq = WQLinear_GEMM.from_linear(
        linear, 4, GROUP, scales=scales.t().float(), zeros=zeros.t().clone(), device="cpu"
    )
    tensors |= {
        "awq4.codes": codes.to(torch.int16),
        "awq4.zeros": zeros.to(torch.int16),
        "awq4.scales": scales,
        "awq4.qweight": awq.qweight,
        "awq4.qzeros": awq.qzeros,
        "awq4.scales_out": awq.scales,
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, out)


if __name__ == "__main__":
    main(sys.argv[1])
