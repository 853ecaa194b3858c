/* fencepost's native CPU kernels: integer matrix products and a whole decode step.
 *
 * A matrix is one of seven kinds (KIND_*), each holding a GGUF block type's numbers as
 * they were shipped, or fencepost's own 4- and 8-bit groups (which are Q4_1 and Q8_0
 * blocks): every kind computes W = q * scale + minimum per group of 32 inputs (16 for
 * Q6_K), with the scales formed in fp32 exactly as gguf's dequantisation forms them.
 * Each integer product first turns its fp32 activations into integers per group of 32
 * (one scale a group): 16-bit values held as two signed bytes (w4a16), or one signed
 * byte (w4a8, half the integer work); the caller picks per model (Model.act_bytes) or
 * per call, and quantize() says what each costs. It multiplies integers exactly (VNNI's
 * vpdpbusd, or AVX2's vpmaddubsw + vpmaddwd, once per byte), then scales each group's
 * integer sum in fp32. Every kernel exists for both widths (the width a constant of
 * it, so the one-byte kernels carry no test or load for a second byte). F16 and BF16
 * matrices multiply fp32 activations by their exactly widened values, one input at a time.
 *
 * Layout: outputs are packed in tiles of TILE rows (16 with AVX-512, 8 with AVX2),
 * four inputs of each row side by side, so one vector register holds TILE rows x 4
 * inputs and each 32-bit lane of the integer product is one output row: no
 * horizontal sums anywhere, and every output is computed by the same sequence of
 * operations whatever the number of activation rows, the tile it sits in, or the
 * instruction set. A row's result is therefore the same alone or in any batch,
 * and the same on AVX2 and AVX-512 machines.
 *
 * Per tile, for each group of 32 inputs (and for the K kinds, a header before each
 * super-block of 8 groups, HEADER*TILE bytes: TILE fp16 d, TILE fp16 dmin, then per group
 * TILE scales and (Q4_K, Q5_K) TILE minimums, or (Q6_K) per half group TILE scales):
 * - KIND_Q4 (Q4_0, Q4_1, fencepost's 4-bit): four sub-blocks of TILE*4 bytes (sub-block
 *   b covers inputs 8b..8b+7: byte 4*o + j holds input 8b+j of row o in its low nibble
 *   and input 8b+4+j in its high nibble), TILE fp16 scales, TILE fp16 minimums: 20*TILE
 *   bytes for 32*TILE weights.
 * - KIND_Q8 (Q8_0): eight sub-blocks of TILE*4 signed bytes (inputs 4b..4b+3), TILE
 *   fp16 scales: 34*TILE bytes.
 * - KIND_Q4K (Q4_K): the four nibble sub-blocks as KIND_Q4 (16*TILE bytes); the
 *   header's 6-bit sc and m as bytes: W = (d * sc) * q - dmin * m. 4.625 bits a weight.
 * - KIND_Q5K (Q5_K): the nibbles, then a plane of fifth bits (TILE*4 bytes: bit 2b + h
 *   of byte 4*o + j for input 8b + 4h + j), scales as Q4_K's. 5.625 bits a weight.
 * - KIND_Q6K (Q6_K): the nibbles, then two planes of the two high bits (plane v for
 *   inputs 16v..16v+15: bits 2(2s + h) of byte 4*o + j for input 16v + 8s + 4h + j);
 *   W = (d * sc) * (q - 32) with the signed scale of each half group. 6.625 bits.
 * - KIND_F16, KIND_BF16: for each input of the group, TILE 16-bit values: 64*TILE bytes.
 * Every K-kind group is a whole number of cache lines (with 288-byte groups, half their
 * loads across two lines, Q4_K ran 1.5x slower at 16 rows).
 * A matrix may continue into another (`next`, of any kind, with the same inputs): one
 * product computes both, the second's outputs after the first's (q, k and v of a layer
 * are three GGUF tensors, each of its own type). `scale` multiplies a matrix's outputs
 * (the attention scale on q, a family's residual or logit multiplier): 1 is none.
 *
 * Compiled by adapters/engine/native.py at first use for the instruction set the
 * CPU reports (FP_AVX512 or FP_AVX2), with -ffp-contract=off so that the compiler
 * fuses nothing on its own; the elementwise code sums in a fixed order of 16
 * partial sums, whatever the vector width, and attention's vector code works lane
 * by lane (one position or one dimension a lane), so its results do not depend on
 * the width either. The KV cache is fp16, converted exactly by F16C both ways.
 */
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(FP_AVX512)
#define TILE 16
#define FP_ISA "avx512-vnni"
#elif defined(FP_AVX2)
#define TILE 8
#define FP_ISA "avx2"
#else
#error "define FP_AVX512 or FP_AVX2"
#endif

#define GROUP 32
/* A K kind's super-block header, in units of TILE bytes: d, dmin, then the eight groups'
 * scales and minimums (Q6_K: sixteen half-group scales), so that every group's quants
 * are whole cache lines. */
#define HEADER 20
/* Weights stream through each product once a step; asking for the bytes 8 KiB ahead
 * of the loads made a one-row step 10% faster here (2 and 4 KiB: no gain; 16 and 32
 * KiB: less). A prefetch past the end of a matrix is harmless: it never faults. */
#define PREFETCH 8192
/* Ask for every cache line of the n bytes at p, PREFETCH ahead. */
#define PREFETCH_SPAN(p, n)                                                                \
    for (int off_ = 0; off_ < (n); off_ += 64) _mm_prefetch((const char *)(p) + PREFETCH + off_, _MM_HINT_T0)

enum { KIND_Q4, KIND_Q8, KIND_Q4K, KIND_Q5K, KIND_Q6K, KIND_F16, KIND_BF16 };

typedef struct Mat {
    int32_t out, in, groups, tiles, kind;
    const uint8_t *data;
    float scale;            /* every output times this; 1: none */
    const struct Mat *next; /* more output rows over the same inputs; NULL: none */
} Mat;

/* Bytes of one tile: per group, and per super-block header (the K kinds). */
static size_t tile_bytes(const Mat *m) {
    static const int per_group[] = {20, 34, 16, 20, 24, 64, 64};
    int k = m->kind;
    size_t bytes = (size_t)m->groups * per_group[k] * TILE;
    if (k == KIND_Q4K || k == KIND_Q5K || k == KIND_Q6K) bytes += (size_t)(m->groups / 8) * HEADER * TILE;
    return bytes;
}

typedef struct { /* activations quantized per group of 32, in one or two 8-bit parts */
    int32_t rows, in, groups;
    int32_t bytes;  /* 2: c and c2 (16-bit values); 1: c alone (c2 unused, NULL) */
    const float *x; /* [rows][in] the fp32 activations themselves (F16 and BF16) */
    int8_t *c;      /* [rows][in] high part: round(x / d), d = max |x| / 127 */
    int8_t *c2;     /* [rows][in] low part: round((x - c * d) * 128 / d), within +-64 */
    float *d;       /* [rows][groups] the step of a value: d / 128 of the 16-bit value
                     * 128 * c + c2 (two bytes), d itself of c (one byte) */
    float *dsum;    /* [rows][groups] that step times the sum of the values */
    int32_t *csum;  /* [rows][groups] sum of the values (16-bit, or c alone) */
    int32_t *csum16; /* [rows][2 groups] the same over each half group (Q6_K) */
} Act;

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, inter, vocab, layers;
    int32_t block_size, slots, max_context;
    float eps;
    const float *embed;      /* [vocab][hidden], or NULL: rows unpacked from embed_mat */
    const Mat *embed_mat;    /* the table as a packed matrix (as shipped) */
    const float *final_norm; /* [hidden] */
    const Mat *head;
    /* Per layer: [layers] pointers, NULL where the layer has no such tensor (the
     * families differ in which norms, biases and rotary each layer has: spec.py). */
    const float *const *input_norm;     /* [hidden], before attention */
    const float *const *post_norm;      /* [hidden], before the MLP */
    const Mat *qkv, *o, *gate_up, *down; /* [layers] */
    uint16_t *k_cache, *v_cache; /* fp16 [layers][kv_heads][slots][head_dim] (keys: per
                                  * block [head_dim][block_size], see attend_head) */
    const float *const *cos, *const *sin; /* [max_context][rot_dim]; NULL: no rotary */
    const float *const *qkv_bias;       /* [q_size + 2 kv_size] */
    const float *const *o_bias;         /* [hidden] */
    const float *const *gate_up_bias;   /* [2 inter] */
    const float *const *down_bias;      /* [hidden] */
    const float *const *q_norm, *const *k_norm; /* [head_dim] (per head) or the width */
    const float *const *attn_out_norm;  /* [hidden], on attention's output (Gemma, OLMo 2) */
    const float *const *mlp_out_norm;   /* [hidden], on the MLP's output */
    const int32_t *window;              /* [layers]: positions a query sees; 0: all */
    const float *softcap;               /* [layers]: scores -> tanh(s / c) * c; 0: none */
    int32_t rot_dim;                    /* rotated dimensions of each head (even) */
    int32_t qk_norm_width;              /* 1: q and k normalised whole, 0: per head */
    int32_t gelu;                       /* 1: tanh-GELU gate, 0: SiLU */
    float final_softcap;                /* logits -> tanh(l / c) * c; 0: none */
    /* Mixtures of experts (spec.Experts), per layer: experts[l] 0 is a dense MLP. */
    const int32_t *experts;             /* [layers] how many experts; 0: none */
    const int32_t *has_mlp;             /* [layers] 1: gate_up/down run (an MLP or a
                                         * shared expert), 0: only experts */
    int32_t top_k, expert_inter, renormalise;
    const float *const *router;         /* [experts][hidden] fp32 */
    const Mat *const *expert_gate_up;   /* [experts] */
    const Mat *const *expert_down;      /* [experts] */
    const float *const *shared_gate;    /* [hidden]: sigmoid gate of the shared expert */
    int32_t act_bytes;                  /* activation bytes of every product: 1 or 2 */
} Model;

const char *fp_isa(void) { return FP_ISA; }
int32_t fp_tile(void) { return TILE; }

/* ---- threads ----------------------------------------------------------------------
 * A call may use several threads: the caller and helpers started at first need. Work
 * is split so that each output is still computed whole by one thread, in the same
 * order (products: by tiles; attention: by row and key/value head), so results do
 * not depend on the thread count. Between jobs a helper spins a little (a step's
 * jobs come tens of microseconds apart), then sleeps on a condition variable. One
 * caller at a time: a second concurrent call runs on its own thread alone. */

#define MAX_THREADS 64
#define SPIN 20000

typedef void (*part_fn)(void *ctx, int part, int parts);

static struct {
    pthread_mutex_t use; /* held by a caller for its whole call */
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int helpers;
    atomic_int generation; /* bumped for each job */
    atomic_int pending;    /* helpers yet to finish the current job */
    part_fn fn;
    void *ctx;
    int parts;
} pool = {.use = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

/* A forked child has none of the parent's helpers: it starts its own when it needs them. */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.use, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pool.helpers = 0;
}

static void pool_register(void) { pthread_atfork(NULL, NULL, pool_after_fork); }

typedef struct {
    int index, seen;
} HelperStart;

static void *helper_main(void *arg) {
    HelperStart start = *(HelperStart *)arg;
    free(arg);
    int seen = start.seen;
    for (;;) {
        int spins = 0;
        while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen) {
            if (++spins < SPIN) {
                _mm_pause();
                continue;
            }
            pthread_mutex_lock(&pool.mu);
            while (atomic_load_explicit(&pool.generation, memory_order_acquire) == seen)
                pthread_cond_wait(&pool.wake, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen++;
        if (start.index < pool.parts) pool.fn(pool.ctx, start.index, pool.parts);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_acq_rel);
    }
    return NULL;
}

/* Take the pool for a call wanting `threads` threads -> how many it may use (1: run
 * alone; the pool is then not held). */
static int pool_take(int threads) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1) return 1;
    pthread_once(&pool_once, pool_register);
    if (pthread_mutex_trylock(&pool.use) != 0) return 1;
    while (pool.helpers < threads - 1) {
        HelperStart *start = malloc(sizeof *start);
        pthread_t thread;
        if (!start) break;
        start->index = pool.helpers + 1;
        start->seen = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, helper_main, start) != 0) {
            free(start);
            break;
        }
        pthread_detach(thread);
        pool.helpers++;
    }
    int usable = pool.helpers + 1 < threads ? pool.helpers + 1 : threads;
    if (usable <= 1) pthread_mutex_unlock(&pool.use);
    return usable;
}

static void pool_give(int threads) {
    if (threads > 1) pthread_mutex_unlock(&pool.use);
}

/* fn(ctx, part, parts) for every part, part 0 on the caller; returns when all are done. */
static void run_parts(part_fn fn, void *ctx, int parts) {
    if (parts <= 1) {
        fn(ctx, 0, 1);
        return;
    }
    pool.fn = fn;
    pool.ctx = ctx;
    pool.parts = parts;
    atomic_store_explicit(&pool.pending, pool.helpers, memory_order_relaxed);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.generation, 1, memory_order_release);
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, 0, parts);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0) _mm_pause();
}

/* ---- activation quantization ---------------------------------------------------- */

/* Each group of 32 becomes 16-bit integers v = 128 * c + c2 with one fp32 scale: the
 * high byte c is x rounded at d = max |x| / 127, the low byte c2 the remainder rounded
 * at d / 128; or, with one byte, c alone at step d. One byte errs up to half a step of
 * the group's largest value (about 0.4% of it) on each input; the two parts keep ~15
 * bits. Both keep the integer products exact (two 8-bit products summed as 128 * hi +
 * lo in 32 bits, or one), and a row's bytes never depend on the other rows; the weight
 * format's quality gate judges whether one byte is good enough for a model. */
/* Round to the nearest integer, ties to even, for |v| < 2^22: adding and taking away
 * 1.5 * 2^23 leaves no fraction bits (vectorizes; nearbyintf may not). */
static inline float round_even(float v) { return (v + 12582912.0f) - 12582912.0f; }

/* Rows r0..r1 of x into a (whose shape quantize has set), in a->bytes parts. With one
 * part the value is c alone, at step d: llama.cpp's Q8 activations, but per group of
 * 32 rather than of 256, and the same rounding for a row alone or in any batch. */
static void quantize_rows(const float *x, int in, Act *a, int r0, int r1) {
    int groups = in / GROUP, two = a->bytes == 2;
    for (int r = r0; r < r1; r++) {
        const float *xr = x + (size_t)r * in;
        int8_t *cr = a->c + (size_t)r * in, *lr = two ? a->c2 + (size_t)r * in : NULL;
        for (int g = 0; g < groups; g++) {
            const float *xg = xr + g * GROUP;
            float part[16];
            for (int j = 0; j < 16; j++) {
                float u = fabsf(xg[j]), v = fabsf(xg[j + 16]);
                part[j] = u > v ? u : v;
            }
            for (int w = 8; w >= 1; w /= 2)
                for (int j = 0; j < w; j++) part[j] = part[j] > part[j + w] ? part[j] : part[j + w];
            float d = part[0] / 127.0f;
            float inv = d > 0.0f ? 1.0f / d : 0.0f;
            int32_t hi[GROUP], lo[GROUP];
            if (two)
                for (int i = 0; i < GROUP; i++) {
                    float h = round_even(xg[i] * inv); /* within +-127: |x| <= max |x| */
                    float l = round_even((xg[i] - h * d) * inv * 128.0f);
                    l = l > 127.0f ? 127.0f : (l < -127.0f ? -127.0f : l);
                    hi[i] = (int32_t)h;
                    lo[i] = (int32_t)l;
                }
            else /* one byte: the same high part, and no low part at all */
                for (int i = 0; i < GROUP; i++) hi[i] = (int32_t)round_even(xg[i] * inv);
            int32_t sum = 0, half = 0;
            for (int i = 0; i < GROUP; i++) {
                cr[g * GROUP + i] = (int8_t)hi[i];
                if (two) lr[g * GROUP + i] = (int8_t)lo[i];
                sum += two ? 128 * hi[i] + lo[i] : hi[i];
                if (i == 15) half = sum;
            }
            a->csum16[(r * groups + g) * 2] = half;
            a->csum16[(r * groups + g) * 2 + 1] = sum - half;
            float step = two ? d / 128.0f : d;
            a->d[r * groups + g] = step;
            a->csum[r * groups + g] = sum;
            a->dsum[r * groups + g] = step * (float)sum;
        }
    }
}

typedef struct {
    const float *x;
    int rows, in;
    Act *a;
} QuantizeJob;

static void quantize_part(void *ctx, int part, int parts) {
    const QuantizeJob *job = ctx;
    quantize_rows(job->x, job->in, job->a, job->rows * part / parts,
                  job->rows * (part + 1) / parts);
}

/* x [rows][in] into a, rows shared between up to `threads` threads (each row on its
 * own: the same bits however they are shared). */
static void quantize(const float *x, int rows, int in, Act *a, int threads) {
    a->rows = rows;
    a->in = in;
    a->groups = in / GROUP;
    a->x = x;
    QuantizeJob job = {x, rows, in, a};
    run_parts(quantize_part, &job, threads < rows ? threads : rows);
}

/* ---- products: y[r][o] = sum over inputs of W[o][i] * dequantized x[r][i] -------- */

#if defined(FP_AVX512)
typedef __m512 vf;
typedef __m512i vi;
#define VF_ZERO() _mm512_setzero_ps()
#define VI_ZERO() _mm512_setzero_si512()
#define VI_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define VI_AND(a, b) _mm512_and_si512(a, b)
#define VI_SHR4(a) _mm512_srli_epi16(a, 4)
#define VI_SET1B(v) _mm512_set1_epi8(v)
#define VI_BCAST32(p) _mm512_set1_epi32(*(const int32_t *)(p))
#define VI_SET1(v) _mm512_set1_epi32(v)
#define VI_SUB(a, b) _mm512_sub_epi32(a, b)
#define VI_ADD(a, b) _mm512_add_epi32(a, b)
#define VI_OR(a, b) _mm512_or_si512(a, b)
#define VI_SHL16(a, k) _mm512_slli_epi16(a, k)
#define VI_SHR16(a, k) _mm512_srli_epi16(a, k)
#define VI_JOIN(hi, lo) _mm512_add_epi32(_mm512_slli_epi32(hi, 7), lo) /* 128 * hi + lo */
#define VF_SET1(v) _mm512_set1_ps(v)
#define VF_CVT(a) _mm512_cvtepi32_ps(a)
#define VF_MUL(a, b) _mm512_mul_ps(a, b)
#define VF_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VF_HALF(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#define VF_LOAD(p) _mm512_loadu_ps(p)
#define VF_STORE(p, v) _mm512_storeu_ps(p, v)
#define VF_ADD(a, b) _mm512_add_ps(a, b)
/* u8 x s8, four products summed per 32-bit lane, added to acc; U4_TO_32 turns a
 * group's sums into 32-bit lanes (here they already are) */
#define DOT_U4(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#define U4_TO_32(acc) (acc)
/* signed 8-bit weights: shifted to unsigned once per load (w + 128), and the extra
 * 128 * sum(x) taken off per group (S8_BIASED) */
#define PREP_S8(w) _mm512_xor_si512(w, VI_SET1B((char)0x80))
#define DOT_S8(acc, u, w, x) _mm512_dpbusd_epi32(acc, u, x)
#define S8_BIASED 1
static inline void vf_store(float *y, vf v, int n) {
    if (n == TILE)
        _mm512_storeu_ps(y, v);
    else
        _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1u), v);
}
#else
typedef __m256 vf;
typedef __m256i vi;
#define VF_ZERO() _mm256_setzero_ps()
#define VI_ZERO() _mm256_setzero_si256()
#define VI_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define VI_AND(a, b) _mm256_and_si256(a, b)
#define VI_SHR4(a) _mm256_srli_epi16(a, 4)
#define VI_SET1B(v) _mm256_set1_epi8(v)
#define VI_BCAST32(p) _mm256_set1_epi32(*(const int32_t *)(p))
#define VI_SET1(v) _mm256_set1_epi32(v)
#define VI_SUB(a, b) _mm256_sub_epi32(a, b)
#define VI_ADD(a, b) _mm256_add_epi32(a, b)
#define VI_OR(a, b) _mm256_or_si256(a, b)
#define VI_SHL16(a, k) _mm256_slli_epi16(a, k)
#define VI_SHR16(a, k) _mm256_srli_epi16(a, k)
#define VI_JOIN(hi, lo) _mm256_add_epi32(_mm256_slli_epi32(hi, 7), lo)
#define VF_SET1(v) _mm256_set1_ps(v)
#define VF_CVT(a) _mm256_cvtepi32_ps(a)
#define VF_MUL(a, b) _mm256_mul_ps(a, b)
#define VF_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VF_HALF(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define VF_LOAD(p) _mm256_loadu_ps(p)
#define VF_STORE(p, v) _mm256_storeu_ps(p, v)
#define VF_ADD(a, b) _mm256_add_ps(a, b)
/* u8 x s8: pairs summed in 16-bit lanes (at most 2 * 15 * 127 a pair, so a group's
 * eight pairs stay within 30,480, no saturation), widened to 32 bits once a group */
#define DOT_U4(acc, w, x) _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))
#define U4_TO_32(acc) _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
/* s8 x s8 as |w| times x with w's sign: at most 2 * 128 * 127, within 16 bits */
#define PREP_S8(w) _mm256_sign_epi8(w, w)
#define DOT_S8(acc, u, w, x)                                                               \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(x, w)), \
                                            _mm256_set1_epi16(1)))
#define S8_BIASED 0
static inline void vf_store(float *y, vf v, int n) {
    if (n == TILE) {
        _mm256_storeu_ps(y, v);
    } else {
        float tmp[TILE];
        _mm256_storeu_ps(tmp, v);
        memcpy(y, tmp, (size_t)n * sizeof(float));
    }
}
#endif

/* TILE bytes of a row vector as fp32: unsigned, signed, or bfloat16 values. */
#if defined(FP_AVX512)
#define VF_U8(p) _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VF_S8(p) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p))))
#define VF_BF16(p)                                                                         \
    _mm512_castsi512_ps(                                                                   \
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#define VF_FNMA(a, b, c) _mm512_fnmadd_ps(a, b, c) /* c - a * b, one rounding */
/* unsigned 8-bit weights (up to 63) x signed activation bytes, four a lane */
#define DOT_U8(acc, w, x) _mm512_dpbusd_epi32(acc, w, x)
#else
#define VF_U8(p) _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VF_S8(p) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p))))
#define VF_BF16(p)                                                                         \
    _mm256_castsi256_ps(                                                                   \
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p))), 16))
#define VF_FNMA(a, b, c) _mm256_fnmadd_ps(a, b, c)
/* pairs at most 2 * 63 * 127 (within 16 bits), widened to 32 at once */
#define DOT_U8(acc, w, x)                                                                  \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)))
#endif

/* The RB rows' results for tile t, times the matrix's scale, into y (row stride
 * `stride`, the matrix's outputs from column `col`). */
static inline void store_rows(const Mat *m, vf *acc, int rb, float *y, int r0, int stride, int col,
                              int t) {
    int n = m->out - t * TILE < TILE ? m->out - t * TILE : TILE;
    for (int r = 0; r < rb; r++) {
        vf v = m->scale != 1.0f ? VF_MUL(acc[r], VF_SET1(m->scale)) : acc[r];
        vf_store(y + (size_t)(r0 + r) * stride + col + t * TILE, v, n);
    }
}

/* The integer sum of a group from its parts' sums: 128 * hi + lo with two activation
 * bytes, hi alone with one (A, a constant of each kernel: the low part's products are
 * then not computed at all). */
#define JOINED(A, hi, lo) ((A) == 2 ? VI_JOIN(hi, lo) : (hi))

/* Four nibble sub-blocks at p (advanced past them) against RB rows' activation bytes
 * of group g: the high and (A == 2) low parts' integer sums. */
#define NIBBLE_DOTS(RB, A)                                                                 \
    for (int r = 0; r < RB; r++) high_sum[r] = low_sum[r] = VI_ZERO();                     \
    for (int b = 0; b < 4; b++) {                                                          \
        _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);                             \
        vi packed = VI_LOAD(p);                                                            \
        vi lo = VI_AND(packed, low), hi = VI_AND(VI_SHR4(packed), low);                    \
        for (int r = 0; r < RB; r++) {                                                     \
            size_t at = (size_t)(r0 + r) * in + g * GROUP + 8 * b;                         \
            high_sum[r] = DOT_U4(high_sum[r], lo, VI_BCAST32(a->c + at));                  \
            high_sum[r] = DOT_U4(high_sum[r], hi, VI_BCAST32(a->c + at + 4));              \
            if (A == 2) {                                                                  \
                low_sum[r] = DOT_U4(low_sum[r], lo, VI_BCAST32(a->c2 + at));               \
                low_sum[r] = DOT_U4(low_sum[r], hi, VI_BCAST32(a->c2 + at + 4));           \
            }                                                                              \
        }                                                                                  \
        p += 4 * TILE;                                                                     \
    }

/* At each super-block of a K kind (group g, tile pointer p): its header, read into d
 * and dmin, `header` left pointing at it for the groups' scales, p moved past it. */
#define K_HEADER()                                                                         \
    do {                                                                                   \
        if (g % 8 == 0) {                                                                  \
            header = p;                                                                    \
            PREFETCH_SPAN(p, HEADER * TILE);                                               \
            d = VF_HALF(p);                                                                \
            dmin = VF_HALF(p + 2 * TILE);                                                  \
            p += HEADER * TILE;                                                            \
        }                                                                                  \
    } while (0)

#define ROWS_ARGS                                                                          \
    const Mat *m, const Act *a, int r0, float *y, int stride, int col, int t0, int t1

/* RB activation rows (from r0) against tiles t0..t1 of a KIND_Q4 matrix. */
#define DEFINE_Q4(RB, A)                                                                   \
    static void q4_rows_##RB##_##A(ROWS_ARGS) {                                            \
        const vi low = VI_SET1B(0x0F);                                                     \
        const int groups = m->groups, in = m->in;                                          \
        for (int t = t0; t < t1; t++) {                                                    \
            const uint8_t *p = m->data + (size_t)t * tile_bytes(m);                        \
            vf acc[RB];                                                                    \
            for (int r = 0; r < RB; r++) acc[r] = VF_ZERO();                               \
            for (int g = 0; g < groups; g++) {                                             \
                vi high_sum[RB], low_sum[RB];                                              \
                NIBBLE_DOTS(RB, A)                                                         \
                vf scale = VF_HALF(p), minimum = VF_HALF(p + 2 * TILE);                    \
                p += 4 * TILE;                                                             \
                for (int r = 0; r < RB; r++) {                                             \
                    int at = (r0 + r) * groups + g;                                        \
                    vf s = VF_MUL(scale, VF_SET1(a->d[at]));                               \
                    vi sum = JOINED(A, U4_TO_32(high_sum[r]), U4_TO_32(low_sum[r]));       \
                    acc[r] = VF_FMA(VF_CVT(sum), s, acc[r]);                               \
                    acc[r] = VF_FMA(minimum, VF_SET1(a->dsum[at]), acc[r]);                \
                }                                                                          \
            }                                                                              \
            store_rows(m, acc, RB, y, r0, stride, col, t);                                 \
        }                                                                                  \
    }

/* RB activation rows against tiles t0..t1 of a KIND_Q4K matrix: as KIND_Q4, with each
 * group's scale d * sc and minimum dmin * m formed in fp32 (exact: 17-bit products). */
#define DEFINE_Q4K(RB, A)                                                                  \
    static void q4k_rows_##RB##_##A(ROWS_ARGS) {                                           \
        const vi low = VI_SET1B(0x0F);                                                     \
        const int groups = m->groups, in = m->in;                                          \
        for (int t = t0; t < t1; t++) {                                                    \
            const uint8_t *p = m->data + (size_t)t * tile_bytes(m);                        \
            const uint8_t *header = p;                                                     \
            vf acc[RB], d = VF_ZERO(), dmin = VF_ZERO();                                   \
            for (int r = 0; r < RB; r++) acc[r] = VF_ZERO();                               \
            for (int g = 0; g < groups; g++) {                                             \
                K_HEADER();                                                                \
                vi high_sum[RB], low_sum[RB];                                              \
                NIBBLE_DOTS(RB, A)                                                         \
                const uint8_t *sc = header + (4 + g % 8) * TILE;                           \
                vf scale = VF_MUL(d, VF_U8(sc)), minimum = VF_MUL(dmin, VF_U8(sc + 8 * TILE)); \
                for (int r = 0; r < RB; r++) {                                             \
                    int at = (r0 + r) * groups + g;                                        \
                    vf s = VF_MUL(scale, VF_SET1(a->d[at]));                               \
                    vi sum = JOINED(A, U4_TO_32(high_sum[r]), U4_TO_32(low_sum[r]));       \
                    acc[r] = VF_FMA(VF_CVT(sum), s, acc[r]);                               \
                    acc[r] = VF_FNMA(minimum, VF_SET1(a->dsum[at]), acc[r]);               \
                }                                                                          \
            }                                                                              \
            store_rows(m, acc, RB, y, r0, stride, col, t);                                 \
        }                                                                                  \
    }

/* RB activation rows (from r0) against tiles t0..t1 of a KIND_Q8 matrix. */
#define DEFINE_Q8(RB, A)                                                                   \
    static void q8_rows_##RB##_##A(ROWS_ARGS) {                                            \
        const int groups = m->groups, in = m->in;                                          \
        for (int t = t0; t < t1; t++) {                                                    \
            const uint8_t *p = m->data + (size_t)t * tile_bytes(m);                        \
            vf acc[RB];                                                                    \
            for (int r = 0; r < RB; r++) acc[r] = VF_ZERO();                               \
            for (int g = 0; g < groups; g++) {                                             \
                vi high_sum[RB], low_sum[RB];                                              \
                for (int r = 0; r < RB; r++) high_sum[r] = low_sum[r] = VI_ZERO();         \
                for (int b = 0; b < 8; b++) {                                              \
                    _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);                 \
                    vi w = VI_LOAD(p), u = PREP_S8(w);                                     \
                    for (int r = 0; r < RB; r++) {                                         \
                        size_t at = (size_t)(r0 + r) * in + g * GROUP + 4 * b;             \
                        high_sum[r] = DOT_S8(high_sum[r], u, w, VI_BCAST32(a->c + at));    \
                        if (A == 2)                                                        \
                            low_sum[r] = DOT_S8(low_sum[r], u, w, VI_BCAST32(a->c2 + at)); \
                    }                                                                      \
                    p += 4 * TILE;                                                         \
                }                                                                          \
                vf scale = VF_HALF(p);                                                     \
                p += 2 * TILE;                                                             \
                for (int r = 0; r < RB; r++) {                                             \
                    int at = (r0 + r) * groups + g;                                        \
                    vi sum = JOINED(A, high_sum[r], low_sum[r]);                           \
                    if (S8_BIASED) sum = VI_SUB(sum, VI_SET1(128 * a->csum[at]));          \
                    acc[r] = VF_FMA(VF_CVT(sum), VF_MUL(scale, VF_SET1(a->d[at])), acc[r]); \
                }                                                                          \
            }                                                                              \
            store_rows(m, acc, RB, y, r0, stride, col, t);                                 \
        }                                                                                  \
    }

/* Bit k of each byte of x moved to bit `to` (16-bit shifts: the bits a shift carries
 * across a byte boundary are masked off by the caller). */
#define MOVE_BIT(x, k, to)                                                                 \
    ((to) > (k) ? VI_SHL16(x, (to) > (k) ? (to) - (k) : 0)                                 \
                : ((to) < (k) ? VI_SHR16(x, (k) > (to) ? (k) - (to) : 0) : (x)))

/* One sub-block's two nibble vectors with their high bits from the plane: lo (inputs
 * 8b..8b+3) takes plane bit(s) from `lo_at`, hi (8b+4..8b+7) from `hi_at`, into bit 4
 * up (mask 0x10 for one bit, 0x30 for two). */
#define WITH_HIGH(packed, plane, lo_at, hi_at, mask, lo, hi)                               \
    do {                                                                                   \
        lo = VI_OR(VI_AND(packed, low), VI_AND(MOVE_BIT(plane, lo_at, 4), mask));          \
        hi = VI_OR(VI_AND(VI_SHR4(packed), low), VI_AND(MOVE_BIT(plane, hi_at, 4), mask)); \
    } while (0)

/* lo and hi of sub-block b (inputs 8b..) against RB rows' activation bytes, the
 * products widened to 32 bits at once (weights up to 63). */
#define WIDE_DOTS(RB, A, b, lo, hi)                                                        \
    for (int r = 0; r < RB; r++) {                                                         \
        size_t at = (size_t)(r0 + r) * in + g * GROUP + 8 * (b);                           \
        high_sum[r] = DOT_U8(high_sum[r], lo, VI_BCAST32(a->c + at));                      \
        high_sum[r] = DOT_U8(high_sum[r], hi, VI_BCAST32(a->c + at + 4));                  \
        if (A == 2) {                                                                      \
            low_sum[r] = DOT_U8(low_sum[r], lo, VI_BCAST32(a->c2 + at));                   \
            low_sum[r] = DOT_U8(low_sum[r], hi, VI_BCAST32(a->c2 + at + 4));               \
        }                                                                                  \
    }

/* RB activation rows against tiles t0..t1 of a KIND_Q5K matrix: nibbles plus a plane of
 * fifth bits (bit 2b + h of byte 4 o + j: input 8b + 4h + j), the scales as Q4_K's. */
#define DEFINE_Q5K(RB, A)                                                                  \
    static void q5k_rows_##RB##_##A(ROWS_ARGS) {                                           \
        const vi low = VI_SET1B(0x0F), bit = VI_SET1B(0x10);                               \
        const int groups = m->groups, in = m->in;                                          \
        for (int t = t0; t < t1; t++) {                                                    \
            const uint8_t *p = m->data + (size_t)t * tile_bytes(m);                        \
            const uint8_t *header = p;                                                     \
            vf acc[RB], d = VF_ZERO(), dmin = VF_ZERO();                                   \
            for (int r = 0; r < RB; r++) acc[r] = VF_ZERO();                               \
            for (int g = 0; g < groups; g++) {                                             \
                K_HEADER();                                                                \
                PREFETCH_SPAN(p, 20 * TILE);                                               \
                vi plane = VI_LOAD(p + 16 * TILE), lo, hi;                                 \
                vi high_sum[RB], low_sum[RB];                                              \
                for (int r = 0; r < RB; r++) high_sum[r] = low_sum[r] = VI_ZERO();         \
                WITH_HIGH(VI_LOAD(p), plane, 0, 1, bit, lo, hi);                           \
                WIDE_DOTS(RB, A, 0, lo, hi)                                                \
                WITH_HIGH(VI_LOAD(p + 4 * TILE), plane, 2, 3, bit, lo, hi);                \
                WIDE_DOTS(RB, A, 1, lo, hi)                                                \
                WITH_HIGH(VI_LOAD(p + 8 * TILE), plane, 4, 5, bit, lo, hi);                \
                WIDE_DOTS(RB, A, 2, lo, hi)                                                \
                WITH_HIGH(VI_LOAD(p + 12 * TILE), plane, 6, 7, bit, lo, hi);               \
                WIDE_DOTS(RB, A, 3, lo, hi)                                                \
                p += 20 * TILE;                                                            \
                const uint8_t *sc = header + (4 + g % 8) * TILE;                           \
                vf scale = VF_MUL(d, VF_U8(sc)), minimum = VF_MUL(dmin, VF_U8(sc + 8 * TILE)); \
                for (int r = 0; r < RB; r++) {                                             \
                    int at = (r0 + r) * groups + g;                                        \
                    vf s = VF_MUL(scale, VF_SET1(a->d[at]));                               \
                    acc[r] = VF_FMA(VF_CVT(JOINED(A, high_sum[r], low_sum[r])), s, acc[r]); \
                    acc[r] = VF_FNMA(minimum, VF_SET1(a->dsum[at]), acc[r]);               \
                }                                                                          \
            }                                                                              \
            store_rows(m, acc, RB, y, r0, stride, col, t);                                 \
        }                                                                                  \
    }

/* RB activation rows against tiles t0..t1 of a KIND_Q6K matrix: nibbles plus two planes
 * of the two high bits (plane v, for inputs 16v..16v+15: bits 2(2s + h) of byte
 * 4 o + j for input 16v + 8s + 4h + j), half a group at a time: its integer sum less
 * 32 times its activations' sum (q - 32, exactly), times d * sc of that half. */
#define DEFINE_Q6K(RB, A)                                                                  \
    static void q6k_rows_##RB##_##A(ROWS_ARGS) {                                           \
        const vi low = VI_SET1B(0x0F), bits = VI_SET1B(0x30);                              \
        const int groups = m->groups, in = m->in;                                          \
        for (int t = t0; t < t1; t++) {                                                    \
            const uint8_t *p = m->data + (size_t)t * tile_bytes(m);                        \
            const uint8_t *header = p;                                                     \
            vf acc[RB], d = VF_ZERO(), dmin = VF_ZERO(); /* dmin: read, not used */        \
            for (int r = 0; r < RB; r++) acc[r] = VF_ZERO();                               \
            for (int g = 0; g < groups; g++) {                                             \
                K_HEADER();                                                                \
                PREFETCH_SPAN(p, 24 * TILE);                                               \
                for (int v = 0; v < 2; v++) {                                              \
                    vi plane = VI_LOAD(p + 16 * TILE + v * 4 * TILE), lo, hi;              \
                    vi high_sum[RB], low_sum[RB];                                          \
                    for (int r = 0; r < RB; r++) high_sum[r] = low_sum[r] = VI_ZERO();     \
                    WITH_HIGH(VI_LOAD(p + 8 * v * TILE), plane, 0, 2, bits, lo, hi);       \
                    WIDE_DOTS(RB, A, 2 * v, lo, hi)                                        \
                    WITH_HIGH(VI_LOAD(p + (8 * v + 4) * TILE), plane, 4, 6, bits, lo, hi); \
                    WIDE_DOTS(RB, A, 2 * v + 1, lo, hi)                                    \
                    vf scale = VF_MUL(d, VF_S8(header + (4 + 2 * (g % 8) + v) * TILE));    \
                    for (int r = 0; r < RB; r++) {                                         \
                        int at = (r0 + r) * groups + g;                                    \
                        vi sum = VI_SUB(JOINED(A, high_sum[r], low_sum[r]),                \
                                        VI_SET1(32 * a->csum16[2 * at + v]));              \
                        acc[r] = VF_FMA(VF_CVT(sum), VF_MUL(scale, VF_SET1(a->d[at])), acc[r]); \
                    }                                                                      \
                }                                                                          \
                p += 24 * TILE;                                                            \
            }                                                                              \
            (void)dmin;                                                                    \
            store_rows(m, acc, RB, y, r0, stride, col, t);                                 \
        }                                                                                  \
    }

/* RB activation rows against tiles t0..t1 of a KIND_F16 or KIND_BF16 matrix: the fp32
 * activations times each input's TILE widened weights, input after input. */
#define DEFINE_F16(RB)                                                                     \
    static void f16_rows_##RB(ROWS_ARGS) {                                                 \
        const int in = m->in, brain = m->kind == KIND_BF16;                                \
        for (int t = t0; t < t1; t++) {                                                    \
            const uint8_t *p = m->data + (size_t)t * tile_bytes(m);                        \
            vf acc[RB];                                                                    \
            for (int r = 0; r < RB; r++) acc[r] = VF_ZERO();                               \
            for (int i = 0; i < in; i++) {                                                 \
                _mm_prefetch((const char *)p + PREFETCH, _MM_HINT_T0);                     \
                vf w = brain ? VF_BF16(p) : VF_HALF(p);                                    \
                for (int r = 0; r < RB; r++)                                               \
                    acc[r] = VF_FMA(w, VF_SET1(a->x[(size_t)(r0 + r) * in + i]), acc[r]);  \
                p += 2 * TILE;                                                             \
            }                                                                              \
            store_rows(m, acc, RB, y, r0, stride, col, t);                                 \
        }                                                                                  \
    }

/* The integer kinds for RB rows and A activation bytes; every kind for RB rows. */
#define DEFINE_INT(RB, A)                                                                  \
    DEFINE_Q4(RB, A) DEFINE_Q8(RB, A) DEFINE_Q4K(RB, A) DEFINE_Q5K(RB, A) DEFINE_Q6K(RB, A)
#define DEFINE_ALL(RB) DEFINE_INT(RB, 1) DEFINE_INT(RB, 2) DEFINE_F16(RB)
#define KERNELS_A(RB, A) {q4_rows_##RB##_##A, q8_rows_##RB##_##A, q4k_rows_##RB##_##A,     \
                          q5k_rows_##RB##_##A, q6k_rows_##RB##_##A, f16_rows_##RB, f16_rows_##RB}
#define KERNELS(RB) {KERNELS_A(RB, 1), KERNELS_A(RB, 2)}
#define KERNELS_ONE(RB) {KERNELS_A(RB, 1), {0}} /* one byte only */

/* Rows per pass: as many as the vector registers hold, each row an accumulator and a
 * part sum or two (A = 2 needs a third register a row). AVX-512's 32 registers: 8
 * rows at one byte, 6 at two; AVX2's 16: 4 at one byte, 3 at two. Every count up to
 * the most is a kernel, so a batch's last rows take one pass too (a pass reads its
 * band's weights from cache again, and unpacks them again: fewer passes, less work).
 * A row's operations are the same in any of them. */
DEFINE_ALL(1)
DEFINE_ALL(2)
DEFINE_ALL(3)
DEFINE_INT(4, 1)
DEFINE_F16(4)
#if defined(FP_AVX512)
DEFINE_INT(4, 2)
DEFINE_ALL(5)
DEFINE_ALL(6)
DEFINE_INT(7, 1)
DEFINE_INT(8, 1)
DEFINE_F16(7)
DEFINE_F16(8)
#define MOST_ROWS_1 8
#define MOST_ROWS_2 6
#else
#define MOST_ROWS_1 4
#define MOST_ROWS_2 3
#endif

typedef void (*rows_fn)(ROWS_ARGS);

/* [rows][activation bytes - 1][kind] */
static const rows_fn kernels[MOST_ROWS_1 + 1][2][7] = {
    {{0}}, KERNELS(1), KERNELS(2), KERNELS(3),
#if defined(FP_AVX512)
    KERNELS(4), KERNELS(5), KERNELS(6), KERNELS_ONE(7), KERNELS_ONE(8),
#else
    KERNELS_ONE(4),
#endif
};

/* Tiles t0..t1 of m (one matrix of a chain) for every row of a, a band of tiles at a
 * time: with many rows (a prefill) the band's weights stay in cache while the rows
 * pass. */
static void product_tiles(const Mat *m, const Act *a, float *y, int stride, int col, int t0, int t1) {
    const int band = 8;
    const int w = a->bytes - 1, most = w ? MOST_ROWS_2 : MOST_ROWS_1;
    for (int b0 = t0; b0 < t1; b0 += band) {
        int b1 = b0 + band < t1 ? b0 + band : t1;
        int r = 0;
        while (r < a->rows) {
            int left = a->rows - r;
            int take = left < most ? left : most;
            rows_fn fn = kernels[take][w][m->kind];
            fn(m, a, r, y, stride, col, b0, b1);
            r += take;
        }
    }
}

typedef struct {
    const Mat *m;
    const Act *a;
    float *y;
    int stride, tiles; /* the chain's outputs and tiles, all its matrices together */
} ProductJob;

/* A contiguous share of the chain's tiles, matrix by matrix. */
static void product_part(void *ctx, int part, int parts) {
    const ProductJob *job = ctx;
    int first = (int)((int64_t)job->tiles * part / parts);
    int last = (int)((int64_t)job->tiles * (part + 1) / parts);
    int base = 0, col = 0;
    for (const Mat *m = job->m; m && base < last; m = m->next) {
        int lo = first > base ? first - base : 0, hi = last - base < m->tiles ? last - base : m->tiles;
        if (lo < hi) product_tiles(m, job->a, job->y, job->stride, col, lo, hi);
        base += m->tiles;
        col += m->out;
    }
}

static int chain_out(const Mat *m) {
    int out = 0;
    for (; m; m = m->next) out += m->out;
    return out;
}

static void product(const Mat *m, const Act *a, float *y, int threads) {
    ProductJob job = {m, a, y, chain_out(m), 0};
    for (const Mat *k = m; k; k = k->next) job.tiles += k->tiles;
    run_parts(product_part, &job, threads < job.tiles ? threads : job.tiles);
}

/* ---- rows of a matrix as fp32 (the embedding table, and tests) ---------------------- */

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Row `row` of m (not a chain) -> out [in]: each weight as gguf's dequantisation
 * computes it (the same fp32 operations in the same order), times m's scale. */
static void unpack_row(const Mat *m, int64_t row, float *out) {
    const int o = (int)(row % TILE), k = m->kind;
    const uint8_t *p = m->data + (size_t)(row / TILE) * tile_bytes(m);
    const uint8_t *header = p;
    float d = 0.0f, dmin = 0.0f;
    for (int g = 0; g < m->groups; g++) {
        float *w = out + g * GROUP;
        if ((k == KIND_Q4K || k == KIND_Q5K || k == KIND_Q6K) && g % 8 == 0) {
            header = p;
            d = half_at(p + 2 * o);
            dmin = half_at(p + 2 * TILE + 2 * o);
            p += HEADER * TILE;
        }
        const uint8_t *sc = header + (4 + g % 8) * TILE + o, *mins = sc + 8 * TILE;
        if (k == KIND_Q4 || k == KIND_Q4K) {
            for (int b = 0; b < 4; b++)
                for (int j = 0; j < 4; j++) {
                    uint8_t byte = p[b * 4 * TILE + 4 * o + j];
                    w[8 * b + j] = (float)(byte & 15);
                    w[8 * b + 4 + j] = (float)(byte >> 4);
                }
            if (k == KIND_Q4) {
                float scale = half_at(p + 16 * TILE + 2 * o), low = half_at(p + 18 * TILE + 2 * o);
                for (int i = 0; i < GROUP; i++) w[i] = w[i] * scale + low;
                p += 20 * TILE;
            } else {
                float scale = d * (float)*sc, low = dmin * (float)*mins;
                for (int i = 0; i < GROUP; i++) w[i] = scale * w[i] - low;
                p += 16 * TILE;
            }
        } else if (k == KIND_Q8) {
            float scale = half_at(p + 32 * TILE + 2 * o);
            for (int b = 0; b < 8; b++)
                for (int j = 0; j < 4; j++) w[4 * b + j] = scale * (float)(int8_t)p[b * 4 * TILE + 4 * o + j];
            p += 34 * TILE;
        } else if (k == KIND_Q5K || k == KIND_Q6K) {
            for (int i = 0; i < GROUP; i++) { /* input i = 8b + 4h + j */
                int b = i / 8, h = (i / 4) % 2, j = i % 4;
                uint8_t byte = p[b * 4 * TILE + 4 * o + j];
                int q = h ? byte >> 4 : byte & 15;
                if (k == KIND_Q5K) {
                    q |= ((p[16 * TILE + 4 * o + j] >> (2 * b + h)) & 1) << 4;
                    w[i] = (d * (float)*sc) * (float)q - dmin * (float)*mins;
                } else {
                    int v = b / 2, s = b % 2;
                    q |= ((p[16 * TILE + v * 4 * TILE + 4 * o + j] >> (2 * (2 * s + h))) & 3) << 4;
                    int8_t half = (int8_t)header[(4 + 2 * (g % 8) + v) * TILE + o];
                    w[i] = (d * (float)half) * (float)(q - 32);
                }
            }
            p += (k == KIND_Q5K ? 20 : 24) * TILE;
        } else {
            for (int i = 0; i < GROUP; i++) {
                const uint8_t *v = p + (size_t)(i * TILE + o) * 2;
                if (k == KIND_F16) {
                    w[i] = half_at(v);
                } else {
                    uint32_t bits = (uint32_t)(v[0] | v[1] << 8) << 16;
                    memcpy(&w[i], &bits, 4);
                }
            }
            p += 64 * TILE;
        }
    }
    if (m->scale != 1.0f)
        for (int i = 0; i < m->in; i++) out[i] *= m->scale;
}

/* out [count][in] = rows `rows` of m. */
void fp_unpack_rows(const Mat *m, const int64_t *rows, int32_t count, float *out) {
    for (int r = 0; r < count; r++) unpack_row(m, rows[r], out + (size_t)r * m->in);
}

/* ---- activation buffers ----------------------------------------------------------- */

static int act_reserve(Act *a, int rows, int in, int bytes) {
    int groups = in / GROUP;
    a->bytes = bytes;
    a->c = malloc((size_t)rows * in);
    a->c2 = bytes == 2 ? malloc((size_t)rows * in) : NULL;
    a->d = malloc((size_t)rows * groups * sizeof(float));
    a->dsum = malloc((size_t)rows * groups * sizeof(float));
    a->csum = malloc((size_t)rows * groups * sizeof(int32_t));
    a->csum16 = malloc((size_t)rows * groups * 2 * sizeof(int32_t));
    return a->c && (a->c2 || bytes == 1) && a->d && a->dsum && a->csum && a->csum16;
}

static void act_free(Act *a) {
    free(a->c);
    free(a->c2);
    free(a->d);
    free(a->dsum);
    free(a->csum);
    free(a->csum16);
}

/* y [rows][out] = x [rows][in] through m, its activations quantized in `act_bytes`
 * (1 or 2) parts, on up to `threads` threads. Returns 0, -1 when out of memory, or -2
 * for another act_bytes. */
int fp_matmul(const Mat *m, const float *x, int32_t rows, float *y, int32_t threads,
              int32_t act_bytes) {
    Act a;
    if (act_bytes != 1 && act_bytes != 2) return -2;
    if (!act_reserve(&a, rows, m->in, act_bytes)) {
        act_free(&a);
        return -1;
    }
    threads = pool_take(threads);
    quantize(x, rows, m->in, &a, threads);
    product(m, &a, y, threads);
    pool_give(threads);
    act_free(&a);
    return 0;
}

/* ---- elementwise, in a fixed order of 16 partial sums ------------------------------ */

/* e^v for v in [-87, 88] (clamped outside) to about 2 ulp: v = n ln 2 + f with |f| <=
 * ln 2 / 2, e^f by its Taylor series to f^7, times 2^n built in the exponent bits.
 * Branch-free, so loops of it vectorize; the same bits on every instruction set. */
static inline float exp_approx(float v) {
    v = v < -87.0f ? -87.0f : (v > 88.0f ? 88.0f : v);
    float n = round_even(v * 1.44269504f);
    float f = (v - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.0f / 5040.0f;
    p = p * f + 1.0f / 720.0f;
    p = p * f + 1.0f / 120.0f;
    p = p * f + 1.0f / 24.0f;
    p = p * f + 1.0f / 6.0f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    union { int32_t i; float f; } scale = {.i = ((int32_t)n + 127) << 23};
    return p * scale.f;
}

static float sum16(const float *part) {
    float s8[8], s4[4];
    for (int i = 0; i < 8; i++) s8[i] = part[i] + part[i + 8];
    for (int i = 0; i < 4; i++) s4[i] = s8[i] + s8[i + 4];
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

static float dot(const float *a, const float *b, int n) { /* n % 16 == 0 */
    float part[16] = {0};
    for (int i = 0; i < n; i += 16)
        for (int j = 0; j < 16; j++) part[j] += a[i + j] * b[i + j];
    return sum16(part);
}

static void rms_norm(const float *x, const float *w, int n, float eps, float *out) {
    float mean = dot(x, x, n) / (float)n;
    float inv = 1.0f / sqrtf(mean + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

/* tanh from exp_approx: 1 - 2 / (e^2v + 1), saturating far out (e^2v clamps). */
static inline float tanh_approx(float v) { return 1.0f - 2.0f / (exp_approx(2.0f * v) + 1.0f); }

static inline float softcap(float v, float cap) { return tanh_approx(v / cap) * cap; }

/* x (n values) through the norm w when the layer has one, else copied: into out. */
static void norm_or_copy(const float *x, const float *w, int n, float eps, float *out) {
    if (w)
        rms_norm(x, w, n, eps, out);
    else
        memcpy(out, x, (size_t)n * sizeof(float));
}

static void add_bias(float *x, const float *bias, int n) {
    if (bias)
        for (int i = 0; i < n; i++) x[i] += bias[i];
}

static void rotate(float *x, const float *cos, const float *sin, int dim) {
    int half = dim / 2;
    float tmp[512];
    memcpy(tmp, x, (size_t)dim * sizeof(float));
    for (int i = 0; i < half; i++) {
        x[i] = tmp[i] * cos[i] - tmp[i + half] * sin[i];
        x[i + half] = tmp[i + half] * cos[i + half] + tmp[i] * sin[i + half];
    }
}

static inline int64_t slot_of(const int32_t *table, int block_size, int64_t position) {
    return (int64_t)table[position / block_size] * block_size + position % block_size;
}

/* One row's attention at `position` for the query heads of key/value head h: q
 * [heads][dim] (scaled) over its keys and values at positions 0..position, through its
 * block table (slots: each position's cache slot) -> out [heads][dim], those heads.
 *
 * Keys (fp16) are kept per block transposed, [dim][block_size] (fp_forward writes them
 * so): a block's scores are then block_size independent sums over the dimensions, one
 * per vector lane, in order, with no horizontal sum; block_size must be a multiple of
 * 16. Values (fp16) stay [slot][dim]: each position's vector is added into the
 * output, scaled, TILE dimensions at a time (head_dim is a multiple of 16). */
/* Query heads of a group that share one pass over a key vector (registers allow). */
#define SHARED 4

static void attend_head(const Model *md, int layer, int h, const float *q, const int32_t *table,
                        const int64_t *slots, int64_t position, float *scores, float *out) {
    int dim = md->head_dim, group = md->heads / md->kv_heads, bs = md->block_size;
    int64_t count = position + 1, blocks = (count + bs - 1) / bs;
    /* A window: the query sees positions first..position only. */
    int64_t window = md->window[layer], first = window > 0 && count > window ? count - window : 0;
    float cap = md->softcap[layer];
    size_t head_stride = (size_t)md->slots * dim;
    size_t at = (size_t)layer * md->kv_heads * head_stride + h * head_stride;
    const uint16_t *keys = md->k_cache + at, *values = md->v_cache + at;
    /* The group's query heads share this head's keys and values: each key vector is
     * loaded and widened once for up to SHARED of them, and each value vector once for
     * all of them. Every (query head, position) sum still runs over the dimensions in
     * order, and every output over the positions in order: the same bits as one head
     * at a time. */
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *kt = keys + (size_t)table[b] * bs * dim;
        for (int o0 = 0; o0 < bs; o0 += TILE) { /* TILE floats fill a vector */
            for (int j0 = 0; j0 < group; j0 += SHARED) {
                const float *q0 = q + (h * group + j0) * dim;
                float *s0 = scores + (size_t)j0 * blocks * bs + b * bs + o0;
                if (group - j0 >= SHARED) {
                    vf acc[SHARED];
                    for (int j = 0; j < SHARED; j++) acc[j] = VF_ZERO();
                    for (int i = 0; i < dim; i++) {
                        vf k = VF_HALF(kt + i * bs + o0);
                        for (int j = 0; j < SHARED; j++)
                            acc[j] = VF_ADD(acc[j], VF_MUL(VF_SET1(q0[j * dim + i]), k));
                    }
                    for (int j = 0; j < SHARED; j++) VF_STORE(s0 + (size_t)j * blocks * bs, acc[j]);
                } else {
                    for (int j = 0; j < group - j0; j++) {
                        vf acc = VF_ZERO();
                        for (int i = 0; i < dim; i++)
                            acc = VF_ADD(acc, VF_MUL(VF_SET1(q0[j * dim + i]), VF_HALF(kt + i * bs + o0)));
                        VF_STORE(s0 + (size_t)j * blocks * bs, acc);
                    }
                }
            }
        }
    }
    float inv[group];
    for (int j = 0; j < group; j++) {
        float *s = scores + j * blocks * bs;
        if (cap > 0.0f)
            for (int64_t p = first; p < count; p++) s[p] = softcap(s[p], cap);
        float top = -INFINITY;
        for (int64_t p = first; p < count; p++) top = s[p] > top ? s[p] : top;
        for (int64_t p = first; p < count; p++) s[p] = exp_approx(s[p] - top);
        float part[16] = {0};
        int64_t p = first;
        for (; p + 16 <= count; p += 16)
            for (int i = 0; i < 16; i++) part[i] += s[p + i];
        for (; p < count; p++) part[0] += s[p];
        inv[j] = 1.0f / sum16(part);
        float *o = out + (h * group + j) * dim;
        for (int i = 0; i < dim; i++) o[i] = 0.0f;
    }
    float *o = out + h * group * dim, weight[group];
    for (int64_t p = first; p < count; p++) {
        const uint16_t *v = values + slots[p] * dim;
        for (int j = 0; j < group; j++) weight[j] = scores[j * blocks * bs + p] * inv[j];
        for (int d0 = 0; d0 < dim; d0 += TILE) {
            vf value = VF_HALF(v + d0);
            for (int j = 0; j < group; j++) {
                float *oj = o + j * dim + d0;
                VF_STORE(oj, VF_ADD(VF_LOAD(oj), VF_MUL(VF_SET1(weight[j]), value)));
            }
        }
    }
}

typedef struct {
    const Model *md;
    int layer, rows, width, qkv_size, q_size;
    int64_t longest, span;
    const float *fused;
    const int32_t *tables;
    const int64_t *positions, *slots;
    float *scores; /* [parts][group * span] */
    float *attn;
} AttendJob;

/* Items (row, key/value head), every parts-th one from `part` on: a prefill chunk's
 * rows attend over more positions the later they are (the work is a triangle), and
 * contiguous shares left one thread three quarters of it on two threads (the other
 * spun waiting for 26% of a 4,000-token prefill); dealt out in turn the shares are
 * even. Each item is still one thread's whole, so no result depends on the split. */
static void attend_part(void *ctx, int part, int parts) {
    const AttendJob *job = ctx;
    int items = job->rows * job->md->kv_heads;
    int group = job->md->heads / job->md->kv_heads;
    float *scores = job->scores + (size_t)part * group * job->span;
    for (int item = part; item < items; item += parts) {
        int r = item / job->md->kv_heads, h = item % job->md->kv_heads;
        attend_head(job->md, job->layer, h, job->fused + (size_t)r * job->qkv_size,
                    job->tables + (size_t)r * job->width, job->slots + r * job->longest,
                    job->positions[r], scores, job->attn + (size_t)r * job->q_size);
    }
}

static inline float silu(float v) { return v / (1.0f + exp_approx(-v)); }

/* GELU with tanh: 0.5 v (1 + tanh(sqrt(2 / pi) (v + 0.044715 v^3))). */
static inline float gelu_tanh(float v) {
    return 0.5f * v * (1.0f + tanh_approx(0.7978845608f * (v + 0.044715f * v * v * v)));
}

/* q and k of one row (the start of its fused q|k|v) RMSNorm-ed as the layer says. */
static void qk_norm(const Model *md, int l, float *f, float *tmp) {
    int dim = md->head_dim, q_size = md->heads * dim, kv_size = md->kv_heads * dim;
    if (md->qk_norm_width) {
        rms_norm(f, md->q_norm[l], q_size, md->eps, tmp);
        memcpy(f, tmp, (size_t)q_size * sizeof(float));
        rms_norm(f + q_size, md->k_norm[l], kv_size, md->eps, tmp);
        memcpy(f + q_size, tmp, (size_t)kv_size * sizeof(float));
        return;
    }
    for (int h = 0; h < md->heads + md->kv_heads; h++) {
        const float *w = h < md->heads ? md->q_norm[l] : md->k_norm[l];
        rms_norm(f + h * dim, w, dim, md->eps, tmp);
        memcpy(f + h * dim, tmp, (size_t)dim * sizeof(float));
    }
}

/* act(gate) * up of rows of gate|up [rows][2 width] (plus their bias, where given)
 * -> h [rows][width], the rows shared between threads. */
typedef struct {
    const Model *md;
    float *both, *h;
    const float *bias;
    int rows, width;
} GateJob;

static void gate_part(void *ctx, int part, int parts) {
    const GateJob *job = ctx;
    int n = job->width;
    for (int r = job->rows * part / parts; r < job->rows * (part + 1) / parts; r++) {
        float *gu = job->both + (size_t)r * 2 * n, *h = job->h + (size_t)r * n;
        add_bias(gu, job->bias, 2 * n);
        if (job->md->gelu)
            for (int i = 0; i < n; i++) h[i] = gelu_tanh(gu[i]) * gu[n + i];
        else
            for (int i = 0; i < n; i++) h[i] = silu(gu[i]) * gu[n + i];
    }
}

static void gate(const Model *md, float *both, const float *bias, int rows, int width, float *h,
                 int threads) {
    GateJob job = {md, both, h, bias, rows, width};
    run_parts(gate_part, &job, threads < rows ? threads : rows);
}

/* What a mixture's layer works in (fp_forward reserves it for its rows). Its pairs
 * (row, rank) are kept sorted by expert: each expert's rows are one run of them. */
typedef struct {
    float *in;       /* [rows][hidden] the normed rows the experts take */
    float *picked;   /* [pairs][hidden] each pair's row, sorted by expert */
    float *both;     /* [pairs][2 expert_inter] their gate|up */
    float *inner;    /* [pairs][expert_inter] */
    float *result;   /* [pairs][hidden] */
    float *weight;   /* [rows][top_k] */
    int32_t *chosen; /* [rows][top_k] */
    int32_t *sorted; /* [rows][top_k]: where the pair sits in the sorted runs */
    int32_t *count;  /* [experts] pairs of each expert */
    float *probs;    /* [experts] */
    Act act;         /* [pairs] rows, as wide as the widest of hidden and expert_inter */
} Moe;

static int moe_reserve(Moe *m, const Model *md, int rows) {
    int most = 0, hidden = md->hidden, k = md->top_k, inner = md->expert_inter;
    for (int l = 0; l < md->layers; l++) most = md->experts[l] > most ? md->experts[l] : most;
    memset(m, 0, sizeof *m);
    if (!most) return 1;
    size_t pairs = (size_t)rows * k;
    m->in = malloc((size_t)rows * hidden * sizeof(float));
    m->picked = malloc(pairs * hidden * sizeof(float));
    m->both = malloc(pairs * 2 * inner * sizeof(float));
    m->inner = malloc(pairs * inner * sizeof(float));
    m->result = malloc(pairs * hidden * sizeof(float));
    m->weight = malloc(pairs * sizeof(float));
    m->chosen = malloc(pairs * sizeof(int32_t));
    m->sorted = malloc(pairs * sizeof(int32_t));
    m->count = malloc((size_t)most * sizeof(int32_t));
    m->probs = malloc((size_t)most * sizeof(float));
    int acts = act_reserve(&m->act, (int)pairs, hidden > inner ? hidden : inner, md->act_bytes);
    return acts && m->in && m->picked && m->both && m->inner && m->result && m->weight &&
           m->chosen && m->sorted && m->count && m->probs;
}

static void moe_free(Moe *m) {
    void *buffers[] = {m->in,     m->picked, m->both,  m->inner, m->result,
                       m->weight, m->chosen, m->sorted, m->count, m->probs};
    for (size_t i = 0; i < sizeof buffers / sizeof *buffers; i++) free(buffers[i]);
    act_free(&m->act); /* zeroed by moe_reserve where not reserved */
}

/* Rows first.. first + n of a quantized batch, as a batch of their own. */
static Act act_rows(const Act *a, int first, int n) {
    Act v = *a;
    size_t in = (size_t)a->in, groups = (size_t)a->groups;
    v.rows = n;
    v.x = a->x + first * in;
    v.c = a->c + first * in;
    v.c2 = a->c2 ? a->c2 + first * in : NULL;
    v.d = a->d + first * groups;
    v.dsum = a->dsum + first * groups;
    v.csum = a->csum + first * groups;
    v.csum16 = a->csum16 + first * groups * 2;
    return v;
}

/* Several products, each its own matrix (or chain) over its own rows, as one threaded
 * job: the tiles of all of them split in contiguous shares between the threads. */
typedef struct {
    const Mat *m;
    Act a;
    float *y;
} Task;

typedef struct {
    const Task *tasks;
    int count, tiles;
} TaskJob;

static void tasks_part(void *ctx, int part, int parts) {
    const TaskJob *job = ctx;
    int first = (int)((int64_t)job->tiles * part / parts);
    int last = (int)((int64_t)job->tiles * (part + 1) / parts);
    int base = 0;
    for (int t = 0; t < job->count && base < last; t++) {
        const Task *task = &job->tasks[t];
        int stride = chain_out(task->m), col = 0;
        for (const Mat *m = task->m; m && base < last; m = m->next) {
            int lo = first > base ? first - base : 0;
            int hi = last - base < m->tiles ? last - base : m->tiles;
            if (lo < hi) product_tiles(m, &task->a, task->y, stride, col, lo, hi);
            base += m->tiles;
            col += m->out;
        }
    }
}

static void run_tasks(const Task *tasks, int count, int threads) {
    TaskJob job = {tasks, count, 0};
    for (int t = 0; t < count; t++)
        for (const Mat *m = tasks[t].m; m; m = m->next) job.tiles += m->tiles;
    if (job.tiles) run_parts(tasks_part, &job, threads < job.tiles ? threads : job.tiles);
}

/* Layer l's mixture over the normed rows m->in, added into out [rows][hidden] (which
 * holds the shared expert's output where the layer has one, else is overwritten).
 *
 * Per row: the router's logits (fp32 dots), their softmax, the top_k (the largest
 * first; ties: the lower expert), divided by their sum where the family says. Then
 * the (row, rank) pairs sorted by expert, their rows gathered and quantized once, and
 * every chosen expert's gate|up run over its own run of pairs, all experts in one
 * threaded job (each chosen expert's weights read once a step however many rows
 * chose it); then the gates, and every expert's down the same way. Each row's k
 * results are summed last, in rank order: with the kernels' row independence, a
 * row's output is the same bits whatever rows shared its experts. */
static void mixture(const Model *md, int l, int rows, Moe *m, float *out, int threads) {
    int hidden = md->hidden, k = md->top_k, count = md->experts[l], inner = md->expert_inter;
    int pairs = rows * k;
    for (int r = 0; r < rows; r++) {
        const float *row = m->in + (size_t)r * hidden;
        float top = -INFINITY, total = 0.0f;
        for (int e = 0; e < count; e++) {
            m->probs[e] = dot(row, md->router[l] + (size_t)e * hidden, hidden);
            top = m->probs[e] > top ? m->probs[e] : top;
        }
        for (int e = 0; e < count; e++) {
            m->probs[e] = exp_approx(m->probs[e] - top);
            total += m->probs[e];
        }
        float kept = 0.0f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < count; e++) /* the largest not yet taken */
                if (m->probs[e] >= 0.0f && (best < 0 || m->probs[e] > m->probs[best])) best = e;
            m->chosen[r * k + j] = best;
            m->weight[r * k + j] = m->probs[best] / total;
            kept += m->weight[r * k + j];
            m->probs[best] = -1.0f;
        }
        if (md->renormalise)
            for (int j = 0; j < k; j++) m->weight[r * k + j] /= kept;
    }
    memset(m->count, 0, (size_t)count * sizeof(int32_t));
    for (int p = 0; p < pairs; p++) m->count[m->chosen[p]]++;
    int at = 0; /* each expert's run starts where the one before ends */
    for (int e = 0; e < count; e++) {
        int n = m->count[e];
        m->count[e] = at;
        at += n;
    }
    for (int p = 0; p < pairs; p++) { /* pairs in row order within each run */
        int s = m->count[m->chosen[p]]++;
        m->sorted[p] = s;
        memcpy(m->picked + (size_t)s * hidden, m->in + (size_t)(p / k) * hidden,
               (size_t)hidden * sizeof(float));
    }
    Task tasks[count > 0 ? count : 1];
    int used = 0;
    quantize(m->picked, pairs, hidden, &m->act, threads);
    for (int e = 0, first = 0; e < count; first = m->count[e++]) {
        int n = m->count[e] - first; /* count[e] is now where run e ends */
        if (n) tasks[used++] = (Task){&md->expert_gate_up[l][e], act_rows(&m->act, first, n),
                                      m->both + (size_t)first * 2 * inner};
    }
    run_tasks(tasks, used, threads);
    gate(md, m->both, NULL, pairs, inner, m->inner, threads);
    quantize(m->inner, pairs, inner, &m->act, threads);
    used = 0;
    for (int e = 0, first = 0; e < count; first = m->count[e++]) {
        int n = m->count[e] - first;
        if (n) tasks[used++] = (Task){&md->expert_down[l][e], act_rows(&m->act, first, n),
                                      m->result + (size_t)first * hidden};
    }
    run_tasks(tasks, used, threads);
    for (int r = 0; r < rows; r++) {
        float *o = out + (size_t)r * hidden;
        const float *row = m->in + (size_t)r * hidden;
        float shared = 0.0f;
        if (md->has_mlp[l] && md->shared_gate[l])
            shared = 1.0f / (1.0f + exp_approx(-dot(row, md->shared_gate[l], hidden)));
        for (int i = 0; i < hidden; i++) {
            float sum = 0.0f;
            for (int j = 0; j < k; j++)
                sum += m->weight[r * k + j] * m->result[(size_t)m->sorted[r * k + j] * hidden + i];
            if (!md->has_mlp[l])
                o[i] = sum;
            else
                o[i] = sum + (md->shared_gate[l] ? o[i] * shared : o[i]);
        }
    }
}

/* A sublayer's output rows (out) get their bias, their norm if the layer has one (into
 * scratch, then back), and are added to the residual stream x. */
static void finish_sublayer(const Model *md, const float *bias, const float *norm, int rows,
                            float *out, float *scratch, float *x) {
    int hidden = md->hidden;
    for (int r = 0; r < rows; r++) {
        float *o = out + (size_t)r * hidden;
        add_bias(o, bias, hidden);
        if (norm) {
            rms_norm(o, norm, hidden, md->eps, scratch + (size_t)r * hidden);
            memcpy(o, scratch + (size_t)r * hidden, (size_t)hidden * sizeof(float));
        }
    }
    for (size_t i = 0; i < (size_t)rows * hidden; i++) x[i] += out[i];
}

/* One forward pass of `rows` rows, each a token at a position of a sequence whose block
 * table (`width` blocks, covering the position) it names -> logits [count][vocab] of
 * the rows listed in `wanted`. Each layer writes every row's key and value before any
 * row attends, so rows of one sequence at consecutive positions (a prefill chunk)
 * see each other causally: a decode step and a prefill are the same computation, row
 * by row. Returns 0, -1 when out of memory, or -2 when act_bytes is neither 1 nor 2. */
int fp_forward(const Model *md, int32_t rows, const int64_t *tokens, const int64_t *positions,
               const int32_t *tables, int32_t width, const int32_t *wanted, int32_t count,
               float *logits, int32_t threads) {
    if (md->act_bytes != 1 && md->act_bytes != 2) return -2;
    int hidden = md->hidden, dim = md->head_dim, inter = md->inter;
    int q_size = md->heads * dim, kv_size = md->kv_heads * dim;
    int qkv_size = q_size + 2 * kv_size;
    /* The widest activation any product quantizes: the residual stream, the MLP's
     * inner width, or attention's output (wider than the stream in some models). */
    int widest = hidden > inter ? hidden : inter;
    widest = widest > q_size ? widest : q_size;
    widest = widest > md->expert_inter ? widest : md->expert_inter;
    int64_t longest = 0;
    for (int r = 0; r < rows; r++) longest = positions[r] + 1 > longest ? positions[r] + 1 : longest;
    int group = md->heads / md->kv_heads;
    float *x = malloc((size_t)rows * hidden * sizeof(float));
    float *normed = malloc((size_t)rows * widest * sizeof(float));
    float *fused = malloc((size_t)rows * 2 * inter * sizeof(float) + (size_t)rows * qkv_size * sizeof(float));
    float *attn = malloc((size_t)rows * q_size * sizeof(float));
    float *out = malloc((size_t)rows * hidden * sizeof(float));
    int64_t span = (longest + md->block_size - 1) / md->block_size * md->block_size;
    threads = pool_take(threads);
    float *scores = malloc((size_t)threads * group * span * sizeof(float));
    int64_t *slots = malloc((size_t)rows * longest * sizeof(int64_t)); /* [rows][longest] */
    Act a;
    Moe moe;
    int ok = act_reserve(&a, rows, widest, md->act_bytes) && x && normed && fused && attn && out && scores && slots;
    ok = moe_reserve(&moe, md, rows) && ok;
    if (ok) {
        for (int r = 0; r < rows; r++) /* where each row's positions are in the cache */
            for (int64_t p = 0; p <= positions[r]; p++)
                slots[r * longest + p] = slot_of(tables + (size_t)r * width, md->block_size, p);
        for (int r = 0; r < rows; r++) {
            if (md->embed)
                memcpy(x + (size_t)r * hidden, md->embed + (size_t)tokens[r] * hidden,
                       (size_t)hidden * sizeof(float));
            else
                unpack_row(md->embed_mat, tokens[r], x + (size_t)r * hidden);
        }
        size_t head_stride = (size_t)md->slots * dim;
        size_t layer_stride = (size_t)md->kv_heads * head_stride;
        for (int l = 0; l < md->layers; l++) {
            for (int r = 0; r < rows; r++)
                norm_or_copy(x + (size_t)r * hidden, md->input_norm[l], hidden, md->eps,
                             normed + (size_t)r * hidden);
            quantize(normed, rows, hidden, &a, threads);
            product(&md->qkv[l], &a, fused, threads);
            for (int r = 0; r < rows; r++) {
                float *f = fused + (size_t)r * qkv_size;
                int64_t pos = positions[r];
                add_bias(f, md->qkv_bias[l], qkv_size);
                if (md->q_norm[l]) qk_norm(md, l, f, attn + (size_t)r * q_size);
                if (md->cos[l]) {
                    int rot = md->rot_dim;
                    const float *cos = md->cos[l] + pos * rot, *sin = md->sin[l] + pos * rot;
                    for (int h = 0; h < md->heads + md->kv_heads; h++)
                        rotate(f + h * dim, cos, sin, rot);
                }
                int64_t slot = slots[r * longest + pos];
                int64_t block = slot / md->block_size, offset = slot % md->block_size;
                for (int h = 0; h < md->kv_heads; h++) {
                    size_t at = l * layer_stride + h * head_stride;
                    uint16_t *kt = md->k_cache + at + (size_t)block * md->block_size * dim;
                    uint16_t *vt = md->v_cache + at + slot * dim;
                    for (int i = 0; i < dim; i++) { /* keys transposed per block (attend_head) */
                        kt[i * md->block_size + offset] = _cvtss_sh(f[q_size + h * dim + i], 0);
                        vt[i] = _cvtss_sh(f[q_size + kv_size + h * dim + i], 0);
                    }
                }
            }
            AttendJob job = {md,     l,         rows,      width,  qkv_size, q_size, longest,
                             span,   fused,     tables,    positions, slots, scores, attn};
            int items = rows * md->kv_heads;
            run_parts(attend_part, &job, threads < items ? threads : items);
            quantize(attn, rows, q_size, &a, threads);
            product(&md->o[l], &a, out, threads);
            finish_sublayer(md, md->o_bias[l], md->attn_out_norm[l], rows, out, normed, x);
            for (int r = 0; r < rows; r++)
                norm_or_copy(x + (size_t)r * hidden, md->post_norm[l], hidden, md->eps,
                             normed + (size_t)r * hidden);
            if (md->experts[l]) memcpy(moe.in, normed, (size_t)rows * hidden * sizeof(float));
            if (md->has_mlp[l]) {
                quantize(normed, rows, hidden, &a, threads);
                product(&md->gate_up[l], &a, fused, threads);
                gate(md, fused, md->gate_up_bias[l], rows, inter, normed, threads);
                quantize(normed, rows, inter, &a, threads);
                product(&md->down[l], &a, out, threads);
            }
            if (md->experts[l]) mixture(md, l, rows, &moe, out, threads);
            finish_sublayer(md, md->down_bias[l], md->mlp_out_norm[l], rows, out, normed, x);
        }
        for (int k = 0; k < count; k++)
            rms_norm(x + (size_t)wanted[k] * hidden, md->final_norm, hidden, md->eps,
                     normed + (size_t)k * hidden);
        if (count > 0) {
            quantize(normed, count, hidden, &a, threads);
            product(md->head, &a, logits, threads);
            if (md->final_softcap > 0.0f)
                for (size_t i = 0; i < (size_t)count * md->vocab; i++)
                    logits[i] = softcap(logits[i], md->final_softcap);
        }
    }
    act_free(&a);
    moe_free(&moe);
    free(x);
    free(normed);
    free(fused);
    free(attn);
    free(out);
    free(scores);
    free(slots);
    pool_give(threads);
    return ok ? 0 : -1;
}
