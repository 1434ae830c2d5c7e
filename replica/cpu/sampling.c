/* Sampling for the CPU engine (replica/sampler.py calls these through ops.py): the argmax
 * of each row, and one draw from each row's softmax at its temperature, after its top-k,
 * top-p and min-p filters. Both read bf16 logits without widening the whole row first.
 *
 * Why fused: a decode step of one sequence samples one row of the vocabulary, and torch's
 * ops for it (softmax, a topk of candidates, cumsum, searchsorted and the masks between
 * them) take a tenth of such a step for a small model, most of it in the calls themselves. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvserve_abi.h"
#include "scalar.h"

/* Greedy sampling: the index of each row's largest value (the first one on ties, as
 * torch.argmax). x: [rows, n] contiguous; NaN rows give an arbitrary index. */
void argmax_rows(int64_t* out, const void* x, int64_t rows, int64_t n, int is_bf16, int num_threads) {
    const int64_t chunk = 4096;
#pragma omp parallel num_threads(num_threads)
    {
        float* buf = (float*)malloc(sizeof(float) * chunk);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            float best = -INFINITY;
            int64_t best_index = 0;
            for (int64_t start = 0; start < n; start += chunk) {
                const int len = (int)(n - start < chunk ? n - start : chunk);
                load_row(buf, x, r * n + start, len, is_bf16);
                float chunk_max = -INFINITY;
#pragma omp simd reduction(max : chunk_max)
                for (int i = 0; i < len; i++) chunk_max = buf[i] > chunk_max ? buf[i] : chunk_max;
                if (chunk_max > best) {
                    best = chunk_max;
                    for (int i = 0; i < len; i++)
                        if (buf[i] == chunk_max) {
                            best_index = start + i;
                            break;
                        }
                }
            }
            out[r] = best_index;
        }
        free(buf);
    }
}

#define SAMPLE_CHUNK 64

/* Filtered rows find their kept tokens among a few candidates: the tokens at least as
 * heavy as a threshold (2^-8 of the top token's weight, then 2^-16, 2^-32, then every
 * token with weight), read only from chunks whose heaviest token reaches it. Every token
 * under the threshold ranks after all of them, so once they hold every kept token (top_k
 * of them, or top_p of the mass, or the threshold is at most min_p of the top), only they
 * are sorted. A peaked distribution's nucleus is above the first threshold. */
static const float THRESHOLDS[] = {0x1p-8f, 0x1p-16f, 0x1p-32f, 0.0f};

typedef struct {
    float weight;
    int32_t index;
} Candidate;

/* By weight, heaviest first, then by index: ties (common among bf16 logits) in a fixed order. */
static int by_rank(const void* a, const void* b) {
    const Candidate *x = (const Candidate*)a, *y = (const Candidate*)b;
    if (x->weight != y->weight) return x->weight > y->weight ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

static inline int heavy(float w, float threshold) { return threshold > 0.0f ? w >= threshold : w > 0.0f; }

/* How many tokens weigh at least `threshold` (0: more than 0), and their mass; written to
 * cand where it is not NULL. Only chunks whose peak reaches the threshold are read. */
static int64_t heavy_tokens(const float* w, const float* peaks, int64_t n, float threshold, Candidate* cand,
                            double* mass) {
    int64_t count = 0;
    double sum = 0.0;
    for (int64_t c = 0; c < (n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK; c++) {
        if (!heavy(peaks[c], threshold)) continue;
        const int64_t end = (c + 1) * SAMPLE_CHUNK < n ? (c + 1) * SAMPLE_CHUNK : n;
        for (int64_t i = c * SAMPLE_CHUNK; i < end; i++) {
            if (!heavy(w[i], threshold)) continue;
            if (cand) cand[count] = (Candidate){w[i], (int32_t)i};
            count++, sum += w[i];
        }
    }
    if (mass) *mass = sum;
    return count;
}

/* w [n]: a row's weights, its top token's 1 (exp(0)), total their sum; peaks: each
 * SAMPLE_CHUNK's heaviest. The kept tokens are a prefix by rank: rank r is kept while
 * r < top_k (top_k 0: no limit), the weight ranked before it is under top_p of the total,
 * and its weight is at least min_p of the top one's; the top token always is. The draw
 * picks among them by rank, as the torch path's candidates do. */
static int64_t filtered_pick(const float* w, const float* peaks, int64_t n, float total, int64_t top_k, float top_p,
                             float min_p, float draw) {
    const double limit = top_p < 1.0f ? (double)top_p * total : INFINITY;
    float threshold = 0.0f;
    int64_t count = 0;
    for (size_t t = 0; t < sizeof(THRESHOLDS) / sizeof(float); t++) {
        threshold = THRESHOLDS[t];
        double mass;
        count = heavy_tokens(w, peaks, n, threshold, NULL, &mass);
        /* (mass a hair over the limit: the prefix sums below add in another order) */
        if (threshold == 0.0f || (top_k > 0 && count >= top_k) || mass >= limit * (1.0 + 1e-6) || threshold <= min_p)
            break;
    }
    Candidate* cand = (Candidate*)malloc(sizeof(Candidate) * (size_t)(count > 0 ? count : 1));
    const int64_t held = heavy_tokens(w, peaks, n, threshold, cand, NULL);
    qsort(cand, (size_t)held, sizeof(Candidate), by_rank);
    int64_t kept = 0;
    double before = 0.0;
    for (; kept < held; kept++) {
        const Candidate c = cand[kept];
        if (kept > 0 && ((top_k > 0 && kept >= top_k) || before >= limit || c.weight < min_p * cand[0].weight)) break;
        before += c.weight;
    }
    const double target = (double)draw * before;
    double running = 0.0;
    int64_t pick = kept > 0 ? cand[kept - 1].index : 0; /* where rounding leaves the target unreached */
    for (int64_t r = 0; r < kept; r++) {
        running += cand[r].weight;
        if (running > target) {
            pick = cand[r].index;
            break;
        }
    }
    free(cand);
    return pick;
}

/* Sampling by inverse CDF, fused: per row, the max, then the weights exp((x - max) / T)
 * with their sum. A row without filters takes the first token whose running sum exceeds
 * draw x sum, in vocabulary order: weights are never normalised (the draw scales
 * instead), and the walk skips whole chunks by their sums. A filtered row draws among its
 * kept tokens (filtered_pick). Rows with T = 0 (inv_temperature 0) take the argmax.
 * Weights below e^-87 of the top are 0, as softmax underflows them too.
 * x: [rows, n] contiguous; draws in [0, 1); top_k (0: none), top_p (1: none) and min_p
 * (0: none) per row, each NULL where no row sets it. */
void sample_rows(int64_t* out, const void* x, const float* inv_temperature, const int64_t* top_k,
                 const float* top_p, const float* min_p, const float* draws, int64_t rows, int64_t n, int is_bf16,
                 int num_threads) {
#pragma omp parallel num_threads(num_threads) if (rows >= 16)
    {
        const int64_t num_chunks = (n + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
        float* w = (float*)malloc(sizeof(float) * (size_t)(n + 2 * num_chunks));
        float *chunk_sums = w + n, *peaks = chunk_sums + num_chunks;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            load_row(w, x, r * n, (int)n, is_bf16);
            float top = -INFINITY;
#pragma omp simd reduction(max : top)
            for (int64_t i = 0; i < n; i++) top = w[i] > top ? w[i] : top;
            const float inv_t = inv_temperature[r];
            if (inv_t == 0.0f) { /* greedy: the first index of the max, as torch.argmax */
                int64_t i = 0;
                while (i < n - 1 && w[i] != top) i++;
                out[r] = i;
                continue;
            }
            float total = 0.0f;
            for (int64_t c = 0; c < num_chunks; c++) {
                const int64_t start = c * SAMPLE_CHUNK, end = start + SAMPLE_CHUNK < n ? start + SAMPLE_CHUNK : n;
                float sum = 0.0f, peak = 0.0f;
#pragma omp simd reduction(+ : sum) reduction(max : peak)
                for (int64_t i = start; i < end; i++) {
                    const float d = (w[i] - top) * inv_t;
                    w[i] = d < -87.0f ? 0.0f : exp_clamped(d);
                    sum += w[i];
                    peak = w[i] > peak ? w[i] : peak;
                }
                chunk_sums[c] = sum;
                peaks[c] = peak;
                total += sum;
            }
            const int64_t k = top_k && top_k[r] < n ? top_k[r] : 0;
            const float p = top_p ? top_p[r] : 1.0f, floor = min_p ? min_p[r] : 0.0f;
            if (k > 0 || p < 1.0f || floor > 0.0f) {
                out[r] = filtered_pick(w, peaks, n, total, k, p, floor, draws[r]);
                continue;
            }
            const float target = draws[r] * total;
            float running = 0.0f;
            int64_t c = 0;
            while (c < num_chunks - 1 && running + chunk_sums[c] <= target) running += chunk_sums[c++];
            /* Within the chunk; rounding may leave the target unreached: take its last token
             * with weight, which a zero-weight token never is. */
            const int64_t start = c * SAMPLE_CHUNK, end = start + SAMPLE_CHUNK < n ? start + SAMPLE_CHUNK : n;
            int64_t pick = -1;
            for (int64_t i = start; i < end; i++) {
                if (w[i] == 0.0f) continue;
                pick = i;
                running += w[i];
                if (running > target) break;
            }
            while (pick < 0 && c > 0) { /* an all-zero last chunk: step back to one with weight */
                c--;
                for (int64_t i = c * SAMPLE_CHUNK; i < (c + 1) * SAMPLE_CHUNK; i++)
                    if (w[i] != 0.0f) pick = i;
            }
            out[r] = pick < 0 ? 0 : pick;
        }
        free(w);
    }
}
