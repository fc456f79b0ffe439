/* Decode attention over the rollout engine's KV cache: one new query position per row, grouped-query heads.

   For row b and KV head h, the G query heads that share h attend to the first n = positions[b] + 1 keys of
   cache slot slots[b]:  out[b, h, g] = softmax(scale * q[b, h, g] . K[j]) . V[j],  j < n.
   K and V are read in place (no gather, no mask) and combined with an online softmax over blocks of keys;
   scores, probabilities and sums stay in fp32 whatever the cache's dtype (bf16 is widened as it is read).
   One task per (row, KV head), spread over the caller's OpenMP threads (torch's own runtime: the library
   is loaded after torch, whose libgomp.so.1 it then shares).

   Written over vectors of LANES floats (lanes.h): 16 with AVX-512, 8 otherwise. The head dim must be a multiple
   of 16.
   Built and loaded by rolerl.rollout.native, called through ctypes. */

#include "lanes.h"

#define BLOCK 64   /* keys per online-softmax block */
#define MAX_D 256  /* largest head dim */
#define MAX_G 16   /* largest number of query heads per KV head */

static inline vf vmax(vf a, vf b) {
    const vi less = a < b; /* all ones where a < b */
    return (vf)(((vi)a & ~less) | ((vi)b & less));
}

/* exp(x) in every lane, for x <= 0: 2^k * 2^f with k = round(x / ln 2), |f| <= 1/2, 2^f by its Taylor series
   to degree 7 (relative error < 2e-7); x below -87 gives exp(-87) (~1.6e-38, not 0). */
static inline vf exp_lanes(vf x) {
    x = vmax(x, (vf){} - 87.0f);
    vf t = x * 1.44269504088896341f, k;
    for (int i = 0; i < LANES; i++) k[i] = __builtin_floorf(t[i] + 0.5f);
    vf y = (t - k) * 0.69314718055994531f;
    vf p = 1.0f + y * (1.0f + y * (0.5f + y * (1.0f / 6 + y * (1.0f / 24 + y * (1.0f / 120
           + y * (1.0f / 720 + y * (1.0f / 5040)))))));
    vi bits = (__builtin_convertvector(k, vi) + 127) << 23;
    vf scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline float hmax(vf x) {
    float m = x[0];
    for (int i = 1; i < LANES; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += x[i];
    return s;
}

/* One (row, KV head): G queries over n >= 1 keys of C * LANES dims at k/v, consecutive keys key_bytes apart.
   Per block of keys and per query: the scores LANES keys at a time (one vector of partial products per key,
   summed across lanes by reduce_lanes), the block's exp and sums as vectors, then the probabilities times V
   into an accumulator that stays in registers. C is a constant where the head dim is 64 or 128, so the
   query and the accumulator live in registers. */
#define ATTEND_ONE(NAME, C_EXPR, DTYPE)                                                                              \
    static void NAME(const void *q, const char *k, const char *v, void *out, int64_t n, int64_t G,                   \
                     int64_t head_dim, int64_t key_bytes, float scale) {                                             \
        const int dtype = DTYPE;                                                                                     \
        const int64_t C = C_EXPR, size = dtype == BF16 ? 2 : 4;                                                      \
        vf acc[MAX_G][MAX_D / LANES], s[MAX_G][BLOCK / LANES];                                                       \
        float m[MAX_G], l[MAX_G];                                                                                    \
        (void)head_dim;                                                                                              \
        for (int64_t g = 0; g < G; g++) {                                                                            \
            for (int64_t c = 0; c < C; c++) acc[g][c] = (vf){};                                                      \
            m[g] = -3.4e38f; /* finite: exp(m_old - m_new) is the exp of a finite number */                          \
            l[g] = 0.0f;                                                                                             \
        }                                                                                                            \
        for (int64_t j0 = 0; j0 < n; j0 += BLOCK) {                                                                  \
            const int jn = (int)(n - j0 < BLOCK ? n - j0 : BLOCK), vectors = (jn + LANES - 1) / LANES;               \
            const char *kb = k + j0 * key_bytes, *vb = v + j0 * key_bytes;                                           \
            for (int64_t g = 0; g < G; g++) {                                                                        \
                vf qv[MAX_D / LANES];                                                                                \
                for (int64_t c = 0; c < C; c++)                                                                      \
                    qv[c] = load_lanes((const char *)q + (g * C + c) * LANES * size, dtype) * scale;                 \
                vf top = (vf){} + m[g];                                                                              \
                for (int i = 0; i < vectors; i++) {                                                                  \
                    vf t[LANES];                                                                                     \
                    for (int j = 0; j < LANES; j++) {                                                                \
                        const int key = i * LANES + j < jn ? i * LANES + j : jn - 1; /* past the end: a repeat */    \
                        vf dot = (vf){};                                                                             \
                        for (int64_t c = 0; c < C; c++)                                                              \
                            dot += qv[c] * load_lanes(kb + key * key_bytes + c * LANES * size, dtype);               \
                        t[j] = dot;                                                                                  \
                    }                                                                                                \
                    s[g][i] = reduce_lanes(t);                                                                       \
                    top = vmax(top, s[g][i]);                                                                        \
                }                                                                                                    \
                const float new_max = hmax(top);                                                                     \
                const float carry = exp_lanes((vf){} + (m[g] - new_max))[0];                                         \
                vf sum = (vf){};                                                                                     \
                for (int i = 0; i < vectors; i++) {                                                                  \
                    vf p = exp_lanes(s[g][i] - new_max);                                                             \
                    for (int j = 0; j < LANES; j++)                                                                  \
                        if (i * LANES + j >= jn) p[j] = 0.0f; /* the repeated keys past the end */                   \
                    s[g][i] = p;                                                                                     \
                    sum += p;                                                                                        \
                }                                                                                                    \
                l[g] = l[g] * carry + hsum(sum);                                                                     \
                m[g] = new_max;                                                                                      \
                vf a[MAX_D / LANES];                                                                                 \
                for (int64_t c = 0; c < C; c++) a[c] = acc[g][c] * carry;                                            \
                for (int j = 0; j < jn; j++) {                                                                       \
                    const float p = s[g][j / LANES][j % LANES];                                                      \
                    for (int64_t c = 0; c < C; c++) a[c] += p * load_lanes(vb + j * key_bytes + c * LANES * size, dtype); \
                }                                                                                                    \
                for (int64_t c = 0; c < C; c++) acc[g][c] = a[c];                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int64_t g = 0; g < G; g++) {                                                                            \
            const float inv = 1.0f / l[g];                                                                           \
            for (int64_t c = 0; c < C; c++) {                                                                        \
                store_lanes((char *)out + (g * C + c) * LANES * size, acc[g][c] * inv, dtype);                       \
            }                                                                                                        \
        }                                                                                                            \
    }

ATTEND_ONE(attend_d64_f32, 64 / LANES, F32)
ATTEND_ONE(attend_d128_f32, 128 / LANES, F32)
ATTEND_ONE(attend_any_f32, head_dim / LANES, F32)
ATTEND_ONE(attend_d64_bf16, 64 / LANES, BF16)
ATTEND_ONE(attend_d128_bf16, 128 / LANES, BF16)
ATTEND_ONE(attend_any_bf16, head_dim / LANES, BF16)

typedef void (*attend_fn)(const void *, const char *, const char *, void *, int64_t, int64_t, int64_t, int64_t,
                          float);

/* q, out: (rows, kv_heads, groups, head_dim) contiguous. k, v: one layer's cache of slot_count slots and
   key_count positions, element strides slot_stride / head_stride / key_stride (head dim contiguous). Row b
   reads slot slots[b], keys [0, positions[b * position_stride]], clamped to the cache (a slot outside it
   gives zeros). dtype: 0 = float32, 1 = bfloat16. head_dim: a multiple of 16, at most MAX_D. */
void rolerl_decode_attention(const void *q, const void *k, const void *v, void *out, const int64_t *slots,
                             const int64_t *positions, int64_t position_stride, int64_t rows, int64_t kv_heads,
                             int64_t groups, int64_t head_dim, int64_t slot_count, int64_t key_count,
                             int64_t slot_stride, int64_t head_stride, int64_t key_stride, float scale, int dtype,
                             int threads) {
    const int64_t size = dtype == BF16 ? 2 : 4, per_row = groups * head_dim * size;
    const attend_fn fn = dtype == BF16 ? (head_dim == 64 ? attend_d64_bf16 : head_dim == 128 ? attend_d128_bf16 : attend_any_bf16)
                                       : (head_dim == 64 ? attend_d64_f32 : head_dim == 128 ? attend_d128_f32 : attend_any_f32);
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < rows; b++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t slot = slots[b], task = b * kv_heads + h;
            int64_t n = positions[b * position_stride] + 1;
            n = n > key_count ? key_count : n;
            char *o = (char *)out + task * per_row;
            if (slot < 0 || slot >= slot_count || n < 1) {
                memset(o, 0, (size_t)per_row);
                continue;
            }
            const int64_t at = (slot * slot_stride + h * head_stride) * size;
            const char *qt = (const char *)q + task * per_row, *kt = (const char *)k + at, *vt = (const char *)v + at;
            fn(qt, kt, vt, o, n, groups, head_dim, key_stride * size, scale);
        }
    }
}

/* RoPE of one head of D values, as the engine's decoder computes it (rolerl.rollout.decoder: HF's
   q * cos + rotate_half(q) * sin, with rotate_half's sign folded into sin): dst[j] = round(round(src[j] * cos[j])
   + round(src[(j + D/2) % D] * sin[j])), every product and the sum rounded to the dtype as torch's three ops
   round them (bf16: to nearest even; fp32: each op rounded on its own, so no fused multiply-add here). */
#if defined(__clang__)
#define SEPARATE_ROUNDING
#define SEPARATE_ROUNDING_BODY _Pragma("clang fp contract(off)")
#else
#define SEPARATE_ROUNDING __attribute__((optimize("fp-contract=off"), noinline))
#define SEPARATE_ROUNDING_BODY
#endif

SEPARATE_ROUNDING static void rope_head(const char *src, const char *cos, const char *sin, char *dst, int64_t D,
                                        int dtype) {
    SEPARATE_ROUNDING_BODY
    const int64_t size = dtype == BF16 ? 2 : 4, half = D / 2;
    if (half % LANES == 0) {
        for (int64_t j = 0; j < D; j += LANES) {
            const int64_t r = j < half ? j + half : j - half; /* vectors never straddle the halves */
            const vf a = round_lanes(load_lanes(src + j * size, dtype) * load_lanes(cos + j * size, dtype), dtype);
            const vf b = round_lanes(load_lanes(src + r * size, dtype) * load_lanes(sin + j * size, dtype), dtype);
            store_lanes(dst + j * size, a + b, dtype);
        }
        return;
    }
    for (int64_t j = 0; j < D; j++) {
        const int64_t r = j < half ? j + half : j - half;
        const float a = round_one(load_one(src + j * size, dtype) * load_one(cos + j * size, dtype), dtype);
        const float b = round_one(load_one(src + r * size, dtype) * load_one(sin + j * size, dtype), dtype);
        store_one(dst + j * size, a + b, dtype);
    }
}

/* One decode step of one layer after its q/k/v projection: RoPE of the queries and the new key, the new key
   and value written to the cache, and the attention of rolerl_decode_attention, in one task per (row, KV
   head). qkv: (rows, heads of q, k and v) rows qkv_row elements apart, its heads in order q (kv_heads *
   groups), k (kv_heads), v (kv_heads), each head_dim contiguous; cos, sin: (rows, head_dim) contiguous,
   sin's first half negated. Row b writes its key and value to column writes[b] of its slot (a column outside
   the cache: no write) and attends to keys [0, positions[b * position_stride]]. Rows must have distinct
   slots (each task writes only its own slot and head). */
void rolerl_decode_step(const void *qkv, int64_t qkv_row, const void *cos, const void *sin, void *k, void *v,
                        void *out, const int64_t *slots, const int64_t *positions, int64_t position_stride,
                        const int64_t *writes, int64_t rows, int64_t kv_heads, int64_t groups, int64_t head_dim,
                        int64_t slot_count, int64_t key_count, int64_t slot_stride, int64_t head_stride,
                        int64_t key_stride, float scale, int dtype, int threads) {
    const int64_t size = dtype == BF16 ? 2 : 4, per_row = groups * head_dim * size, hd = head_dim * size;
    const attend_fn fn = dtype == BF16 ? (head_dim == 64 ? attend_d64_bf16 : head_dim == 128 ? attend_d128_bf16 : attend_any_bf16)
                                       : (head_dim == 64 ? attend_d64_f32 : head_dim == 128 ? attend_d128_f32 : attend_any_f32);
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int64_t b = 0; b < rows; b++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            const int64_t slot = slots[b], task = b * kv_heads + h, column = writes[b];
            int64_t n = positions[b * position_stride] + 1;
            n = n > key_count ? key_count : n;
            char *o = (char *)out + task * per_row;
            if (slot < 0 || slot >= slot_count) {
                memset(o, 0, (size_t)per_row);
                continue;
            }
            const char *row = (const char *)qkv + b * qkv_row * size, *c = (const char *)cos + b * hd,
                       *s = (const char *)sin + b * hd;
            const int64_t at = (slot * slot_stride + h * head_stride) * size;
            char *kt = (char *)k + at, *vt = (char *)v + at;
            if (column >= 0 && column < key_count) {
                rope_head(row + (kv_heads * groups + h) * hd, c, s, kt + column * key_stride * size, head_dim, dtype);
                memcpy(vt + column * key_stride * size, row + (kv_heads * (groups + 1) + h) * hd, (size_t)hd);
            }
            if (n < 1) {
                memset(o, 0, (size_t)per_row);
                continue;
            }
            _Alignas(64) char qt[MAX_G * MAX_D * 4];
            for (int64_t g = 0; g < groups; g++) rope_head(row + (h * groups + g) * hd, c, s, qt + g * hd, head_dim, dtype);
            fn(qt, kt, vt, o, n, groups, head_dim, key_stride * size, scale);
        }
    }
}

/* 0: the largest head dim, 1: the most query heads per KV head, 2: the vector ISA the kernel was built for
   (512: AVX-512, 256: AVX2, 0: neither, where the generic vectors may run slower than torch's kernels). */
int rolerl_decode_attention_limit(int which) {
    return which == 0 ? MAX_D : which == 1 ? MAX_G : ISA;
}
