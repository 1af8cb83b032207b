/* Copies and block checksums in one pass over memory: each piece is copied and, where asked,
 * hashed right after, while its bytes are still in the core's cache. A checked DRAM restore
 * and a put that writes into the owner's memory otherwise read every byte twice (a copy, then
 * a hash pass over bytes long evicted), and the second pass cost more than the copy.
 *
 * The hash is the caller's XXH3-64 (libxxhash's, its vector dispatcher where it has one,
 * passed as an address that cuda_ext/host_hash.py found through ctypes), so this file needs
 * no xxhash header and hashes exactly what core/integrity.py does. The GIL is released for
 * the whole batch: several threads run one batch at once, each claiming the next row
 * (cuda_ext/host_hash.py copy_and_hash). */
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

static int writable_array(PyObject *obj, Py_buffer *view, Py_ssize_t item, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % item != 0) {
        PyErr_Format(PyExc_ValueError, "%s is not an array of %zd-byte items", name, item);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
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
        for (int64_t i = first; i < end; i++) {
            const int64_t *row = rows + 4 * i;
            size_t length = (size_t)row[2];
            if (row[0] != 0)
                copy_bytes((char *)(uintptr_t)row[0], (const char *)(uintptr_t)row[1], length);
            if (row[3] != 0) found[i] = xxh3((const void *)(uintptr_t)row[3], length);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ops);
    PyBuffer_Release(&sums);
    PyBuffer_Release(&next);
    Py_RETURN_NONE;
}

static PyMethodDef METHODS[] = {
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(ops, sums, next, xxh3_address): copy and hash every op (rows dst, src, "
     "length, hash_at of an int64 array), claiming rows from the shared counter next "
     "(threads call it at once), the GIL released"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_copyhash", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__copyhash(void) { return PyModule_Create(&MODULE); }
