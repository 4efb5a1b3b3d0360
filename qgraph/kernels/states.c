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

/* a * r + k * v, rounded as the vector loops round it (one fused multiply-add where there is one;
   built with -ffp-contract=off, so the compiler fuses nothing else), so the float32 and bfloat16
   outputs are the same numbers. */
static inline float step(float a, float r, float k, float v) {
#if defined(__FMA__)
    return __builtin_fmaf(a, r, k * v);
#else
    return a * r + k * v;
#endif
}

/* One [v_dim] row of S_t: row <- a * row + ki * vt, streamed to out as float32 (bf16 == 0) or as
   bfloat16 (bf16 == 1). A vector loop where the row is aligned, the scalar step for the rest. */
static inline void row_step(float *restrict row, const float *restrict vt, float a, float ki,
                            void *restrict out, int64_t v_dim, int bf16) {
    int64_t j = 0;
#if defined(__AVX512F__)
    if (((uintptr_t)out & (bf16 ? 31 : 63)) == 0) {
        const __m512 av = _mm512_set1_ps(a), kv = _mm512_set1_ps(ki);
        const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff), nan = _mm512_set1_epi32(0x7fc0);
        for (; j + 16 <= v_dim; j += 16) {
            __m512 r = _mm512_fmadd_ps(av, _mm512_loadu_ps(row + j), _mm512_mul_ps(kv, _mm512_loadu_ps(vt + j)));
            _mm512_storeu_ps(row + j, r);
            if (!bf16) {
                _mm512_stream_ps((float *)out + j, r);
                continue;
            }
            __m512i u = _mm512_castps_si512(r);  /* to_bf16, sixteen at a time */
            __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
            __m512i high = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(half, odd)), 16);
            high = _mm512_mask_mov_epi32(high, _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q), nan);
            _mm256_stream_si256((__m256i *)((uint16_t *)out + j), _mm512_cvtepi32_epi16(high));
        }
    }
#elif defined(__AVX__)
    if (!bf16 && ((uintptr_t)out & 31) == 0) {
        const __m256 av = _mm256_set1_ps(a), kv = _mm256_set1_ps(ki);
        for (; j + 8 <= v_dim; j += 8) {
            __m256 vk = _mm256_mul_ps(kv, _mm256_loadu_ps(vt + j));
#if defined(__FMA__)
            __m256 r = _mm256_fmadd_ps(av, _mm256_loadu_ps(row + j), vk);
#else
            __m256 r = _mm256_add_ps(_mm256_mul_ps(av, _mm256_loadu_ps(row + j)), vk);
#endif
            _mm256_storeu_ps(row + j, r);
            _mm256_stream_ps((float *)out + j, r);
        }
    }
#endif
    for (; j < v_dim; j++) {
        row[j] = step(a, row[j], ki, vt[j]);
        if (bf16)
            ((uint16_t *)out)[j] = to_bf16(row[j]);
        else
            ((float *)out)[j] = row[j];
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
                void *o = bf16 ? (void *)((uint16_t *)out + offset + i * v_dim) : (void *)((float *)out + offset + i * v_dim);
                row_step(s + i * v_dim, vt, a, kt[i], o, v_dim, bf16);
            }
        }
    }
#if defined(__SSE2__)
    _mm_sfence(); /* streaming stores are visible to every thread before we return */
#endif
}
