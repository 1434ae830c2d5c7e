/* A whole decoder step of the Llama family in bf16 or fp32 (shape->is_bf16), in one
 * call: every layer's norms and MLP activation (kernels.c), GEMMs (gemm.c, or gemm_int8.c
 * for int8 weights) and paged attention (attention.c), in the order and with the rounding
 * points of decoder.py's Python loop over the same kernels, which it replaces where it
 * can (see FusedDecoder).
 *
 * Why: a step calls eight kernels per layer. From Python each call costs a few
 * microseconds of argument handling and tensor allocation, while the other threads spin
 * in OpenMP; for a small model that is a large share of a one-sequence decode step. Here
 * the calls cost nothing, and scratch buffers are reused. */
#include <stdint.h>
#include <string.h>

#include "kvserve_abi.h"

/* Keep rows[0..kept-1] (ascending) of x [rows, row_bytes] as its first rows. */
static void keep_rows(char* x, int64_t row_bytes, const int64_t* rows, int64_t kept) {
    for (int64_t r = 0; r < kept; r++)
        if (rows[r] != r) memmove(x + r * row_bytes, x + rows[r] * row_bytes, (size_t)row_bytes);
}

/* The projections, as group_kernels orders them. */
enum { QKV, O_PROJ, GATE_UP, DOWN };

/* y [m, n] = x [m, k] W^T + b through gemm.c's kernel for the model's dtype, or
 * gemm_int8.c's for int8 weights (w_scale: theirs), or for group-quantized ones (w_group)
 * the gemm_group.c kernel projection `which` chose; gated: the gate/up projection's
 * silu(gate) * up (its weights packed as SiluMLP packs them). */
static void linear(const DecoderShape* shape, int which, void* y, const void* x, const void* w,
                   const float* w_scale, const GroupWeight* w_group, const void* b, int64_t m, int64_t n, int64_t k,
                   int gated, int num_threads) {
    if (shape->is_group)
        group_linear(y, x, w_group, b, m, n, k, gated, shape->is_bf16, shape->group_kernels[which], num_threads);
    else if (shape->is_int8)
        gemm_i8(y, x, w, w_scale, b, m, n, k, gated, num_threads);
    else if (shape->is_bf16)
        gemm_bf16(y, x, w, b, m, n, k, gated, num_threads);
    else
        gemm_f32(y, x, w, b, m, n, k, gated, num_threads);
}

/* residual [T, E]: the embeddings in; used as the skip connection. out [R, E]: the final
 * normed hidden states of the packed rows `rows` (R = num_rows of them, ascending, maybe
 * none), or of every row when num_rows < 0 (R = T). cos/sin [T, D]. scratch:
 * decoder_scratch_elements(T) elements of the model's dtype. */
void decoder_forward(const DecoderShape* shape, const DecoderLayer* layers, const StepLayout* step, void* residual,
                     const void* cos, const void* sin, const int64_t* rows, int64_t num_rows, void* out,
                     void* scratch, int num_threads) {
    const int bf = shape->is_bf16;
    const int64_t T = step->num_tokens, E = shape->hidden, D = shape->head_dim, I = shape->intermediate;
    const int64_t size = bf ? (int64_t)sizeof(bf16) : (int64_t)sizeof(float);
    const int64_t q_width = shape->num_heads * D, kv_width = shape->num_kv_heads * D;
    const int64_t qkv_width = q_width + 2 * kv_width;
    char* normed = scratch;                         /* [T, E] */
    char* qkv = normed + T * E * size;              /* [T, qkv_width] */
    char* attended = qkv + T * qkv_width * size;    /* [T, q_width] */
    char* projected = attended + T * q_width * size; /* [T, E]: o_proj's, then the MLP's output */
    char* act = projected + T * E * size;           /* [T, I] */
    int64_t rows_now = T;
    for (int i = 0; i < shape->num_layers; i++) {
        const DecoderLayer* L = &layers[i];
        /* The previous layer's MLP output joins the skip connection, then the norm. */
        rms_norm(normed, i == 0 ? residual : projected, i == 0 ? NULL : residual, L->input_norm, rows_now, E,
                 shape->eps, bf, num_threads);
        linear(shape, QKV, qkv, normed, L->qkv, L->qkv_scale, &L->qkv_group, L->qkv_bias, rows_now, qkv_width, E, 0, num_threads);
        paged_attention(attended, qkv, qkv_width, D, qkv + q_width * size, qkv_width, D,
                        qkv + (q_width + kv_width) * size, qkv_width, D, cos, sin, L->k_cache, L->v_cache, step,
                        shape->num_heads, shape->num_kv_heads, (int)D, shape->block_size, shape->scale, bf,
                        shape->kv_format, L->k_scale, L->v_scale, num_threads);
        if (i == shape->num_layers - 1 && num_rows >= 0) {
            /* Only these rows go on: the others' KV is written, and nothing reads the rest. */
            keep_rows(attended, q_width * size, rows, num_rows);
            keep_rows(residual, E * size, rows, num_rows);
            rows_now = num_rows;
        }
        linear(shape, O_PROJ, projected, attended, L->o, L->o_scale, &L->o_group, L->o_bias, rows_now, E, q_width, 0, num_threads);
        rms_norm(normed, projected, residual, L->post_norm, rows_now, E, shape->eps, bf, num_threads);
        linear(shape, GATE_UP, act, normed, L->gate_up, L->gate_up_scale, &L->gate_up_group, L->gate_up_bias, rows_now, I, E, 1, num_threads);
        linear(shape, DOWN, projected, act, L->down, L->down_scale, &L->down_group, L->down_bias, rows_now, E, I, 0, num_threads);
    }
    rms_norm(out, projected, residual, shape->final_norm, rows_now, E, shape->eps, bf, num_threads);
}

int64_t decoder_scratch_elements(const DecoderShape* shape, int64_t num_tokens) {
    const int64_t D = shape->head_dim, E = shape->hidden, I = shape->intermediate;
    const int64_t q_width = shape->num_heads * D, kv_width = shape->num_kv_heads * D;
    return num_tokens * (2 * E + q_width + 2 * kv_width + q_width + I);
}

size_t kvserve_decoder_layer_size(void) { return sizeof(DecoderLayer); }

size_t kvserve_decoder_shape_size(void) { return sizeof(DecoderShape); }
