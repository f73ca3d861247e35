/* tm_limits: the constants of kernels.h, for the Python side to read instead of copying. */
#include "kernels.h"

void tm_limits(tm_limits_t *out) {
    out->abi_version = TM_ABI_VERSION;
    out->max_head_dim = TM_MAX_HEAD_DIM;
    out->max_block_size = TM_MAX_BLOCK_SIZE;
    out->max_heads_per_kv_head = TM_MAX_HEADS_PER_KV_HEAD;
    out->max_row_dim = TM_MAX_ROW_DIM;
    out->max_qmax = TM_MAX_QMAX;
    out->max_int8_k = TM_MAX_INT8_K;
    out->kv_int8_group = TM_KV_INT8_GROUP;
    out->kv_int8_direct = tm_internal_kv_int8_direct();
    out->int8_linear_isa = tm_int8_linear_isa();
    out->bf16_attention_amx = tm_internal_bf16_attention_amx();
    out->q4_linear_isa = tm_q4_linear_isa();
    out->q4_linear_tiles = tm_q4_tiles_available();
    out->lora_isa = tm_lora_isa();
    out->lora_max_blocks = TM_LORA_MAX_BLOCKS;
    out->packed_matvec_vector = tm_packed_matvec_vector();
    out->attention_args_size = sizeof(tm_attention_args);
    out->kv_write_args_size = sizeof(tm_kv_write_args);
    out->rms_norm_args_size = sizeof(tm_rms_norm_args);
    out->rotary_args_size = sizeof(tm_rotary_args);
    out->silu_args_size = sizeof(tm_silu_args);
    out->quantize_args_size = sizeof(tm_quantize_args);
    out->int8_linear_args_size = sizeof(tm_int8_linear_args);
    out->argmax_args_size = sizeof(tm_argmax_args);
    out->int4_unpack_args_size = sizeof(tm_int4_unpack_args);
    out->q4_linear_args_size = sizeof(tm_q4_linear_args);
    out->q4_unpack_args_size = sizeof(tm_q4_unpack_args);
    out->lora_args_size = sizeof(tm_lora_args);
    out->packed_matvec_args_size = sizeof(tm_packed_matvec_args);
    out->moe_isa = tm_moe_isa();
    out->moe_max_top_k = TM_MOE_MAX_TOP_K;
    out->moe_args_size = sizeof(tm_moe_args);
    out->fp8_linear_isa = tm_fp8_linear_isa();
    out->fp8_linear_args_size = sizeof(tm_fp8_linear_args);
    out->vision_attention_amx = tm_internal_vision_attention_amx();
    out->vision_attention_args_size = sizeof(tm_vision_attention_args);
    out->layer_norm_args_size = sizeof(tm_layer_norm_args);
    out->int4_pack_args_size = sizeof(tm_int4_pack_args);
    out->gguf_dequantize_args_size = sizeof(tm_gguf_dequantize_args);
    out->q4_pack_gguf_args_size = sizeof(tm_q4_pack_gguf_args);
}
