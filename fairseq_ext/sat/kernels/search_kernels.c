/* Two parts of a beam step, for fairseq_ext/sat/search_kernels.py (which builds and loads this file and documents
 * it). Plain C (the log-softmax with the compiler's AVX-512F intrinsics); no Python or PyTorch headers.
 *
 * fx_log_softmax_top: for each row x[0..V) of logits, without writing the V log-probabilities,
 *   m = max_v x[v],  s = log sum_v exp(x[v] - m)          (log-softmax: lp[v] = (x[v] - m) - s)
 *   the B largest lp[v] over v not in {skip0, skip1}, best first (equal values: the smaller v first), and
 *   lp[keep] (the EOS column, which a search scores on its own).
 * A row whose m or s is not finite (a NaN anywhere, +inf, or every x -inf) is reported, not computed: the
 * caller then takes PyTorch's path for the call.
 *
 * fx_enumerated_group: the SAT generator's enumerated group step (below). */
#include <math.h>
#include <stdint.h>

/* fx_log_softmax_top is compiled for AVX-512F (the caller checks the CPU: fx_log_softmax_top_built() says whether
 * this build has it); the group step is plain C for any CPU. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(FX_NO_AVX512)
#include <immintrin.h>
#define FX_AVX512 __attribute__((target("avx512f")))

int fx_log_softmax_top_built(void) { return 1; }

/* exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp): x = n ln2 + r, |r| <= ln2 / 2, exp(x) = 2^n p(r) */
FX_AVX512 static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x); /* exp(-104) is 0 in float32; a NaN x stays NaN */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* insert (v, j) into the B best so far (vals descending, idx), which hold `filled` entries */
FX_AVX512 static inline void insert(float *vals, int64_t *idx, int B, int *filled, float v, int64_t j) {
    int i = *filled < B ? (*filled)++ : B - 1;
    while (i > 0 && vals[i - 1] < v) {
        vals[i] = vals[i - 1];
        idx[i] = idx[i - 1];
        i--;
    }
    vals[i] = v;
    idx[i] = j;
}

/* x: [rows, V] with row stride `stride` (floats); out_vals [rows, B], out_idx [rows, B] (int64), out_keep [rows].
 * Returns the number of rows that were not computed (not finite: see above); their outputs are unspecified. */
FX_AVX512 int fx_log_softmax_top(const float *x, int64_t rows, int64_t V, int64_t stride, int B, int64_t skip0,
                                 int64_t skip1, int64_t keep, float *out_vals, int64_t *out_idx, float *out_keep) {
    int bad = 0;
    const int64_t body = V / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (V - body)) - 1);
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * stride;
        float *vals = out_vals + r * B;
        int64_t *idx = out_idx + r * B;
        int filled = 0;
        /* pass 1: the maximum, and the B largest candidates (a block is looked at only when it holds a value
         * above the B-th so far, or while fewer than B are held) */
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        float floor_ = -INFINITY; /* the B-th value held (-inf while fewer than B) */
        for (int64_t j = 0; j < V; j += 16) {
            __m512 v = j < body ? _mm512_loadu_ps(row + j)
                                : _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, row + j);
            vmax = _mm512_max_ps(vmax, v);
            __mmask16 m = _mm512_cmp_ps_mask(v, _mm512_set1_ps(floor_), _CMP_GT_OQ);
            if (filled < B)
                m = j < body ? (__mmask16)0xFFFF : tail;
            while (m) {
                int l = __builtin_ctz(m);
                m &= m - 1;
                int64_t c = j + l;
                float xv = row[c];
                if (c == skip0 || c == skip1)
                    continue;
                if (filled < B || xv > vals[B - 1]) { /* strict: the earlier column stays ahead of an equal one */
                    insert(vals, idx, B, &filled, xv, c);
                    if (filled == B)
                        floor_ = vals[B - 1];
                }
            }
        }
        float mx = _mm512_reduce_max_ps(vmax);
        /* pass 2: s = log sum exp(x - m) */
        __m512 vm = _mm512_set1_ps(mx), acc = _mm512_setzero_ps();
        for (int64_t j = 0; j < body; j += 16)
            acc = _mm512_add_ps(acc, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + j), vm)));
        if (tail)
            acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(
                                         _mm512_maskz_loadu_ps(tail, row + body), vm))));
        float sum = _mm512_reduce_add_ps(acc);
        float s = logf(sum);
        if (!isfinite(mx) || !isfinite(s) || isnan(row[keep])) {
            bad++;
            continue;
        }
        for (int i = 0; i < filled; i++)
            vals[i] = (vals[i] - mx) - s;
        for (int i = filled; i < B; i++) { /* fewer than B candidate columns */
            vals[i] = -INFINITY;
            idx[i] = filled ? idx[0] : 0;
        }
        out_keep[r] = (row[keep] - mx) - s;
    }
    return bad;
}
#else
int fx_log_softmax_top_built(void) { return 0; }
int fx_log_softmax_top(const float *x, int64_t rows, int64_t V, int64_t stride, int B, int64_t skip0,
                       int64_t skip1, int64_t keep, float *out_vals, int64_t *out_idx, float *out_keep) {
    (void)x, (void)V, (void)stride, (void)B, (void)skip0, (void)skip1, (void)keep, (void)out_vals, (void)out_idx,
        (void)out_keep;
    return (int)rows; /* not built: every row left to the caller */
}
#endif

/* The SAT generator's enumerated group step (fairseq_ext/sat/generator.py, _enumerated_group, which documents the
 * rule and its exactness) for rows = sentence * P + parent, N = n * P rows:
 *   scores [N]: s(h); vals, words [N, K, B]: the B best non-EOS words per position; eos_lp [N, K];
 *   ranks [C, K], lengths [C]: the candidate prefixes as ranks into vals (padded with rank 0);
 * out:
 *   cum [N, C, K]: s(h) + the candidate's first k + 1 words (summed in double, rounded to float per position,
 *     as PyTorch's CPU cumsum does); cwords [N, C, K];
 *   end [N, C]: s(h) + its L words + EOS at position L (L < K; unspecified for L = K);
 *   alive [N, C]: the score of a full-length (L = K) candidate, -inf for the others;
 *   fin [J, n, B]: per position j < J and sentence, the top B of the candidates of length j + 1 over its P
 *     parents (those that end at j with EOS, scored by end, and the prefixes of length j + 1, scored by their
 *     cum), best first (equal scores: parent, then candidate order, as the PyTorch step's slots): parent * C +
 *     candidate for one that ends at j, -1 for a prefix, a -inf score or an empty place. */
void fx_enumerated_group(const float *scores, const float *vals, const int64_t *words, const float *eos_lp,
                         int64_t n, int64_t P, int64_t K, int64_t B, int64_t J, const int64_t *ranks,
                         const int64_t *lengths, int64_t C, float *cum, int64_t *cwords, float *end, float *alive,
                         int64_t *fin) {
    const int64_t N = n * P;
    for (int64_t row = 0; row < N; row++) {
        const float *v = vals + row * K * B;
        const int64_t *w = words + row * K * B;
        for (int64_t c = 0; c < C; c++) {
            const int64_t *r = ranks + c * K, L = lengths[c];
            float *cu = cum + (row * C + c) * K;
            int64_t *cw = cwords + (row * C + c) * K;
            double acc = scores[row];
            for (int64_t k = 0; k < K; k++) {
                acc += v[k * B + r[k]];
                cu[k] = (float)acc;
                cw[k] = w[k * B + r[k]];
            }
            float prefix = L ? cu[L - 1] : scores[row];
            end[row * C + c] = L < K ? prefix + eos_lp[row * K + L] : -INFINITY;
            alive[row * C + c] = L == K ? prefix : -INFINITY;
        }
    }
    float top[64];
    int64_t who[64];
    for (int64_t j = 0; j < J; j++)
        for (int64_t s = 0; s < n; s++) {
            int filled = 0;
            for (int64_t p = 0; p < P; p++) {
                const int64_t row = s * P + p;
                for (int pass = 0; pass < 2; pass++) /* the slots' order: those ending at j, then the prefixes */
                    for (int64_t c = 0; c < C; c++) {
                        if (lengths[c] != j + pass)
                            continue;
                        float score = pass ? cum[(row * C + c) * K + j] : end[row * C + c];
                        if (!(score > -INFINITY) || (filled == B && !(score > top[B - 1])))
                            continue;
                        int i = filled < B ? filled++ : (int)B - 1;
                        while (i > 0 && top[i - 1] < score) {
                            top[i] = top[i - 1];
                            who[i] = who[i - 1];
                            i--;
                        }
                        top[i] = score;
                        who[i] = pass ? -1 : p * C + c;
                    }
            }
            int64_t *f = fin + (j * n + s) * B;
            for (int i = 0; i < B; i++)
                f[i] = i < filled ? who[i] : -1;
        }
}
