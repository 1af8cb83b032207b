/* AES-256-CTR over rows of host memory in place, through libcrypto's EVP calls at the
 * addresses cuda_ext/host_seal.py found them at (sealed SSD pages). */
#include "_copyhash.h"

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
PyObject *fc_ctr_rows(PyObject *self, PyObject *args) {
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
    if (fc_writable_array(rows_obj, &rows, 3 * sizeof(int64_t), "rows") == 0) have_rows = 1;
    if (have_rows && fc_writable_array(counters_obj, &counters, 16, "counters") == 0)
        have_counters = 1;
    if (have_counters && fc_writable_array(next_obj, &next, sizeof(int64_t), "next") == 0)
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
