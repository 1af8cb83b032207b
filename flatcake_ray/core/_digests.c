/* Page-key digests in one call: BLAKE2b-128 of (namespace frame, "s", UTF-8 key) for every str
 * key of a request, the same bytes as core/keys.py's hashlib path (which stays the fallback
 * when this is not built). Python spends ~0.4 us a key creating a hashlib object per key;
 * here a key is one compression of one 128-byte block (about 0.16 us on the project's
 * machines: 0.54 ms for a 3,421-key request); with AVX2, four keys at once, one per 64-bit
 * lane (digest4, below: 0.22 ms for the same request). And the index's probe (find_slots, below).
 *
 * BLAKE2b per RFC 7693 (its reference code, section 3 and appendix C, with the rounds
 * unrolled). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define FOUR_LANES 1
#endif

#define ROTR64(x, y) (((x) >> (y)) ^ ((x) << (64 - (y))))
#define G(a, b, c, d, x, y)                 \
    do {                                    \
        v[a] = v[a] + v[b] + (x);           \
        v[d] = ROTR64(v[d] ^ v[a], 32);     \
        v[c] = v[c] + v[d];                 \
        v[b] = ROTR64(v[b] ^ v[c], 24);     \
        v[a] = v[a] + v[b] + (y);           \
        v[d] = ROTR64(v[d] ^ v[a], 16);     \
        v[c] = v[c] + v[d];                 \
        v[b] = ROTR64(v[b] ^ v[c], 63);     \
    } while (0)

static const uint64_t IV[8] = {
    0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL, 0xA54FF53A5F1D36F1ULL,
    0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL, 0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL};

typedef struct {
    uint8_t b[128];
    uint64_t h[8];
    uint64_t t[2];
    size_t c;
} Blake2b;

static uint64_t load64(const uint8_t *p) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    uint64_t x;
    memcpy(&x, p, 8);
    return x;
#else
    uint64_t x = 0;
    for (int i = 7; i >= 0; i--) x = (x << 8) | p[i];
    return x;
#endif
}

#define ROUND(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15) \
    do {                                                                            \
        G(0, 4, 8, 12, m[a0], m[a1]);                                               \
        G(1, 5, 9, 13, m[a2], m[a3]);                                               \
        G(2, 6, 10, 14, m[a4], m[a5]);                                              \
        G(3, 7, 11, 15, m[a6], m[a7]);                                              \
        G(0, 5, 10, 15, m[a8], m[a9]);                                              \
        G(1, 6, 11, 12, m[a10], m[a11]);                                            \
        G(2, 7, 8, 13, m[a12], m[a13]);                                             \
        G(3, 4, 9, 14, m[a14], m[a15]);                                             \
    } while (0)

/* The rounds spelled out with SIGMA's rows as constants, so that every message word is a
 * register the compiler picks at build time (the table read a round took a third of a
 * key's time). */
static void compress(Blake2b *s, int last) {
    uint64_t v[16], m[16];
    for (int i = 0; i < 8; i++) {
        v[i] = s->h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= s->t[0];
    v[13] ^= s->t[1];
    if (last) v[14] = ~v[14];
    for (int i = 0; i < 16; i++) m[i] = load64(&s->b[8 * i]);
    ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
    ROUND(11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4);
    ROUND(7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8);
    ROUND(9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13);
    ROUND(2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9);
    ROUND(12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11);
    ROUND(13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10);
    ROUND(6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5);
    ROUND(10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0);
    ROUND(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    ROUND(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
    for (int i = 0; i < 8; i++) s->h[i] ^= v[i] ^ v[i + 8];
}

static void update(Blake2b *s, const uint8_t *in, size_t len) {
    for (size_t i = 0; i < len; i++) {
        if (s->c == 128) {
            s->t[0] += s->c;
            if (s->t[0] < s->c) s->t[1]++;
            compress(s, 0);
            s->c = 0;
        }
        s->b[s->c++] = in[i];
    }
}

/* Whether prefix + key fits one block (most keys): the block is then the prefix's bytes, the
 * key's and zeros, and the digest one compression. */
static int one_block(const Blake2b *start, size_t len) { return start->c + len <= 128; }

static void fill_block(const Blake2b *start, const uint8_t *key, size_t len, uint8_t *block) {
    memcpy(block, start->b, start->c);
    memcpy(block + start->c, key, len);
    memset(block + start->c + len, 0, 128 - start->c - len);
}

/* A digest of 16 bytes, no key: what hashlib.blake2b(data, digest_size=16) gives. */
static void digest16(const Blake2b *start, const uint8_t *key, size_t len, uint8_t *out) {
    Blake2b s;
    if (one_block(start, len)) {
        memcpy(s.h, start->h, sizeof s.h);
        s.t[0] = start->t[0];
        s.t[1] = start->t[1];
        fill_block(start, key, len, s.b);
        s.c = start->c + len;
    } else {
        s = *start;
        update(&s, key, len);
        memset(s.b + s.c, 0, 128 - s.c);
    }
    s.t[0] += s.c;
    if (s.t[0] < s.c) s.t[1]++;
    compress(&s, 1);
    for (int i = 0; i < 16; i++) out[i] = (uint8_t)(s.h[i >> 3] >> (8 * (i & 7)));
}

#ifdef FOUR_LANES
static int have_avx2 = 0;

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}

/* G of four states at once: lane j of every vector is key j's. Rotations by 32, 24 and 16
 * are byte shuffles; by 63, a shift and an add. */
#define ROT4_32(x) _mm256_shuffle_epi32((x), _MM_SHUFFLE(2, 3, 0, 1))
#define ROT4_24(x) _mm256_shuffle_epi8((x), rot24)
#define ROT4_16(x) _mm256_shuffle_epi8((x), rot16)
#define ROT4_63(x) _mm256_or_si256(_mm256_srli_epi64((x), 63), _mm256_add_epi64((x), (x)))
#define G4(a, b, c, d, x, y)                                           \
    do {                                                               \
        v[a] = _mm256_add_epi64(_mm256_add_epi64(v[a], v[b]), (x));    \
        v[d] = ROT4_32(_mm256_xor_si256(v[d], v[a]));                  \
        v[c] = _mm256_add_epi64(v[c], v[d]);                           \
        v[b] = ROT4_24(_mm256_xor_si256(v[b], v[c]));                  \
        v[a] = _mm256_add_epi64(_mm256_add_epi64(v[a], v[b]), (y));    \
        v[d] = ROT4_16(_mm256_xor_si256(v[d], v[a]));                  \
        v[c] = _mm256_add_epi64(v[c], v[d]);                           \
        v[b] = ROT4_63(_mm256_xor_si256(v[b], v[c]));                  \
    } while (0)
#define ROUND4(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15) \
    do {                                                                             \
        G4(0, 4, 8, 12, m[a0], m[a1]);                                               \
        G4(1, 5, 9, 13, m[a2], m[a3]);                                               \
        G4(2, 6, 10, 14, m[a4], m[a5]);                                              \
        G4(3, 7, 11, 15, m[a6], m[a7]);                                              \
        G4(0, 5, 10, 15, m[a8], m[a9]);                                              \
        G4(1, 6, 11, 12, m[a10], m[a11]);                                            \
        G4(2, 7, 8, 13, m[a12], m[a13]);                                             \
        G4(3, 4, 9, 14, m[a14], m[a15]);                                             \
    } while (0)

/* The digests of four keys that each fit one block with the prefix (``one_block``): the same
 * bytes as four digest16 calls. */
__attribute__((target("avx2"))) static void digest4(const Blake2b *start, const uint8_t *keys[4],
                                                    const size_t lens[4], uint8_t *out) {
    const __m256i rot24 = _mm256_setr_epi8(3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10,
                                           3, 4, 5, 6, 7, 0, 1, 2, 11, 12, 13, 14, 15, 8, 9, 10);
    const __m256i rot16 = _mm256_setr_epi8(2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9,
                                           2, 3, 4, 5, 6, 7, 0, 1, 10, 11, 12, 13, 14, 15, 8, 9);
    uint64_t words[16][4], counts[4];
    for (int j = 0; j < 4; j++) {
        uint8_t block[128];
        fill_block(start, keys[j], lens[j], block);
        for (int i = 0; i < 16; i++) words[i][j] = load64(block + 8 * i);
        counts[j] = start->t[0] + start->c + lens[j]; /* one block: t[1] stays 0 */
    }
    __m256i v[16], m[16];
    for (int i = 0; i < 16; i++) m[i] = _mm256_loadu_si256((const __m256i *)words[i]);
    for (int i = 0; i < 8; i++) {
        v[i] = _mm256_set1_epi64x((long long)start->h[i]);
        v[i + 8] = _mm256_set1_epi64x((long long)IV[i]);
    }
    v[12] = _mm256_xor_si256(v[12], _mm256_loadu_si256((const __m256i *)counts));
    v[13] = _mm256_xor_si256(v[13], _mm256_set1_epi64x((long long)start->t[1]));
    v[14] = _mm256_xor_si256(v[14], _mm256_set1_epi64x(-1)); /* the last block */
    ROUND4(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    ROUND4(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
    ROUND4(11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4);
    ROUND4(7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8);
    ROUND4(9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13);
    ROUND4(2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9);
    ROUND4(12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11);
    ROUND4(13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10);
    ROUND4(6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5);
    ROUND4(10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0);
    ROUND4(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    ROUND4(14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3);
    uint64_t h[2][4];
    for (int i = 0; i < 2; i++) { /* the 16 bytes kept: words 0 and 1 of the state */
        __m256i start_h = _mm256_set1_epi64x((long long)start->h[i]);
        __m256i word = _mm256_xor_si256(start_h, _mm256_xor_si256(v[i], v[i + 8]));
        _mm256_storeu_si256((__m256i *)h[i], word);
    }
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < 16; i++) out[16 * j + i] = (uint8_t)(h[i >> 3][j] >> (8 * (i & 7)));
}
#endif

/* Every key's digest: four at a time where four keys in a row each fit one block and the CPU
 * has AVX2, one at a time otherwise. */
static void digest_all(const Blake2b *start, const uint8_t **raw, const size_t *lens,
                       Py_ssize_t n, uint8_t *dst) {
    Py_ssize_t i = 0;
#ifdef FOUR_LANES
    if (have_avx2) {
        for (; i + 4 <= n; i += 4) {
            if (one_block(start, lens[i]) && one_block(start, lens[i + 1]) &&
                one_block(start, lens[i + 2]) && one_block(start, lens[i + 3])) {
                digest4(start, raw + i, lens + i, dst + 16 * i);
            } else {
                for (int j = 0; j < 4; j++)
                    digest16(start, raw[i + j], lens[i + j], dst + 16 * (i + j));
            }
        }
    }
#endif
    for (; i < n; i++) digest16(start, raw[i], lens[i], dst + 16 * i);
}

static PyObject *digest_str_keys(PyObject *self, PyObject *args) {
    Py_buffer prefix;
    PyObject *keys;
    if (!PyArg_ParseTuple(args, "y*O", &prefix, &keys)) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys are a list or tuple");
    if (seq == NULL) {
        PyBuffer_Release(&prefix);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 16);
    Blake2b start;
    memset(&start, 0, sizeof start);
    for (int i = 0; i < 8; i++) start.h[i] = IV[i];
    start.h[0] ^= 0x01010000ULL ^ 16;
    update(&start, (const uint8_t *)prefix.buf, (size_t)prefix.len);
    PyBuffer_Release(&prefix);
    if (out == NULL) goto fail;
    const uint8_t **raw = PyMem_Malloc(sizeof *raw * (size_t)(n ? n : 1));
    size_t *lens = PyMem_Malloc(sizeof *lens * (size_t)(n ? n : 1));
    if (raw == NULL || lens == NULL) {
        PyErr_NoMemory();
        Py_CLEAR(out);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        Py_ssize_t len;
        const char *text = PyUnicode_CheckExact(key) ? PyUnicode_AsUTF8AndSize(key, &len) : NULL;
        if (text == NULL || len == 0) { /* not a plain non-empty encodable str: the caller's */
            PyErr_Clear();
            Py_CLEAR(out);
            out = Py_NewRef(Py_None);
            goto done;
        }
        raw[i] = (const uint8_t *)text;
        lens[i] = (size_t)len;
    }
    /* The GIL stays held: the keys' UTF-8 lives in str objects another thread could drop. */
    digest_all(&start, raw, lens, n, (uint8_t *)PyBytes_AS_STRING(out));
done:
    PyMem_Free(raw);
    PyMem_Free(lens);
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    return NULL;
}

/* use_avx2(flag): four keys at once where the CPU has AVX2, or one at a time; returns the
 * previous choice. For tests: both must give the same bytes. */
static PyObject *use_avx2(PyObject *self, PyObject *args) {
    int flag;
    if (!PyArg_ParseTuple(args, "p", &flag)) return NULL;
#ifdef FOUR_LANES
    int previous = have_avx2;
    have_avx2 = flag && cpu_has_avx2();
    return PyBool_FromLong(previous);
#else
    (void)flag;
    Py_RETURN_FALSE;
#endif
}

/* The index's tables (core/index.py PageIndex): three arrays of uint64 slots, hi and lo words
 * of a 16-byte digest and its value, open-addressed and linearly probed from ``hi & mask``. A
 * slot with hi == lo == 0 is empty and ends a probe; hi == 0 with lo != 0 is a deleted slot
 * (the numpy delete's), passed over. */
typedef struct {
    uint64_t *hi, *lo, *val;
    Py_ssize_t slots;
} Tables;

/* ``val`` may be NULL (a lookup needs no values). False, with a ValueError naming ``usage``,
 * unless the tables are a power of two uint64 slots each. */
static int tables_of(Tables *t, Py_buffer *hi, Py_buffer *lo, Py_buffer *val, const char *usage) {
    t->slots = hi->len / 8;
    t->hi = (uint64_t *)hi->buf;
    t->lo = (uint64_t *)lo->buf;
    t->val = val == NULL ? NULL : (uint64_t *)val->buf;
    if (t->slots == 0 || (t->slots & (t->slots - 1)) != 0 || hi->len % 8 != 0 ||
        lo->len != hi->len || (val != NULL && val->len != hi->len)) {
        PyErr_SetString(PyExc_ValueError, usage);
        return 0;
    }
    return 1;
}

/* The slot that holds the digest (want_hi, want_lo), or -1 where an empty slot ends its chain
 * first; ``first_free`` (unless NULL) gets the chain's first free slot (empty or deleted) up
 * to that point, -1 if none. */
static Py_ssize_t chain_slot(const Tables *t, uint64_t want_hi, uint64_t want_lo,
                             Py_ssize_t *first_free) {
    uint64_t mask = (uint64_t)t->slots - 1, slot = want_hi & mask;
    if (first_free != NULL) *first_free = -1;
    for (Py_ssize_t step = 0; step < t->slots; step++, slot = (slot + 1) & mask) {
        if (t->hi[slot] == want_hi && t->lo[slot] == want_lo) return (Py_ssize_t)slot;
        if (t->hi[slot] == 0) {
            if (first_free != NULL && *first_free < 0) *first_free = (Py_ssize_t)slot;
            if (t->lo[slot] == 0) break; /* empty: the chain ends */
        }
    }
    return -1;
}

/* The index's probe (core/index.py PageIndex): for each 16-byte digest (two little-endian
 * uint64 words, hi and lo), the slot of the table that holds it, or -1. numpy takes a pass a
 * probe step over every digest still looking (about 0.26 ms for a 3,421-page lookup); this is
 * one short loop a digest (about 0.03 ms). */
static PyObject *find_slots(PyObject *self, PyObject *args) {
    Py_buffer hi_table, lo_table, digests, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &hi_table, &lo_table, &digests, &out)) return NULL;
    const char *usage = "find_slots(hi, lo, digests, out): tables of a power of two uint64 "
                        "slots each, 16-byte digests, an int64 out a digest";
    Py_ssize_t n = digests.len / 16;
    PyObject *result = NULL;
    Tables t;
    if (!tables_of(&t, &hi_table, &lo_table, NULL, usage)) goto done;
    if (digests.len % 16 != 0 || out.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, usage);
        goto done;
    }
    const uint64_t *words = (const uint64_t *)digests.buf;
    int64_t *found = (int64_t *)out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        found[i] = chain_slot(&t, words[2 * i], words[2 * i + 1], NULL);
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&hi_table);
    PyBuffer_Release(&lo_table);
    PyBuffer_Release(&digests);
    PyBuffer_Release(&out);
    return result;
}

/* The index's insert (core/index.py PageIndex.insert): each digest that is absent goes into
 * the first free slot (empty, or deleted) of its chain, with its value; one that is present
 * (in the table, or earlier in the batch) keeps its first value. ``inserted`` gets 1 where a
 * digest went in. The caller reserved room for every digest (a free slot always ends a
 * chain). Returns how many deleted slots were taken. numpy took a pass a probe step plus a
 * sort for the batch's repeats (about 2 ms for 3,421 pages, and a whole-table rehash in
 * passes); this is one short loop a digest. */
static PyObject *place_digests(PyObject *self, PyObject *args) {
    Py_buffer hi_table, lo_table, val_table, digests, values, out;
    if (!PyArg_ParseTuple(args, "w*w*w*y*y*w*", &hi_table, &lo_table, &val_table, &digests,
                          &values, &out))
        return NULL;
    const char *usage = "place_digests(hi, lo, val, digests, values, inserted): tables of a "
                        "power of two uint64 slots each, 16-byte digests, a uint64 value and "
                        "a bool out a digest";
    Py_ssize_t n = digests.len / 16;
    PyObject *result = NULL;
    Tables t;
    if (!tables_of(&t, &hi_table, &lo_table, &val_table, usage)) goto done;
    if (digests.len % 16 != 0 || values.len != n * 8 || out.len != n) {
        PyErr_SetString(PyExc_ValueError, usage);
        goto done;
    }
    const uint64_t *words = (const uint64_t *)digests.buf, *value = (const uint64_t *)values.buf;
    uint8_t *inserted = (uint8_t *)out.buf;
    long reused = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t free_slot;
        inserted[i] = 0;
        if (chain_slot(&t, words[2 * i], words[2 * i + 1], &free_slot) >= 0) continue;
        if (free_slot < 0) {
            PyErr_SetString(PyExc_RuntimeError, "place_digests: the table is full");
            goto done;
        }
        reused += t.lo[free_slot] != 0;
        t.hi[free_slot] = words[2 * i];
        t.lo[free_slot] = words[2 * i + 1];
        t.val[free_slot] = value[i];
        inserted[i] = 1;
    }
    result = PyLong_FromLong(reused);
done:
    PyBuffer_Release(&hi_table);
    PyBuffer_Release(&lo_table);
    PyBuffer_Release(&val_table);
    PyBuffer_Release(&digests);
    PyBuffer_Release(&values);
    PyBuffer_Release(&out);
    return result;
}

/* The index's delete (core/index.py PageIndex.delete) without deleted slots: each digest found
 * is taken out and the entries after it in its cluster move back into the gap where their
 * probe would find them earlier (backward-shift deletion), so a chain never holds a deleted
 * slot and the table never needs a rehash to clear them (numpy marked slots deleted, and
 * every few evictions a 3,421-page put paid a whole-table rehash for them: 2-14 ms). The
 * caller passes a table without deleted slots. Returns how many digests were found. */
static PyObject *remove_digests(PyObject *self, PyObject *args) {
    Py_buffer hi_table, lo_table, val_table, digests;
    if (!PyArg_ParseTuple(args, "w*w*w*y*", &hi_table, &lo_table, &val_table, &digests))
        return NULL;
    const char *usage = "remove_digests(hi, lo, val, digests): tables of a power of two uint64 "
                        "slots each, 16-byte digests";
    Py_ssize_t n = digests.len / 16;
    PyObject *result = NULL;
    Tables t;
    if (!tables_of(&t, &hi_table, &lo_table, &val_table, usage)) goto done;
    if (digests.len % 16 != 0) {
        PyErr_SetString(PyExc_ValueError, usage);
        goto done;
    }
    const uint64_t *words = (const uint64_t *)digests.buf;
    uint64_t mask = (uint64_t)t.slots - 1;
    long removed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t found = chain_slot(&t, words[2 * i], words[2 * i + 1], NULL);
        if (found < 0) continue;
        removed++;
        uint64_t gap = (uint64_t)found, next = gap;
        for (Py_ssize_t step = 0; step < t.slots; step++) {
            next = (next + 1) & mask;
            if (t.hi[next] == 0) break; /* the cluster ends */
            uint64_t home = t.hi[next] & mask;
            /* The entry at ``next`` stays unless its home is at or before the gap, cyclically:
             * a probe from its home passes the gap before reaching it. */
            int stays = gap <= next ? (gap < home && home <= next) : (gap < home || home <= next);
            if (stays) continue;
            t.hi[gap] = t.hi[next];
            t.lo[gap] = t.lo[next];
            t.val[gap] = t.val[next];
            gap = next;
        }
        t.hi[gap] = 0;
        t.lo[gap] = 0;
        t.val[gap] = 0;
    }
    result = PyLong_FromLong(removed);
done:
    PyBuffer_Release(&hi_table);
    PyBuffer_Release(&lo_table);
    PyBuffer_Release(&val_table);
    PyBuffer_Release(&digests);
    return result;
}

static PyMethodDef METHODS[] = {
    {"find_slots", find_slots, METH_VARARGS,
     "find_slots(hi, lo, digests, out): each digest's slot in the index's tables, or -1"},
    {"place_digests", place_digests, METH_VARARGS,
     "place_digests(hi, lo, val, digests, values, inserted) -> deleted slots taken: each "
     "absent digest into its chain's first free slot"},
    {"remove_digests", remove_digests, METH_VARARGS,
     "remove_digests(hi, lo, val, digests) -> how many were found: each taken out, its "
     "cluster shifted back (no deleted slots)"},
    {"use_avx2", use_avx2, METH_VARARGS,
     "use_avx2(flag): four keys at once where the CPU has AVX2, or one at a time; the previous"},
    {"digest_str_keys", digest_str_keys, METH_VARARGS,
     "digest_str_keys(prefix, keys) -> the packed 16-byte BLAKE2b digests of prefix + key "
     "for each non-empty str key, or None when some key is not one"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef MODULE = {PyModuleDef_HEAD_INIT, "_digests", NULL, -1, METHODS};

PyMODINIT_FUNC PyInit__digests(void) {
#ifdef FOUR_LANES
    have_avx2 = cpu_has_avx2();
#endif
    return PyModule_Create(&MODULE);
}
