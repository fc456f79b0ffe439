/* Decode attention over the rollout engine's KV cache: one new query position per row, grouped-query heads.

   For row b and KV head h, the G query heads that share h attend to the first n = positions[b] + 1 keys of
   cache slot slots[b]:  out[b, h, g] = softmax(scale * q[b, h, g] . K[j]) . V[j],  j < n.
   K and V are read in place (no gather, no mask) and combined with an online softmax over blocks of keys;
   scores, probabilities and sums stay in fp32 whatever the cache's dtype (bf16 is widened as it is read).
   One task per (row, KV head), spread over the caller's OpenMP threads (torch's own runtime: the library
   is loaded after torch, whose libgomp.so.1 it then shares).

   Written with GCC/Clang vector extensions over LANES floats, one register of the widest ISA the compiler
   targets (-march=native): 16 with AVX-512, 8 otherwise. The head dim must be a multiple of 16.
   Built and loaded by rolerl.rollout.native, called through ctypes. */

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define BLOCK 64   /* keys per online-softmax block */
#define MAX_D 256  /* largest head dim */
#define MAX_G 16   /* largest number of query heads per KV head */

enum { F32 = 0, BF16 = 1 };

#if defined(__AVX512F__)
#define LANES 16 /* one AVX-512 register */
#else
#define LANES 8 /* one AVX2 register (or two SSE ones): wider generic vectors lower badly there */
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef uint16_t vh __attribute__((vector_size(LANES * 2)));
typedef uint32_t vu __attribute__((vector_size(LANES * 4)));
typedef int32_t vi __attribute__((vector_size(LANES * 4)));

#if defined(__clang__) || __GNUC__ >= 12
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi){__VA_ARGS__})
#endif

/* LANES values of a row at p as fp32 (bf16: the 16 bits become the high half of an fp32, exact). */
static inline vf load_lanes(const void *p, int dtype) {
    vf f;
    if (dtype == BF16) { /* one widening load each (GCC splits the generic conversion) */
#if defined(__AVX512F__)
        f = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
#elif defined(__AVX2__)
        f = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p)), 16));
#else
        vh h;
        memcpy(&h, p, sizeof h);
        vu w = __builtin_convertvector(h, vu) << 16;
        memcpy(&f, &w, sizeof f);
#endif
    } else {
        memcpy(&f, p, sizeof f);
    }
    return f;
}

/* Lane j of the result = the sum of the lanes of t[j]: a transposing tree of adds (for 16 lanes, 45 shuffles
   and adds give 16 sums, where one vector's horizontal sum alone takes 8). */
static inline vf reduce_lanes(const vf t[LANES]) {
#if LANES == 16
    vf u[8], w[4], x[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: key 2i's partial sums, 8-15: key 2i+1's */
        u[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               SHUFFLE(t[2 * i], t[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* four lanes per key, keys 4i..4i+3 in order */
        w[i] = SHUFFLE(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
               SHUFFLE(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* two lanes per key, keys 8i..8i+7 */
        x[i] = SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
               SHUFFLE(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return SHUFFLE(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
           SHUFFLE(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
    vf w[4], x[2];
    for (int i = 0; i < 4; i++) /* lanes 0-3: key 2i's partial sums, 4-7: key 2i+1's */
        w[i] = SHUFFLE(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               SHUFFLE(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++) /* two lanes per key, keys 4i..4i+3 */
        x[i] = SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
               SHUFFLE(w[2 * i], w[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
    return SHUFFLE(x[0], x[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUFFLE(x[0], x[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

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
                vf r = acc[g][c] * inv;                                                                              \
                char *dst = (char *)out + (g * C + c) * LANES * size;                                                \
                if (dtype == BF16) { /* round to nearest even, as torch does; NaN stays NaN */                       \
                    vu u;                                                                                            \
                    memcpy(&u, &r, sizeof u);                                                                        \
                    vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;                                             \
                    vu nan = (vu)(r != r);                                                                           \
                    rounded = (rounded & ~nan) | (0x7fc0u & nan);                                                    \
                    vh h = __builtin_convertvector(rounded, vh);                                                     \
                    memcpy(dst, &h, sizeof h);                                                                       \
                } else {                                                                                             \
                    memcpy(dst, &r, sizeof r);                                                                       \
                }                                                                                                    \
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

/* 0: the largest head dim, 1: the most query heads per KV head, 2: the vector ISA the kernel was built for
   (512: AVX-512, 256: AVX2, 0: neither, where the generic vectors may run slower than torch's kernels). */
int rolerl_decode_attention_limit(int which) {
#if defined(__AVX512F__)
    const int isa = 512;
#elif defined(__AVX2__) && defined(__FMA__)
    const int isa = 256;
#else
    const int isa = 0;
#endif
    return which == 0 ? MAX_D : which == 1 ? MAX_G : isa;
}
