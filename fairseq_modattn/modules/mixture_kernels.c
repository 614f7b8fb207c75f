/* The diagonal GMM's per-point passes on the CPU, forward and backward (native_mixture.py).
 *
 * Why: gmm._MixtureStatistics clusters (G, M, d) points with C clusters by matmuls against the
 * (C, d) parameters. At DMA's sizes (d = 128, C = 4-8) those products are thin, and a GMM's forward
 * and backward made ~20 passes over its points, each a separate torch call that streams a tensor
 * as large as a layer's input (docs/design.md, "The GMMs on the CPU"). Here each point is read
 * once a direction: everything a point contributes is computed while its d values are in
 * registers and the L1 cache.
 *
 * The equations are those of gmm._MixtureStatistics (its docstring); with a = scale,
 * sigma^-2 = inv_var, mu sigma^-2 = scaled_means, log N_c = log_norm, per point i of group g:
 *
 *   forward   J_c  = log N_c - a^2 / 2 sum_k z_k^2 sigma_ck^-2 + a sum_k z_k (mu sigma^-2)_ck
 *             LP_c = J_c - logsumexp_c J,  P_c = exp(LP_c)
 *             T_c  = -offset_c + a^2 / 2 sum_k x_k^2 sigma_ck^-2 - a sum_k x_k (mu sigma^-2)_ck + LP_c
 *             KL   = sum_c P_c T_c - kl_const                      (with need_kl; T is kept)
 *   backward  G^LP' = G^LP + P G^P + G^KL P (T + kl_shift)            (kl_shift = 1 - d log(2 pi) / 2)
 *             G^J'  = G^J + G^LP' - P sum_c G^LP',   W = G^KL P
 *             dz-part: a G^J' (mu sigma^-2) - a^2 (G^J' sigma^-2) * z,  dx-part: -a W (mu sigma^-2) + a^2 (W sigma^-2) * x
 *             weight_c += W_c - G^J'_c,  kl_weight_c += W_c,
 *             first_c += -a G^J'_c z + a W_c x,  second_c += -a^2 G^J'_c z^2 + a^2 W_c x^2.
 *
 * Each point's sums run over k in one order whatever M or the caller's blocks, so a point's
 * results do not depend on the other points (incremental decoding gives the full forward's
 * values). Loops over k are `omp simd` reductions, compiled for AVX-512, AVX2 and baseline x86-64
 * by target_clones, chosen at load time. The points run in parts on OpenMP's threads where the
 * library is built with -fopenmp: torch's own libgomp threads (native_build.openmp_flags says why).
 */
#include <math.h>
#include <stdint.h>

#define MAX_CLUSTERS 64

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif

/* Strided (G, M, d) points: row (g, m) starts at base + g * group_stride + m * point_stride. */
typedef struct {
    const float *base;
    int64_t group_stride, point_stride;
} points_t;

static inline const float *row(points_t p, int64_t g, int64_t m) {
    return p.base + g * p.group_stride + m * p.point_stride;
}

CLONES static void forward_range(points_t x, points_t z, int64_t groups, int64_t num_points, int64_t begin,
                                 int64_t end, int64_t dim, int64_t clusters, const float *inv_var,
                                 const float *scaled_means, const float *log_norm, const float *offset,
                                 float scale, float kl_const, float *log_joint, float *log_post, float *post,
                                 float *kl, float *terms) {
    const float half_a2 = 0.5f * scale * scale;
    /* point by point, all groups of a point together: a head-split view of a token-major
     * activation keeps a token's groups side by side in memory */
    for (int64_t m = begin; m < end; m++) {
        for (int64_t g = 0; g < groups; g++) {
            const float *iv_g = inv_var + g * clusters * dim, *sm_g = scaled_means + g * clusters * dim;
            const float *zr = row(z, g, m);
            const int64_t out = (g * num_points + m) * clusters;
            float joint[MAX_CLUSTERS], top = -INFINITY;
            for (int64_t c = 0; c < clusters; c++) {
                const float *iv = iv_g + c * dim, *sm = sm_g + c * dim;
                /* z . (a mu sigma^-2 - a^2 / 2 z sigma^-2): both products in one sum */
                float product = 0.0f;
#pragma omp simd reduction(+ : product)
                for (int64_t k = 0; k < dim; k++) product += zr[k] * (scale * sm[k] - half_a2 * zr[k] * iv[k]);
                joint[c] = log_norm[g * clusters + c] + product;
                top = joint[c] > top ? joint[c] : top;
            }
            float total = 0.0f;
            for (int64_t c = 0; c < clusters; c++) total += expf(joint[c] - top);
            /* (J - max) - log sum exp(J - max), as torch's log_softmax: max + log sum would round
             * at the scale of J (~d log 2 pi / 2), not of LP */
            const float log_total = logf(total);
            for (int64_t c = 0; c < clusters; c++) {
                log_joint[out + c] = joint[c];
                log_post[out + c] = (joint[c] - top) - log_total;
                post[out + c] = expf(log_post[out + c]);
            }
            if (offset == 0) continue;
            const float *xr = row(x, g, m);
            float divergence = 0.0f;
            for (int64_t c = 0; c < clusters; c++) {
                const float *iv = iv_g + c * dim, *sm = sm_g + c * dim;
                float product = 0.0f;
#pragma omp simd reduction(+ : product)
                for (int64_t k = 0; k < dim; k++) product += xr[k] * (scale * sm[k] - half_a2 * xr[k] * iv[k]);
                const float term = -offset[g * clusters + c] - product + log_post[out + c];
                terms[out + c] = term;
                divergence += post[out + c] * term;
            }
            kl[g * num_points + m] = divergence - kl_const;
        }
    }
}

/* Points [begin, end) of part `part` of `parts` equal parts of num_points. */
static void part_range(int64_t num_points, int part, int parts, int64_t *begin, int64_t *end) {
    *begin = num_points * part / parts;
    *end = num_points * (part + 1) / parts;
}

#ifdef _OPENMP
#include <omp.h>
#define PART omp_get_thread_num()
#define PARTS omp_get_num_threads()
#else
#define PART 0
#define PARTS 1
#endif

/* The forward of all points, in `parts` parts at once on OpenMP's threads (the pool torch's CPU
 * operators run on, native_mixture.py); 0 if there are more clusters than the kernels take. */
int modattn_gmm_forward(points_t x, points_t z, int64_t groups, int64_t num_points, int64_t dim, int64_t clusters,
                        const float *inv_var, const float *scaled_means, const float *log_norm,
                        const float *offset, float scale, float kl_const, float *log_joint, float *log_post,
                        float *post, float *kl, float *terms, int parts) {
    if (clusters > MAX_CLUSTERS) return 0;
#pragma omp parallel num_threads(parts)
    {
        int64_t begin, end;
        part_range(num_points, PART, PARTS, &begin, &end);
        forward_range(x, z, groups, num_points, begin, end, dim, clusters, inv_var, scaled_means, log_norm, offset,
                      scale, kl_const, log_joint, log_post, post, kl, terms);
    }
    return 1;
}

/* One point gradient target: out = sum of the dz-part (with G^J') and/or the dx-part (with W). */
typedef struct {
    float *base;
    int64_t group_stride, point_stride;
    int with_sampled, with_mean;
} target_t;

CLONES static void backward_range(points_t x, points_t z, int64_t groups, int64_t num_points, int64_t begin,
                                  int64_t end, int64_t dim, int64_t clusters, const float *inv_var,
                                  const float *scaled_means, const float *post, const float *terms,
                                  const float *grad_joint, const float *grad_log_post, const float *grad_post,
                                  const float *grad_kl, float scale, float kl_shift, target_t first_target,
                                  target_t second_target, float *weight, float *kl_weight, float *first,
                                  float *second) {
    const float a2 = scale * scale;
    const int with_kl = grad_kl != 0 && terms != 0;
    const target_t targets[2] = {first_target, second_target};
    for (int64_t m = begin; m < end; m++) { /* as in the forward: a point's groups together */
        for (int64_t g = 0; g < groups; g++) {
            const float *iv_g = inv_var + g * clusters * dim, *sm_g = scaled_means + g * clusters * dim;
            float *first_g = first ? first + g * clusters * dim : 0;
            float *second_g = second ? second + g * clusters * dim : 0;
            const int64_t at = (g * num_points + m) * clusters;
            const float *p = post + at;
            float grad_lp[MAX_CLUSTERS], grad_j[MAX_CLUSTERS], weighted[MAX_CLUSTERS];
            int have_lp = 0;
            if (with_kl) {
                const float gk = grad_kl[g * num_points + m];
                for (int64_t c = 0; c < clusters; c++) {
                    weighted[c] = p[c] * gk;
                    const float shifted = (grad_post ? grad_post[at + c] : 0.0f) + gk * kl_shift;
                    grad_lp[c] = (shifted + gk * terms[at + c]) * p[c];
                }
                have_lp = 1;
            } else {
                for (int64_t c = 0; c < clusters; c++) weighted[c] = 0.0f;
                if (grad_post) {
                    for (int64_t c = 0; c < clusters; c++) grad_lp[c] = p[c] * grad_post[at + c];
                    have_lp = 1;
                }
            }
            if (grad_log_post) {
                for (int64_t c = 0; c < clusters; c++) grad_lp[c] = (have_lp ? grad_lp[c] : 0.0f) + grad_log_post[at + c];
                have_lp = 1;
            }
            float lp_sum = 0.0f;
            if (have_lp)
                for (int64_t c = 0; c < clusters; c++) lp_sum += grad_lp[c];
            for (int64_t c = 0; c < clusters; c++) {
                float gj = have_lp ? grad_lp[c] - p[c] * lp_sum : 0.0f;
                if (grad_joint) gj += grad_joint[at + c];
                grad_j[c] = gj;
                weight[g * clusters + c] += weighted[c] - gj;
                if (kl_weight) kl_weight[g * clusters + c] += weighted[c];
            }
            const float *zr = row(z, g, m);
            const float *xr = with_kl ? row(x, g, m) : zr; /* read with weight 0 without the KL */
            for (int t = 0; t < 2; t++) {
                const target_t target = targets[t];
                if (!target.base) continue;
                float means_coef[MAX_CLUSTERS], sampled_coef[MAX_CLUSTERS], mean_coef[MAX_CLUSTERS];
                for (int64_t c = 0; c < clusters; c++) {
                    const float gj = target.with_sampled ? grad_j[c] : 0.0f;
                    const float w = target.with_mean ? weighted[c] : 0.0f;
                    means_coef[c] = scale * (gj - w);
                    sampled_coef[c] = -a2 * gj;
                    mean_coef[c] = a2 * w;
                }
                float *out = target.base + g * target.group_stride + m * target.point_stride;
                /* cluster by cluster, each a vector pass over the point's row in the L1 cache */
                for (int64_t c = 0; c < clusters; c++) {
                    const float *iv = iv_g + c * dim, *sm = sm_g + c * dim;
                    const float mc = means_coef[c], sc = sampled_coef[c], xc = mean_coef[c];
                    if (c == 0) {
#pragma omp simd
                        for (int64_t k = 0; k < dim; k++) out[k] = mc * sm[k] + iv[k] * (sc * zr[k] + xc * xr[k]);
                    } else {
#pragma omp simd
                        for (int64_t k = 0; k < dim; k++) out[k] += mc * sm[k] + iv[k] * (sc * zr[k] + xc * xr[k]);
                    }
                }
            }
            if (!first_g) continue;
            for (int64_t c = 0; c < clusters; c++) {
                const float on_sampled = -scale * grad_j[c], on_mean = scale * weighted[c];
                float *first_c = first_g + c * dim;
#pragma omp simd
                for (int64_t k = 0; k < dim; k++) first_c[k] += on_sampled * zr[k] + on_mean * xr[k];
                if (!second_g) continue;
                float *second_c = second_g + c * dim;
                const float sampled2 = scale * on_sampled, mean2 = scale * on_mean;
#pragma omp simd
                for (int64_t k = 0; k < dim; k++)
                    second_c[k] += sampled2 * zr[k] * zr[k] + mean2 * xr[k] * xr[k];
            }
        }
    }
}

/* The backward of all points, as the forward in `parts` parts; part p adds its column sums into
 * weight[p], kl_weight[p], first[p] and second[p] (the caller's (parts, ...) buffers, zeroed). */
int modattn_gmm_backward(points_t x, points_t z, int64_t groups, int64_t num_points, int64_t dim, int64_t clusters,
                         const float *inv_var, const float *scaled_means, const float *post, const float *terms,
                         const float *grad_joint, const float *grad_log_post, const float *grad_post,
                         const float *grad_kl, float scale, float kl_shift, target_t first_target,
                         target_t second_target, float *weight, float *kl_weight, float *first, float *second,
                         int parts) {
    if (clusters > MAX_CLUSTERS) return 0;
    const int64_t sums = groups * clusters, moments = groups * clusters * dim;
#pragma omp parallel num_threads(parts)
    {
        const int part = PART;
        int64_t begin, end;
        part_range(num_points, part, PARTS, &begin, &end);
        backward_range(x, z, groups, num_points, begin, end, dim, clusters, inv_var, scaled_means, post, terms,
                       grad_joint, grad_log_post, grad_post, grad_kl, scale, kl_shift, first_target, second_target,
                       weight + part * sums, kl_weight ? kl_weight + part * sums : 0,
                       first ? first + part * moments : 0, second ? second + part * moments : 0);
    }
    return 1;
}
