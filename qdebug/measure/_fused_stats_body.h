/* The kernel of _fused_stats.c for one vector width, included once per instruction set with
 *     FOLD    the function's name
 *     TARGET  its instruction set, as a GCC target attribute (empty: the compiler's default)
 *     W       doubles per vector register of that set (8 AVX-512, 4 AVX2, 2 SSE2)
 *     WIDEN   W floats at a pointer, widened to a vector of W doubles
 * See _fused_stats.c for what it computes.
 */

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define DV CAT(dv, W)
#define FV CAT(fv, W)
#define LV CAT(lv, W)
#define ACC CAT(acc, W)

typedef double DV __attribute__((vector_size(W * sizeof(double))));
typedef float FV __attribute__((vector_size(W * sizeof(float))));
typedef int64_t LV __attribute__((vector_size(W * sizeof(int64_t))));

/* W values of x at P into xd, folded into xx, lo, hi. */
#define FOLD_X(P)                                               \
    do {                                                        \
        xd = WIDEN(P);                                          \
        LV below = xd < lo, above = xd > hi;                    \
        xx += xd * xd;                                          \
        lo = (DV)(((LV)xd & below) | ((LV)lo & ~below));        \
        hi = (DV)(((LV)xd & above) | ((LV)hi & ~above));        \
    } while (0)

/* W values of one y at P, against xd, folded into its sums EE, YY, AE and maximum MX. */
#define FOLD_Y(P, EE, YY, AE, MX)                               \
    do {                                                        \
        DV yd = WIDEN(P), e = yd - xd;                          \
        DV ab = (DV)((LV)e & INT64_MAX);                        \
        LV bigger = ab > MX;                                    \
        EE += e * e;                                            \
        YY += yd * yd;                                          \
        AE += ab;                                               \
        MX = (DV)(((LV)ab & bigger) | ((LV)MX & ~bigger));      \
    } while (0)

/* A channel's running sums: W lanes, plus scalars for the last m % W values of its rows. */
typedef struct {
    DV xx, lo, hi, ee[2], yy[2], ae[2], mx[2];
    double xx_, lo_, hi_, ee_[2], yy_[2], ae_[2], mx_[2];
} CAT(acc, W);

TARGET static int FOLD(const float *x, int64_t x_sn, int64_t x_sc, const float *y0, int64_t y0_sn, int64_t y0_sc,
                       const float *y1, int64_t y1_sn, int64_t y1_sc, int64_t n, int64_t c, int64_t ch0,
                       int64_t ch1, int64_t col0, int64_t col1, double *out) {
    const int T = y1 ? 2 : 1;
    const float *ys[2] = {y0, y1};
    const int64_t y_sn[2] = {y0_sn, y1_sn}, y_sc[2] = {y0_sc, y1_sc};
    const DV zero = {0}, inf = zero + __builtin_inf();
    /* Sample by sample, each sample's channels in memory order: one forward sweep of memory,
       which the hardware prefetches (walking one channel through all samples jumps between
       2n short streams, and ran 3-4 times slower on maps that are not in cache).  The
       channels' sums wait in acc between samples. */
    ACC *acc = aligned_alloc(sizeof(DV), sizeof(ACC) * (size_t)(ch1 - ch0));
    if (!acc) return -1;
    for (int64_t ch = ch0; ch < ch1; ch++) {
        ACC *a = acc + (ch - ch0);
        a->xx = zero, a->lo = inf, a->hi = -inf;
        a->xx_ = 0.0, a->lo_ = __builtin_inf(), a->hi_ = -__builtin_inf();
        for (int t = 0; t < 2; t++) {
            a->ee[t] = a->yy[t] = a->ae[t] = a->mx[t] = zero;
            a->ee_[t] = a->yy_[t] = a->ae_[t] = a->mx_[t] = 0.0;
        }
    }
    for (int64_t i = 0; i < n; i++) {
        for (int64_t ch = ch0; ch < ch1; ch++) {
            ACC *a = acc + (ch - ch0);
            const float *xr = x + i * x_sn + ch * x_sc;
            const float *yr[2] = {ys[0] + i * y_sn[0] + ch * y_sc[0], T == 2 ? ys[1] + i * y_sn[1] + ch * y_sc[1] : NULL};
            int64_t j = col0;
            if (col1 - col0 >= W) { /* (a row shorter than W goes to the scalar sums alone) */
                /* Named variables, one loop per count of outputs: every sum stays in a register. */
                DV xx = a->xx, lo = a->lo, hi = a->hi;
                DV ee0 = a->ee[0], yy0 = a->yy[0], ae0 = a->ae[0], mx0 = a->mx[0];
                DV ee1 = a->ee[1], yy1 = a->yy[1], ae1 = a->ae[1], mx1 = a->mx[1];
                if (T == 1) {
                    for (; j + W <= col1; j += W) {
                        DV xd;
                        __builtin_prefetch(xr + j + AHEAD);
                        __builtin_prefetch(yr[0] + j + AHEAD);
                        FOLD_X(xr + j);
                        FOLD_Y(yr[0] + j, ee0, yy0, ae0, mx0);
                    }
                } else {
                    for (; j + W <= col1; j += W) {
                        DV xd;
                        __builtin_prefetch(xr + j + AHEAD);
                        __builtin_prefetch(yr[0] + j + AHEAD);
                        __builtin_prefetch(yr[1] + j + AHEAD);
                        FOLD_X(xr + j);
                        FOLD_Y(yr[0] + j, ee0, yy0, ae0, mx0);
                        FOLD_Y(yr[1] + j, ee1, yy1, ae1, mx1);
                    }
                }
                a->xx = xx, a->lo = lo, a->hi = hi;
                a->ee[0] = ee0, a->yy[0] = yy0, a->ae[0] = ae0, a->mx[0] = mx0;
                a->ee[1] = ee1, a->yy[1] = yy1, a->ae[1] = ae1, a->mx[1] = mx1;
            }
            for (; j < col1; j++) {
                double xv = xr[j];
                a->xx_ += xv * xv;
                a->lo_ = xv < a->lo_ ? xv : a->lo_;
                a->hi_ = xv > a->hi_ ? xv : a->hi_;
                for (int t = 0; t < T; t++) {
                    double yv = yr[t][j], e = yv - xv, ab = e < 0 ? -e : e;
                    a->ee_[t] += e * e;
                    a->yy_[t] += yv * yv;
                    a->ae_[t] += ab;
                    a->mx_[t] = ab > a->mx_[t] ? ab : a->mx_[t];
                }
            }
        }
    }
    /* Each channel's lanes in lane order, then its tail. */
    for (int64_t ch = ch0; ch < ch1; ch++) {
        const ACC *a = acc + (ch - ch0);
        double lo = a->lo_, hi = a->hi_;
        for (int k = 0; k < W; k++) {
            lo = a->lo[k] < lo ? a->lo[k] : lo;
            hi = a->hi[k] > hi ? a->hi[k] : hi;
        }
        out[ch] += lane_sum(a->xx, W) + a->xx_;
        out[c + ch] = lo < out[c + ch] ? lo : out[c + ch];
        out[2 * c + ch] = hi > out[2 * c + ch] ? hi : out[2 * c + ch];
        for (int t = 0; t < T; t++) {
            double *part = out + 3 * c + t * (c + 3), biggest = a->mx_[t];
            for (int k = 0; k < W; k++) biggest = a->mx[t][k] > biggest ? a->mx[t][k] : biggest;
            part[ch] += lane_sum(a->ee[t], W) + a->ee_[t];
            part[c] += lane_sum(a->yy[t], W) + a->yy_[t];
            part[c + 1] += lane_sum(a->ae[t], W) + a->ae_[t];
            part[c + 2] = biggest > part[c + 2] ? biggest : part[c + 2];
        }
    }
    free(acc);
    return 0;
}

#undef FOLD_X
#undef FOLD_Y
#undef DV
#undef FV
#undef LV
#undef ACC
#undef CAT
#undef CAT_
