/* What the parts of the _copyhash module share: its .c files build one extension
 * (_copyhash.c: the module, its copies and use_avx2; _copyhash_pieces.c: blocks copied into
 * pieces; _copyhash_seal.c: AES-CTR through libcrypto). */
#ifndef FLATCAKE_COPYHASH_H
#define FLATCAKE_COPYHASH_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Whether the AVX2 pass is taken: the CPU has it and use_avx2 left it on. */
extern int fc_have_avx2;

/* ``obj`` as a writable C-contiguous buffer of whole ``item``-byte items, or -1 with a
 * Python error set. */
int fc_writable_array(PyObject *obj, Py_buffer *view, Py_ssize_t item, const char *name);

PyObject *fc_copy_hash_pieces(PyObject *self, PyObject *args);
PyObject *fc_pieces_pass(PyObject *self, PyObject *args);
PyObject *fc_ctr_rows(PyObject *self, PyObject *args);
#endif
