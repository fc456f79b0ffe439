/* The engine's fp32 linear layers, `y = x W^T + b`, on weights laid out once for this kernel (`rollout.kernels:
   native`, rolerl.rollout.packed).

   A decode step multiplies a few dozen rows by every weight of the model, and in fp32 the weights stay in no
   cache: the step streams them from memory (538 MB for the default model), so a GEMM of 8-64 rows is as much
   a copy as a product. oneDNN's and MKL's kernels read a weight block from memory and then compute on it;
   this one computes on one panel of the weight while the next is on its way to L2 (software prefetch spread
   over the current panel's work), so the loads overlap the FMAs.

   Layout: W (N, K) becomes ceil(N / NR) panels of K x NR floats, column n of panel p at [k][n - p NR], the
   last panel padded with zeros. A register block of MR rows x NR columns (NV vectors) runs down the K axis:
   for each k, NV loads of the panel, MR broadcasts of x, MR x NV FMAs into accumulators that never leave the
   registers (AVX-512: 8 x 3 of 32 registers; AVX2: 6 x 2 of 16). Threads split the panels; rows go in
   chunks of at most ~512 KB of x, so that a prefill's many rows stay in L2 while a panel is reused.

   Numbers: each output is `b + sum_k x[k] w[k]`, the products added one by one in k order with fused
   multiply-adds, whatever the number of rows, the row's place among them, or the threads: a row gives the
   same bits alone or in any batch. torch's `F.linear` adds in another order (a few units in the last place
   of the largest term apart). Called through ctypes by rolerl.rollout.native. */

#include <omp.h>

#include "lanes.h"

#if LANES == 16
#define NV 3
#define MR 8
#else
#define NV 2
#define MR 6
#endif
#define NR (NV * LANES)          /* columns per panel */
#define CHUNK_BYTES (512 * 1024) /* the most bytes of x one pass over the panels reads */

static inline vf broadcast(const float *a) {
#if defined(__AVX512F__) && LANES == 16
    return (vf)_mm512_set1_ps(*a);
#elif defined(__AVX2__) && LANES == 8
    return (vf)_mm256_set1_ps(*a);
#else
    return (vf){} + *a;
#endif
}

/* rows x NR outputs of one panel (the first `cols` of them are real), prefetching `lines` cache lines of
   `ahead` per k (the next panel; 0: none). `rows` is a constant after inlining, so acc stays in registers. */
static inline __attribute__((always_inline)) void block(const int rows, const float *x, int64_t ldx,
                                                        const float *panel, int64_t k_len, const float *bias,
                                                        float *y, int64_t ldy, int64_t cols, const char *ahead,
                                                        int lines) {
    vf acc[MR][NV];
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) {
            vf b = (vf){};
            if (bias) memcpy(&b, bias + v * LANES, sizeof b);
            acc[r][v] = b;
        }
    for (int64_t k = 0; k < k_len; k++) {
        for (int j = 0; j < lines; j++) __builtin_prefetch(ahead + (k * lines + j) * 64, 0, 2);
        vf w[NV];
#pragma GCC unroll 4
        for (int v = 0; v < NV; v++) memcpy(&w[v], panel + k * NR + v * LANES, sizeof(vf));
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++) {
            const vf a = broadcast(x + r * ldx + k);
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[r][v] += a * w[v];
        }
    }
    if (cols == NR) {
#pragma GCC unroll 16
        for (int r = 0; r < rows; r++)
#pragma GCC unroll 4
            for (int v = 0; v < NV; v++) memcpy(y + r * ldy + v * LANES, &acc[r][v], sizeof(vf));
    } else {
        for (int r = 0; r < rows; r++) memcpy(y + r * ldy, acc[r], cols * sizeof(float));
    }
}

#define BLOCK_ARGS                                                                                            \
    const float *x, int64_t ldx, const float *panel, int64_t k_len, const float *bias, float *y, int64_t ldy, \
        int64_t cols, const char *ahead, int lines
#define BLOCK(R) \
    static void block_##R(BLOCK_ARGS) { block(R, x, ldx, panel, k_len, bias, y, ldy, cols, ahead, lines); }
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)
#if MR > 6
BLOCK(7) BLOCK(8)
#endif
typedef void (*block_fn)(BLOCK_ARGS);
static const block_fn BLOCKS[MR + 1] = {0, block_1, block_2, block_3, block_4, block_5, block_6,
#if MR > 6
                                        block_7, block_8
#endif
};

/* The panel width, for the caller's layout. */
int rolerl_gemm_panel(void) { return NR; }

/* W (n, k) row-major, rows `ldw` floats apart -> the panels at `out` (ceil(n / NR) * k * NR floats). */
void rolerl_gemm_pack(const float *w, int64_t ldw, float *out, int64_t n, int64_t k, int threads) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *o = out + p * k * NR;
        for (int64_t i = 0; i < k; i++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                o[i * NR + j] = col < n ? w[col * ldw + i] : 0.0f;
            }
    }
}

/* y (m, n), rows `ldy` apart = x (m, k), rows `ldx` apart, times the panels of W (n, k), plus bias (n; NULL:
   none). */
void rolerl_gemm(const float *x, int64_t ldx, const float *panels, const float *bias, float *y, int64_t ldy,
                 int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t count = (n + NR - 1) / NR, lines = k * NR * 4 / 64; /* cache lines per panel */
    int64_t chunk = CHUNK_BYTES / (4 * (k > 0 ? k : 1)) / MR * MR;
    if (chunk < MR) chunk = MR;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t rows = m - m0 < chunk ? m - m0 : chunk, blocks = (rows + MR - 1) / MR;
        /* the next panel's lines, spread evenly over this panel's blocks and k steps */
        const int per_k = (int)((lines + blocks * k - 1) / (blocks * (k > 0 ? k : 1)));
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t p = 0; p < count; p++) {
            const float *panel = panels + p * k * NR;
            const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            float padded[NR];
            const float *b = 0;
            if (bias) {
                memset(padded, 0, sizeof padded);
                memcpy(padded, bias + p * NR, cols * sizeof(float));
                b = padded;
            }
            for (int64_t i = 0; i < blocks; i++) {
                const int64_t r0 = m0 + i * MR, r = m - r0 < MR ? m - r0 : MR;
                int lines_k = per_k;
                const char *ahead = (const char *)(panel + k * NR) + i * k * per_k * 64;
                if (p + 1 >= count || i * k * per_k >= lines) ahead = (const char *)panel, lines_k = 0;
                BLOCKS[r](x + r0 * ldx, ldx, panel, k, b, y + r0 * ldy + p * NR, ldy, cols, ahead, lines_k);
            }
        }
    }
}
