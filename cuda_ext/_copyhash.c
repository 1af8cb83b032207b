/* Copies and block checksums in one pass over memory. A checked DRAM restore and a put that
 * writes into the owner's memory otherwise read every byte twice (a copy, then a hash pass
 * over bytes long evicted), and the second pass cost more than the copy.
 *
 * Where the CPU has AVX2, a row that hashes the bytes it copies is hashed inside the copy
 * loop (copy_xxh3 below: XXH3-64, exactly libxxhash's, from the registers each stripe was
 * loaded into); elsewhere, and for rows of 240 bytes or less, each piece is copied and then
 * hashed right after, while it is in cache, by the caller's XXH3-64 (libxxhash's, its vector
 * dispatcher where it has one, passed as an address that cuda_ext/host_hash.py found through
 * ctypes). The GIL is released for the whole batch: several threads run one batch at once,
 * each claiming the next rows (cuda_ext/host_hash.py copy_and_hash). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

typedef uint64_t (*xxh3_fn)(const void *, size_t);

#if defined(__x86_64__)
/* glibc's memcpy (2.36, rep movsb on this AMD EPYC) slows to half or less where source and
 * destination sit differently against a 64-byte line: 7.4 GB/s for a destination 16 bytes
 * off (a numpy array's usual place) and a page-aligned source, 3.0 at 8, against 16-17 where
 * both sit alike. Such pairs take 16-byte unaligned loads and aligned stores instead, which
 * ran at 16-17 GB/s for every offset measured (SSE2: every x86-64 has it); pairs that sit
 * alike keep memcpy, as fast there and faster on bytes in cache (wider vectors). */
static void copy_bytes(char *dst, const char *src, size_t length) {
    if (length < 256 || (((uintptr_t)dst ^ (uintptr_t)src) & 63) == 0) {
        memcpy(dst, src, length);
        return;
    }
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    memcpy(dst, src, head);
    size_t i = head;
    for (; i + 64 <= length; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_store_si128((__m128i *)(dst + i), a);
        _mm_store_si128((__m128i *)(dst + i + 16), b);
        _mm_store_si128((__m128i *)(dst + i + 32), c);
        _mm_store_si128((__m128i *)(dst + i + 48), d);
    }
    memcpy(dst + i, src + i, length - i);
}
#else
static void copy_bytes(char *dst, const char *src, size_t length) { memcpy(dst, src, length); }
#endif

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

static int have_avx2 = 0;

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}

static enum store_kind store_kind_for(const char *dst, size_t length) {
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

/* XXH3-64's end for an input of ``length`` (> 240) bytes: its last 64 bytes, read at
 * ``last``, accumulated with the last secret, then the lanes merged and mixed. */
__attribute__((target("avx2"))) static uint64_t xxh3_finish(__m256i *acc, const char *last,
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

/* Copy ``length`` (> 240) bytes from ``src`` to ``dst`` (no overlap) and answer their XXH3-64.
 * The last stripe, which XXH3 takes again from the input's end, is read back from ``again``
 * (the destination for a reader's check, the source for a writer's own sums). */
__attribute__((target("avx2"))) static uint64_t copy_xxh3(char *dst, const char *src,
                                                         size_t length, const char *again) {
    static const uint64_t init[8] = {XXH_PRIME32_3, XXH_PRIME64_1, XXH_PRIME64_2,
                                     XXH_PRIME64_3, XXH_PRIME64_4, XXH_PRIME32_2,
                                     XXH_PRIME64_5, XXH_PRIME32_1};
    enum store_kind kind = store_kind_for(dst, length);
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)init),
                      _mm256_loadu_si256((const __m256i *)(init + 4))};
    const size_t stripes_per_block = (sizeof(XXH3_SECRET) - 64) / 8; /* 16: 1 KiB blocks */
    const size_t block_bytes = 64 * stripes_per_block;
    const size_t blocks = (length - 1) / block_bytes;
    size_t at = 0;
    for (size_t block = 0; block < blocks; block++) {
        for (size_t n = 0; n < stripes_per_block; n++, at += 64)
            copy_stripe(dst, src, at, acc, XXH3_SECRET + 8 * n, kind);
        acc[0] = scramble_256(acc[0], XXH3_SECRET + sizeof(XXH3_SECRET) - 64);
        acc[1] = scramble_256(acc[1], XXH3_SECRET + sizeof(XXH3_SECRET) - 32);
    }
    const size_t stripes = ((length - 1) - at) / 64;
    for (size_t n = 0; n < stripes; n++, at += 64)
        copy_stripe(dst, src, at, acc, XXH3_SECRET + 8 * n, kind);
    memcpy(dst + at, src + at, length - at);
    if (kind != STORE_CACHED) _mm_sfence();
    return xxh3_finish(acc, again + length - 64, length);
}

/* As copy_xxh3, the source's bytes going to ``pieces`` destinations of ``piece_bytes`` each
 * instead of one (a block of pages whose pages are split in the reader's memory: vLLM's K
 * and V planes, or slots apart). ``piece_bytes`` is a multiple of 64 and ``length`` of
 * ``piece_bytes``, so no stripe straddles two pieces; the last stripe is read back from the
 * last piece, where it was stored (what is hashed is what the reader keeps). Each piece's
 * stores are chosen by the whole block's length, not the piece's: a block of 64 KiB in 16 KiB
 * K and V pieces is as long a copy, and non-temporal stores took it from 2.0 to 0.8-1.1 ms
 * a 15.7 MB restore (16 KiB pieces, 2 threads; cached stores read every line first). */
__attribute__((target("avx2"))) static uint64_t copy_xxh3_pieces(const int64_t *pieces,
                                                                size_t piece_bytes,
                                                                const char *src,
                                                                size_t length) {
    static const uint64_t init[8] = {XXH_PRIME32_3, XXH_PRIME64_1, XXH_PRIME64_2,
                                     XXH_PRIME64_3, XXH_PRIME64_4, XXH_PRIME32_2,
                                     XXH_PRIME64_5, XXH_PRIME32_1};
    __m256i acc[2] = {_mm256_loadu_si256((const __m256i *)init),
                      _mm256_loadu_si256((const __m256i *)(init + 4))};
    const size_t stripes_per_block = (sizeof(XXH3_SECRET) - 64) / 8;
    const size_t block_bytes = 64 * stripes_per_block;
    const size_t blocks = (length - 1) / block_bytes;
    /* ``shifted + at`` is where source byte ``at`` goes: the current piece, moved back by the
     * bytes before it (integer arithmetic, never a pointer outside a piece). */
    size_t piece = 0, piece_end = piece_bytes;
    uintptr_t shifted = (uintptr_t)pieces[0];
    enum store_kind kind = store_kind_for((const char *)shifted, length);
    size_t at = 0;
#define NEXT_PIECE_AT(at)                                                           \
    if ((at) == piece_end) {                                                         \
        piece++;                                                                     \
        shifted = (uintptr_t)pieces[piece] - (at);                                   \
        piece_end += piece_bytes;                                                    \
        kind = store_kind_for((const char *)(uintptr_t)pieces[piece], length);      \
    }
    for (size_t block = 0; block < blocks; block++) {
        for (size_t n = 0; n < stripes_per_block; n++, at += 64) {
            NEXT_PIECE_AT(at)
            copy_stripe((char *)shifted, src, at, acc, XXH3_SECRET + 8 * n, kind);
        }
        acc[0] = scramble_256(acc[0], XXH3_SECRET + sizeof(XXH3_SECRET) - 64);
        acc[1] = scramble_256(acc[1], XXH3_SECRET + sizeof(XXH3_SECRET) - 32);
    }
    const size_t stripes = ((length - 1) - at) / 64;
    for (size_t n = 0; n < stripes; n++, at += 64) {
        NEXT_PIECE_AT(at)
        copy_stripe((char *)shifted, src, at, acc, XXH3_SECRET + 8 * n, kind);
    }
    NEXT_PIECE_AT(at)
#undef NEXT_PIECE_AT
    memcpy((char *)(shifted + at), src + at, length - at); /* the last stripe: one piece */
    _mm_sfence(); /* any piece's non-temporal stores are visible before the read back */
    return xxh3_finish(acc, (const char *)(uintptr_t)pieces[piece] + piece_bytes - 64, length);
}

/* A long copy with non-temporal stores (the destination's lines are not read first). */
__attribute__((target("avx2"))) static void copy_streaming(char *dst, const char *src,
                                                           size_t length,
                                                           enum store_kind kind) {
    size_t at = 0;
    for (; at + 64 <= length; at += 64)
        store_64(dst + at, _mm256_loadu_si256((const __m256i *)(src + at)),
                 _mm256_loadu_si256((const __m256i *)(src + at + 32)), kind);
    memcpy(dst + at, src + at, length - at);
    _mm_sfence();
}
#endif

static int writable_array(PyObject *obj, Py_buffer *view, Py_ssize_t item, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % item != 0) {
        PyErr_Format(PyExc_ValueError, "%s is not an array of %zd-byte items", name, item);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* One op: the fused pass where it applies (AVX2, a row that hashes the bytes it copies, over
 * 240 of them), else the copy and then the hash. */
static void run_row(const int64_t *row, xxh3_fn xxh3, uint64_t *sum) {
    char *dst = (char *)(uintptr_t)row[0];
    const char *src = (const char *)(uintptr_t)row[1];
    const char *hash_at = (const char *)(uintptr_t)row[3];
    size_t length = (size_t)row[2];
#ifdef FUSED_XXH3
    if (have_avx2 && dst != NULL && length > XXH3_MIDSIZE_MAX &&
        (hash_at == dst || hash_at == src)) {
        *sum = copy_xxh3(dst, src, length, hash_at);
        return;
    }
    if (have_avx2 && dst != NULL && hash_at == NULL) {
        enum store_kind kind = store_kind_for(dst, length);
        if (kind != STORE_CACHED) {
            copy_streaming(dst, src, length, kind);
            return;
        }
    }
#endif
    if (dst != NULL) copy_bytes(dst, src, length);
    if (hash_at != NULL) *sum = xxh3(hash_at, length);
}

/* copy_hash(ops, sums, next, xxh3_address): for each op i of ``ops`` (an int64 array of rows
 * (dst, src, length, hash_at)), copy ``length`` bytes from ``src`` to ``dst`` when ``dst`` is
 * not 0, then, when ``hash_at`` is not 0, store the XXH3-64 of the ``length`` bytes at
 * ``hash_at`` in sums[i]. ``xxh3_address`` may be 0 where no op hashes.
 *
 * Rows are claimed one at a time from the shared counter ``next`` (an int64 array of one
 * item, 0 at the start), and several threads call it with the same arrays at once: a thread
 * that starts late or runs slower claims fewer rows. Fixed shares left the first thread done
 * and waiting for the other: 16 MB batches on 2 threads ran at 0.75 of one 224 MB batch. */
static PyObject *copy_hash(PyObject *self, PyObject *args) {
    PyObject *ops_obj, *sums_obj, *next_obj;
    unsigned long long address;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "OOOKn", &ops_obj, &sums_obj, &next_obj, &address, &step))
        return NULL;
    Py_buffer ops, sums, next;
    if (writable_array(ops_obj, &ops, 4 * sizeof(int64_t), "ops") < 0) return NULL;
    if (writable_array(sums_obj, &sums, sizeof(uint64_t), "sums") < 0) {
        PyBuffer_Release(&ops);
        return NULL;
    }
    if (writable_array(next_obj, &next, sizeof(int64_t), "next") < 0) {
        PyBuffer_Release(&ops);
        PyBuffer_Release(&sums);
        return NULL;
    }
    Py_ssize_t count = ops.len / (Py_ssize_t)(4 * sizeof(int64_t));
    const int64_t *rows = (const int64_t *)ops.buf;
    const char *error = NULL;
    if (sums.len / (Py_ssize_t)sizeof(uint64_t) != count || next.len != sizeof(int64_t))
        error = "ops, sums and next do not agree";
    if (step < 1) error = "a step of no rows";
    for (Py_ssize_t i = 0; error == NULL && i < count; i++)
        if (rows[4 * i + 3] != 0 && address == 0) error = "an op hashes and no XXH3 function address";
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        PyBuffer_Release(&ops);
        PyBuffer_Release(&sums);
        PyBuffer_Release(&next);
        return NULL;
    }
    uint64_t *found = (uint64_t *)sums.buf;
    int64_t *counter = (int64_t *)next.buf;
    xxh3_fn xxh3 = (xxh3_fn)(uintptr_t)address;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        int64_t first = __atomic_fetch_add(counter, (int64_t)step, __ATOMIC_RELAXED);
        if (first >= count) break;
        int64_t end = first + step < count ? first + step : count;
        for (int64_t i = first; i < end; i++) run_row(rows + 4 * i, xxh3, found + i);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ops);
    PyBuffer_Release(&sums);
    PyBuffer_Release(&next);
    Py_RETURN_NONE;
}

#ifdef FUSED_XXH3
/* The first problem with a pieces batch, or NULL: every row's pieces must exist and each
 * stripe land in one piece (the fused pass is the only one: there is no plain fallback for
 * pieces, the caller checks ``pieces_pass`` first). */
static const char *pieces_problem(const int64_t *rows, Py_ssize_t count, Py_ssize_t pieces) {
    if (!have_avx2) return "the pieces pass needs AVX2";
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t length = rows[4 * i + 1], first = rows[4 * i + 2], piece = rows[4 * i + 3];
        if (length <= XXH3_MIDSIZE_MAX || piece <= 0 || piece % 64 || length % piece)
            return "a row's length must exceed 240 bytes and be whole pieces of a multiple of 64";
        if (first < 0 || first + length / piece > pieces) return "a row's pieces run past the list";
    }
    return NULL;
}
#endif

/* copy_hash_pieces(rows, pieces, sums, next, step): for each row i of ``rows`` (an int64
 * array of rows (src, length, first_piece, piece_bytes)), copy ``length`` bytes from ``src``
 * into the destinations ``pieces[first_piece]``, ``pieces[first_piece + 1]``, ...,
 * ``piece_bytes`` each, and store their XXH3-64 in sums[i]. Rows are claimed from ``next``
 * ``step`` at a time by every thread that calls it with the same arrays, as copy_hash's. */
static PyObject *copy_hash_pieces(PyObject *self, PyObject *args) {
    PyObject *objects[4];
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "OOOOn", &objects[0], &objects[1], &objects[2], &objects[3],
                          &step))
        return NULL;
    static const Py_ssize_t items[4] = {4 * sizeof(int64_t), sizeof(int64_t), sizeof(uint64_t),
                                        sizeof(int64_t)};
    static const char *names[4] = {"rows", "pieces", "sums", "next"};
    Py_buffer views[4];
    int held = 0;
    for (; held < 4; held++)
        if (writable_array(objects[held], &views[held], items[held], names[held]) < 0) break;
    const char *error = NULL;
    Py_ssize_t count = 0;
    if (held == 4) {
        count = views[0].len / items[0];
        if (views[2].len / items[2] != count || views[3].len != items[3])
            error = "rows, sums and next do not agree";
        else if (step < 1)
            error = "a step of no rows";
#ifdef FUSED_XXH3
        else
            error = pieces_problem((const int64_t *)views[0].buf, count, views[1].len / items[1]);
#else
        else
            error = "the pieces pass needs AVX2";
#endif
        if (error != NULL) PyErr_SetString(PyExc_ValueError, error);
    }
#ifdef FUSED_XXH3
    if (held == 4 && error == NULL) {
        const int64_t *rows = (const int64_t *)views[0].buf;
        const int64_t *pieces = (const int64_t *)views[1].buf;
        uint64_t *found = (uint64_t *)views[2].buf;
        int64_t *counter = (int64_t *)views[3].buf;
        Py_BEGIN_ALLOW_THREADS
        for (;;) {
            int64_t first = __atomic_fetch_add(counter, (int64_t)step, __ATOMIC_RELAXED);
            if (first >= count) break;
            int64_t end = first + step < count ? first + step : count;
            for (int64_t i = first; i < end; i++) {
                const int64_t *row = rows + 4 * i;
                found[i] = copy_xxh3_pieces(pieces + row[2], (size_t)row[3],
                                            (const char *)(uintptr_t)row[0], (size_t)row[1]);
            }
        }
        Py_END_ALLOW_THREADS
    }
#endif
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    if (held < 4 || error != NULL) return NULL;
    Py_RETURN_NONE;
}

/* pieces_pass(): whether copy_hash_pieces runs here (AVX2, and use_avx2 left on). */
static PyObject *pieces_pass(PyObject *self, PyObject *args) {
#ifdef FUSED_XXH3
    return PyBool_FromLong(have_avx2);
#else
    Py_RETURN_FALSE;
#endif
}

/* libcrypto's EVP calls, by the addresses ``host_seal.py`` found them at (this file links
 * nothing: where libcrypto is missing, nothing here is called). */
typedef void *(*evp_new_fn)(void);
typedef void (*evp_free_fn)(void *);
typedef int (*evp_init_fn)(void *, const void *, void *, const unsigned char *,
                           const unsigned char *);
typedef int (*evp_update_fn)(void *, unsigned char *, int *, const unsigned char *, int);

/* One row, in place: the keystream from its counter block, ``skip`` bytes of it spent. */
static int ctr_row(void *ctx, evp_init_fn init, evp_update_fn update, const int64_t *row,
                   const unsigned char *counter) {
    unsigned char scratch[16];
    int done = 0;
    if (init(ctx, NULL, NULL, NULL, counter) != 1) return 0;
    if (row[2] > 0 && update(ctx, scratch, &done, scratch, (int)row[2]) != 1) return 0;
    unsigned char *at = (unsigned char *)(uintptr_t)row[0];
    for (int64_t left = row[1]; left > 0;) {
        int piece = left > (1 << 30) ? (1 << 30) : (int)left;
        if (update(ctx, at, &done, at, piece) != 1) return 0;
        at += piece;
        left -= piece;
    }
    return 1;
}

/* ctr_rows(rows, counters, next, key, addresses, step): for each row i of ``rows`` (an int64
 * array of rows (address, length, skip)), XOR ``length`` bytes at ``address`` in place with
 * the AES-256-CTR keystream of ``key`` from counter block ``counters[16 i : 16 i + 16]``,
 * its first ``skip`` bytes spent. ``addresses``: (EVP_aes_256_ctr(), EVP_CIPHER_CTX_new,
 * EVP_CIPHER_CTX_free, EVP_EncryptInit_ex, EVP_EncryptUpdate). Rows are claimed from the
 * shared counter ``next`` as in copy_hash, the GIL released; returns the rows that failed. */
static PyObject *ctr_rows(PyObject *self, PyObject *args) {
    PyObject *rows_obj, *counters_obj, *next_obj;
    Py_buffer key;
    unsigned long long cipher, new_at, free_at, init_at, update_at;
    Py_ssize_t step;
    if (!PyArg_ParseTuple(args, "OOOy*(KKKKK)n", &rows_obj, &counters_obj, &next_obj, &key,
                          &cipher, &new_at, &free_at, &init_at, &update_at, &step))
        return NULL;
    Py_buffer rows, counters, next;
    int have_rows = 0, have_counters = 0, have_next = 0;
    const char *error = NULL;
    if (writable_array(rows_obj, &rows, 3 * sizeof(int64_t), "rows") == 0) have_rows = 1;
    if (have_rows && writable_array(counters_obj, &counters, 16, "counters") == 0)
        have_counters = 1;
    if (have_counters && writable_array(next_obj, &next, sizeof(int64_t), "next") == 0)
        have_next = 1;
    if (!have_next) goto done;
    Py_ssize_t count = rows.len / (Py_ssize_t)(3 * sizeof(int64_t));
    if (counters.len != count * 16 || next.len != sizeof(int64_t)) error = "rows, counters and next do not agree";
    if (key.len != 32) error = "a key of 32 bytes";
    if (step < 1) error = "a step of no rows";
    if (!cipher || !new_at || !free_at || !init_at || !update_at) error = "a libcrypto address of 0";
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        goto done;
    }
    const int64_t *table = (const int64_t *)rows.buf;
    const unsigned char *blocks = (const unsigned char *)counters.buf;
    int64_t *claimed = (int64_t *)next.buf;
    const unsigned char *key_bytes = (const unsigned char *)key.buf;
    evp_init_fn init = (evp_init_fn)(uintptr_t)init_at;
    evp_update_fn update = (evp_update_fn)(uintptr_t)update_at;
    long failed = 0;
    Py_BEGIN_ALLOW_THREADS
    void *ctx = ((evp_new_fn)(uintptr_t)new_at)();
    if (ctx == NULL || init(ctx, (const void *)(uintptr_t)cipher, NULL, key_bytes, blocks) != 1) {
        failed = (long)count;
    } else {
        for (;;) {
            int64_t first = __atomic_fetch_add(claimed, (int64_t)step, __ATOMIC_RELAXED);
            if (first >= count) break;
            int64_t end = first + step < count ? first + step : count;
            for (int64_t i = first; i < end; i++)
                failed += !ctr_row(ctx, init, update, table + 3 * i, blocks + 16 * i);
        }
    }
    if (ctx != NULL) ((evp_free_fn)(uintptr_t)free_at)(ctx);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rows);
    PyBuffer_Release(&counters);
    PyBuffer_Release(&next);
    PyBuffer_Release(&key);
    return PyLong_FromLong(failed);
done:
    if (have_rows) PyBuffer_Release(&rows);
    if (have_counters) PyBuffer_Release(&counters);
    if (have_next) PyBuffer_Release(&next);
    PyBuffer_Release(&key);
    return NULL;
}

/* use_avx2(flag): take the AVX2 pass (fused hash, non-temporal stores) where the CPU has it,
 * or the plain one (copy, then the caller's XXH3) everywhere; returns the previous choice.
 * For tests: both must give the same bytes and sums. */
static PyObject *use_avx2(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
#ifdef FUSED_XXH3
    int previous = have_avx2;
    have_avx2 = flag && cpu_has_avx2();
    return PyBool_FromLong(previous);
#else
    (void)flag;
    Py_RETURN_FALSE;
#endif
}

static PyMethodDef METHODS[] = {
    {"use_avx2", use_avx2, METH_VARARGS,
     "use_avx2(flag): the AVX2 pass where the CPU has it, or the plain one; the previous"},
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(ops, sums, next, xxh3_address): copy and hash every op (rows dst, src, "
     "length, hash_at of an int64 array), claiming rows from the shared counter next "
     "(threads call it at once), the GIL released"},
    {"copy_hash_pieces", copy_hash_pieces, METH_VARARGS,
     "copy_hash_pieces(rows, pieces, sums, next, step): copy each row (src, length, "
     "first_piece, piece_bytes of an int64 array) into its pieces and hash it in one pass, "
     "claiming rows from the shared counter next, the GIL released"},
    {"pieces_pass", pieces_pass, METH_NOARGS, "pieces_pass(): whether copy_hash_pieces runs here"},
    {"ctr_rows", ctr_rows, METH_VARARGS,
     "ctr_rows(rows, counters, next, key, addresses, step): AES-256-CTR in place over rows "
     "(address, length, skip) through libcrypto's EVP calls at addresses, rows claimed from "
     "the shared counter next, the GIL released; returns the rows that failed"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_copyhash", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__copyhash(void) {
#ifdef FUSED_XXH3
    have_avx2 = cpu_has_avx2();
#endif
    return PyModule_Create(&MODULE);
}
