/* Blocks copied into pieces far apart and hashed in the same pass: a checked restore into
 * pages split in the reader's memory (vLLM's K and V planes), cuda_ext/host_hash.py
 * copy_and_hash_pieces. AVX2 only: elsewhere the restore copies privately first. */
#include "_copyhash.h"
#include "_xxh3_stripes.h"

#ifdef FUSED_XXH3
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
    __m256i acc[2];
    xxh3_start(acc);
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
#endif

#ifdef FUSED_XXH3
/* The first problem with a pieces batch, or NULL: every row's pieces must exist and each
 * stripe land in one piece (the fused pass is the only one: there is no plain fallback for
 * pieces, the caller checks ``pieces_pass`` first). */
static const char *pieces_problem(const int64_t *rows, Py_ssize_t count, Py_ssize_t pieces) {
    if (!fc_have_avx2) return "the pieces pass needs AVX2";
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
PyObject *fc_copy_hash_pieces(PyObject *self, PyObject *args) {
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
        if (fc_writable_array(objects[held], &views[held], items[held], names[held]) < 0) break;
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
PyObject *fc_pieces_pass(PyObject *self, PyObject *args) {
#ifdef FUSED_XXH3
    return PyBool_FromLong(fc_have_avx2);
#else
    Py_RETURN_FALSE;
#endif
}
