/* The lean decoder's residual adds and RMSNorms (rolerl.rollout.decoder), one call per norm where torch runs
   eight small ops (HF's LlamaRMSNorm and its Mistral/Qwen copies, plus the residual add before it), each of
   which costs more in dispatch than in arithmetic on a decode step's few dozen rows.

   Per row of d values, as HF computes it in the model's dtype (bf16: every tensor HF stores is rounded to
   nearest even; fp32: no rounding):

       s   = round(x + y)                       the residual add (when y is given), written to `sum`
       var = sum(s^2) / d                       fp32 partial sums per lane, added up in double
       r   = 1 / sqrt(var + eps)                fp32 (torch's rsqrt on CPU: a division by a square root)
       out = round(w * round(s * r))            HF rounds the normalised row to the dtype, then scales it

   torch sums the squares in fp32 in an order of its own, so var can differ from torch's in its last bits and
   a bf16 output by one unit in the last place, rarely. Rows are spread
   over the caller's OpenMP threads (torch's) when there are enough of them to pay for waking the threads.
   Called through ctypes by rolerl.rollout.native. */

#include <math.h>
#include <omp.h>

#include "lanes.h"

#define PARALLEL_MIN (1 << 16) /* elements below which one thread does all rows (a decode step's 32 x 576) */

void rolerl_rms_norm(const void *x, const void *y, void *sum, const void *w, void *out, int64_t rows, int64_t d,
                     float eps, int dtype, int threads) {
    const int64_t size = dtype == BF16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) if (rows * d >= PARALLEL_MIN) schedule(static)
    for (int64_t n = 0; n < rows; n++) {
        const char *xn = (const char *)x + n * d * size;
        const char *yn = y ? (const char *)y + n * d * size : 0;
        char *sn = y ? (char *)sum + n * d * size : 0;
        char *on = (char *)out + n * d * size;
        const char *src = y ? sn : xn; /* the row the norm reads: the sum, once written */
        vf part = (vf){}; /* lane k: the squares of elements k, k + LANES, ... */
        int64_t i = 0;
        for (; i + LANES <= d; i += LANES) {
            vf s = load_lanes(xn + i * size, dtype);
            if (y) {
                s = round_lanes(s + load_lanes(yn + i * size, dtype), dtype);
                store_lanes(sn + i * size, s, dtype);
            }
            part += s * s;
        }
        double acc = 0;
        for (int k = 0; k < LANES; k++) acc += (double)part[k];
        for (; i < d; i++) {
            float s = load_one(xn + i * size, dtype);
            if (y) {
                s = round_one(s + load_one(yn + i * size, dtype), dtype);
                store_one(sn + i * size, s, dtype);
            }
            acc += (double)s * s;
        }
        const float r = 1.0f / sqrtf((float)(acc / (double)d) + eps);
        const vf rv = (vf){} + r;
        for (i = 0; i + LANES <= d; i += LANES)
            store_lanes(on + i * size,
                        load_lanes((const char *)w + i * size, dtype) *
                            round_lanes(load_lanes(src + i * size, dtype) * rv, dtype),
                        dtype);
        for (; i < d; i++)
            store_one(on + i * size, load_one((const char *)w + i * size, dtype) *
                                         round_one(load_one(src + i * size, dtype) * r, dtype), dtype);
    }
}
