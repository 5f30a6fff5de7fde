/* tiermem native core: plain C, no Python or torch headers; loaded with ctypes by
 * tiermem/_native.py. Every entry point works on raw pointers and element counts.
 *
 * Bump TM_ABI_VERSION whenever a signature below changes: the Python loader refuses a library
 * whose tm_abi_version() differs from the one it was written for (a stale build in the tree).
 */
#ifndef TIERMEM_NATIVE_H
#define TIERMEM_NATIVE_H

#include <stddef.h>
#include <stdint.h>

#define TM_API __attribute__((visibility("default")))

#define TM_ABI_VERSION 2

/* dtype codes shared with tiermem/_native.py */
enum tm_dtype { TM_F32 = 0, TM_BF16 = 1, TM_F16 = 2, TM_NONE = 3 };

/* instruction-set levels of the Adam kernel (tm_adam_set_isa / tm_adam_isa) */
enum tm_isa { TM_ISA_AUTO = -1, TM_ISA_DEFAULT = 0, TM_ISA_AVX2 = 1, TM_ISA_AVX512 = 2 };

/* error codes returned by tm_adam_step (0 = success) */
enum tm_err {
    TM_OK = 0,
    TM_EINVAL_DTYPE = -1,
    TM_EINVAL_NUMEL = -2,
    TM_EINVAL_PTR = -3,
    TM_EINVAL_STEP = -4,
    TM_EINVAL_SUM = -5,
};

TM_API int tm_abi_version(void);

/* One fused Adam/AdamW step over numel elements (torch's fused CPU AdamW operation order).
 *   param:      fp32 master params, updated in place
 *   grad:       grad_dtype = TM_F32 / TM_BF16 / TM_F16, read only
 *   exp_avg, exp_avg_sq: state_dtype = TM_F32 / TM_BF16, updated in place
 *   param_out:  optional (NULL with out_dtype = TM_NONE); receives the updated param rounded
 *               to nearest-even in out_dtype = TM_F32 / TM_BF16 / TM_F16
 *   adamw:      1 = decoupled weight decay (AdamW), 0 = L2 penalty added to the gradient (Adam)
 *   num_threads: OpenMP threads; <= 0 uses omp_get_max_threads(); capped so each thread gets
 *               at least 32768 elements
 * Returns TM_OK or a negative tm_err. */
TM_API int tm_adam_step(float *param, const void *grad, int grad_dtype, void *exp_avg,
                        void *exp_avg_sq, int state_dtype, void *param_out, int out_dtype,
                        int64_t numel, int64_t step, double lr, double beta1, double beta2,
                        double eps, double weight_decay, int adamw, int maximize,
                        int num_threads);

/* tm_adam_step that also stores in *sum_out the sum, modulo 2**64, of the param_out bytes it
 * wrote, byte j weighted 256**((sum_phase + j) % 8) for j < sum_weighted and 1 from there on
 * (sum_weighted may be <= 0 or beyond the output): tiermem.stream.checksums.piece_checksum of
 * the output placed at byte offset lo of an 8-byte-aligned whole of N bytes, with
 * sum_phase = lo % 8 and sum_weighted = N / 8 * 8 - lo. Each block of the output is summed right
 * after it is written (from L1); needs out_dtype != TM_NONE and 0 <= sum_phase < 8, else
 * TM_EINVAL_SUM. With sum_out NULL it is tm_adam_step. */
TM_API int tm_adam_step_sum(float *param, const void *grad, int grad_dtype, void *exp_avg,
                            void *exp_avg_sq, int state_dtype, void *param_out, int out_dtype,
                            int64_t numel, int64_t step, double lr, double beta1, double beta2,
                            double eps, double weight_decay, int adamw, int maximize,
                            int num_threads, int64_t sum_phase, int64_t sum_weighted,
                            uint64_t *sum_out);

/* Kernel ISA in use (tm_isa); tm_adam_set_isa forces one (TM_ISA_AUTO = best supported) and
 * returns the level now in use (a level the CPU lacks falls back to the best supported). */
TM_API int tm_adam_isa(void);
TM_API int tm_adam_set_isa(int isa);

/* omp_get_max_threads() of the calling thread. */
TM_API int tm_omp_max_threads(void);

/* CRC-32C (Castagnoli), standard init/xorout 0xFFFFFFFF, chainable:
 * tm_crc32c(tm_crc32c(0, a, na), b, nb) == CRC of a||b; tm_crc32c(0, "123456789", 9) ==
 * 0xE3069283. Uses the SSE4.2 crc32 instruction on 3 interleaved streams when available. */
TM_API uint32_t tm_crc32c(uint32_t crc, const void *buf, size_t nbytes);
/* 1 when tm_crc32c uses the SSE4.2 instruction, 0 for the table-driven fallback. */
TM_API int tm_crc32c_hw(void);
/* The table-driven path alone (tests compare it with the hardware path). */
TM_API uint32_t tm_crc32c_sw(uint32_t crc, const void *buf, size_t nbytes);

#endif
