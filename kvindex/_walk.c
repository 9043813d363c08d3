/* kvindex._walk: the precise index's prefix walk (kvindex/index/walk.py ``walk``), in C.
 *
 * walk(keys, holders, allowed) -> [(depth, mask), ...]
 *
 * ``holders`` maps key -> bitmask of the worker slots holding it; ``allowed`` is the mask of the
 * slots a query may answer with. The walk ANDs the masks of the prompt's keys in order and stops
 * when no slot is left. Its answer, as in Python: for each depth d >= 1 at which some slots stop
 * (their longest held prefix is d keys), (d, mask of those slots), deepest first.
 * Masks are Python ints of any width; while they fit in 64 bits the walk stays in C integers.
 * ``walk`` in kvindex/index/walk.py is the reference; tests compare the two.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* A run of the walk: the last depth at which the running mask had this value. */
typedef struct {
    Py_ssize_t last;
    PyObject *value; /* owned */
} Run;

typedef struct {
    Run *runs;
    Py_ssize_t len, cap;
} Runs;

static int runs_push(Runs *r, Py_ssize_t last, PyObject *value) {
    if (r->len == r->cap) {
        Py_ssize_t cap = r->cap ? 2 * r->cap : 16;
        Run *grown = PyMem_Realloc(r->runs, (size_t)cap * sizeof *grown);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        r->runs = grown;
        r->cap = cap;
    }
    r->runs[r->len].last = last;
    r->runs[r->len].value = value;
    r->len++;
    return 0;
}

static void runs_free(Runs *r) {
    for (Py_ssize_t i = 0; i < r->len; i++) Py_DECREF(r->runs[i].value);
    PyMem_Free(r->runs);
}

/* The runs, any mask width: Python ints throughout. */
static int walk_objects(PyObject **keys, Py_ssize_t n, PyObject *holders, PyObject *allowed, Runs *out) {
    PyObject *cur = Py_NewRef(allowed);
    Py_ssize_t last = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *mask = PyDict_GetItemWithError(holders, keys[i]);
        if (mask == NULL) {
            if (PyErr_Occurred()) goto fail;
            break; /* nobody holds this key: every slot stops here */
        }
        PyObject *next = PyNumber_And(cur, mask);
        if (next == NULL) goto fail;
        int empty = PyObject_Not(next);
        if (empty) {
            Py_DECREF(next);
            if (empty < 0) goto fail;
            break;
        }
        int same = PyObject_RichCompareBool(next, cur, Py_EQ);
        if (same < 0) {
            Py_DECREF(next);
            goto fail;
        }
        if (same) {
            Py_DECREF(next);
        } else {
            if (runs_push(out, last, cur) < 0) {
                Py_DECREF(next);
                goto fail;
            }
            cur = next;
        }
        last = i + 1;
    }
    if (runs_push(out, last, cur) == 0) return 0;
fail:
    Py_DECREF(cur);
    return -1;
}

/* The runs with masks in uint64_t; 1: a mask does not fit (the caller walks with objects). */
static int walk_u64(PyObject **keys, Py_ssize_t n, PyObject *holders, uint64_t allowed, Runs *out) {
    uint64_t cur = allowed;
    Py_ssize_t last = 0;
    Runs local = {NULL, 0, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *mask = PyDict_GetItemWithError(holders, keys[i]);
        if (mask == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        if (!PyLong_CheckExact(mask)) goto wide;
        uint64_t m = PyLong_AsUnsignedLongLong(mask);
        if (m == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto wide;
        }
        uint64_t next = cur & m;
        if (next == 0) break;
        if (next != cur) {
            PyObject *v = PyLong_FromUnsignedLongLong(cur);
            if (v == NULL || runs_push(&local, last, v) < 0) {
                Py_XDECREF(v);
                goto fail;
            }
            cur = next;
        }
        last = i + 1;
    }
    PyObject *v = PyLong_FromUnsignedLongLong(cur);
    if (v == NULL || runs_push(&local, last, v) < 0) {
        Py_XDECREF(v);
        goto fail;
    }
    *out = local;
    return 0;
wide:
    runs_free(&local);
    return 1;
fail:
    runs_free(&local);
    return -1;
}

/* Deepest first: (last, value & ~deeper value) for each run that ends at depth >= 1. */
static PyObject *groups_of(Runs *r) {
    PyObject *out = PyList_New(0);
    PyObject *seen = NULL;
    for (Py_ssize_t i = r->len - 1; out != NULL && i >= 0 && r->runs[i].last >= 1; i--) {
        PyObject *value = r->runs[i].value, *fresh;
        if (seen == NULL) {
            fresh = Py_NewRef(value);
        } else {
            PyObject *inv = PyNumber_Invert(seen);
            fresh = inv ? PyNumber_And(value, inv) : NULL;
            Py_XDECREF(inv);
        }
        PyObject *item = fresh ? Py_BuildValue("(nN)", r->runs[i].last, fresh) : NULL;
        if (item == NULL || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
        seen = value;
    }
    return out;
}

PyDoc_STRVAR(walk_doc,
"walk(keys, holders, allowed) -> list[tuple[int, int]]\n\n"
"(depth, mask of the slots whose longest held prefix of ``keys`` is that deep), deepest first,\n"
"for depths >= 1; ``holders`` maps key -> slot mask, ``allowed`` masks the slots to consider.");

static PyObject *walk(PyObject *self, PyObject *args) {
    PyObject *keys_obj, *holders, *allowed;
    if (!PyArg_ParseTuple(args, "OO!O!", &keys_obj, &PyDict_Type, &holders, &PyLong_Type, &allowed)) return NULL;
    PyObject *seq = PySequence_Fast(keys_obj, "keys must be a sequence");
    if (seq == NULL) return NULL;
    PyObject **keys = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Runs runs = {NULL, 0, 0};
    int rc = 1;
    uint64_t small = PyLong_AsUnsignedLongLong(allowed);
    if (small == (uint64_t)-1 && PyErr_Occurred()) PyErr_Clear();
    else rc = walk_u64(keys, n, holders, small, &runs);
    if (rc == 1) rc = walk_objects(keys, n, holders, allowed, &runs);
    PyObject *out = rc == 0 ? groups_of(&runs) : NULL;
    runs_free(&runs);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef methods[] = {
    {"walk", walk, METH_VARARGS, walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvindex._walk",
    "The precise index's prefix walk in C (kvindex/index/walk.py walk is the reference).", -1, methods,
};

PyMODINIT_FUNC PyInit__walk(void) { return PyModule_Create(&module); }
