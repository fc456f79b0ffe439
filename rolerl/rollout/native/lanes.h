/* Vectors of LANES floats shared by the engine's native kernels (decode_attention.c, lora.c): GCC/Clang vector
   extensions over one register of the widest ISA the compiler targets (-march=native), 16 floats with
   AVX-512, 8 otherwise; bf16 widened exactly as it is read and rounded to nearest even as it is written. */

#ifndef ROLERL_LANES_H
#define ROLERL_LANES_H

#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1 };

#if defined(__AVX512F__)
#define LANES 16 /* one AVX-512 register */
#else
#define LANES 8 /* one AVX2 register (or two SSE ones): wider generic vectors lower badly there */
#endif
typedef float vf __attribute__((vector_size(LANES * 4)));
typedef float vfu __attribute__((vector_size(LANES * 4), aligned(4))); /* for loads and stores at any float */
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

/* Store LANES fp32 values at p in dtype (bf16: rounded to nearest even, as torch does; NaN stays NaN). */
static inline void store_lanes(void *p, vf r, int dtype) {
    if (dtype == BF16) {
        vu u;
        memcpy(&u, &r, sizeof u);
        vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
        vu nan = (vu)(r != r);
        rounded = (rounded & ~nan) | (0x7fc0u & nan);
        vh h = __builtin_convertvector(rounded, vh);
        memcpy(p, &h, sizeof h);
    } else {
        memcpy(p, &r, sizeof r);
    }
}

/* round(x) to the dtype and back, in fp32 lanes: what storing and loading again would give (bf16: to nearest
   even, NaN stays NaN; fp32: x itself). */
static inline vf round_lanes(vf x, int dtype) {
    if (dtype != BF16) return x;
    vu u;
    memcpy(&u, &x, sizeof u);
    const vu nan = (vu)(x != x);
    u = ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u & ~nan) | (u & nan);
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline float round_one(float f, int dtype) {
    if (dtype != BF16 || f != f) return f;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* One value at p as fp32 / stored from fp32, for the scalar tails (the same rounding as store_lanes). */
static inline float load_one(const void *p, int dtype) {
    if (dtype == BF16) {
        uint32_t w = (uint32_t)(*(const uint16_t *)p) << 16;
        float f;
        memcpy(&f, &w, sizeof f);
        return f;
    }
    return *(const float *)p;
}

static inline void store_one(void *p, float f, int dtype) {
    if (dtype == BF16) {
        uint32_t u;
        memcpy(&u, &f, sizeof u);
        *(uint16_t *)p = f != f ? 0x7fc0u : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    } else {
        *(float *)p = f;
    }
}

/* The vector ISA this file was built for (512: AVX-512, 256: AVX2 with FMA, 0: neither). */
#if defined(__AVX512F__)
#define ISA 512
#elif defined(__AVX2__) && defined(__FMA__)
#define ISA 256
#else
#define ISA 0
#endif

#endif
