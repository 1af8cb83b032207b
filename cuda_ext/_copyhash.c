/* Copies and block checksums in one pass over memory: each piece is copied and, where asked,
 * hashed right after, while its bytes are still in the core's cache. A checked DRAM restore
 * and a put that writes into the owner's memory otherwise read every byte twice (a copy, then
 * a hash pass over bytes long evicted), and the second pass cost more than the copy.
 *
 * The hash is the caller's XXH3-64 (libxxhash's, its vector dispatcher where it has one,
 * passed as an address that cuda_ext/host_hash.py found through ctypes), so this file needs
 * no xxhash header and hashes exactly what core/integrity.py does. The GIL is released for
 * the whole batch: several threads run disjoint index ranges of one batch at once
 * (cuda_ext/host_hash.py copy_and_hash). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef uint64_t (*xxh3_fn)(const void *, size_t);

static int writable_array(PyObject *obj, Py_buffer *view, Py_ssize_t item, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len % item != 0) {
        PyErr_Format(PyExc_ValueError, "%s is not an array of %zd-byte items", name, item);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* copy_hash(ops, sums, first, end, xxh3_address): for each op i in [first, end) of ``ops``
 * (an int64 array of rows (dst, src, length, hash_at)), copy ``length`` bytes from ``src`` to
 * ``dst`` when ``dst`` is not 0, then, when ``hash_at`` is not 0, store the XXH3-64 of the
 * ``length`` bytes at ``hash_at`` in sums[i]. */
static PyObject *copy_hash(PyObject *self, PyObject *args) {
    PyObject *ops_obj, *sums_obj;
    Py_ssize_t first, end;
    unsigned long long address;
    if (!PyArg_ParseTuple(args, "OOnnK", &ops_obj, &sums_obj, &first, &end, &address))
        return NULL;
    if (address == 0) {
        PyErr_SetString(PyExc_ValueError, "no XXH3 function address");
        return NULL;
    }
    Py_buffer ops, sums;
    if (writable_array(ops_obj, &ops, 4 * sizeof(int64_t), "ops") < 0) return NULL;
    if (writable_array(sums_obj, &sums, sizeof(uint64_t), "sums") < 0) {
        PyBuffer_Release(&ops);
        return NULL;
    }
    Py_ssize_t count = ops.len / (Py_ssize_t)(4 * sizeof(int64_t));
    if (sums.len / (Py_ssize_t)sizeof(uint64_t) != count || first < 0 || end > count ||
        first > end) {
        PyErr_SetString(PyExc_ValueError, "ops, sums and [first, end) do not agree");
        PyBuffer_Release(&ops);
        PyBuffer_Release(&sums);
        return NULL;
    }
    const int64_t *rows = (const int64_t *)ops.buf;
    uint64_t *found = (uint64_t *)sums.buf;
    xxh3_fn xxh3 = (xxh3_fn)(uintptr_t)address;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = first; i < end; i++) {
        const int64_t *row = rows + 4 * i;
        size_t length = (size_t)row[2];
        if (row[0] != 0) memcpy((void *)(uintptr_t)row[0], (const void *)(uintptr_t)row[1], length);
        if (row[3] != 0) found[i] = xxh3((const void *)(uintptr_t)row[3], length);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ops);
    PyBuffer_Release(&sums);
    Py_RETURN_NONE;
}

static PyMethodDef METHODS[] = {
    {"copy_hash", copy_hash, METH_VARARGS,
     "copy_hash(ops, sums, first, end, xxh3_address): copy and hash ops[first:end] "
     "(rows dst, src, length, hash_at of an int64 array), the GIL released"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_copyhash", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__copyhash(void) { return PyModule_Create(&MODULE); }
