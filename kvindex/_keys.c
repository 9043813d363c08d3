/* kvindex._keys: the chained block keys of kvindex.keys, in C.
 *
 * Same definitions as the Python twin (kvindex/keys.py is the reference; tests compare both):
 *   local_i = XXH3-64(tokens of block i as u32 little-endian, seed 1337)
 *   key_i   = XXH3-64(LE64(key_{i-1}) || LE64(local_i)), key_{-1} = root
 * Only full blocks have keys. Token ids arrive as a buffer of u32s (an array("I")). XXH3-64 is
 * kvindex's own (kx_xxh3.h, from the published specification): a C compiler is all the build needs.
 * xxh3_64() and xxh3_64_slices() expose it alone, for tests/test_xxh3.py and benchmarks/xxh3.py.
 * kthena_chain() is the approximate index's Kthena chain (kvindex/approx/hashing.py kthena_hashes
 * is the reference): h_i = XXH64(decimal(h_{i-1}) || block_i), over XXH64 of kx_xxh64.h.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "kx_u64s.h"
#include "kx_xxh3.h"
#include "kx_xxh64.h"

#define LOCAL_SEED 1337ULL

static void put_le64(unsigned char *out, uint64_t v) {
    for (int i = 0; i < 8; i++) out[i] = (unsigned char)(v >> (8 * i));
}

static uint64_t chain(uint64_t parent, uint64_t local) {
    unsigned char pair[16];
    put_le64(pair, parent);
    put_le64(pair + 8, local);
    return kx_xxh3_64(pair, sizeof pair, 0);
}

/* A u64 from a Python int (0 <= v < 2**64); sets an exception otherwise. */
static int as_u64(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "expected an int");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* Full blocks in a token buffer of ``nbytes``, at most ``limit`` (negative: no limit). Divides
   before it multiplies: any block size, however large (it comes off the wire), gives the floor
   Python's ``len(data) // (4 * block_size)`` gives, and a block's width is then <= nbytes. */
static Py_ssize_t full_blocks(Py_ssize_t nbytes, Py_ssize_t block_size, Py_ssize_t limit) {
    Py_ssize_t n = (nbytes / 4) / block_size;
    return (limit >= 0 && limit < n) ? limit : n;
}

/* The block size argument: 1 (in *out), 0 when it is beyond any buffer (no full block: Python's
   answer is []), -1 with an exception (not an int, or not positive). */
static int block_size_arg(PyObject *obj, Py_ssize_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "block_size must be an int");
        return -1;
    }
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (overflow > 0 || v > PY_SSIZE_T_MAX) return 0;
    if (overflow < 0 || v <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return -1;
    }
    *out = (Py_ssize_t)v;
    return 1;
}

static int token_buffer(PyObject *tokens, Py_buffer *view) {
    if (PyObject_GetBuffer(tokens, view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->itemsize != 4 && view->itemsize != 1) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "token ids must be a buffer of u32 (array('I')) or bytes");
        return -1;
    }
    return 0;
}

/* The module's state: array("Q", [0]), which every answer is a repeat of (made at import). */
typedef struct {
    PyObject *u64_one;
} State;

static PyObject *u64_one(PyObject *module) { return ((State *)PyModule_GetState(module))->u64_one; }

/* One hash per full block of ``tokens`` (at most ``limit``): the block's local hash, or with
   ``chained`` its key, chained from ``key`` (the root). A new array("Q"), or NULL with an exception. */
static PyObject *per_block(PyObject *module, PyObject *tokens, PyObject *bs_obj, Py_ssize_t limit, int chained,
                           uint64_t key) {
    Py_ssize_t block_size = 1;
    int sized = block_size_arg(bs_obj, &block_size);
    if (sized < 0) return NULL;
    Py_buffer view;
    if (token_buffer(tokens, &view) < 0) return NULL;
    Py_ssize_t n = sized ? full_blocks(view.len, block_size, limit) : 0;
    uint64_t *out_items;
    PyObject *out = kx_zeros(u64_one(module), n, (void **)&out_items);
    const unsigned char *data = view.buf;
    size_t width = (size_t)(4 * block_size); /* n > 0 only when 4 * block_size <= view.len */
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        uint64_t local = kx_xxh3_64(data + i * width, width, LOCAL_SEED);
        out_items[i] = chained ? (key = chain(key, local)) : local;
    }
    PyBuffer_Release(&view);
    return out;
}

PyDoc_STRVAR(prompt_keys_doc,
"prompt_keys(root, tokens, block_size, limit=-1) -> array('Q')\n\n"
"Chained keys of the full blocks of ``tokens`` (a buffer of u32, e.g. array('I')), at most\n"
"``limit`` blocks when limit >= 0.");

static PyObject *prompt_keys(PyObject *self, PyObject *args) {
    PyObject *root_obj, *tokens, *bs_obj;
    Py_ssize_t limit = -1;
    uint64_t root;
    if (!PyArg_ParseTuple(args, "OOO|n", &root_obj, &tokens, &bs_obj, &limit)) return NULL;
    if (as_u64(root_obj, &root) < 0) return NULL;
    return per_block(self, tokens, bs_obj, limit, 1, root);
}

PyDoc_STRVAR(local_hashes_doc,
"local_hashes(tokens, block_size, limit=-1) -> array('Q')\n\n"
"Dynamo's per-block hashes (XXH3-64, seed 1337) of the full blocks of ``tokens``.");

static PyObject *local_hashes(PyObject *self, PyObject *args) {
    PyObject *tokens, *bs_obj;
    Py_ssize_t limit = -1;
    if (!PyArg_ParseTuple(args, "OO|n", &tokens, &bs_obj, &limit)) return NULL;
    return per_block(self, tokens, bs_obj, limit, 0, 0);
}

PyDoc_STRVAR(chain_keys_doc,
"chain_keys(root, locals) -> array('Q')\n\n"
"key_i = XXH3-64(LE64(key_{i-1}) || LE64(locals[i])), starting from ``root``.");

static PyObject *chain_keys(PyObject *self, PyObject *args) {
    PyObject *root_obj, *locals;
    uint64_t key;
    if (!PyArg_ParseTuple(args, "OO", &root_obj, &locals)) return NULL;
    if (as_u64(root_obj, &key) < 0) return NULL;
    Py_buffer view;
    uint64_t *out_items;
    PyObject *out;
    if (kx_u64_view(locals, &view)) { /* an array("Q") (the HTTP bodies' hashes): read in place */
        Py_ssize_t n = view.len / 8;
        const uint64_t *in = view.buf;
        if ((out = kx_zeros(u64_one(self), n, (void **)&out_items)) != NULL)
            for (Py_ssize_t i = 0; i < n; i++) out_items[i] = key = chain(key, in[i]);
        PyBuffer_Release(&view);
        return out;
    }
    PyObject *seq = PySequence_Fast(locals, "locals must be a sequence of ints");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    out = kx_zeros(u64_one(self), n, (void **)&out_items);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        uint64_t local;
        if (as_u64(items[i], &local) < 0) Py_CLEAR(out);
        else out_items[i] = key = chain(key, local);
    }
    Py_DECREF(seq);
    return out;
}

PyDoc_STRVAR(xxh3_64_doc,
"xxh3_64(data, seed=0) -> int\n\n"
"XXH3-64 of a bytes-like ``data`` with ``seed`` (0 <= seed < 2**64), as xxhash.xxh3_64_intdigest.");

static PyObject *xxh3_64(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"data", "seed", NULL};
    Py_buffer view;
    PyObject *seed_obj = NULL;
    uint64_t seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|O", names, &view, &seed_obj)) return NULL;
    if (seed_obj != NULL && as_u64(seed_obj, &seed) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint64_t h = kx_xxh3_64(view.buf, (size_t)view.len, seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

PyDoc_STRVAR(xxh3_64_slices_doc,
"xxh3_64_slices(data, width, seed=0) -> int\n\n"
"The xor of XXH3-64 (with ``seed``) of each full ``width``-byte slice of ``data``: the hash alone,\n"
"many times, without a Python int per hash (benchmarks/xxh3.py).");

static PyObject *xxh3_64_slices(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"data", "width", "seed", NULL};
    Py_buffer view;
    Py_ssize_t width;
    PyObject *seed_obj = NULL;
    uint64_t seed = 0, folded = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*n|O", names, &view, &width, &seed_obj)) return NULL;
    if ((seed_obj != NULL && as_u64(seed_obj, &seed) < 0) || width <= 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "width must be positive");
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *data = view.buf;
    for (Py_ssize_t at = 0; at <= view.len - width; at += width) folded ^= kx_xxh3_64(data + at, (size_t)width, seed);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(folded);
}

PyDoc_STRVAR(kthena_chain_doc,
"kthena_chain(data, first, size, count) -> list[int]\n\n"
"Kthena's chain over ``count`` blocks of ``size`` bytes of ``data`` (the last may be short):\n"
"h_i = XXH64(decimal(h_{i-1}) || block_i), h_{-1} = first.");

static PyObject *kthena_chain(PyObject *self, PyObject *args) {
    Py_buffer view;
    PyObject *first_obj;
    Py_ssize_t size, count;
    uint64_t prev;
    if (!PyArg_ParseTuple(args, "y*Onn", &view, &first_obj, &size, &count)) return NULL;
    if (as_u64(first_obj, &prev) < 0 || size <= 0 || size > 4096 || count < 0 || count > (view.len + size - 1) / size) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "size must be in 1..4096 and count cover data");
        PyBuffer_Release(&view);
        return NULL;
    }
    unsigned char *buf = PyMem_Malloc((size_t)size + 20);
    PyObject *out = buf != NULL ? PyList_New(count) : NULL;
    if (out == NULL) {
        PyMem_Free(buf);
        PyBuffer_Release(&view);
        return buf == NULL ? PyErr_NoMemory() : NULL;
    }
    const unsigned char *data = view.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        char digits[21];
        int n = 0;
        uint64_t v = prev;
        do { digits[n++] = (char)('0' + v % 10); v /= 10; } while (v);
        for (int j = 0; j < n; j++) buf[j] = (unsigned char)digits[n - 1 - j];
        Py_ssize_t start = i * size, len = view.len - start < size ? view.len - start : size;
        memcpy(buf + n, data + start, (size_t)len);
        prev = kx_xxh64(buf, (size_t)n + (size_t)len, 0);
        PyObject *h = PyLong_FromUnsignedLongLong(prev);
        if (h == NULL) {
            Py_DECREF(out);
            out = NULL;
            break;
        }
        PyList_SET_ITEM(out, i, h);
    }
    PyMem_Free(buf);
    PyBuffer_Release(&view);
    return out;
}

static PyMethodDef methods[] = {
    {"prompt_keys", prompt_keys, METH_VARARGS, prompt_keys_doc},
    {"local_hashes", local_hashes, METH_VARARGS, local_hashes_doc},
    {"chain_keys", chain_keys, METH_VARARGS, chain_keys_doc},
    {"kthena_chain", kthena_chain, METH_VARARGS, kthena_chain_doc},
    {"xxh3_64", (PyCFunction)(void (*)(void))xxh3_64, METH_VARARGS | METH_KEYWORDS, xxh3_64_doc},
    {"xxh3_64_slices", (PyCFunction)(void (*)(void))xxh3_64_slices, METH_VARARGS | METH_KEYWORDS, xxh3_64_slices_doc},
    {NULL, NULL, 0, NULL},
};

static int state_clear(PyObject *module) {
    Py_CLEAR(((State *)PyModule_GetState(module))->u64_one);
    return 0;
}

static int state_traverse(PyObject *module, visitproc visit, void *arg) {
    Py_VISIT(((State *)PyModule_GetState(module))->u64_one);
    return 0;
}

static void state_free(void *module) { state_clear((PyObject *)module); }

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvindex._keys",
    "kvindex's chained block keys in C (kvindex/keys.py is the reference).", sizeof(State), methods,
    NULL, state_traverse, state_clear, state_free,
};

PyMODINIT_FUNC PyInit__keys(void) {
    PyObject *m = PyModule_Create(&module), *array = m ? PyImport_ImportModule("array") : NULL;
    State *st = m ? PyModule_GetState(m) : NULL;
    if (array != NULL) st->u64_one = PyObject_CallMethod(array, "array", "s[i]", "Q", 0);
    Py_XDECREF(array);
    if (m != NULL && (st == NULL || st->u64_one == NULL)) Py_CLEAR(m);
    return m;
}
