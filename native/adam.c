/* Fused CPU Adam/AdamW step: fp32 master params, fp32 or bf16 moments, fp32/bf16/fp16
 * gradients, optional bf16/fp16/fp32 copy of the updated params written in the same pass.
 *
 * Operation order follows torch's fused CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp,
 * vectorised path as compiled in torch's x86 wheels, where gcc contracts some multiply-adds
 * into FMAs), so fp32 results match torch.optim.AdamW(fused=True) bit for bit:
 *   g = grad * (maximize ? -1 : 1)
 *   Adam (L2):   g = fma(p, wd, g)                  AdamW: p = p * (float)(1 - lr * wd)
 *   m = fma(w, g - m, m)        (lerp, w = 1 - beta1 < 0.5; else fma(w - 1, g - m, g))
 *   v = fma((1 - beta2) * g, g, v * beta2)
 *   denom = sqrt(v) / (float)sqrt(bc2) + eps
 *   p = p + ((float)(-lr / bc1) * m) / denom
 * with the scalars computed in double and rounded to float once, as torch does. The file is
 * compiled with -ffp-contract=off so the compiler fuses nothing beyond the explicit fmaf().
 * (torch's own scalar remainder loop -- the last < 16 elements of each of its per-thread
 * ranges -- is contracted differently, v = fma(v, beta2, ((1 - beta2) * g) * g), so torch's
 * result for such an element can differ from its vector path by 1 ulp in v; we apply the
 * vector-path formula to every element, which keeps results independent of chunking.)
 *
 * One generic loop body is inlined into three functions compiled for AVX-512, AVX2+FMA and
 * baseline x86-64 (target attributes), picked at run time with __builtin_cpu_supports; gcc
 * auto-vectorises it (sqrtf needs -fno-math-errno). Every element is computed independently with
 * the same operations in the vector body and the remainder, so results do not depend on the ISA,
 * the thread count or how a caller splits the range into chunks.
 */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "tiermem_native.h"

#define TM_INLINE static inline __attribute__((always_inline))

/* ---- conversions (bit-exact, branch-free so they vectorise) --------------------------------- */

TM_INLINE uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

TM_INLINE float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

TM_INLINE float bf16_to_f32(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* Round to nearest even; NaN -> 0x7FC0 (c10::detail::round_to_nearest_even, which
 * Tensor.to(torch.bfloat16) uses). */
TM_INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0u : (uint16_t)r;
}

/* IEEE half -> float, exact (the FP16 library's fp16_ieee_to_fp32_value, also used by c10). */
TM_INLINE float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const float normalized = f32_from_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t mag = two_w < (1u << 27) ? f32_bits(denormalized) : f32_bits(normalized);
    return f32_from_bits(sign | mag);
}

/* float -> IEEE half, round to nearest even, overflow to inf, NaN kept
 * (fp16_ieee_from_fp32_value; equals Tensor.to(torch.float16)). Needs IEEE float arithmetic
 * with denormals (no FTZ/DAZ) and no re-association, which this file's flags guarantee. */
TM_INLINE uint16_t f32_to_f16(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

TM_INLINE float load_any(const void *p, int64_t i, const int dt) {
    if (dt == TM_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    if (dt == TM_F16) return f16_to_f32(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

TM_INLINE void store_any(void *p, int64_t i, float x, const int dt) {
    if (dt == TM_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else if (dt == TM_F16)
        ((uint16_t *)p)[i] = f32_to_f16(x);
    else if (dt == TM_F32)
        ((float *)p)[i] = x;
}

/* ---- the loop body ------------------------------------------------------------------------- */

typedef struct {
    float *param;
    const void *grad;
    void *exp_avg, *exp_avg_sq, *param_out;
    int grad_dtype, state_dtype, out_dtype;
    int l2;          /* Adam with weight_decay != 0: g += p * wd */
    int lerp_small;  /* |1 - beta1| < 0.5: m = fma(w, g - m, m), else fma(w - 1, g - m, g) */
    float grad_sign; /* -1 for maximize (torch multiplies by -1.0; exact) */
    float wd;        /* (float)weight_decay, Adam L2 only */
    float decay;     /* (float)(1 - lr * wd) for AdamW, 1 otherwise (p * 1 is exact) */
    float lerp_coeff;
    float beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
} adam_args;

TM_INLINE void adam_body(const adam_args *a, int64_t begin, int64_t end, const int GD,
                         const int SD, const int OD) {
    float *__restrict p = a->param;
    const void *__restrict g = a->grad;
    void *__restrict m = a->exp_avg;
    void *__restrict v = a->exp_avg_sq;
    void *__restrict out = a->param_out;
    const int l2 = a->l2, lerp_small = a->lerp_small;
    const float grad_sign = a->grad_sign, wd = a->wd, decay = a->decay;
    const float coeff = a->lerp_coeff, beta2 = a->beta2, c2 = a->one_minus_beta2;
    const float bc2_sqrt = a->bc2_sqrt, eps = a->eps, neg_step_size = a->neg_step_size;

    for (int64_t i = begin; i < end; i++) {
        float pi = p[i];
        float gi = load_any(g, i, GD) * grad_sign;
        float l2_gi = fmaf(pi, wd, gi);
        gi = l2 ? l2_gi : gi;
        pi = pi * decay;
        float mi = load_any(m, i, SD);
        float vi = load_any(v, i, SD);
        float diff = gi - mi;
        mi = fmaf(coeff, diff, lerp_small ? mi : gi);
        vi = fmaf(c2 * gi, gi, vi * beta2);
        store_any(m, i, mi, SD);
        store_any(v, i, vi, SD);
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        pi = pi + (neg_step_size * mi) / denom;
        p[i] = pi;
        if (OD != TM_NONE) store_any(out, i, pi, OD);
    }
}

/* ---- the placed byte sum of the written params (tm_adam_step_sum) --------------------------
 * Byte j of b[0, n) weighs 256**((phase + j) % 8) for j < weighted and 1 from there on; the sum
 * is modulo 2**64. That is tiermem.stream.checksums.piece_checksum's quantity for bytes that sit
 * at byte offset lo (phase = lo % 8) of an 8-byte-aligned whole whose last whole word ends
 * weighted + lo bytes in (its tail of < 8 bytes is summed bytewise). Integer adds: exact, and
 * independent of how the bytes are split into calls, blocks or threads. */
TM_INLINE uint64_t placed_sum(const unsigned char *b, int64_t n, int64_t phase,
                              int64_t weighted) {
    uint64_t s = 0;
    const int64_t w = weighted < 0 ? 0 : (weighted > n ? n : weighted);
    int64_t head = (8 - phase) & 7, j = 0;
    if (head > w) head = w;
    for (; j < head; j++) s += (uint64_t)b[j] << (8 * ((phase + j) & 7));
    const int64_t nw = (w - j) / 8;
    const unsigned char *q = b + j;
    for (int64_t k = 0; k < nw; k++) { /* (phase + j) % 8 == 0 here: little-endian words */
        uint64_t x;
        memcpy(&x, q + 8 * k, sizeof x);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        x = __builtin_bswap64(x);
#endif
        s += x;
    }
    j += nw * 8;
    for (; j < w; j++) s += (uint64_t)b[j] << (8 * ((phase + j) & 7));
    for (; j < n; j++) s += b[j];
    return s;
}

/* Elements stepped before their output is summed: 4 or 8 KiB of output, still in L1 then. */
#define TM_SUM_BLOCK 2048

#define TM_KEY(GD, SD, OD) (((GD) * 2 + (SD)) * 4 + (OD))
#define TM_CASE(GD, SD, OD)                    \
    case TM_KEY(GD, SD, OD):                   \
        adam_body(a, begin, end, GD, SD, OD);  \
        break;
#define TM_CASES_OD(GD, SD)                         \
    TM_CASE(GD, SD, TM_F32) TM_CASE(GD, SD, TM_BF16) \
    TM_CASE(GD, SD, TM_F16) TM_CASE(GD, SD, TM_NONE)
#define TM_CASES                                                                 \
    TM_CASES_OD(TM_F32, TM_F32) TM_CASES_OD(TM_F32, TM_BF16)                     \
    TM_CASES_OD(TM_BF16, TM_F32) TM_CASES_OD(TM_BF16, TM_BF16)                   \
    TM_CASES_OD(TM_F16, TM_F32) TM_CASES_OD(TM_F16, TM_BF16)

/* NAME steps [begin, end); NAME##_sum also returns the placed sum of the output it wrote
 * there, block by block, each block summed right after it is written (read back from L1). */
#define TM_DEFINE_RANGE(NAME, ATTR)                                                         \
    ATTR static void NAME(const adam_args *a, int64_t begin, int64_t end) {                \
        switch (TM_KEY(a->grad_dtype, a->state_dtype, a->out_dtype)) { TM_CASES default:; } \
    }                                                                                       \
    ATTR static uint64_t NAME##_sum(const adam_args *a, int64_t begin, int64_t end,        \
                                    int64_t phase, int64_t weighted) {                      \
        const int64_t osz = a->out_dtype == TM_F32 ? 4 : 2;                                 \
        const unsigned char *out = (const unsigned char *)a->param_out;                     \
        uint64_t s = 0;                                                                     \
        for (int64_t b = begin; b < end; b += TM_SUM_BLOCK) {                               \
            const int64_t e = end - b > TM_SUM_BLOCK ? b + TM_SUM_BLOCK : end;              \
            NAME(a, b, e);                                                                  \
            const int64_t off = b * osz; /* bytes from the call's first output byte */      \
            s += placed_sum(out + off, (e - b) * osz, (phase + off) & 7, weighted - off);   \
        }                                                                                   \
        return s;                                                                           \
    }

#if defined(__x86_64__) || defined(__i386__)
TM_DEFINE_RANGE(adam_range_avx512,
                __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,"
                                      "prefer-vector-width=512"))))
TM_DEFINE_RANGE(adam_range_avx2, __attribute__((target("avx2,fma,f16c"))))
#define TM_HAVE_X86 1
#else
#define TM_HAVE_X86 0
#endif
TM_DEFINE_RANGE(adam_range_default, )

typedef void (*adam_range_fn)(const adam_args *, int64_t, int64_t);
typedef uint64_t (*adam_sum_fn)(const adam_args *, int64_t, int64_t, int64_t, int64_t);

static int tm_isa_best(void) {
#if TM_HAVE_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return TM_ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return TM_ISA_AVX2;
#endif
    return TM_ISA_DEFAULT;
}

static int tm_isa_current = TM_ISA_AUTO; /* resolved lazily; benign race (same value) */

static int resolve_isa(void) {
    int isa = __atomic_load_n(&tm_isa_current, __ATOMIC_RELAXED);
    if (isa == TM_ISA_AUTO) {
        isa = tm_isa_best();
        const char *env = getenv("TIERMEM_NATIVE_ISA"); /* avx512 | avx2 | default */
        if (env && strcmp(env, "default") == 0) isa = TM_ISA_DEFAULT;
        else if (env && strcmp(env, "avx2") == 0 && isa >= TM_ISA_AVX2) isa = TM_ISA_AVX2;
        __atomic_store_n(&tm_isa_current, isa, __ATOMIC_RELAXED);
    }
    return isa;
}

TM_API int tm_adam_isa(void) { return resolve_isa(); }

TM_API int tm_adam_set_isa(int isa) {
    int best = tm_isa_best();
    if (isa == TM_ISA_AUTO || isa > best) isa = best;
    if (isa < TM_ISA_DEFAULT) isa = TM_ISA_DEFAULT;
    __atomic_store_n(&tm_isa_current, isa, __ATOMIC_RELAXED);
    return isa;
}

TM_API int tm_abi_version(void) { return TM_ABI_VERSION; }

TM_API int tm_omp_max_threads(void) { return omp_get_max_threads(); }

/* Elements per thread below which another thread costs more than it saves (~10 us of work). */
#define TM_MIN_ELEMS_PER_THREAD 32768
/* Per-thread ranges start on multiples of this (64 B lines of fp32 and of bf16 data). */
#define TM_ALIGN_ELEMS 32

TM_API int tm_adam_step(float *param, const void *grad, int grad_dtype, void *exp_avg,
                        void *exp_avg_sq, int state_dtype, void *param_out, int out_dtype,
                        int64_t numel, int64_t step, double lr, double beta1, double beta2,
                        double eps, double weight_decay, int adamw, int maximize,
                        int num_threads) {
    return tm_adam_step_sum(param, grad, grad_dtype, exp_avg, exp_avg_sq, state_dtype,
                            param_out, out_dtype, numel, step, lr, beta1, beta2, eps,
                            weight_decay, adamw, maximize, num_threads, 0, 0, NULL);
}

TM_API int tm_adam_step_sum(float *param, const void *grad, int grad_dtype, void *exp_avg,
                            void *exp_avg_sq, int state_dtype, void *param_out, int out_dtype,
                            int64_t numel, int64_t step, double lr, double beta1, double beta2,
                            double eps, double weight_decay, int adamw, int maximize,
                            int num_threads, int64_t sum_phase, int64_t sum_weighted,
                            uint64_t *sum_out) {
    if (grad_dtype < TM_F32 || grad_dtype > TM_F16) return TM_EINVAL_DTYPE;
    if (state_dtype != TM_F32 && state_dtype != TM_BF16) return TM_EINVAL_DTYPE;
    if (out_dtype < TM_F32 || out_dtype > TM_NONE) return TM_EINVAL_DTYPE;
    if (numel < 0) return TM_EINVAL_NUMEL;
    if (step < 1) return TM_EINVAL_STEP;
    if (sum_out && (out_dtype == TM_NONE || sum_phase < 0 || sum_phase > 7))
        return TM_EINVAL_SUM;
    if (sum_out) *sum_out = 0;
    if (numel == 0) return TM_OK;
    if (!param || !grad || !exp_avg || !exp_avg_sq || (out_dtype != TM_NONE && !param_out))
        return TM_EINVAL_PTR;

    /* Scalars in double, exactly as FusedAdamKernel.cpp computes them. */
    const double stepd = (double)step;
    const double bias_correction1 = 1 - pow(beta1, stepd);
    const double bias_correction2 = 1 - pow(beta2, stepd);
    const double step_size = lr / bias_correction1;
    const double exp_avg_grad_coefficient = 1 - beta1;
    const double bias_correction2_sqrt = sqrt(bias_correction2);

    adam_args a;
    a.param = param;
    a.grad = grad;
    a.exp_avg = exp_avg;
    a.exp_avg_sq = exp_avg_sq;
    a.param_out = out_dtype == TM_NONE ? NULL : param_out;
    a.grad_dtype = grad_dtype;
    a.state_dtype = state_dtype;
    a.out_dtype = out_dtype;
    a.l2 = (!adamw && weight_decay != 0.0);
    a.grad_sign = maximize ? -1.0f : 1.0f;
    a.wd = (float)weight_decay;
    a.decay = (adamw && weight_decay != 0.0) ? (float)(1 - lr * weight_decay) : 1.0f;
    const float w = (float)exp_avg_grad_coefficient;
    a.lerp_small = fabsf(w) < 0.5f;
    a.lerp_coeff = a.lerp_small ? w : w - 1.0f;
    a.beta2 = (float)beta2;
    a.one_minus_beta2 = (float)(1 - beta2);
    a.bc2_sqrt = (float)bias_correction2_sqrt;
    a.eps = (float)eps;
    a.neg_step_size = (float)(-step_size);

    adam_range_fn fn = adam_range_default;
    adam_sum_fn fn_sum = adam_range_default_sum;
#if TM_HAVE_X86
    switch (resolve_isa()) {
        case TM_ISA_AVX512: fn = adam_range_avx512; fn_sum = adam_range_avx512_sum; break;
        case TM_ISA_AVX2: fn = adam_range_avx2; fn_sum = adam_range_avx2_sum; break;
        default: break;
    }
#endif

    int64_t nt = num_threads > 0 ? num_threads : omp_get_max_threads();
    int64_t cap = (numel + TM_MIN_ELEMS_PER_THREAD - 1) / TM_MIN_ELEMS_PER_THREAD;
    if (nt > cap) nt = cap;
    if (nt < 1) nt = 1;
    if (nt == 1) {
        if (sum_out)
            *sum_out = fn_sum(&a, 0, numel, sum_phase, sum_weighted);
        else
            fn(&a, 0, numel);
        return TM_OK;
    }
    const int64_t nblocks = (numel + TM_ALIGN_ELEMS - 1) / TM_ALIGN_ELEMS;
    uint64_t total = 0; /* the threads' sums added modulo 2**64: exact in any order */
#pragma omp parallel num_threads((int)nt) reduction(+ : total)
    {
        /* static partition in whole 32-element blocks (one contiguous range per thread) */
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
        const int64_t per = nblocks / T, rem = nblocks % T;
        const int64_t b0 = t * per + (t < rem ? t : rem);
        const int64_t b1 = b0 + per + (t < rem ? 1 : 0);
        int64_t begin = b0 * TM_ALIGN_ELEMS, end = b1 * TM_ALIGN_ELEMS;
        if (end > numel) end = numel;
        if (begin < end) {
            if (sum_out)
                total += fn_sum(&a, begin, end, sum_phase, sum_weighted);
            else
                fn(&a, begin, end);
        }
    }
    if (sum_out) *sum_out = total;
    return TM_OK;
}
