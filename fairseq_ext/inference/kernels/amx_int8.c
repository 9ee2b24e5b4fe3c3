/* int8 linear layers on Intel AMX tiles, for fairseq_ext/inference/amx_int8.py (which builds and loads this
 * file and documents it). Plain C with the compiler's AMX and AVX-512 intrinsics; no Python or PyTorch headers.
 *
 *   y[m, n] = sum_k qx[m, k] * qw[n, k] * sx[m] * sw[n] + b[n]
 *
 * qw: int8 weights with one scale per output row (made once, fx_amx_pack lays them out in AMX tiles);
 * qx: each input row quantised on the fly to int8 with its own symmetric scale sx[m] = max|x[m, :]| / 127. */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE_BYTES 1024 /* a B tile: 16 rows (groups of 4 k) x 64 bytes (16 outputs x 4 k) */

static int round_up(int v, int to) { return (v + to - 1) / to * to; }

/* Linux hands out AMX tile state only on request, once per process. 0: granted. */
int fx_amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1; }

/* bytes of the packed weight of an N x K int8 matrix: N padded to 32 (two tiles of outputs per step), K to 64 */
size_t fx_amx_packed_bytes(int N, int K) { return (size_t)round_up(N, 32) * (size_t)round_up(K, 64); }

/* w: int8 [N, K] row-major -> tiles [N/16][K/64][16][64]: tile row r holds, for 16 outputs j, w[j, 4r .. 4r+3] */
void fx_amx_pack(const int8_t *w, int N, int K, int8_t *out) {
    int Np = round_up(N, 32), Kb = round_up(K, 64) / 64;
    for (int nb = 0; nb < Np / 16; nb++)
        for (int kb = 0; kb < Kb; kb++) {
            int8_t *t = out + ((size_t)nb * Kb + kb) * TILE_BYTES;
            for (int r = 0; r < 16; r++)
                for (int j = 0; j < 16; j++)
                    for (int q = 0; q < 4; q++) {
                        int n = nb * 16 + j, k = kb * 64 + r * 4 + q;
                        t[r * 64 + j * 4 + q] = (n < N && k < K) ? w[(size_t)n * K + k] : 0;
                    }
        }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure(int rows) { /* tiles 0, 1: outputs; 2: inputs (rows x 64 int8); 3, 4: weights */
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) {
        c.rows[t] = t >= 3 ? 16 : rows;
        c.colsb[t] = 64;
    }
    _tile_loadconfig(&c);
}

/* rows [0, M) in blocks of mb rows (the tiles are configured for mb; qx has zero rows up to a whole block) */
static void block_rows(const int8_t *qx, int M, int mb, int Kp, const int8_t *wp, const float *sw, const float *bias,
                       int N, const float *sx, float *out, int ldo) {
    int Kb = Kp / 64, Np = round_up(N, 32);
    int32_t acc[2][16 * 16] __attribute__((aligned(64)));
    for (int n0 = 0; n0 < Np; n0 += 32) {
        const int8_t *B0 = wp + (size_t)(n0 / 16) * Kb * TILE_BYTES, *B1 = B0 + (size_t)Kb * TILE_BYTES;
        int cnt[2] = {N - n0 < 16 ? N - n0 : 16, N - n0 - 16 < 16 ? N - n0 - 16 : 16};
        for (int m0 = 0; m0 < M; m0 += mb) {
            int rows = M - m0 < mb ? M - m0 : mb;
            const int8_t *A = qx + (size_t)m0 * Kp;
            _tile_zero(0);
            _tile_zero(1);
            for (int kb = 0; kb < Kb; kb++) {
                _tile_loadd(2, A + kb * 64, Kp);
                _tile_loadd(3, B0 + kb * TILE_BYTES, 64);
                _tile_loadd(4, B1 + kb * TILE_BYTES, 64);
                _tile_dpbssd(0, 2, 3);
                _tile_dpbssd(1, 2, 4);
            }
            _tile_stored(0, acc[0], 64);
            _tile_stored(1, acc[1], 64);
            for (int h = 0; h < 2 && cnt[h] > 0; h++) { /* y = acc * (sx * sw) + b, 16 outputs at a time */
                int n = n0 + 16 * h;
                __mmask16 msk = cnt[h] == 16 ? 0xFFFF : (__mmask16)((1u << cnt[h]) - 1);
                __m512 w = _mm512_maskz_loadu_ps(msk, sw + n);
                __m512 b = bias ? _mm512_maskz_loadu_ps(msk, bias + n) : _mm512_setzero_ps();
                for (int m = 0; m < rows; m++) {
                    __m512 c = _mm512_cvtepi32_ps(_mm512_load_si512(acc[h] + 16 * m));
                    __m512 y = _mm512_fmadd_ps(c, _mm512_mul_ps(w, _mm512_set1_ps(sx[m0 + m])), b);
                    _mm512_mask_storeu_ps(out + (size_t)(m0 + m) * ldo + n, msk, y);
                }
            }
        }
    }
}

static __thread int8_t *qbuf; /* the quantised inputs, [M, Kp], grown as needed */
static __thread size_t qcap;

/* x: float32 [M, K] row-major; wp: fx_amx_pack's layout; sw, bias (or NULL): [N]; out: float32 [M, N] with rows
 * ldo apart (a slice of N outputs, from a multiple of 32, is wp + n0 * Kp, sw + n0, bias + n0, out + n0).
 * Returns 0, or -1 when the input buffer cannot be allocated. */
static int linear(const float *x, int M, int K, const int8_t *wp, const float *sw, const float *bias, int N,
                  float *out, int ldo) {
    if (M <= 0) return 0;
    int Kp = round_up(K, 64), blocks = (M + 15) / 16, mb = (M + blocks - 1) / blocks, Mp = blocks * mb;
    size_t need = (size_t)Mp * Kp + (size_t)M * sizeof(float);
    if (need > qcap) {
        free(qbuf);
        qbuf = aligned_alloc(64, (need + 63) / 64 * 64);
        qcap = qbuf ? need : 0;
        if (!qbuf) return -1;
    }
    float *sx = (float *)(qbuf + (size_t)Mp * Kp);
    memset(qbuf + (size_t)M * Kp, 0, (size_t)(Mp - M) * Kp);
    for (int m = 0; m < M; m++) { /* qx[m] = round(x[m] * 127 / max|x[m]|), half to even */
        const float *r = x + (size_t)m * K;
        int8_t *q = qbuf + (size_t)m * Kp;
        __m512 amax = _mm512_setzero_ps(), nan = _mm512_setzero_ps(), zero = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16) {
            __mmask16 msk = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(msk, r + k);
            amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
            nan = _mm512_add_ps(nan, _mm512_mul_ps(v, zero)); /* NaN once a NaN or inf was seen */
        }
        float a = _mm512_reduce_max_ps(amax);
        int finite = _mm512_reduce_add_ps(nan) == 0.0f; /* a max does not pass NaN on: it reaches the output */
        float inv = (a > 0 && finite) ? 127.0f / a : 0.0f;
        sx[m] = !finite ? NAN : (a > 0 ? a / 127.0f : 0.0f);
        __m512 vinv = _mm512_set1_ps(inv);
        for (int k = 0; k < K; k += 16) {
            __mmask16 msk = K - k >= 16 ? 0xFFFF : (__mmask16)((1u << (K - k)) - 1);
            __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(msk, r + k), vinv);
            __m512i i = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(q + k), _mm512_cvtsepi32_epi8(i));
        }
        memset(q + round_up(K, 16), 0, (size_t)(Kp - round_up(K, 16)));
    }
    /* blocks of mb <= 16 rows, as equal as they can be (24 rows: 2 x 12), the last one padded with zero rows;
     * per block of 32 outputs every row block in turn, so that each weight tile is read once per call */
    configure(mb);
    block_rows(qbuf, M, mb, Kp, wp, sw, bias, N, sx, out, ldo);
    _tile_release();
    return 0;
}

typedef struct {
    const float *x, *sw, *bias;
    const int8_t *wp;
    float *out;
    int M, K, N, ldo, rc;
} slice_args;

static void *run_slice(void *p) {
    slice_args *a = p;
    a->rc = linear(a->x, a->M, a->K, a->wp, a->sw, a->bias, a->N, a->out, a->ldo);
    return NULL;
}

/* a thread started for one call: its input buffer (thread-local) would be lost when it exits, so it is freed */
static void *run_spawned(void *p) {
    run_slice(p);
    free(qbuf);
    qbuf = NULL;
    qcap = 0;
    return NULL;
}

/* linear() with the outputs split over `threads` threads (the caller's and threads - 1 new ones), in slices of
 * whole 32-output blocks; each thread quantises the inputs itself. Returns 0, or -1 (no memory). */
int fx_amx_linear(const float *x, int M, int K, const int8_t *wp, const float *sw, const float *bias, int N,
                  float *out, int threads) {
    int blocks = round_up(N, 32) / 32, Kp = round_up(K, 64);
    if (threads > blocks) threads = blocks;
    if (threads > 64) threads = 64;
    if (threads <= 1) return linear(x, M, K, wp, sw, bias, N, out, N);
    slice_args args[64];
    pthread_t tid[64];
    int started[64] = {0};
    for (int t = 0; t < threads; t++) {
        int n0 = blocks * t / threads * 32, n1 = blocks * (t + 1) / threads * 32;
        if (n1 > N) n1 = N;
        args[t] = (slice_args){x, sw + n0, bias ? bias + n0 : NULL, wp + (size_t)n0 * Kp, out + n0, M, K, n1 - n0, N, 0};
        if (t > 0) started[t] = pthread_create(&tid[t], NULL, run_spawned, &args[t]) == 0;
    }
    for (int t = 1; t < threads; t++)
        if (!started[t]) run_slice(&args[t]); /* no new thread: this one does it */
    run_slice(&args[0]);
    int rc = args[0].rc;
    for (int t = 1; t < threads; t++) {
        if (started[t]) pthread_join(tid[t], NULL);
        rc |= args[t].rc;
    }
    return rc;
}
