/* The DeltaNet state after every token of one chunk, written straight into the states buffer.
 *
 * Compiled at first use by qgraph/kernels/native.py (the C compiler, -O3 -march=native) and called
 * through ctypes. Given the state entering the chunk, the chunk's (normalised) keys k_t, its
 * corrected values d_t and per-token decays a_t, it runs the recurrence
 *
 *     S_t = a_t * S_{t-1} + k_t d_t^T
 *
 * once per token, keeping S in cache, and writes each S_t with non-temporal stores: writing the
 * states is the whole cost (256 MiB per 0.8B block at 256 tokens), and streaming stores skip
 * reading each destination line first. Math is float32; the output is float32 or bfloat16.
 */
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* float32 -> bfloat16 as torch rounds it: to nearest even, every NaN to 0x7fc0. */
static inline uint16_t to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* One [v_dim] row of S_t: row <- a * row + ki * vt, stored to out as float32. */
static inline void row_f32(float *restrict row, const float *restrict vt, float a, float ki,
                           float *restrict out, int64_t v_dim) {
    int64_t j = 0;
#if defined(__AVX512F__)
    if (((uintptr_t)out & 63) == 0) {
        const __m512 av = _mm512_set1_ps(a), kv = _mm512_set1_ps(ki);
        for (; j + 16 <= v_dim; j += 16) {
            __m512 r = _mm512_fmadd_ps(av, _mm512_loadu_ps(row + j), _mm512_mul_ps(kv, _mm512_loadu_ps(vt + j)));
            _mm512_storeu_ps(row + j, r);
            _mm512_stream_ps(out + j, r);
        }
    }
#elif defined(__AVX__)
    if (((uintptr_t)out & 31) == 0) {
        const __m256 av = _mm256_set1_ps(a), kv = _mm256_set1_ps(ki);
        for (; j + 8 <= v_dim; j += 8) {
            __m256 r = _mm256_add_ps(_mm256_mul_ps(av, _mm256_loadu_ps(row + j)),
                                     _mm256_mul_ps(kv, _mm256_loadu_ps(vt + j)));
            _mm256_storeu_ps(row + j, r);
            _mm256_stream_ps(out + j, r);
        }
    }
#endif
    for (; j < v_dim; j++) {
        row[j] = a * row[j] + ki * vt[j];
        out[j] = row[j];
    }
}

/* Rows h in [first, last) of the flattened (batch, head) pairs; heads per batch element `heads`.
 * state  [rows, k_dim, v_dim] float32: the entering states, left holding each row's last state;
 * key    [rows, length, k_dim], values [rows, length, v_dim], decay [rows, length] float32;
 * out    element (b, t, h) of the states at out + b*batch_stride + t*token_stride + h*head_stride
 *        (in elements), each a contiguous [k_dim, v_dim] block; float32, or bfloat16 if bf16. */
void qgraph_chunk_states(float *state, const float *key, const float *values, const float *decay,
                         void *out, int64_t first, int64_t last, int64_t heads, int64_t length,
                         int64_t k_dim, int64_t v_dim, int64_t batch_stride, int64_t token_stride,
                         int64_t head_stride, int bf16) {
    for (int64_t h = first; h < last; h++) {
        float *s = state + h * k_dim * v_dim;
        const float *kh = key + h * length * k_dim, *vh = values + h * length * v_dim;
        for (int64_t t = 0; t < length; t++) {
            const float a = decay[h * length + t];
            const float *kt = kh + t * k_dim, *vt = vh + t * v_dim;
            const int64_t offset = (h / heads) * batch_stride + t * token_stride + (h % heads) * head_stride;
            for (int64_t i = 0; i < k_dim; i++) {
                float *restrict row = s + i * v_dim;
                const float ki = kt[i];
                if (bf16) {
                    uint16_t *restrict o = (uint16_t *)out + offset + i * v_dim;
                    for (int64_t j = 0; j < v_dim; j++) {
                        row[j] = a * row[j] + ki * vt[j];
                        o[j] = to_bf16(row[j]);
                    }
                } else {
                    row_f32(row, vt, a, ki, (float *)out + offset + i * v_dim, v_dim);
                }
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence(); /* streaming stores are visible to every thread before we return */
#endif
}
