/* One pass over a layer's reference output x and one or two compared outputs y: every error
 * sum of qdebug.measure.stats in a single read of the data (qdebug/measure/fused.py loads it
 * with ctypes; the CPython module at the end only lets the import system find the file).
 *
 * The data is a grid of rows (n, c, m): row (i, ch) starts at i * stride_n + ch * stride_c and
 * its m values are contiguous.  For each element, with e = y - x:
 *
 *     per channel:  sum x^2, min x, max x
 *     per y:        sum e^2 per channel, sum y^2, sum |e|, max |e|
 *
 * The work is shared out with OpenMP.  Built with -fopenmp, this library needs libgomp.so.1,
 * and torch (imported first) has loaded its own copy under that name, so the loader binds this
 * library to torch's: the kernel runs on the threads torch's own ops run on, and finds them
 * awake.  (Python threads beside them were slowed 2x on 2 cores by torch's workers spinning
 * for their next op.)
 *
 * x and y are widened to float64 before anything is computed, so e, the squares and the sums
 * are float64: no cancellation in e, and a channel's sum of 10^7 squares keeps ~1e-12 of
 * relative precision (torch's float32 block sums keep ~1e-7).  A channel's sums run in the W
 * lanes of a vector register (GCC vector types; the widest set the CPU has: W = 8 with
 * AVX-512, 4 with AVX2, else 2) and its lanes are reduced in lane order once per channel.  The
 * order of the additions depends on W and the number of threads only.
 * A NaN or Inf anywhere makes some sum non-finite; the caller then redoes the batch with torch
 * ops, so the min/max here need not order NaNs.
 *
 * out, laid out per call (c = channels, T = 1 or 2 outputs compared):
 *     [0, c)  sum x^2 per channel    [c, 2c)  min x    [2c, 3c)  max x
 *     then per y number t, at 3c + t (c + 3):  sum e^2 per channel (c), sum y^2, sum |e|, max |e|
 * Sums add to what out holds and min/max fold with it: initialise min to +inf, max to -inf.
 * qd_fold returns 0, or -1 when it could not allocate its per-channel sums (out untouched).
 *
 * qd_count_outside, the saturation count of a fake quantizer's codes, shares the threads.
 */
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

static inline double lane_sum_(const double *v, int w) {
    double s = 0.0;
    for (int k = 0; k < w; k++) s += v[k];
    return s;
}
#define lane_sum(v, w) lane_sum_((const double *)&(v), (w))

/* Values read ahead of the one folded: the hardware prefetcher alone left a thread at ~8 GB/s
 * of its ~13 GB/s (2 KB ahead: 2 threads then read 800 MB at ~26 GB/s, sum()'s own speed). A
 * prefetch past the end of a tensor is harmless: it never faults. */
#define AHEAD 512

typedef int fold_fn(const float *, int64_t, int64_t, const float *, int64_t, int64_t, const float *, int64_t,
                     int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double *);

/* Generic: load W floats, then convert (GCC picks the instructions). */
#define WIDEN_GENERIC(P, FV_, DV_)       \
    ({                                   \
        FV_ f_;                          \
        memcpy(&f_, (P), sizeof f_);     \
        __builtin_convertvector(f_, DV_); \
    })

#define FOLD fold_2
#define TARGET
#define W 2
#define WIDEN(P) WIDEN_GENERIC(P, fv2, dv2)
#include "_fused_stats_body.h"
#undef FOLD
#undef TARGET
#undef W
#undef WIDEN

#if defined(__x86_64__) && defined(__GNUC__)
#define FOLD fold_4
#define TARGET __attribute__((target("avx2")))
#define W 4
#define WIDEN(P) WIDEN_GENERIC(P, fv4, dv4)
#include "_fused_stats_body.h"
#undef FOLD
#undef TARGET
#undef W
#undef WIDEN

/* AVX-512: one vcvtps2pd from memory (GCC's generic conversion splits it in two halves). */
#define FOLD fold_8
#define TARGET __attribute__((target("avx512f")))
#define W 8
#define WIDEN(P) ((dv8)_mm512_cvtps_pd(_mm256_loadu_ps(P)))
#include "_fused_stats_body.h"
#undef FOLD
#undef TARGET
#undef W
#undef WIDEN
#endif

/* The widest kernel this CPU runs (qd_lanes tells which: 8, 4 or 2 doubles per register). */
static fold_fn *chosen(int *lanes) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return *lanes = 8, fold_8;
    if (__builtin_cpu_supports("avx2")) return *lanes = 4, fold_4;
#endif
    return *lanes = 2, fold_2;
}

static fold_fn *kernel;
static int kernel_lanes;

int qd_lanes(void) {
    if (!kernel) kernel = chosen(&kernel_lanes);
    return kernel_lanes;
}

static inline double min_(double a, double b) { return a < b ? a : b; }
static inline double max_(double a, double b) { return a > b ? a : b; }

/* One thread's part folded into out (the layout above): sums added, minima and maxima kept. */
static void merge(double *out, const double *part, int64_t c, int T) {
    for (int64_t i = 0; i < c; i++) {
        out[i] += part[i];
        out[c + i] = min_(out[c + i], part[c + i]);
        out[2 * c + i] = max_(out[2 * c + i], part[2 * c + i]);
    }
    for (int t = 0; t < T; t++) {
        double *to = out + 3 * c + t * (c + 3);
        const double *from = part + 3 * c + t * (c + 3);
        for (int64_t i = 0; i < c + 2; i++) to[i] += from[i]; /* sum e^2 per channel, sum y^2, sum |e| */
        to[c + 2] = max_(to[c + 2], from[c + 2]);
    }
}

/* Below this many values a call runs on one thread: waking the others costs more. */
#define SERIAL_BELOW (1 << 16)

int qd_fold(const float *x, int64_t x_sn, int64_t x_sc, const float *y0, int64_t y0_sn, int64_t y0_sc,
            const float *y1, int64_t y1_sn, int64_t y1_sc, int64_t n, int64_t c, int64_t m, double *out) {
    qd_lanes();
    int threads = 1;
#ifdef _OPENMP
    if (n * c * m >= SERIAL_BELOW) threads = omp_get_max_threads();
#endif
    if (threads <= 1) return kernel(x, x_sn, x_sc, y0, y0_sn, y0_sc, y1, y1_sn, y1_sc, n, c, 0, c, 0, m, out);
    /* Each thread folds its share into a part of its own (whole channels when there are enough
       of them, else a range of columns); the parts are merged in thread order, so the result
       depends on the data and the number of threads only. */
    const int64_t width = 3 * c + (y1 ? 2 : 1) * (c + 3);
    double *parts = malloc(sizeof(double) * (size_t)(width * threads));
    if (!parts) return -1;
    for (int t = 0; t < threads; t++) {  /* what out starts as: sums 0, minima +inf, maxima -inf */
        double *part = parts + t * width;
        for (int64_t i = 0; i < width; i++) part[i] = 0.0;
        for (int64_t i = c; i < 2 * c; i++) part[i] = __builtin_inf(), part[i + c] = -__builtin_inf();
    }
    int used = threads, failed = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), k = omp_get_num_threads();
        if (t == 0) used = k;
        const int by_channel = c >= k;
        const int64_t span = by_channel ? c : m, lo = span * t / k, hi = span * (t + 1) / k;
        int rc = by_channel ? kernel(x, x_sn, x_sc, y0, y0_sn, y0_sc, y1, y1_sn, y1_sc, n, c, lo, hi, 0, m, parts + t * width)
                            : kernel(x, x_sn, x_sc, y0, y0_sn, y0_sc, y1, y1_sn, y1_sc, n, c, 0, c, lo, hi, parts + t * width);
        if (rc) {
#pragma omp atomic write
            failed = 1;
        }
    }
#endif
    if (!failed)
        for (int t = 0; t < used; t++) merge(out, parts + t * width, c, y1 ? 2 : 1);
    free(parts);
    return failed ? -1 : 0;
}

/* How many of p's n values lie below lo or above hi (NaN is neither: not counted; +-Inf is):
 * the values a fake quantizer's clamp changes, counted in one read where torch takes a min/max
 * pass and, when some lie outside, two comparisons and two counts. */
int64_t qd_count_outside(const float *p, int64_t n, float lo, float hi) {
    int64_t count = 0;
#ifdef _OPENMP
#pragma omp parallel for reduction(+ : count) schedule(static) if (n >= SERIAL_BELOW)
#endif
    for (int64_t start = 0; start < n; start += 4096) {
        const int64_t end = start + 4096 < n ? start + 4096 : n;
        /* 4 lanes of 4096 / 4 counts at most: int32 lanes cannot overflow within a chunk. */
        typedef float f4 __attribute__((vector_size(16)));
        typedef int32_t i4 __attribute__((vector_size(16)));
        i4 lanes = {0, 0, 0, 0};
        int64_t i = start, outside = 0;
        for (; i + 16 <= end; i += 16) {
            __builtin_prefetch(p + i + AHEAD);
            for (int k = 0; k < 16; k += 4) {
                f4 v;
                memcpy(&v, p + i + k, sizeof v);
                lanes -= (v < lo) | (v > hi); /* a true comparison is -1 */
            }
        }
        for (; i < end; i++) outside += (p[i] < lo) | (p[i] > hi);
        count += outside + lanes[0] + lanes[1] + lanes[2] + lanes[3];
    }
    return count;
}

/* An importable module, so that qdebug.measure.fused finds this file through the import system. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fused_stats", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__fused_stats(void) { return PyModule_Create(&module); }
