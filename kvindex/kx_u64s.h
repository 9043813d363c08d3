/* kvindex/kx_u64s.h: packed arrays of ints without a Python int per item, for the extensions that
 * take or make keys, hashes and token ids (kvindex._keys, kvindex.index._core, adapters._vllm).
 *
 * Invariants:
 * - kx_u64_view(o, view) is 1, with view held (the caller releases it), exactly when o exports a
 *   C-contiguous buffer of 8-byte unsigned items ("Q", or "L" where a long is 8 bytes): an
 *   array("Q"), as kvindex.keys and the adapters make keys and hashes. Anything else is 0, with no
 *   error set: the caller then reads o as a sequence of ints.
 * - kx_zeros(one, n, &data) is a new array of n zeros of one's type (``one``: an array("I") or
 *   array("Q") of one item), data its items to write: the array's own repeat, a tenth of what its
 *   constructor costs from a few KB of bytes. The pointer stays valid while the new array is not
 *   resized (nothing else holds it yet).
 * - Header only, the functions static inline: each extension that includes it gets its own copy.
 */
#ifndef KX_U64S_H
#define KX_U64S_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static inline int kx_u64_view(PyObject *o, Py_buffer *view) {
    if (!PyObject_CheckBuffer(o)) return 0;
    if (PyObject_GetBuffer(o, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format;
    if (view->itemsize == 8 && f && (f[0] == 'Q' || f[0] == 'L') && !f[1]) return 1;
    PyBuffer_Release(view);
    return 0;
}

static inline PyObject *kx_zeros(PyObject *one, Py_ssize_t n, void **data) {
    PyObject *out = PySequence_Repeat(one, n);
    Py_buffer view;
    if (out == NULL) return NULL;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    *data = view.buf;
    PyBuffer_Release(&view);
    return out;
}

#endif
