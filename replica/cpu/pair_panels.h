/* The weight layout that gemm.c's bf16 kernel and gemm_int8.c's kernel read: w [n, k]
 * row-major -> [panel][k / 2][rows][2], a panel's `rows` output rows with each row's
 * k-pair side by side, zero-padded to whole panels and k-pairs. One copy for either
 * element size (2 bytes, 1 byte). */
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline int64_t pair_panels_elements(int64_t n, int64_t k, int64_t rows) {
    return (n + rows - 1) / rows * rows * ((k + 1) / 2 * 2);
}

static inline void pack_pair_panels(void* dst, const void* w, int64_t n, int64_t k, int64_t rows, size_t size) {
    char* out = (char*)dst;
    const char* in = (const char*)w;
    const int64_t pairs = (k + 1) / 2, panels = (n + rows - 1) / rows;
    for (int64_t panel = 0; panel < panels; panel++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t i = 0; i < rows; i++)
                for (int64_t j = 0; j < 2; j++) {
                    const int64_t row = panel * rows + i, col = 2 * p + j;
                    char* to = out + (((panel * pairs + p) * rows + i) * 2 + j) * (int64_t)size;
                    if (row < n && col < k)
                        memcpy(to, in + (row * k + col) * (int64_t)size, size);
                    else
                        memset(to, 0, size);
                }
}
