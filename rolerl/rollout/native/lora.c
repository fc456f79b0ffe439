/* The routed LoRA adapters of one fused group of linear layers at a decode step (the rollout engine's q/k/v,
   o, gate/up and down: rolerl.models.lora.FusedAdapters), added into the group's base output in place.

   Row n of x (one token) applies at most two terms (slot s, factor c): its own adapter with +scaling and,
   where the packed base weights already hold another adapter (a merged one), that one with -scaling. A slot
   is one adapter on this group: the A matrices of every layer of the group that carries it, stacked by
   rows ((R, in), R ranks in all), and one block per such layer: its columns [lo, hi) of the group's output,
   its ranks [r0, r0 + r) of the slot and its B transposed, (r, hi - lo). Per row and term:

       h = c * A x                        (R values)
       y[lo:hi] += B h[r0 : r0 + r]       for every block of the slot

   so a row pays for its own adapter's ranks and each layer's own columns only: no mask over every adapter's
   ranks, no block matrix of zeros, no (rows, width) temporary, one pass over y per term. Rows with the same
   terms (consecutive in `order`) go through together, up to ROWS at a time, so that each matrix is read
   once per group of rows. fp32 throughout (a bf16 x and y are widened as they are read; y is rounded to
   nearest even as it is written). Groups of rows are spread over the caller's OpenMP threads (torch's, as for
   decode_attention.c). Called through ctypes by rolerl.rollout.native. */

#include <omp.h>
#include <stdlib.h>

#include "lanes.h"

#define ROWS 4 /* rows that share one pass over the matrices (project's 16 = 4 ranks x ROWS sums) */

/* h[k][j] = c * (A[j] . x[k]) for the ROWS rows k and the R ranks j of A (R, in): four ranks at a time, the
   sixteen (rank, row) dot products as vectors of partial sums over LANES inputs, summed across lanes by
   reduce_lanes (16 at once with AVX-512, 8 twice with AVX2). Each A row is read once for all rows; rows past
   `rows` repeat the last one and ranks past R the last rank, and neither is stored. */
static void project(const float *A, int64_t R, int64_t in, const float *const x[ROWS], int rows, float c,
                    float *const h[ROWS]) {
    for (int64_t j0 = 0; j0 < R; j0 += 4) {
        const float *a[4];
        for (int q = 0; q < 4; q++) a[q] = A + (j0 + q < R ? j0 + q : R - 1) * in;
        vf t[16]; /* t[4 q + k]: rank j0 + q, row k */
        for (int u = 0; u < 16; u++) t[u] = (vf){};
        int64_t i = 0;
        for (; i + LANES <= in; i += LANES) {
            vf xv[ROWS];
            for (int k = 0; k < ROWS; k++) xv[k] = *(const vfu *)(x[k] + i);
            for (int q = 0; q < 4; q++) {
                const vf av = *(const vfu *)(a[q] + i);
                for (int k = 0; k < ROWS; k++) t[4 * q + k] += av * xv[k];
            }
        }
        float sums[16];
#if LANES == 16
        *(vfu *)sums = reduce_lanes(t);
#else
        *(vfu *)sums = reduce_lanes(t);
        *(vfu *)(sums + 8) = reduce_lanes(t + 8);
#endif
        for (int q = 0; q < 4 && j0 + q < R; q++)
            for (int k = 0; k < rows; k++) {
                float s = sums[4 * q + k];
                for (int64_t m = i; m < in; m++) s += a[q][m] * x[k][m];
                h[k][j0 + q] = c * s;
            }
    }
}

/* y[k][col] += sum_j Bt[j][col] h[k][j] over the w columns at y[k] (r ranks; Bt is (r, w)), each Bt vector
   read once for all rows. */
static void expand(const float *Bt, int64_t r, int64_t w, const float *const h[ROWS], char *const y[ROWS],
                   int rows, int dtype) {
    const int64_t size = dtype == BF16 ? 2 : 4;
    int64_t col = 0;
    for (; col + LANES <= w; col += LANES) {
        vf acc[ROWS];
        for (int k = 0; k < ROWS; k++) acc[k] = (vf){};
        for (int64_t j = 0; j < r; j++) {
            vf bv;
            memcpy(&bv, Bt + j * w + col, sizeof bv);
            for (int k = 0; k < ROWS; k++) acc[k] += bv * h[k][j];
        }
        for (int k = 0; k < rows; k++) {
            char *p = y[k] + col * size;
            store_lanes(p, load_lanes(p, dtype) + acc[k], dtype);
        }
    }
    for (; col < w; col++) {
        for (int k = 0; k < rows; k++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < r; j++) acc += Bt[j * w + col] * h[k][j];
            char *p = y[k] + col * size;
            store_one(p, load_one(p, dtype) + acc, dtype);
        }
    }
}

static int same_terms(const int64_t *terms, const float *factors, int64_t a, int64_t b) {
    return terms[2 * a] == terms[2 * b] && terms[2 * a + 1] == terms[2 * b + 1] &&
           factors[2 * a] == factors[2 * b] && factors[2 * a + 1] == factors[2 * b + 1];
}

/* x: (rows, in) and y: (rows, width), row strides x_stride and y_stride elements, unit column stride; dtype
   0 = float32, 1 = bfloat16. a (a_len floats) and b (b_len floats): the slots' A and B^T matrices. slots:
   (n_slots, 4) int64: offset of the slot's A (R, in) in a, R, its first block, its block count. blocks:
   (n_blocks, 5) int64: lo, hi, r0, r, offset of the block's B^T in b. terms: (rows, 2) int64, a slot or -1
   (none); factors: (rows, 2) float. order: the rows, those with equal terms next to each other (any
   permutation is correct; grouping makes it faster). Returns the number of terms, blocks and order entries
   skipped because they point outside the tables or the rows (0 when consistent), or -1 where no scratch
   memory could be had (y untouched). */
int64_t rolerl_lora_add(const void *x, void *y, int64_t rows, int64_t in, int64_t width, int64_t x_stride,
                        int64_t y_stride, const float *a, int64_t a_len, const float *b, int64_t b_len,
                        const int64_t *slots, int64_t n_slots, const int64_t *blocks, int64_t n_blocks,
                        const int64_t *terms, const float *factors, const int64_t *order, int dtype,
                        int threads) {
    const int64_t size = dtype == BF16 ? 2 : 4;
    int64_t max_r = 4, bad = 0;
    for (int64_t s = 0; s < n_slots; s++) max_r = slots[4 * s + 1] > max_r ? slots[4 * s + 1] : max_r;
    /* groups: runs of up to ROWS consecutive entries of order with equal terms */
    int64_t *starts = malloc((size_t)(rows + 1) * sizeof(int64_t));
    if (threads < 1) threads = 1;
    const int64_t per_thread = ROWS * (in + max_r);
    float *scratch = malloc((size_t)(threads * per_thread) * sizeof(float));
    if (!starts || !scratch) {
        free(starts);
        free(scratch);
        return -1;
    }
    int64_t groups = 0;
    for (int64_t i = 0; i < rows; i++) {
        if (order[i] < 0 || order[i] >= rows) { /* not a permutation of the rows: touch nothing */
            free(starts);
            free(scratch);
            return rows;
        }
        if (i == 0 || i - starts[groups - 1] == ROWS || !same_terms(terms, factors, order[i], order[i - 1]))
            starts[groups++] = i;
    }
    starts[groups] = rows;
#pragma omp parallel num_threads(threads) reduction(+ : bad)
    {
        float *xs[ROWS], *h[ROWS];
        for (int k = 0; k < ROWS; k++) {
            xs[k] = scratch + omp_get_thread_num() * per_thread + k * (in + max_r);
            h[k] = xs[k] + in;
        }
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int count = (int)(starts[g + 1] - starts[g]);
            const int64_t first = starts[g];
            const int64_t lead = order[first];
            const float *xk[ROWS];
            char *yk[ROWS];
            int widened = 0;
            for (int t = 0; t < 2; t++) {
                const int64_t s = terms[2 * lead + t];
                if (s < 0) continue;
                if (s >= n_slots) {
                    bad++;
                    continue;
                }
                const int64_t *slot = slots + 4 * s;
                const int64_t a_at = slot[0], R = slot[1], first_block = slot[2], n = slot[3];
                if (a_at < 0 || R < 0 || a_at + R * in > a_len || first_block < 0 || n < 0 ||
                    first_block + n > n_blocks) {
                    bad++;
                    continue;
                }
                if (R == 0 || n == 0) continue; /* no layer of this group carries the adapter */
                if (!widened) {
                    for (int k = 0; k < ROWS; k++) {
                        const int64_t row = order[first + (k < count ? k : count - 1)];
                        const char *xr = (const char *)x + row * x_stride * size;
                        int64_t i = 0;
                        for (; i + LANES <= in; i += LANES) {
                            const vf v = load_lanes(xr + i * size, dtype);
                            memcpy(xs[k] + i, &v, sizeof v);
                        }
                        for (; i < in; i++) xs[k][i] = load_one(xr + i * size, dtype);
                        xk[k] = xs[k];
                        yk[k] = (char *)y + row * y_stride * size;
                    }
                    widened = 1;
                }
                const float c = factors[2 * lead + t];
                project(a + a_at, R, in, xk, count, c, h);
                for (int64_t k = first_block; k < first_block + n; k++) {
                    const int64_t *blk = blocks + 5 * k;
                    const int64_t lo = blk[0], hi = blk[1], r0 = blk[2], r = blk[3], b_at = blk[4];
                    if (lo < 0 || hi > width || lo > hi || r0 < 0 || r < 0 || r0 + r > R || b_at < 0 ||
                        b_at + r * (hi - lo) > b_len) {
                        bad++;
                        continue;
                    }
                    const float *hr[ROWS];
                    char *yr[ROWS];
                    for (int q = 0; q < ROWS; q++) {
                        hr[q] = h[q < count ? q : count - 1] + r0;
                        yr[q] = yk[q] + lo * size;
                    }
                    expand(b + b_at, r, hi - lo, hr, yr, count, dtype);
                }
            }
        }
    }
    free(starts);
    free(scratch);
    return bad;
}
