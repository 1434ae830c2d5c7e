/* Everything the kernels' shared library exports: the one declaration of each function
 * and struct that Python binds (build.py's argtypes, abi.py's ctypes mirrors) and that
 * decoder.c calls. Every .c file includes it, so the compiler checks each definition
 * against its declaration here; tests/test_cpu_kernels.py checks build.py's argtypes
 * against these prototypes, and build.py compares abi.py's struct sizes with the
 * kvserve_*_size functions when it loads the library.
 *
 * Tensors are raw pointers of fp32 or bf16 elements (is_bf16) unless a type or a
 * kv_format says otherwise; num_threads is the OpenMP team size (torch.get_num_threads()). */
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef uint16_t bf16;

/* What a KV cache's elements are (kv_format): the activations' dtype; one fp8 byte whose
 * value times the layer's k_scale (v_scale) is the key (value) it stores
 * (replica/kv_quant.py); or bf16 beside fp32 activations. */
enum { KV_ACTIVATIONS = 0, KV_FP8_E4M3 = 1, KV_FP8_E5M2 = 2, KV_BF16 = 3 };

/* One packed step's attention layout, shared by every layer: which cache slot each row's
 * K and V go to, and which rows attend over which block tables. Packed order: decode rows
 * first (one query token each), then prefill chunks. Rows of no decode and no chunk get
 * their K and V written but are not attended (ops.py attends fresh prefills, which need
 * no cache, with torch's SDPA where that is faster). */
typedef struct {
    const int64_t* slots;           /* [num_tokens]: cache slot of each row; < 0: not written */
    int64_t num_tokens;
    const int32_t* decode_tables;   /* [num_decodes, decode_width]: row i's block table */
    const int32_t* decode_lens;     /* [num_decodes]: tokens in row i's context, itself included */
    const int32_t* prefill_starts;  /* [num_prefills]: chunk p's first row */
    const int32_t* prefill_ends;    /* [num_prefills]: one past its last row */
    const int32_t* prefill_lens;    /* [num_prefills]: tokens in its context, the chunk included */
    const int32_t* prefill_tables;  /* [num_prefills, prefill_width]: its block table */
    int num_decodes, decode_width, num_prefills, prefill_width;
} StepLayout;

/* A group-quantized weight (gemm_group.c's layout): the integers, fp16 scales and mins
 * (NULL: none) per group of `group`, `bits` 4 or 8. */
typedef struct {
    const void* qs;
    const uint16_t *scales, *mins;
    int group, bits;
} GroupWeight;

/* One decoder layer's weights (packed by pack_bf16_weight or pack_f32_weight, in the
 * model's dtype, or by pack_i8_weight with their fp32 scales, or group-quantized; biases
 * may be NULL) and KV cache, with its fp8 scales (1 for other caches). */
typedef struct {
    const void *input_norm, *post_norm;
    const void *qkv, *qkv_bias, *o, *o_bias, *gate_up, *gate_up_bias, *down, *down_bias;
    const float *qkv_scale, *o_scale, *gate_up_scale, *down_scale; /* int8 weights' only */
    GroupWeight qkv_group, o_group, gate_up_group, down_group;     /* group weights' only */
    void *k_cache, *v_cache;
    float k_scale, v_scale;
} DecoderLayer;

/* The model's shapes, the same in every layer, its dtype (bf16 or fp32), whether the
 * linears' weights are int8 (gemm_i8's, for fp32 models) or group-quantized (is_group;
 * group_kernels: group_linear's kernel for the qkv, o, gate/up and down projections, in
 * that order) and the KV cache's kv_format. */
typedef struct {
    int num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, is_bf16, is_int8;
    int is_group, kv_format;
    int group_kernels[4];
    float eps, scale;
    const void* final_norm;
} DecoderShape;

/* kernels.c */
void rms_norm(void* out, const void* x, void* residual, const void* weight, int64_t rows, int n, float eps,
              int is_bf16, int num_threads);
void silu_mul(void* out, const void* gate_up, int64_t rows, int n, int is_bf16, int num_threads);
void rotary_embed(void* out, const void* x, int64_t stride_t, int64_t stride_h, const void* cos, const void* sin,
                  int64_t rows, int heads, int D, int is_bf16, int num_threads);

/* sampling.c */
void argmax_rows(int64_t* out, const void* x, int64_t rows, int64_t n, int is_bf16, int num_threads);
void sample_rows(int64_t* out, const void* x, const float* inv_temperature, const int64_t* top_k,
                 const float* top_p, const float* min_p, const float* draws, int64_t rows, int64_t n, int is_bf16,
                 int num_threads);

/* attention.c: one layer's attention over a packed step (rotary when cos is not NULL,
 * the KV write, then causal attention of every query row over its sequence's cache).
 *   q: [T, H, D], k/v: [T, Hkv, D], each with the given strides (last dim contiguous)
 *   cos/sin: [T, D] or NULL; out: contiguous [T, H, D]
 *   k_cache/v_cache: [num_blocks, Hkv, ...], one page per (block, KV head), of kv_format
 *   elements; an fp8 cache holds key / k_scale and value / v_scale */
void paged_attention(void* out, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k,
                     int64_t k_stride_t, int64_t k_stride_h, const void* v, int64_t v_stride_t, int64_t v_stride_h,
                     const void* cos, const void* sin, void* k_cache, void* v_cache, const StepLayout* step,
                     int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int is_bf16,
                     int kv_format, float k_scale, float v_scale, int num_threads);
size_t kvserve_step_layout_size(void);

/* gemm.c */
int bf16_gemm_available(void);
int64_t packed_bf16_weight_elements(int64_t n, int64_t k);
void pack_bf16_weight(bf16* dst, const bf16* w, int64_t n, int64_t k);
void gemm_bf16(bf16* y, const bf16* x, const bf16* packed, const bf16* bias, int64_t m, int64_t n, int64_t k,
               int gated, int num_threads);
int f32_gemm_available(void);
int64_t packed_f32_weight_elements(int64_t n, int64_t k);
void pack_f32_weight(float* dst, const float* w, int64_t n, int64_t k);
void gemm_f32(float* y, const float* x, const float* packed, const float* bias, int64_t m, int64_t n, int64_t k,
              int gated, int num_threads);

/* gemm_int8.c: int8 weights (int8_t) and their fp32 scales, fp32 x and y */
int i8_gemm_available(void);
int32_t activation_limit(int64_t k);
int64_t packed_i8_weight_bytes(int64_t n, int64_t k);
void pack_i8_weight(int8_t* dst, const int8_t* w, int64_t n, int64_t k);
void gemm_i8(float* y, const float* x, const int8_t* packed, const float* w_scale, const float* bias, int64_t m,
             int64_t n, int64_t k, int gated, int num_threads);

/* gemm_group.c: group-quantized weights (4-bit nibbles or int8) with fp16 scales and mins
 * per group, fp32 x and y */
int group_gemm_available(void);
void gemm_group(float* y, const float* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                const float* bias, int64_t m, int64_t n, int64_t k, int32_t group, int32_t bits,
                int32_t num_threads);
void gemm_group_q8(float* y, const float* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                   const float* bias, int64_t m, int64_t n, int64_t k, int32_t group, int32_t bits,
                   int32_t num_threads);
/* 4-bit weights, k a multiple of 64: gemm_group_q8's arithmetic in 256-bit vectors, a
 * second kernel where group_q8_is_wide() (gemm_group_q8 runs 512-bit ones), else the one
 * gemm_group_q8 runs for such weights */
int group_q8_is_wide(void);
void gemm_group_q8_256(float* y, const float* x, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                       const float* bias, int64_t m, int64_t n, int64_t k, int32_t group, int32_t bits,
                       int32_t num_threads);
/* out [n, k] = rows rows[0..n-1] of the weight (rows NULL: its first n), in the model's
 * dtype: the whole weight for a dense GEMM, or a lookup's token embeddings */
void dequantize_group(void* out, const uint8_t* qs, const uint16_t* scales, const uint16_t* mins,
                      const int64_t* rows, int64_t n, int64_t k, int32_t group, int32_t bits, int32_t is_bf16,
                      int32_t num_threads);
/* y [m, n] = x [m, k] W^T + b in the model's dtype (b too), through gemm_group
 * (kernel 0), gemm_group_q8 (1) or gemm_group_q8_256 (2); gated: W holds the gate's n
 * rows, then the up projection's, and y is silu(gate) * up. */
void group_linear(void* y, const void* x, const GroupWeight* w, const void* bias, int64_t m, int64_t n, int64_t k,
                  int gated, int is_bf16, int kernel, int num_threads);
/* group_linear with each of weights[0..count-1] in turn, into the same y. */
void group_linear_each(void* y, const void* x, const GroupWeight* weights, int64_t count, const void* bias, int64_t m,
                       int64_t n, int64_t k, int gated, int is_bf16, int kernel, int num_threads);

/* decoder.c */
void decoder_forward(const DecoderShape* shape, const DecoderLayer* layers, const StepLayout* step, void* residual,
                     const void* cos, const void* sin, const int64_t* rows, int64_t num_rows, void* out,
                     void* scratch, int num_threads);
int64_t decoder_scratch_elements(const DecoderShape* shape, int64_t num_tokens);
size_t kvserve_decoder_layer_size(void);
size_t kvserve_decoder_shape_size(void);
