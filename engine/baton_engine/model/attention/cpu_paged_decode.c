/* Paged decode attention on CPU: one query token per row, K and V read once, straight from the
 * paged cache (no gather into a contiguous copy).
 *
 * Cache layout (one layer): k_cache and v_cache are [num_blocks, block_size, kv_heads, dim].
 * Row r attends over positions [0, seq_lens[r]), position p living in block
 * block_tables[r * table_stride + p / block_size] at offset p % block_size. Its query is token
 * query_tokens[r] of q ([tokens, heads, dim], tokens q_stride elements apart, heads x dim
 * contiguous); its output goes to the same token of out (out_stride apart). Query head h reads
 * KV head h / (heads / kv_heads), as in grouped-query attention.
 *
 * One task is one (row, KV head): the heads sharing that KV head walk the row's blocks together,
 * so each K and V vector is loaded once per task. Softmax is online, rescaled once per block.
 * Vectors are GCC/Clang vector extensions of 16 floats (one AVX-512 register, two AVX2 ones, four
 * NEON ones) and the head size is a compile-time multiple of 16, so a row's K, V and accumulators
 * stay in registers: the same loops with a run-time head size ran 1.6x slower. Built by
 * cpu_paged_decode.py with -fopenmp; the caller passes its torch thread count. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_BLOCK 64
#define HEAD_DIMS_MASK ((1 << 4) | (1 << 8) | (1 << 16)) /* bit d/16 set: head size d built */

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

int baton_paged_decode_limits(int64_t *group, int64_t *head_dims_mask, int64_t *block) {
    *group = MAX_GROUP;
    *head_dims_mask = HEAD_DIMS_MASK;
    *block = MAX_BLOCK;
    return 0;
}

static inline v16 load_f32(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store_f32(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 load_bf16(const uint16_t *p) {
    u16x16 half;
    memcpy(&half, p, sizeof half);
    const u32x16 bits = __builtin_convertvector(half, u32x16) << 16;
    v16 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline void store_bf16(uint16_t *p, v16 v) {
    for (int i = 0; i < 16; i++) {
        uint32_t bits;
        const float x = v[i];
        memcpy(&bits, &x, sizeof bits);
        if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN stays a (quiet) NaN */
            p[i] = (uint16_t)((bits >> 16) | 0x40u);
            continue;
        }
        bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even, as torch does */
        p[i] = (uint16_t)(bits >> 16);
    }
}

/* A tree, not 15 dependent adds (the order C fixes without -ffast-math). */
static inline float sum16(v16 v) {
    v8 low, high;
    memcpy(&low, &v, sizeof low);
    memcpy(&high, (const char *)&v + sizeof low, sizeof high);
    const v8 eight = low + high;
    v4 first, second;
    memcpy(&first, &eight, sizeof first);
    memcpy(&second, (const char *)&eight + sizeof first, sizeof second);
    const v4 four = first + second;
    return (four[0] + four[2]) + (four[1] + four[3]);
}

/* exp(x) for x <= 0 (every argument here is a score minus a running maximum), to about 2 ulp:
 * x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, 2^n by exponent
 * bits. Written out so that it vectorises (libm's expf does not without -ffast-math, which this
 * file must not use: the rounding below relies on exact float arithmetic). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round: 1.5 * 2^23 */
    float r = x - n * 0.693359375f; /* ln2 split in two: hi has few bits, so n * hi is exact */
    r = r + n * 2.12194440e-4f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* One (row, KV head) task for a head size of 16 * NV elements of type T. */
#define DEFINE_TASK(NAME, T, LOAD, STORE, NV)                                                       \
    static void NAME(const T *q_row, const T *k_cache, const T *v_cache, const int64_t *table,      \
                     int64_t length, T *out_row, int64_t group, int64_t token_stride,              \
                     int64_t block_size, float scale) {                                             \
        v16 query[MAX_GROUP][NV], acc[MAX_GROUP][NV];                                               \
        float score[MAX_GROUP][MAX_BLOCK], running_max[MAX_GROUP], total[MAX_GROUP];               \
        for (int64_t g = 0; g < group; g++) {                                                       \
            for (int j = 0; j < NV; j++) {                                                          \
                query[g][j] = LOAD(q_row + g * 16 * NV + 16 * j) * scale;                           \
                acc[g][j] = (v16){0};                                                               \
            }                                                                                       \
            running_max[g] = -INFINITY;                                                             \
            total[g] = 0.0f;                                                                        \
        }                                                                                           \
        for (int64_t start = 0; start < length; start += block_size) {                              \
            const int64_t n = length - start < block_size ? length - start : block_size;            \
            const int64_t base = table[start / block_size] * block_size * token_stride;             \
            for (int64_t t = 0; t < n; t++) {                                                       \
                v16 key[NV];                                                                        \
                for (int j = 0; j < NV; j++) key[j] = LOAD(k_cache + base + t * token_stride + 16 * j); \
                for (int64_t g = 0; g < group; g++) {                                               \
                    v16 s = query[g][0] * key[0];                                                   \
                    for (int j = 1; j < NV; j++) s += query[g][j] * key[j];                         \
                    score[g][t] = sum16(s);                                                         \
                }                                                                                   \
            }                                                                                       \
            for (int64_t g = 0; g < group; g++) {                                                   \
                float block_max = running_max[g];                                                   \
                for (int64_t t = 0; t < n; t++) block_max = score[g][t] > block_max ? score[g][t] : block_max; \
                const float correction = exp_nonpositive(running_max[g] - block_max);               \
                float sum = 0.0f;                                                                   \
                _Pragma("omp simd reduction(+ : sum)")                                              \
                for (int64_t t = 0; t < n; t++) {                                                   \
                    const float p = exp_nonpositive(score[g][t] - block_max);                       \
                    score[g][t] = p;                                                                \
                    sum += p;                                                                       \
                }                                                                                   \
                total[g] = total[g] * correction + sum;                                             \
                running_max[g] = block_max;                                                         \
                if (correction != 1.0f)                                                             \
                    for (int j = 0; j < NV; j++) acc[g][j] *= correction;                           \
            }                                                                                       \
            for (int64_t t = 0; t < n; t++) {                                                       \
                v16 value[NV];                                                                      \
                for (int j = 0; j < NV; j++) value[j] = LOAD(v_cache + base + t * token_stride + 16 * j); \
                for (int64_t g = 0; g < group; g++) {                                               \
                    const float p = score[g][t];                                                    \
                    for (int j = 0; j < NV; j++) acc[g][j] += p * value[j];                         \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
        for (int64_t g = 0; g < group; g++) {                                                       \
            const float inverse = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;                         \
            for (int j = 0; j < NV; j++) STORE(out_row + g * 16 * NV + 16 * j, acc[g][j] * inverse); \
        }                                                                                           \
    }

DEFINE_TASK(task_f32_64, float, load_f32, store_f32, 4)
DEFINE_TASK(task_f32_128, float, load_f32, store_f32, 8)
DEFINE_TASK(task_f32_256, float, load_f32, store_f32, 16)
DEFINE_TASK(task_bf16_64, uint16_t, load_bf16, store_bf16, 4)
DEFINE_TASK(task_bf16_128, uint16_t, load_bf16, store_bf16, 8)
DEFINE_TASK(task_bf16_256, uint16_t, load_bf16, store_bf16, 16)

#define DEFINE_PAGED_DECODE(NAME, T, TASK64, TASK128, TASK256)                                      \
    int NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                      \
             const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,            \
             const int64_t *query_tokens, T *out, int64_t out_stride, int64_t rows, int64_t heads,  \
             int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int threads) {         \
        if (kv_heads <= 0 || heads % kv_heads != 0) return 1;                                       \
        const int64_t group = heads / kv_heads;                                                     \
        if (group > MAX_GROUP || block_size > MAX_BLOCK) return 1;                                  \
        void (*task)(const T *, const T *, const T *, const int64_t *, int64_t, T *, int64_t,      \
                     int64_t, int64_t, float) =                                                     \
            dim == 64 ? TASK64 : dim == 128 ? TASK128 : dim == 256 ? TASK256 : NULL;                \
        if (task == NULL) return 1;                                                                 \
        const int64_t token_stride = kv_heads * dim;                                                \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(threads)")               \
        for (int64_t r = 0; r < rows; r++) {                                                        \
            for (int64_t h = 0; h < kv_heads; h++) {                                                \
                task(q + query_tokens[r] * q_stride + h * group * dim, k_cache + h * dim,           \
                     v_cache + h * dim, block_tables + r * table_stride, seq_lens[r],               \
                     out + query_tokens[r] * out_stride + h * group * dim, group, token_stride,     \
                     block_size, scale);                                                            \
            }                                                                                       \
        }                                                                                           \
        return 0;                                                                                   \
    }

DEFINE_PAGED_DECODE(baton_paged_decode_f32, float, task_f32_64, task_f32_128, task_f32_256)
DEFINE_PAGED_DECODE(baton_paged_decode_bf16, uint16_t, task_bf16_64, task_bf16_128, task_bf16_256)
