/* The pieces of XXH3-64 that the copy loops of the _copyhash module run inside their copies
 * (cuda_ext/_copyhash.c, _copyhash_pieces.c): the secret, one stripe's accumulate, a block's
 * scramble, the end; and the stores a copy takes. */
#ifndef FLATCAKE_XXH3_STRIPES_H
#define FLATCAKE_XXH3_STRIPES_H
#include <stdint.h>
#include <string.h>

/* XXH3-64 computed inside the copy loop: each 64-byte stripe is loaded once, stored to the
 * destination and fed to the hash from the same registers, so the hash costs no second read
 * of the bytes and runs in the time the loads wait on memory. Large copies store past the
 * cache (non-temporal stores: no read of the destination's lines before they are written,
 * a third less memory traffic), since nobody reads a restored or written page right away.
 * Measured here on 224 MB in 64 KiB blocks, 2 threads: copy then hash 20.6 GB/s, this pass
 * 34 (glibc memcpy alone 25). It is the XXH3-64 (seed 0, default secret) of inputs over 240
 * bytes, i.e. what libxxhash answers (a test compares them); the rest go the plain way.
 * AVX2 only, chosen at run time; elsewhere copy then hash as before. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FUSED_XXH3 1
#define XXH3_MIDSIZE_MAX 240
#define NT_MIN_BYTES 65536 /* shorter copies keep normal stores: their lines stay in cache */

static const uint8_t XXH3_SECRET[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};
#define XXH_PRIME32_1 0x9E3779B1U
#define XXH_PRIME32_2 0x85EBCA77U
#define XXH_PRIME32_3 0xC2B2AE3DU
#define XXH_PRIME64_1 0x9E3779B185EBCA87ULL
#define XXH_PRIME64_2 0xC2B2AE3D27D4EB4FULL
#define XXH_PRIME64_3 0x165667B19E3779F9ULL
#define XXH_PRIME64_4 0x85EBCA77C2B2AE63ULL
#define XXH_PRIME64_5 0x27D4EB2F165667C5ULL

enum store_kind { STORE_CACHED, STORE_STREAM_16, STORE_STREAM_32 };
static inline enum store_kind store_kind_for(const char *dst, size_t length) {
    if (length < NT_MIN_BYTES) return STORE_CACHED;
    if (((uintptr_t)dst & 31) == 0) return STORE_STREAM_32;
    if (((uintptr_t)dst & 15) == 0) return STORE_STREAM_16;
    return STORE_CACHED;
}

__attribute__((target("avx2"))) static inline void store_64(char *dst, __m256i a, __m256i b,
                                                             enum store_kind kind) {
    if (kind == STORE_STREAM_32) {
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
    } else if (kind == STORE_STREAM_16) {
        _mm_stream_si128((__m128i *)dst, _mm256_castsi256_si128(a));
        _mm_stream_si128((__m128i *)(dst + 16), _mm256_extracti128_si256(a, 1));
        _mm_stream_si128((__m128i *)(dst + 32), _mm256_castsi256_si128(b));
        _mm_stream_si128((__m128i *)(dst + 48), _mm256_extracti128_si256(b, 1));
    } else {
        _mm256_storeu_si256((__m256i *)dst, a);
        _mm256_storeu_si256((__m256i *)(dst + 32), b);
    }
}

/* One XXH3 accumulate step of a 64-byte stripe held in (a, b) with the secret at ``key``. */
__attribute__((target("avx2"))) static inline void accumulate_512(__m256i *acc, __m256i a,
                                                                   __m256i b,
                                                                   const uint8_t *key) {
    __m256i ka = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)key));
    __m256i kb = _mm256_xor_si256(b, _mm256_loadu_si256((const __m256i *)(key + 32)));
    __m256i pa = _mm256_mul_epu32(ka, _mm256_shuffle_epi32(ka, 0x31));
    __m256i pb = _mm256_mul_epu32(kb, _mm256_shuffle_epi32(kb, 0x31));
    acc[0] = _mm256_add_epi64(acc[0], _mm256_add_epi64(pa, _mm256_shuffle_epi32(a, 0x4E)));
    acc[1] = _mm256_add_epi64(acc[1], _mm256_add_epi64(pb, _mm256_shuffle_epi32(b, 0x4E)));
}

__attribute__((target("avx2"))) static inline __m256i scramble_256(__m256i acc,
                                                                  const uint8_t *key) {
    const __m256i prime = _mm256_set1_epi32((int)XXH_PRIME32_1);
    acc = _mm256_xor_si256(acc, _mm256_srli_epi64(acc, 47));
    acc = _mm256_xor_si256(acc, _mm256_loadu_si256((const __m256i *)key));
    __m256i high = _mm256_mul_epu32(_mm256_srli_epi64(acc, 32), prime);
    return _mm256_add_epi64(_mm256_mul_epu32(acc, prime), _mm256_slli_epi64(high, 32));
}

static inline uint64_t read_64(const void *at) {
    uint64_t value;
    memcpy(&value, at, 8);
    return value;
}

static inline uint64_t mul_fold_64(uint64_t a, uint64_t b) {
    __uint128_t product = (__uint128_t)a * b;
    return (uint64_t)product ^ (uint64_t)(product >> 64);
}

/* Copy the 64-byte stripe at ``at`` and feed it to the hash with the secret at ``key``. */
__attribute__((target("avx2"))) static inline void copy_stripe(char *dst, const char *src,
                                                                size_t at, __m256i *acc,
                                                                const uint8_t *key,
                                                                enum store_kind kind) {
    __m256i a = _mm256_loadu_si256((const __m256i *)(src + at));
    __m256i b = _mm256_loadu_si256((const __m256i *)(src + at + 32));
    store_64(dst + at, a, b, kind);
    accumulate_512(acc, a, b, key);
}

/* XXH3-64's accumulator at the start of an input (seed 0). */
__attribute__((target("avx2"))) static inline void xxh3_start(__m256i *acc) {
    static const uint64_t init[8] = {XXH_PRIME32_3, XXH_PRIME64_1, XXH_PRIME64_2,
                                     XXH_PRIME64_3, XXH_PRIME64_4, XXH_PRIME32_2,
                                     XXH_PRIME64_5, XXH_PRIME32_1};
    acc[0] = _mm256_loadu_si256((const __m256i *)init);
    acc[1] = _mm256_loadu_si256((const __m256i *)(init + 4));
}

/* XXH3-64's end for an input of ``length`` (> 240) bytes: its last 64 bytes, read at
 * ``last``, accumulated with the last secret, then the lanes merged and mixed. */
__attribute__((target("avx2"))) static inline uint64_t xxh3_finish(__m256i *acc, const char *last,
                                                           size_t length) {
    accumulate_512(acc, _mm256_loadu_si256((const __m256i *)last),
                   _mm256_loadu_si256((const __m256i *)(last + 32)),
                   XXH3_SECRET + sizeof(XXH3_SECRET) - 64 - 7);
    uint64_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, acc[0]);
    _mm256_storeu_si256((__m256i *)(lanes + 4), acc[1]);
    uint64_t result = (uint64_t)length * XXH_PRIME64_1;
    const uint8_t *merge_key = XXH3_SECRET + 11;
    for (int i = 0; i < 4; i++)
        result += mul_fold_64(lanes[2 * i] ^ read_64(merge_key + 16 * i),
                              lanes[2 * i + 1] ^ read_64(merge_key + 16 * i + 8));
    result ^= result >> 37;
    result *= 0x165667919E3779F9ULL;
    return result ^ (result >> 32);
}
#endif
#endif
