/* A whole decoder step of the Llama family in bf16, in one call: every layer's norms,
 * GEMMs (gemm.c) and paged attention (kernels.c), in the order and with the rounding
 * points of decoder.py's Python loop over the same kernels, which it replaces where it
 * can (see FusedDecoder).
 *
 * Why: a step calls eight kernels per layer. From Python each call costs a few
 * microseconds of argument handling and tensor allocation, while the other thread spins
 * in OpenMP; for a small model that is a quarter of a one-sequence decode step (30
 * layers: 12-13 ms from Python, 9.4 ms here). Here the calls cost nothing, and scratch
 * buffers are reused. */
#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

/* kernels.c and gemm.c */
void rms_norm(void* out, const void* x, void* residual, const void* weight, int64_t rows, int n, float eps,
              int is_bf16, int num_threads);
void gemm_bf16(bf16* y, const bf16* x, const bf16* packed, const bf16* bias, int64_t m, int64_t n, int64_t k,
               int gated, int num_threads);
void paged_attention(void* out, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
                     int64_t k_stride_t, int64_t k_stride_h, const void* v, int64_t v_stride_t, int64_t v_stride_h,
                     const void* cos, const void* sin, void* k_cache, void* v_cache, const int64_t* slots,
                     int64_t num_tokens, int num_decodes, const int32_t* decode_tables, int decode_width,
                     const int32_t* decode_lens, int num_prefills, const int32_t* prefill_starts,
                     const int32_t* prefill_ends, const int32_t* prefill_lens, const int32_t* prefill_tables,
                     int prefill_width, int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                     int is_bf16, int num_threads);

/* One layer's weights (packed for gemm_bf16; biases may be NULL) and KV cache. */
typedef struct {
    const bf16 *input_norm, *post_norm;
    const bf16 *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    void *k_cache, *v_cache;
} DecoderLayer;

/* The model's shapes. */
typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    const bf16* final_norm;
} DecoderShape;

/* The step's attention layout: paged_attention's arguments after the KV cache. */
typedef struct {
    const int64_t* slots;
    int64_t num_tokens;
    int num_decodes;
    const int32_t* decode_tables;
    int decode_width;
    const int32_t* decode_lens;
    int num_prefills;
    const int32_t *prefill_starts, *prefill_ends, *prefill_lens, *prefill_tables;
    int prefill_width;
} StepLayout;

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
                        qkv_width, D, cos, sin, L->k_cache, L->v_cache, step->slots, step->num_tokens,
                        step->num_decodes, step->decode_tables, step->decode_width, step->decode_lens,
                        step->num_prefills, step->prefill_starts, step->prefill_ends, step->prefill_lens,
                        step->prefill_tables, step->prefill_width, shape->num_heads, shape->num_kv_heads,
                        (int)D, shape->block_size, shape->scale, 1, num_threads);
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
