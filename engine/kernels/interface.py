"""Python mirror of kernels.h: one ctypes Structure per argument struct, the limits read
from the library, and each exported function's signature.

Each Structure lists its header struct's fields in order with the same C types, so
ctypes lays it out as the compiler does; `declare` compares every size with the size the
library reports (tm_limits) and refuses a library built from another version of the
header. The wrappers (paged_attention.py, elementwise.py, quantize.py) fill a Structure
and pass a pointer to it - no positional argument lists to keep in step.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

_ptr, _i64, _i32, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float

# The header's TM_ABI_VERSION this mirror follows.
ABI_VERSION = 24
# Status codes (TM_OK, TM_OUT_OF_MEMORY, TM_UNSUPPORTED_SHAPE, TM_UNSUPPORTED_ISA).
OK, OUT_OF_MEMORY, UNSUPPORTED_SHAPE, UNSUPPORTED_ISA = 0, -1, -2, -3
# tm_limits_t.int8_linear_isa values (TM_INT8_ISA_*), by name.
INT8_LINEAR_ISAS = {
    0: None,
    1: "avx512_vnni",
    2: "amx_int8+avx512_vnni",
    3: "avx2",
    4: "avx_vnni",
}

# tm_limits_t.lora_isa values (TM_LORA_ISA_*), by name.
LORA_ISAS = {0: "generic", 1: "avx512_bf16", 2: "amx_bf16+avx512_bf16", 3: "avx512", 4: "avx2"}
# tm_limits_t.moe_isa values (TM_MOE_ISA_*), by name.
MOE_ISAS = {0: "generic", 1: "avx512_bf16", 2: "amx_bf16+avx512_bf16", 3: "avx512", 4: "avx2"}
# tm_limits_t.fp8_linear_isa values (TM_FP8_ISA_*), by name.
FP8_LINEAR_ISAS = {
    0: "generic",
    1: "avx2",
    2: "avx512",
    3: "avx512_bf16",
    4: "amx_bf16+avx512_bf16",
}


class _Limits(ctypes.Structure):
    _fields_ = [
        ("abi_version", _i64),
        ("max_head_dim", _i64),
        ("max_block_size", _i64),
        ("max_heads_per_kv_head", _i64),
        ("max_row_dim", _i64),
        ("max_qmax", _i64),
        ("max_int8_k", _i64),
        ("kv_int8_group", _i64),
        ("kv_int8_direct", _i64),
        ("int8_linear_isa", _i64),
        ("bf16_attention_amx", _i64),
        ("q4_linear_isa", _i64),
        ("q4_linear_tiles", _i64),
        ("lora_isa", _i64),
        ("lora_max_blocks", _i64),
        ("packed_matvec_vector", _i64),
        ("attention_args_size", _i64),
        ("kv_write_args_size", _i64),
        ("rms_norm_args_size", _i64),
        ("rotary_args_size", _i64),
        ("silu_args_size", _i64),
        ("quantize_args_size", _i64),
        ("int8_linear_args_size", _i64),
        ("argmax_args_size", _i64),
        ("int4_unpack_args_size", _i64),
        ("q4_linear_args_size", _i64),
        ("q4_unpack_args_size", _i64),
        ("lora_args_size", _i64),
        ("packed_matvec_args_size", _i64),
        ("moe_isa", _i64),
        ("moe_max_top_k", _i64),
        ("moe_args_size", _i64),
        ("fp8_linear_isa", _i64),
        ("fp8_linear_args_size", _i64),
        ("vision_attention_amx", _i64),
        ("vision_attention_args_size", _i64),
        ("layer_norm_args_size", _i64),
        ("int4_pack_args_size", _i64),
        ("gguf_dequantize_args_size", _i64),
        ("q4_pack_gguf_args_size", _i64),
    ]


class AttentionArgs(ctypes.Structure):
    """tm_attention_args."""

    _fields_ = [
        ("q", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("out", _ptr),
        ("rows", _ptr),
        ("queries", _ptr),
        ("contexts", _ptr),
        ("block_tables", _ptr),
        ("group_starts", _ptr),
        ("group_shared_blocks", _ptr),
        ("sinks", _ptr),
        ("num_groups", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("block_size", _i64),
        ("max_blocks", _i64),
        ("sliding_window", _i64),
        ("scale", _f32),
        ("is_bf16", _i32),
        ("num_threads", _i32),
        ("kv_int8", _i32),
    ]


class KVWriteArgs(ctypes.Structure):
    """tm_kv_write_args."""

    _fields_ = [
        ("k", _ptr),
        ("v", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("slot_blocks", _ptr),
        ("slot_offsets", _ptr),
        ("num_tokens", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("block_size", _i64),
        ("is_bf16", _i32),
        ("num_threads", _i32),
        ("kv_int8", _i32),
    ]


class RMSNormArgs(ctypes.Structure):
    """tm_rms_norm_args."""

    _fields_ = [
        ("x", _ptr),
        ("residual", _ptr),
        ("out", _ptr),
        ("weight", _ptr),
        ("rows", _i64),
        ("dim", _i64),
        ("eps", _f32),
        ("is_bf16", _i32),
        ("num_threads", _i32),
        ("fp32_weight", _i32),
    ]


class RotaryArgs(ctypes.Structure):
    """tm_rotary_args."""

    _fields_ = [
        ("q", _ptr),
        ("k", _ptr),
        ("v", _ptr),
        ("q_stride", _i64),
        ("k_stride", _i64),
        ("v_stride", _i64),
        ("q_out", _ptr),
        ("k_out", _ptr),
        ("v_out", _ptr),
        ("cos", _ptr),
        ("sin", _ptr),
        ("num_tokens", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("is_bf16", _i32),
        ("num_threads", _i32),
    ]


class LayerNormArgs(ctypes.Structure):
    """tm_layer_norm_args."""

    _fields_ = [
        ("x", _ptr),
        ("residual", _ptr),
        ("sum", _ptr),
        ("out", _ptr),
        ("weight", _ptr),
        ("bias", _ptr),
        ("rows", _i64),
        ("dim", _i64),
        ("eps", _f32),
        ("is_bf16", _i32),
        ("num_threads", _i32),
    ]


class SiluArgs(ctypes.Structure):
    """tm_silu_args."""

    _fields_ = [
        ("x", _ptr),
        ("out", _ptr),
        ("rows", _i64),
        ("dim", _i64),
        ("is_bf16", _i32),
        ("num_threads", _i32),
    ]


class QuantizeArgs(ctypes.Structure):
    """tm_quantize_args."""

    _fields_ = [
        ("x", _ptr),
        ("inv_smooth", _ptr),
        ("out", _ptr),
        ("scales", _ptr),
        ("rows", _i64),
        ("dim", _i64),
        ("is_bf16", _i32),
        ("qmax", _i32),
        ("zero_point", _i32),
        ("num_threads", _i32),
        ("full_range", _i32),
    ]


class Int8LinearArgs(ctypes.Structure):
    """tm_int8_linear_args."""

    _fields_ = [
        ("x", _ptr),
        ("inv_smooth", _ptr),
        ("qx", _ptr),
        ("x_scales", _ptr),
        ("w", _ptr),
        ("w_col_sums", _ptr),
        ("w_scales", _ptr),
        ("bias", _ptr),
        ("out", _ptr),
        ("rows", _i64),
        ("n", _i64),
        ("k", _i64),
        ("is_bf16", _i32),
        ("num_threads", _i32),
        ("activation", _i32),
        ("x_full_range", _i32),
    ]


class ArgmaxArgs(ctypes.Structure):
    """tm_argmax_args."""

    _fields_ = [
        ("x", _ptr),
        ("out", _ptr),
        ("rows", _i64),
        ("n", _i64),
        ("num_threads", _i32),
    ]


class Int4UnpackArgs(ctypes.Structure):
    """tm_int4_unpack_args."""

    _fields_ = [
        ("packed", _ptr),
        ("scales_and_zeros", _ptr),
        ("out", _ptr),
        ("n", _i64),
        ("k", _i64),
        ("group", _i64),
        ("num_threads", _i32),
    ]


class Int4PackArgs(ctypes.Structure):
    """tm_int4_pack_args."""

    _fields_ = [
        ("weight", _ptr),
        ("packed", _ptr),
        ("scale", _ptr),
        ("minimum", _ptr),
        ("num_nonfinite", _ptr),
        ("n", _i64),
        ("k", _i64),
        ("group", _i64),
        ("is_bf16", _i32),
        ("num_threads", _i32),
    ]


class GGUFDequantizeArgs(ctypes.Structure):
    """tm_gguf_dequantize_args."""

    _fields_ = [
        ("blocks", _ptr),
        ("out", _ptr),
        ("num_blocks", _i64),
        ("kind", _i32),
        ("num_threads", _i32),
        ("bf16", _i32),
    ]


class Q4PackGGUFArgs(ctypes.Structure):
    """tm_q4_pack_gguf_args."""

    _fields_ = [
        ("raw", _ptr),
        ("out", _ptr),
        ("n", _i64),
        ("k", _i64),
        ("affine", _i32),
        ("num_threads", _i32),
    ]


class Q4LinearArgs(ctypes.Structure):
    """tm_q4_linear_args."""

    _fields_ = [
        ("x", _ptr),
        ("qx", _ptr),
        ("x_scales", _ptr),
        ("x_sums", _ptr),
        ("w", _ptr),
        ("bias", _ptr),
        ("out", _ptr),
        ("rows", _i64),
        ("n", _i64),
        ("k", _i64),
        ("is_bf16", _i32),
        ("num_threads", _i32),
        ("affine", _i32),
    ]


class Q4UnpackArgs(ctypes.Structure):
    """tm_q4_unpack_args."""

    _fields_ = [
        ("w", _ptr),
        ("out", _ptr),
        ("n", _i64),
        ("k", _i64),
        ("affine", _i32),
        ("num_threads", _i32),
    ]


class LoRAArgs(ctypes.Structure):
    """tm_lora_args."""

    _fields_ = [
        ("x", _ptr),
        ("y", _ptr),
        ("a", _ptr),
        ("b", _ptr),
        ("runs", _ptr),
        ("slot_ranks", _ptr),
        ("slot_blocks", _ptr),
        ("slot_num_blocks", _ptr),
        ("rows", _i64),
        ("num_runs", _i64),
        ("num_slots", _i64),
        ("in_features", _i64),
        ("out_features", _i64),
        ("a_cols", _i64),
        ("b_rows", _i64),
        ("b_cols", _i64),
        ("is_bf16", _i32),
        ("num_threads", _i32),
    ]


class PackedMatvecArgs(ctypes.Structure):
    """tm_packed_matvec_args."""

    _fields_ = [
        ("x", _ptr),
        ("w", _ptr),
        ("bias", _ptr),
        ("y", _ptr),
        ("in_features", _i64),
        ("out_features", _i64),
        ("block_cols", _i64),
        ("num_threads", _i32),
    ]


class MoEArgs(ctypes.Structure):
    """tm_moe_args."""

    _fields_ = [
        ("x", _ptr),
        ("expert_ids", _ptr),
        ("expert_weights", _ptr),
        ("gate_up", _ptr),
        ("down", _ptr),
        ("gate_up_scales", _ptr),
        ("down_scales", _ptr),
        ("gate_up_bias", _ptr),
        ("down_bias", _ptr),
        ("out", _ptr),
        ("rows", _i64),
        ("top_k", _i64),
        ("num_experts", _i64),
        ("hidden", _i64),
        ("inter", _i64),
        ("panel_cols", _i64),
        ("is_bf16", _i32),
        ("weight_format", _i32),
        ("activation", _i32),
        ("swiglu_alpha", _f32),
        ("swiglu_limit", _f32),
        ("num_threads", _i32),
    ]


class Fp8LinearArgs(ctypes.Structure):
    """tm_fp8_linear_args."""

    _fields_ = [
        ("x", _ptr),
        ("w", _ptr),
        ("scales", _ptr),
        ("bias", _ptr),
        ("out", _ptr),
        ("rows", _i64),
        ("n", _i64),
        ("k", _i64),
        ("block_n", _i64),
        ("block_k", _i64),
        ("is_bf16", _i32),
        ("num_threads", _i32),
        ("max_isa", _i32),
    ]


class VisionAttentionArgs(ctypes.Structure):
    """tm_vision_attention_args."""

    _fields_ = [
        ("q", _ptr),
        ("k", _ptr),
        ("v", _ptr),
        ("out", _ptr),
        ("num_images", _i64),
        ("seq_len", _i64),
        ("num_heads", _i64),
        ("head_dim", _i64),
        ("q_stride", _i64),
        ("k_stride", _i64),
        ("v_stride", _i64),
        ("scale", _f32),
        ("num_threads", _i32),
    ]


# Exported function -> its argument struct, and the size field tm_limits reports for it.
FUNCTIONS = {
    "tm_paged_attention": (AttentionArgs, "attention_args_size"),
    "tm_write_kv_cache": (KVWriteArgs, "kv_write_args_size"),
    "tm_rms_norm": (RMSNormArgs, "rms_norm_args_size"),
    "tm_rotary_qkv": (RotaryArgs, "rotary_args_size"),
    "tm_silu_and_mul": (SiluArgs, "silu_args_size"),
    "tm_gelu_tanh_and_mul": (SiluArgs, "silu_args_size"),
    "tm_gelu_tanh": (SiluArgs, "silu_args_size"),
    "tm_quantize_rows_u8": (QuantizeArgs, "quantize_args_size"),
    "tm_int8_linear": (Int8LinearArgs, "int8_linear_args_size"),
    "tm_argmax_rows": (ArgmaxArgs, "argmax_args_size"),
    "tm_int4_unpack_bf16": (Int4UnpackArgs, "int4_unpack_args_size"),
    "tm_int4_pack": (Int4PackArgs, "int4_pack_args_size"),
    "tm_gguf_dequantize": (GGUFDequantizeArgs, "gguf_dequantize_args_size"),
    "tm_q4_pack_gguf": (Q4PackGGUFArgs, "q4_pack_gguf_args_size"),
    "tm_q4_linear": (Q4LinearArgs, "q4_linear_args_size"),
    "tm_q4_unpack_bf16": (Q4UnpackArgs, "q4_unpack_args_size"),
    "tm_q4_linear_tiles": (Q4LinearArgs, "q4_linear_args_size"),
    "tm_lora": (LoRAArgs, "lora_args_size"),
    "tm_packed_matvec": (PackedMatvecArgs, "packed_matvec_args_size"),
    "tm_moe": (MoEArgs, "moe_args_size"),
    "tm_fp8_linear": (Fp8LinearArgs, "fp8_linear_args_size"),
    "tm_vision_attention": (VisionAttentionArgs, "vision_attention_args_size"),
    "tm_add_layer_norm": (LayerNormArgs, "layer_norm_args_size"),
}


@dataclass(frozen=True)
class KernelLimits:
    """The shapes the kernels take (kernels.h), as the loaded library reports them."""

    max_head_dim: int
    max_block_size: int
    max_heads_per_kv_head: int
    max_row_dim: int  # RMSNorm and SiLU-and-mul row width
    max_qmax: int
    max_int8_k: int  # the int8 product's longest reduction
    kv_int8_group: int  # values per scale in an int8 KV cache (head_dim a multiple of it)
    kv_int8_direct: bool  # int8 caches read in int16 dot products (AVX512-VNNI or AVX2)
    int8_linear_isa: str | None  # the instructions tm_int8_linear has here, or None
    bf16_attention_amx: bool  # attention over pair-layout bf16 caches on AMX tiles
    q4_linear_isa: str | None  # the instructions tm_q4_linear has here, or None
    q4_linear_tiles: bool  # tm_q4_linear_tiles (AMX bf16) runs here
    lora_isa: str  # how tm_lora computes here: LORA_ISAS' names
    lora_max_blocks: int  # blocks (PEFT targets) per adapter in one LoRA layer
    packed_matvec_vector: bool  # tm_packed_matvec runs vdpbf16ps here (else plain loops)
    moe_isa: str  # how tm_moe computes here: MOE_ISAS' names
    moe_max_top_k: int  # experts per row tm_moe takes
    fp8_linear_isa: str  # the vectors tm_fp8_linear's sums compile to: FP8_LINEAR_ISAS' names
    vision_attention_amx: bool  # tm_vision_attention (AMX bf16) runs here


def declare(lib: ctypes.CDLL) -> KernelLimits:
    """Give lib's exported functions their signatures (one struct pointer each, an int
    status back; tm_stores_bf16_pairs two ints) after checking that lib was built from the
    header this module mirrors.

    Returns:
        The library's limits.
    Raises:
        RuntimeError: the library's ABI version or a struct's size differs.
    """
    lib.tm_limits.restype = None
    lib.tm_limits.argtypes = [ctypes.POINTER(_Limits)]
    reported = _Limits()
    lib.tm_limits(ctypes.byref(reported))
    if reported.abi_version != ABI_VERSION:
        raise RuntimeError(
            f"native kernels built for ABI {reported.abi_version}, expected {ABI_VERSION}"
        )
    for name, (struct, size_field) in FUNCTIONS.items():
        if ctypes.sizeof(struct) != getattr(reported, size_field):
            raise RuntimeError(
                f"{struct.__name__} ({ctypes.sizeof(struct)} bytes) does not mirror the "
                f"header's struct ({getattr(reported, size_field)} bytes); fix interface.py"
            )
        function = getattr(lib, name)
        function.restype = ctypes.c_int
        function.argtypes = [ctypes.POINTER(struct)]
    lib.tm_stores_bf16_pairs.restype = ctypes.c_int
    lib.tm_stores_bf16_pairs.argtypes = [_i64, _i64]  # block_size, head_dim
    return KernelLimits(
        max_head_dim=reported.max_head_dim,
        max_block_size=reported.max_block_size,
        max_heads_per_kv_head=reported.max_heads_per_kv_head,
        max_row_dim=reported.max_row_dim,
        max_qmax=reported.max_qmax,
        max_int8_k=reported.max_int8_k,
        kv_int8_group=reported.kv_int8_group,
        kv_int8_direct=bool(reported.kv_int8_direct),
        int8_linear_isa=INT8_LINEAR_ISAS.get(reported.int8_linear_isa),
        bf16_attention_amx=bool(reported.bf16_attention_amx),
        q4_linear_isa=INT8_LINEAR_ISAS.get(reported.q4_linear_isa),
        q4_linear_tiles=bool(reported.q4_linear_tiles),
        lora_isa=LORA_ISAS[reported.lora_isa],
        lora_max_blocks=reported.lora_max_blocks,
        packed_matvec_vector=bool(reported.packed_matvec_vector),
        moe_isa=MOE_ISAS[reported.moe_isa],
        moe_max_top_k=reported.moe_max_top_k,
        fp8_linear_isa=FP8_LINEAR_ISAS[reported.fp8_linear_isa],
        vision_attention_amx=bool(reported.vision_attention_amx),
    )


def check_status(status: int, what: str) -> None:
    """Raise for a kernel's non-zero status: ValueError for a shape beyond the limits,
    MemoryError for scratch it could not allocate."""
    if status == UNSUPPORTED_SHAPE:
        raise ValueError(f"the native kernels do not take this shape: {what}")
    if status == UNSUPPORTED_ISA:
        raise RuntimeError(f"the native kernels were built without the instructions for {what}")
    if status == OUT_OF_MEMORY:
        raise MemoryError("native kernel could not allocate its scratch buffers")
    if status != OK:
        raise RuntimeError(f"native kernel returned status {status}")
