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
 * each claiming the next rows (cuda_ext/host_hash.py copy_and_hash).
 *
 * The module's other parts: blocks copied into pieces far apart (_copyhash_pieces.c), AES-CTR
 * over sealed pages (_copyhash_seal.c); the XXH3 stripes all copies hash with are in
 * _xxh3_stripes.h. */
#include "_copyhash.h"
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

#include "_xxh3_stripes.h"

int fc_have_avx2 = 0;

#ifdef FUSED_XXH3
static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}

/* Copy ``length`` (> 240) bytes from ``src`` to ``dst`` (no overlap) and answer their XXH3-64.
 * The last stripe, which XXH3 takes again from the input's end, is read back from ``again``
 * (the destination for a reader's check, the source for a writer's own sums). */
__attribute__((target("avx2"))) static uint64_t copy_xxh3(char *dst, const char *src,
                                                         size_t length, const char *again) {
    enum store_kind kind = store_kind_for(dst, length);
    __m256i acc[2];
    xxh3_start(acc);
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

int fc_writable_array(PyObject *obj, Py_buffer *view, Py_ssize_t item, const char *name) {
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
    if (fc_have_avx2 && dst != NULL && length > XXH3_MIDSIZE_MAX &&
        (hash_at == dst || hash_at == src)) {
        *sum = copy_xxh3(dst, src, length, hash_at);
        return;
    }
    if (fc_have_avx2 && dst != NULL && hash_at == NULL) {
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
    if (fc_writable_array(ops_obj, &ops, 4 * sizeof(int64_t), "ops") < 0) return NULL;
    if (fc_writable_array(sums_obj, &sums, sizeof(uint64_t), "sums") < 0) {
        PyBuffer_Release(&ops);
        return NULL;
    }
    if (fc_writable_array(next_obj, &next, sizeof(int64_t), "next") < 0) {
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

/* use_avx2(flag): take the AVX2 pass (fused hash, non-temporal stores) where the CPU has it,
 * or the plain one (copy, then the caller's XXH3) everywhere; returns the previous choice.
 * For tests: both must give the same bytes and sums. */
static PyObject *use_avx2(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
#ifdef FUSED_XXH3
    int previous = fc_have_avx2;
    fc_have_avx2 = flag && cpu_has_avx2();
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
    {"copy_hash_pieces", fc_copy_hash_pieces, METH_VARARGS,
     "copy_hash_pieces(rows, pieces, sums, next, step): copy each row (src, length, "
     "first_piece, piece_bytes of an int64 array) into its pieces and hash it in one pass, "
     "claiming rows from the shared counter next, the GIL released"},
    {"pieces_pass", fc_pieces_pass, METH_NOARGS, "pieces_pass(): whether copy_hash_pieces runs here"},
    {"ctr_rows", fc_ctr_rows, METH_VARARGS,
     "ctr_rows(rows, counters, next, key, addresses, step): AES-256-CTR in place over rows "
     "(address, length, skip) through libcrypto's EVP calls at addresses, rows claimed from "
     "the shared counter next, the GIL released; returns the rows that failed"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_copyhash", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__copyhash(void) {
#ifdef FUSED_XXH3
    fc_have_avx2 = cpu_has_avx2();
#endif
    return PyModule_Create(&MODULE);
}
