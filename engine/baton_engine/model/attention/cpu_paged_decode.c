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
 * Built by cpu_paged_decode.py with -fopenmp; the caller passes its torch thread count. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_DIM 256
#define MAX_BLOCK 64

int baton_paged_decode_limits(int64_t *group, int64_t *dim, int64_t *block) {
    *group = MAX_GROUP;
    *dim = MAX_DIM;
    *block = MAX_BLOCK;
    return 0;
}

/* exp(x) for x <= 0 (every argument here is a score minus a running maximum), to about 2 ulp:
 * x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial, 2^n by exponent
 * bits. Written out so that it vectorises (libm's expf does not without -ffast-math, which this
 * file must not use: the rounding above relies on exact float arithmetic). */
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

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float x) { p[i] = x; }

static inline float load_bf16(const uint16_t *p, int64_t i) {
    const uint32_t bits = (uint32_t)p[i] << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

static inline void store_bf16(uint16_t *p, int64_t i, float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN stays a (quiet) NaN */
        p[i] = (uint16_t)((bits >> 16) | 0x40u);
        return;
    }
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest, ties to even, as torch does */
    p[i] = (uint16_t)(bits >> 16);
}

#define DEFINE_PAGED_DECODE(NAME, T, LOAD, STORE)                                                   \
    int NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache,                     \
             const int64_t *block_tables, int64_t table_stride, const int64_t *seq_lens,           \
             const int64_t *query_tokens, T *out, int64_t out_stride, int64_t rows, int64_t heads, \
             int64_t kv_heads, int64_t dim, int64_t block_size, float scale, int threads) {        \
        if (kv_heads <= 0 || heads % kv_heads != 0) return 1;                                      \
        const int64_t group = heads / kv_heads;                                                    \
        if (group > MAX_GROUP || dim > MAX_DIM || block_size > MAX_BLOCK) return 1;                \
        const int64_t token_stride = kv_heads * dim;                                               \
        _Pragma("omp parallel for collapse(2) schedule(static) num_threads(threads)")              \
        for (int64_t r = 0; r < rows; r++) {                                                       \
            for (int64_t h = 0; h < kv_heads; h++) {                                               \
                float query[MAX_GROUP][MAX_DIM], acc[MAX_GROUP][MAX_DIM];                          \
                float score[MAX_GROUP][MAX_BLOCK], running_max[MAX_GROUP], total[MAX_GROUP];       \
                const T *q_row = q + query_tokens[r] * q_stride + h * group * dim;                 \
                for (int64_t g = 0; g < group; g++) {                                              \
                    for (int64_t d = 0; d < dim; d++) query[g][d] = LOAD(q_row, g * dim + d) * scale; \
                    memset(acc[g], 0, sizeof(float) * (size_t)dim);                                \
                    running_max[g] = -INFINITY;                                                    \
                    total[g] = 0.0f;                                                               \
                }                                                                                  \
                const int64_t length = seq_lens[r];                                                \
                const int64_t *table = block_tables + r * table_stride;                            \
                for (int64_t start = 0; start < length; start += block_size) {                     \
                    const int64_t n = length - start < block_size ? length - start : block_size;   \
                    const int64_t base = table[start / block_size] * block_size * token_stride + h * dim; \
                    for (int64_t t = 0; t < n; t++) {                                              \
                        const T *key = k_cache + base + t * token_stride;                          \
                        for (int64_t g = 0; g < group; g++) {                                      \
                            float s = 0.0f;                                                        \
                            _Pragma("omp simd reduction(+ : s)")                                   \
                            for (int64_t d = 0; d < dim; d++) s += query[g][d] * LOAD(key, d);     \
                            score[g][t] = s;                                                       \
                        }                                                                          \
                    }                                                                              \
                    for (int64_t g = 0; g < group; g++) {                                          \
                        float block_max = running_max[g];                                          \
                        for (int64_t t = 0; t < n; t++) block_max = score[g][t] > block_max ? score[g][t] : block_max; \
                        const float correction = exp_nonpositive(running_max[g] - block_max);      \
                        float sum = 0.0f;                                                          \
                        _Pragma("omp simd reduction(+ : sum)")                                     \
                        for (int64_t t = 0; t < n; t++) {                                          \
                            const float p = exp_nonpositive(score[g][t] - block_max);              \
                            score[g][t] = p;                                                       \
                            sum += p;                                                              \
                        }                                                                          \
                        total[g] = total[g] * correction + sum;                                    \
                        running_max[g] = block_max;                                                \
                        if (correction != 1.0f) {                                                  \
                            _Pragma("omp simd")                                                    \
                            for (int64_t d = 0; d < dim; d++) acc[g][d] *= correction;             \
                        }                                                                          \
                    }                                                                              \
                    for (int64_t t = 0; t < n; t++) {                                              \
                        const T *value = v_cache + base + t * token_stride;                        \
                        for (int64_t g = 0; g < group; g++) {                                      \
                            const float p = score[g][t];                                           \
                            _Pragma("omp simd")                                                    \
                            for (int64_t d = 0; d < dim; d++) acc[g][d] += p * LOAD(value, d);     \
                        }                                                                          \
                    }                                                                              \
                }                                                                                  \
                T *out_row = out + query_tokens[r] * out_stride + h * group * dim;                 \
                for (int64_t g = 0; g < group; g++) {                                              \
                    const float inverse = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;                \
                    for (int64_t d = 0; d < dim; d++) STORE(out_row, g * dim + d, acc[g][d] * inverse); \
                }                                                                                  \
            }                                                                                      \
        }                                                                                          \
        return 0;                                                                                  \
    }

DEFINE_PAGED_DECODE(baton_paged_decode_f32, float, load_f32, store_f32)
DEFINE_PAGED_DECODE(baton_paged_decode_bf16, uint16_t, load_bf16, store_bf16)
