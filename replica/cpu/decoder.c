/* A whole decoder step of the Llama family in bf16, in one call: every layer's norms
 * (kernels.c), GEMMs (gemm.c) and paged attention (attention.c), in the order and with
 * the rounding points of decoder.py's Python loop over the same kernels, which it
 * replaces where it can (see FusedDecoder).
 *
 * Why: a step calls eight kernels per layer. From Python each call costs a few
 * microseconds of argument handling and tensor allocation, while the other threads spin
 * in OpenMP; for a small model that is a large share of a one-sequence decode step. Here
 * the calls cost nothing, and scratch buffers are reused. */
#include <stdint.h>
#include <string.h>

#include "kvserve_abi.h"

/* Keep rows[0..kept-1] (ascending) of x [rows, n] as its first rows. */
static void keep_rows(bf16* x, int64_t n, const int64_t* rows, int64_t kept) {
    for (int64_t r = 0; r < kept; r++)
        if (rows[r] != r) memmove(x + r * n, x + rows[r] * n, sizeof(bf16) * (size_t)n);
}

/* residual [T, E]: the embeddings in; used as the skip connection. out [R, E]: the final
 * normed hidden states of the packed rows `rows` (R = num_rows of them, ascending, maybe
 * none), or of every row when num_rows < 0 (R = T). cos/sin [T, D]. scratch:
 * decoder_scratch_elements(T) bf16. */
void decoder_forward(const DecoderShape* shape, const DecoderLayer* layers, const StepLayout* step, bf16* residual,
                     const bf16* cos, const bf16* sin, const int64_t* rows, int64_t num_rows, bf16* out,
                     bf16* scratch, int num_threads) {
    const int64_t T = step->num_tokens, E = shape->hidden, D = shape->head_dim;
    const int64_t q_width = shape->num_heads * D, kv_width = shape->num_kv_heads * D;
    const int64_t qkv_width = q_width + 2 * kv_width;
    bf16* normed = scratch;                /* [T, E] */
    bf16* qkv = normed + T * E;            /* [T, qkv_width] */
    bf16* attended = qkv + T * qkv_width;  /* [T, q_width] */
    bf16* projected = attended + T * q_width; /* [T, E]: o_proj's, then the MLP's output */
    bf16* act = projected + T * E;         /* [T, intermediate] */
    int64_t rows_now = T;
    for (int i = 0; i < shape->num_layers; i++) {
        const DecoderLayer* L = &layers[i];
        /* The previous layer's MLP output joins the skip connection, then the norm. */
        rms_norm(normed, i == 0 ? residual : projected, i == 0 ? NULL : residual, L->input_norm, rows_now, E,
                 shape->eps, 1, num_threads);
        gemm_bf16(qkv, normed, L->qkv, L->qkv_bias, rows_now, qkv_width, E, 0, num_threads);
        paged_attention(attended, qkv, qkv_width, D, qkv + q_width, qkv_width, D, qkv + q_width + kv_width,
                        qkv_width, D, cos, sin, L->k_cache, L->v_cache, step, shape->num_heads,
                        shape->num_kv_heads, (int)D, shape->block_size, shape->scale, 1, num_threads);
        if (i == shape->num_layers - 1 && num_rows >= 0) {
            /* Only these rows go on: the others' KV is written, and nothing reads the rest. */
            keep_rows(attended, q_width, rows, num_rows);
            keep_rows(residual, E, rows, num_rows);
            rows_now = num_rows;
        }
        gemm_bf16(projected, attended, L->o, L->o_bias, rows_now, E, q_width, 0, num_threads);
        rms_norm(normed, projected, residual, L->post_norm, rows_now, E, shape->eps, 1, num_threads);
        gemm_bf16(act, normed, L->gate_up, L->gate_up_bias, rows_now, shape->intermediate, E, 1, num_threads);
        gemm_bf16(projected, act, L->down, L->down_bias, rows_now, E, shape->intermediate, 0, num_threads);
    }
    rms_norm(out, projected, residual, shape->final_norm, rows_now, E, shape->eps, 1, num_threads);
}

int64_t decoder_scratch_elements(const DecoderShape* shape, int64_t num_tokens) {
    const int64_t D = shape->head_dim, E = shape->hidden;
    const int64_t q_width = shape->num_heads * D, kv_width = shape->num_kv_heads * D;
    return num_tokens * (2 * E + q_width + 2 * kv_width + q_width + shape->intermediate);
}

size_t kvserve_decoder_layer_size(void) { return sizeof(DecoderLayer); }

size_t kvserve_decoder_shape_size(void) { return sizeof(DecoderShape); }
