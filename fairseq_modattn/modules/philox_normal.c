/* Standard normal draws on the CPU from a counter-based generator (native_normal.py).
 *
 * Why: torch's CPU generator (Mersenne Twister) is serial, ~3.4 ns a value; DMA draws as many
 * noise values as the layers have activations (~72 draws of 4096 x 512 a training step of the
 * benchmark model, ~0.6 s of a ~8.5 s step on a 2-core CPU). Philox4x32-10 (Salmon et al.,
 * "Parallel random numbers: as easy as 1, 2, 3", SC 2011; the generator of cuRAND and JAX)
 * maps a 64-bit key and a counter to four 32-bit words with no state, so every lane of a vector
 * register computes its own counter.
 *
 * The stream of a key: value i lies in block b = i / 64, run j = (i % 64) / 16, lane
 * l = i % 16; counter c = 16 b + l gives Philox words (w0, w1, w2, w3), and runs 0, 1 are the
 * Box-Muller pair of (w0, w1), runs 2, 3 that of (w2, w3):
 *
 *     u1 = ((w >> 8) + 1) 2^-24 in (0, 1],   u2 = (w' >> 8) 2^-24 in [0, 1),
 *     r = sqrt(-2 log u1),   (run 2k, run 2k + 1) = (r cos 2 pi u2, r sin 2 pi u2).
 *
 * log and sin/cos are evaluated here, with every operation an IEEE float operation in a fixed
 * order (no FMA contraction: built with -ffp-contract=off), so the values are the same on every
 * instruction set: the AVX-512, AVX2 and generic kernels below differ only in how many lanes
 * one instruction holds. tests/test_native_normal.py restates these equations in torch and
 * checks them bit for bit.
 *
 * log u1: u1 = m 2^e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s), s = (m - 1) / (m + 1),
 * |s| <= 0.172, by its series to s^9 (the next term, 2 s^11 / 11, is below 1e-9).
 * 2 pi u2: u2 = (k + f) / 4 with the quadrant k = top 2 of the 24 bits and f in [0, 1); the
 * angle is (k + 1/2) pi / 2 + t, t = (f - 1/2) pi / 2 in [-pi / 4, pi / 4), whose sin and cos
 * are their Taylor series to t^9 and t^8 (next terms below 4e-9), rotated by
 * (k + 1/2) pi / 2, whose sin and cos are +-sqrt(1/2).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the kernels read two 32-bit lanes as one 64-bit lane (little-endian only)"
#endif

#define LANES_PER_BLOCK 16 /* counters per block: a block's 64 values are 4 runs of 16 */

/* One kernel per vector width V (16, 8, 4 lanes), compiled for its instruction set by TARGET.
 * The vector types are GCC/Clang vector extensions; each helper is inlined into its kernel so
 * that it is compiled for the kernel's target. */
#define DEFINE_KERNEL(NAME, V, TARGET)                                                          \
    typedef uint32_t NAME##_u __attribute__((vector_size(4 * V)));                              \
    typedef int32_t NAME##_i __attribute__((vector_size(4 * V)));                               \
    typedef float NAME##_f __attribute__((vector_size(4 * V)));                                 \
                                                                                                \
    /* the high and low words of a * m, 32 x 32 -> 64 bits, lane by lane: the even and odd      \
     * lanes as 64-bit lanes whose upper halves are 0, one unsigned 32-bit multiply each        \
     * (vpmuludq), and the halves put back in place */                                          \
    TARGET static inline __attribute__((always_inline)) NAME##_u NAME##_mul(NAME##_u a,        \
                                                                            uint32_t m,         \
                                                                            NAME##_u *low) {    \
        typedef uint64_t wide __attribute__((vector_size(4 * V)));                              \
        wide even = (wide)a & 0xffffffffu, odd = (wide)a >> 32;                                 \
        wide product_even = even * (uint64_t)m, product_odd = odd * (uint64_t)m;                \
        *low = (NAME##_u)((product_even & 0xffffffffu) | (product_odd << 32));                  \
        return (NAME##_u)((product_even >> 32) | (product_odd & 0xffffffff00000000u));          \
    }                                                                                           \
                                                                                                \
    TARGET static inline __attribute__((always_inline)) NAME##_f NAME##_where(                 \
        NAME##_i mask, NAME##_f a, NAME##_f b) {                                                \
        return (NAME##_f)(((NAME##_i)a & mask) | ((NAME##_i)b & ~mask));                        \
    }                                                                                           \
                                                                                                \
    /* the Box-Muller pair (r cos, r sin) of two Philox words, times scale */                   \
    TARGET static inline __attribute__((always_inline)) void NAME##_box_muller(                \
        NAME##_u w, NAME##_u w2, float scale, NAME##_f *c, NAME##_f *s) {                       \
        NAME##_f u1 = __builtin_convertvector((NAME##_i)((w >> 8) + 1), NAME##_f) * 0x1p-24f;   \
        NAME##_u bits = (NAME##_u)u1;                                                           \
        NAME##_i e = (NAME##_i)(bits >> 23) - 127;                                              \
        NAME##_f m = (NAME##_f)((bits & 0x007fffffu) | 0x3f800000u); /* [1, 2) */               \
        NAME##_i big = m > 1.41421356f;                              /* -1 where true */        \
        m = NAME##_where(big, m * 0.5f, m);                                                     \
        e = e - big;                                                                            \
        NAME##_f z = (m - 1.0f) / (m + 1.0f);                                                   \
        NAME##_f z2 = z * z;                                                                    \
        NAME##_f series = z2 * (1.0f / 9.0f) + 1.0f / 7.0f;                                     \
        series = series * z2 + 1.0f / 5.0f;                                                     \
        series = series * z2 + 1.0f / 3.0f;                                                     \
        series = series * z2 + 1.0f;                                                            \
        NAME##_f log_u1 = 2.0f * z * series + __builtin_convertvector(e, NAME##_f) * 0.693147180559945f; \
        NAME##_f minus_2log = log_u1 * -2.0f, r;                                                \
        for (int l = 0; l < V; l++) r[l] = sqrtf(minus_2log[l]);                                \
        r = r * scale;                                                                          \
        NAME##_u x = w2 >> 8;                                                                   \
        NAME##_u quadrant = x >> 22;                                                            \
        NAME##_f f = __builtin_convertvector((NAME##_i)(x & 0x3fffffu), NAME##_f) * 0x1p-22f - 0.5f; \
        NAME##_f t = f * 1.5707963267948966f;                                                   \
        NAME##_f t2 = t * t;                                                                    \
        NAME##_f sin_t = t * (1.0f + t2 * (-1.0f / 6 + t2 * (1.0f / 120 + t2 * (-1.0f / 5040 + t2 * (1.0f / 362880))))); \
        NAME##_f cos_t = 1.0f + t2 * (-0.5f + t2 * (1.0f / 24 + t2 * (-1.0f / 720 + t2 * (1.0f / 40320)))); \
        NAME##_i cos_negative = (NAME##_i)((quadrant == 1) | (quadrant == 2));                  \
        NAME##_i sin_negative = (NAME##_i)(quadrant >= 2);                                      \
        NAME##_f half = {0};                                                                    \
        half += 0.70710678f;                                                                    \
        NAME##_f cos_a = NAME##_where(cos_negative, -half, half);                               \
        NAME##_f sin_a = NAME##_where(sin_negative, -half, half);                               \
        *c = r * (cos_a * cos_t - sin_a * sin_t);                                               \
        *s = r * (sin_a * cos_t + cos_a * sin_t);                                               \
    }                                                                                           \
                                                                                                \
    /* the 64 values of block `block`, times scale, plus base's (NULL: none), into out */       \
    TARGET static void NAME(float *out, const float *base, uint64_t block, uint64_t key,       \
                            float scale) {                                                      \
        for (int first = 0; first < LANES_PER_BLOCK; first += V) {                              \
            NAME##_u c0, c1, c2 = {0}, c3 = {0};                                                \
            for (int l = 0; l < V; l++) {                                                       \
                uint64_t counter = block * LANES_PER_BLOCK + (uint64_t)(first + l);             \
                c0[l] = (uint32_t)counter;                                                      \
                c1[l] = (uint32_t)(counter >> 32);                                              \
            }                                                                                   \
            uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);                            \
            for (int round = 0; round < 10; round++) {                                          \
                NAME##_u low0, low1;                                                            \
                NAME##_u high0 = NAME##_mul(c0, 0xD2511F53u, &low0);                            \
                NAME##_u high1 = NAME##_mul(c2, 0xCD9E8D57u, &low1);                            \
                c0 = high1 ^ c1 ^ k0;                                                           \
                c2 = high0 ^ c3 ^ k1;                                                           \
                c1 = low1;                                                                      \
                c3 = low0;                                                                      \
                k0 += 0x9E3779B9u;                                                              \
                k1 += 0xBB67AE85u;                                                              \
            }                                                                                   \
            NAME##_f runs[4];                                                                   \
            NAME##_box_muller(c0, c1, scale, &runs[0], &runs[1]);                               \
            NAME##_box_muller(c2, c3, scale, &runs[2], &runs[3]);                               \
            for (int j = 0; j < 4; j++) {                                                       \
                if (base) {                                                                     \
                    NAME##_f b;                                                                 \
                    memcpy(&b, base + j * LANES_PER_BLOCK + first, sizeof b);                   \
                    runs[j] = b + runs[j];                                                      \
                }                                                                               \
                memcpy(out + j * LANES_PER_BLOCK + first, &runs[j], sizeof runs[j]);            \
            }                                                                                   \
        }                                                                                       \
    }

#if defined(__x86_64__)
#define X86 1
DEFINE_KERNEL(block_avx512, 16, __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl"))))
DEFINE_KERNEL(block_avx2, 8, __attribute__((target("avx2"))))
#else
#define X86 0
#endif
DEFINE_KERNEL(block_generic, 4, )

typedef void (*block_kernel)(float *, const float *, uint64_t, uint64_t, float);

/* the widest kernel this CPU runs, or the one of `lanes` (16, 8, 4) if it runs it; 0 if not */
static block_kernel kernel_for(int lanes, int *chosen) {
#if X86
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                 __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
    if ((lanes == 0 || lanes == 16) && avx512) return *chosen = 16, block_avx512;
    if ((lanes == 0 || lanes == 8) && __builtin_cpu_supports("avx2")) return *chosen = 8, block_avx2;
#endif
    if (lanes == 0 || lanes == 4) return *chosen = 4, block_generic;
    return *chosen = 0, (block_kernel)0;
}

/* The vector width modattn_normal takes with `lanes` (0: the widest), or 0 if this CPU has no
 * such kernel. */
int modattn_normal_lanes(int lanes) {
    int chosen;
    kernel_for(lanes, &chosen);
    return chosen;
}

/* out[i] = base[i] + scale * N_i for i < n (base NULL: scale * N_i), N_i the i-th value of the
 * stream of `key` (file comment); out and base are dense float arrays, which may be the same.
 * `lanes`: the kernel's width, 0 for the widest. The blocks run in `parts` parts at once on
 * OpenMP's threads where the library is built with -fopenmp (torch's own threads,
 * native_build.openmp_flags); each block's values are fixed by its counter alone, so the parts
 * change no value. Returns the width used, 0 if none. */
int modattn_normal(float *out, const float *base, int64_t n, uint64_t key, float scale, int lanes, int parts) {
    int chosen;
    block_kernel kernel = kernel_for(lanes, &chosen);
    if (!kernel) return 0;
    const int64_t per_block = 4 * LANES_PER_BLOCK;
    int64_t full = n / per_block;
#pragma omp parallel for num_threads(parts) schedule(static)
    for (int64_t b = 0; b < full; b++)
        kernel(out + b * per_block, base ? base + b * per_block : 0, (uint64_t)b, key, scale);
    int64_t rest = n - full * per_block;
    if (rest > 0) {
        float tail[4 * LANES_PER_BLOCK];
        kernel(tail, 0, (uint64_t)full, key, scale);
        for (int64_t i = 0; i < rest; i++)
            out[full * per_block + i] = base ? base[full * per_block + i] + tail[i] : tail[i];
    }
    return chosen;
}
