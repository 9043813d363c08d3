/* kvindex._apply: the one fast path of kvindex/index/precise.py's store and remove loops, in C, on
 * the index's own Python objects.
 *
 * What it mirrors (PreciseIndex._store_one / _remove_one, on kvindex/index/table.py's Table, are the
 * reference; tests/test_native_apply.py applies the same events to a pure-Python index and an
 * accelerated one and compares every piece of state, and both to kvindex/index/reference.py):
 *   store(table, holders, masks, bit, hashes, keys, start, cap)
 *       PreciseIndex._store's common case (one medium, every block keyed): insert
 *       hashes[i] -> keys[i] into the Table and add ``bit`` to holders[keys[i]] (interning the
 *       new mask as Holders.intern does, ``cap`` = holders.MASKS_CAP). Adds table.used itself.
 *   remove(table, holders, masks, keep, dups, extra, medium, tier, slot, hashes, start, cap)
 *       PreciseIndex._remove's loop for a table without a side dict: Table.take (backward-shift
 *       deletion) and the holder release. Subtracts what it deleted from table.used but never
 *       shrinks the table (the caller does, once per event, as the Python loop does).
 *   rehash(old, new, sh, m, start)
 *       Table.resize's loop (Table.rehash): the non-empty slot pairs of ``old`` into ``new``.
 *
 * The Table attributes read here by name are its documented C contract (kvindex/index/table.py):
 * ``tab`` (array("Q") of (hash, key) slot pairs), ``sh`` and ``m`` (home pair = h * MIX >> sh & m),
 * ``side`` (an exact dict) and ``used``.
 *
 * The fallback rule: C handles an element only the simple way, and decides that before changing
 * anything for it. At the first element it cannot (a side-dict hit, a repeat copy, a duplicate
 * holding, the table's last slot, an extra copy, a _dups entry, a hash or key that is not an exact
 * int in u64 range, a holder mask that is not an exact int, containers of unexpected types) it
 * returns that element's index; Python applies that one element with its own code and calls again
 * for the rest. So the state after any call is the state the Python loop would have reached.
 * Containers must be exact dicts, hashes/keys a tuple or list, slot arrays array("Q") whose last
 * slot is empty (the Table invariant: every probe then ends inside the array without bounds
 * checks). ``rehash`` only sees arrays Table made itself, so bad input there is a TypeError.
 * Errors (MemoryError) propagate; counts done before them are written back first where kept.
 * Borrowed pointers (sequence items, holder masks) stay valid across a call: the only objects it
 * allocates are exact ints and tuples, whose creation can run the cyclic GC but no user code that
 * could touch the index's own containers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MIX 0x9E3779B97F4A7C15ULL

enum { STOP = 0, DONE = 1, UNKNOWN = 2, FAIL = -1 };

static PyObject *s_tab, *s_sh, *s_m, *s_side, *s_used;

/* -- slot arrays --------------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    uint64_t *slot;
    Py_ssize_t n;       /* u64 items (2 per slot pair) */
    unsigned sh;
    uint64_t m;
} Slots;

/* 1 if ``o`` is an exact int in [0, 2**64) (its value in *out), else 0; never an exception. */
static int u64_of(PyObject *o, uint64_t *out) {
    if (!PyLong_CheckExact(o)) return 0;
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();  /* negative or too big: an OverflowError, nothing else for an exact int */
        return 0;
    }
    *out = (uint64_t)v;
    return 1;
}

static Py_ssize_t home(const Slots *s, uint64_t h) {
    return (Py_ssize_t)(((h * MIX) >> s->sh) & s->m);
}

/* Export ``tab`` if it is an array("Q") (writable, contiguous u64s). 1: held; 0: not (no exception). */
static int array_open(Py_buffer *view, PyObject *tab) {
    if (PyObject_GetBuffer(tab, view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        return 0;
    }
    if (view->itemsize == 8 && view->format != NULL && strcmp(view->format, "Q") == 0) return 1;
    PyBuffer_Release(view);
    return 0;
}

/* Export a Table's slot array with its shift and mask. 1: usable; 0: not the layout this code
 * assumes (nothing held, no exception). Every home is a pair inside the array, the last slot empty. */
static int slots_open(Slots *s, PyObject *tab, PyObject *sh, PyObject *m) {
    uint64_t shv, mv;
    if (!u64_of(sh, &shv) || shv > 63 || !u64_of(m, &mv) || !array_open(&s->view, tab)) return 0;
    s->slot = s->view.buf;
    s->n = s->view.len / 8;
    s->sh = (unsigned)shv;
    s->m = mv;
    int ok = s->n >= 2 && s->n % 2 == 0 && mv % 2 == 0 && mv <= (uint64_t)(s->n - 2) && s->slot[s->n - 2] == 0;
    if (!ok) PyBuffer_Release(&s->view);
    return ok;
}

/* Index of ``h``'s pair (*found = 1) or of the empty slot that ends its run (*found = 0). The last
 * slot is empty, so the run ends inside the array. */
static Py_ssize_t probe(const Slots *s, uint64_t h, int *found) {
    Py_ssize_t j = home(s, h);
    uint64_t x;
    while ((x = s->slot[j]) != 0) {
        if (x == h) {
            *found = 1;
            return j;
        }
        j += 2;
    }
    *found = 0;
    return j;
}

/* Table._delete's backward shift (Table.take): later entries of the run whose home is at or before the hole move
 * in; the final hole's hash becomes 0 (its key half is left as it was, as in Python). */
static void shift_out(Slots *s, Py_ssize_t j) {
    Py_ssize_t i = j;
    uint64_t x;
    for (j += 2; (x = s->slot[j]) != 0; j += 2) {
        if (home(s, x) <= i) {
            s->slot[i] = x;
            s->slot[i + 1] = s->slot[j + 1];
            i = j;
        }
    }
    s->slot[i] = 0;
}

static int table_slots(Slots *s, PyObject *table) {
    PyObject *tab = PyObject_GetAttr(table, s_tab);
    PyObject *sh = tab ? PyObject_GetAttr(table, s_sh) : NULL;
    PyObject *m = sh ? PyObject_GetAttr(table, s_m) : NULL;
    int ok = m ? slots_open(s, tab, sh, m) : -1;
    Py_XDECREF(tab);
    Py_XDECREF(sh);
    Py_XDECREF(m);
    return ok;
}

/* -- holder masks -------------------------------------------------------------------------- */

/* ``masks.get(mask) or holders.intern(mask)``: the shared object for ``mask`` (a new reference). */
static PyObject *interned(PyObject *masks, PyObject *mask, Py_ssize_t cap) {
    PyObject *got = PyDict_GetItemWithError(masks, mask);
    if (got != NULL) return Py_NewRef(got);
    if (PyErr_Occurred()) return NULL;
    if (PyDict_GET_SIZE(masks) >= cap) PyDict_Clear(masks);
    if (PyDict_SetItem(masks, mask, mask) < 0) return NULL;
    return Py_NewRef(mask);
}

/* holders[key] as an exact int: *mask borrowed (NULL when absent). 1 ok, 0 not an int, -1 error. */
static int mask_of(PyObject *holders, PyObject *key, PyObject **mask) {
    *mask = PyDict_GetItemWithError(holders, key);
    if (*mask == NULL) return PyErr_Occurred() ? FAIL : DONE;
    return PyLong_CheckExact(*mask) ? DONE : STOP;
}

/* ``mask & other`` is non-zero: 1, 0, or -1 on error. */
static int overlaps(PyObject *mask, PyObject *other) {
    PyObject *both = PyNumber_And(mask, other);
    if (both == NULL) return FAIL;
    int yes = PyObject_IsTrue(both);
    Py_DECREF(both);
    return yes;
}

/* holders[key] = interned(mask | bit), or ``bit`` itself when nobody held it (mask NULL or 0). */
static int add_holder(PyObject *holders, PyObject *masks, PyObject *key, PyObject *mask, PyObject *bit,
                      Py_ssize_t cap) {
    if (mask == NULL || !PyObject_IsTrue(mask)) return PyDict_SetItem(holders, key, bit);
    PyObject *wider = PyNumber_Or(mask, bit);
    PyObject *shared = wider ? interned(masks, wider, cap) : NULL;
    Py_XDECREF(wider);
    if (shared == NULL) return FAIL;
    int rc = PyDict_SetItem(holders, key, shared);
    Py_DECREF(shared);
    return rc;
}

/* ``mask = holders.get(key, 0) & keep``: holders[key] = interned(mask), or the key goes. */
static int drop_holder(PyObject *holders, PyObject *masks, PyObject *key, PyObject *mask, PyObject *keep,
                       Py_ssize_t cap) {
    if (mask == NULL) return 0;  /* holders.pop(key, None) of an absent key */
    PyObject *narrower = PyNumber_And(mask, keep);
    if (narrower == NULL) return FAIL;
    int rc, left = PyObject_IsTrue(narrower);
    if (left) {
        PyObject *shared = interned(masks, narrower, cap);
        rc = shared ? PyDict_SetItem(holders, key, shared) : FAIL;
        Py_XDECREF(shared);
    } else {
        rc = PyDict_DelItem(holders, key);
    }
    Py_DECREF(narrower);
    return rc;
}

/* ``(a, b) in d`` / ``(a, b, c) in d`` for a non-empty dict: 1, 0, -1. */
static int holds_pair(PyObject *d, PyObject *a, PyObject *b, PyObject *c) {
    PyObject *t = c ? PyTuple_Pack(3, a, b, c) : PyTuple_Pack(2, a, b);
    if (t == NULL) return FAIL;
    int rc = PyDict_Contains(d, t);
    Py_DECREF(t);
    return rc;
}

/* -- store --------------------------------------------------------------------------------- */

typedef struct {
    Slots s;
    PyObject *side, *holders, *masks, *bit;
    Py_ssize_t cap;
} Store;

/* One stored copy the simple way: DONE, STOP (untouched: PreciseIndex._store_one takes it), FAIL. */
static int store_one(Store *c, PyObject *h_obj, PyObject *key_obj) {
    uint64_t h, key;
    int found, rc;
    if (!u64_of(h_obj, &h) || h == 0 || !u64_of(key_obj, &key)) return STOP;
    if (PyDict_GET_SIZE(c->side) && (rc = PyDict_Contains(c->side, h_obj)) != 0) return rc < 0 ? FAIL : STOP;
    Py_ssize_t j = probe(&c->s, h, &found);
    if (found || j == c->s.n - 2) return STOP;  /* a repeat copy; or Table.extend's turn */
    PyObject *mask;
    if ((rc = mask_of(c->holders, key_obj, &mask)) != DONE) return rc;
    if (mask != NULL && (rc = overlaps(mask, c->bit)) != 0) return rc < 0 ? FAIL : STOP;  /* a dup */
    if (add_holder(c->holders, c->masks, key_obj, mask, c->bit, c->cap) < 0) return FAIL;
    c->s.slot[j] = h;
    c->s.slot[j + 1] = key;
    return DONE;
}

static int store_args(Store *c, PyObject *const *args) {
    c->holders = args[1];
    c->masks = args[2];
    c->bit = args[3];
    c->cap = PyLong_AsSsize_t(args[7]);
    if (c->cap == -1 && PyErr_Occurred()) return FAIL;
    if (!PyDict_CheckExact(c->holders) || !PyDict_CheckExact(c->masks) || !PyLong_CheckExact(c->bit)
        || !(PyTuple_CheckExact(args[4]) || PyList_CheckExact(args[4]))
        || !(PyTuple_CheckExact(args[5]) || PyList_CheckExact(args[5])))
        return STOP;
    c->side = PyObject_GetAttr(args[0], s_side);
    if (c->side == NULL) return FAIL;
    if (!PyDict_CheckExact(c->side)) {
        Py_CLEAR(c->side);
        return STOP;
    }
    int ok = table_slots(&c->s, args[0]);
    if (ok != DONE) Py_CLEAR(c->side);
    return ok;
}

/* table.used += added (negative for deletions), as the Python loops do on their way out. */
static int add_used(PyObject *table, Py_ssize_t added) {
    if (added == 0) return 0;
    PyObject *used = PyObject_GetAttr(table, s_used), *step = PyLong_FromSsize_t(added);
    PyObject *more = used && step ? PyNumber_Add(used, step) : NULL;
    Py_XDECREF(used);
    Py_XDECREF(step);
    int rc = more ? PyObject_SetAttr(table, s_used, more) : FAIL;
    Py_XDECREF(more);
    return rc;
}

/* The call's way out: write back what it did to table.used (even after an error, keeping that
 * error), then its result, or NULL. */
static PyObject *settle(PyObject *table, Py_ssize_t delta, int failed, PyObject *result) {
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    if (failed) PyErr_Fetch(&type, &value, &tb);
    int bad = add_used(table, delta) < 0;
    if (failed) {
        if (bad) PyErr_Clear();
        PyErr_Restore(type, value, tb);
    }
    if (failed || bad) {
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

PyDoc_STRVAR(store_doc,
"store(table, holders, masks, bit, hashes, keys, start, cap) -> int\n\n"
"PreciseIndex._store's common case from ``start``: the index of the first element it left\n"
"to Python (len(hashes) when none). Adds what it inserted to table.used.");

static PyObject *store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) return PyErr_Format(PyExc_TypeError, "store() takes 8 arguments (%zd given)", nargs);
    Py_ssize_t i = PyLong_AsSsize_t(args[6]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    Store c;
    int ok = store_args(&c, args);
    if (ok == FAIL) return NULL;
    if (ok == STOP) return PyLong_FromSsize_t(i);
    Py_ssize_t n = Py_MIN(PySequence_Fast_GET_SIZE(args[4]), PySequence_Fast_GET_SIZE(args[5]));
    PyObject **hs = PySequence_Fast_ITEMS(args[4]), **ks = PySequence_Fast_ITEMS(args[5]);
    Py_ssize_t start = i < 0 ? 0 : i;
    int rc = DONE;
    for (i = start; i < n && (rc = store_one(&c, hs[i], ks[i])) == DONE; i++) {
    }
    PyBuffer_Release(&c.s.view);
    Py_DECREF(c.side);
    PyObject *result = rc == FAIL ? NULL : PyLong_FromSsize_t(i);
    return settle(args[0], i - start, result == NULL, result);
}

/* -- remove -------------------------------------------------------------------------------- */

typedef struct {
    Slots s;
    PyObject *holders, *masks, *keep, *dups, *extra, *medium, *tier, *slot;
    Py_ssize_t cap;
} Remove;

/* The worker lets go of ``key`` the simple way (no _dups entry): DONE, STOP (untouched), FAIL. */
static int release(Remove *c, PyObject *key) {
    PyObject *mask;
    int rc = PyDict_GET_SIZE(c->dups) ? holds_pair(c->dups, c->tier, key, c->slot) : 0;
    if (rc != 0) return rc < 0 ? FAIL : STOP;  /* a duplicate holding: Holders.release counts it down */
    if ((rc = mask_of(c->holders, key, &mask)) != DONE) return rc;
    return drop_holder(c->holders, c->masks, key, mask, c->keep, c->cap) < 0 ? FAIL : DONE;
}

/* One removed copy the simple way: DONE (removed), UNKNOWN, STOP (untouched), FAIL. */
static int remove_one(Remove *c, PyObject *h_obj) {
    uint64_t h;
    int found, rc;
    if (!u64_of(h_obj, &h)) return STOP;
    if (PyDict_GET_SIZE(c->extra) && (rc = holds_pair(c->extra, c->medium, h_obj, NULL)) != 0)
        return rc < 0 ? FAIL : STOP;  /* a copy goes, the hash stays */
    Py_ssize_t j = probe(&c->s, h, &found);
    if (!found) return UNKNOWN;
    PyObject *key = PyLong_FromUnsignedLongLong(c->s.slot[j + 1]);
    rc = key ? release(c, key) : FAIL;
    Py_XDECREF(key);
    if (rc == DONE) shift_out(&c->s, j);
    return rc;
}

static int remove_args(Remove *c, PyObject *const *args) {
    c->holders = args[1];
    c->masks = args[2];
    c->keep = args[3];
    c->dups = args[4];
    c->extra = args[5];
    c->medium = args[6];
    c->tier = args[7];
    c->slot = args[8];
    c->cap = PyLong_AsSsize_t(args[11]);
    if (c->cap == -1 && PyErr_Occurred()) return FAIL;
    if (!PyDict_CheckExact(c->holders) || !PyDict_CheckExact(c->masks) || !PyDict_CheckExact(c->dups)
        || !PyDict_CheckExact(c->extra) || !PyLong_CheckExact(c->keep)
        || !(PyTuple_CheckExact(args[9]) || PyList_CheckExact(args[9])))
        return STOP;
    return table_slots(&c->s, args[0]);
}

PyDoc_STRVAR(remove_doc,
"remove(table, holders, masks, keep, dups, extra, medium, tier, slot, hashes, start, cap)\n"
"    -> (stop, gone, unknown)\n\n"
"PreciseIndex._remove's loop (no side dict) from ``start``: ``stop`` is the first element left to\n"
"Python (len(hashes) when none), ``gone`` the entries deleted (subtracted from table.used; the\n"
"table is not shrunk), ``unknown`` the hashes the table did not hold.");

static PyObject *remove_(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 12) return PyErr_Format(PyExc_TypeError, "remove() takes 12 arguments (%zd given)", nargs);
    Py_ssize_t i = PyLong_AsSsize_t(args[10]), gone = 0, unknown = 0;
    if (i == -1 && PyErr_Occurred()) return NULL;
    Remove c;
    int rc = remove_args(&c, args);
    if (rc == FAIL) return NULL;
    if (rc == STOP) return Py_BuildValue("nnn", i, gone, unknown);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(args[9]);
    PyObject **hs = PySequence_Fast_ITEMS(args[9]);
    for (i = i < 0 ? 0 : i; i < n; i++) {
        rc = remove_one(&c, hs[i]);
        if (rc == DONE) gone++;
        else if (rc == UNKNOWN) unknown++;
        else break;
    }
    PyBuffer_Release(&c.s.view);
    PyObject *result = rc == FAIL ? NULL : Py_BuildValue("nnn", i, gone, unknown);
    return settle(args[0], -gone, result == NULL, result);
}

/* -- rehash -------------------------------------------------------------------------------- */

/* Place the entries of ``old`` from item ``i`` into the fresh ``new``; returns where it stopped. */
static Py_ssize_t place_all(const uint64_t *old, Py_ssize_t n_old, Slots *new, Py_ssize_t i) {
    for (; i + 1 < n_old; i += 2) {
        uint64_t h = old[i];
        if (h == 0) continue;
        Py_ssize_t j = home(new, h);
        while (new->slot[j]) j += 2;
        if (j == new->n - 2) return i;  /* the last slot: the caller extends ``new`` first */
        new->slot[j] = h;
        new->slot[j + 1] = old[i + 1];
    }
    return n_old;
}

PyDoc_STRVAR(rehash_doc,
"rehash(old, new, sh, m, start) -> int\n\n"
"Table.resize's loop: the entries of slot array ``old`` from item ``start`` (even) into the\n"
"fresh slot array ``new`` (homes by ``sh`` and ``m``). Returns len(old) when done, or the item\n"
"index of the entry that would take ``new``'s last slot: the caller extends ``new`` (Table.extend) and\n"
"calls again from there.");

static PyObject *rehash(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) return PyErr_Format(PyExc_TypeError, "rehash() takes 5 arguments (%zd given)", nargs);
    Py_ssize_t i = PyLong_AsSsize_t(args[4]);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i % 2) return PyErr_Format(PyExc_ValueError, "rehash() start must be even and >= 0");
    Py_buffer old;
    Slots new;
    if (!array_open(&old, args[0])) return PyErr_Format(PyExc_TypeError, "rehash() needs an array('Q')");
    if (!slots_open(&new, args[1], args[2], args[3])) {
        PyBuffer_Release(&old);
        return PyErr_Format(PyExc_TypeError, "rehash() needs a fresh Table slot array");
    }
    i = place_all(old.buf, old.len / 8, &new, i);
    PyBuffer_Release(&new.view);
    PyBuffer_Release(&old);
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"store", (PyCFunction)(void (*)(void))store, METH_FASTCALL, store_doc},
    {"remove", (PyCFunction)(void (*)(void))remove_, METH_FASTCALL, remove_doc},
    {"rehash", (PyCFunction)(void (*)(void))rehash, METH_FASTCALL, rehash_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_apply",
    "The fast path of kvindex.index.precise (store, remove, rehash) in C; its Python is the reference.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__apply(void) {
    s_tab = PyUnicode_InternFromString("tab");
    s_sh = PyUnicode_InternFromString("sh");
    s_m = PyUnicode_InternFromString("m");
    s_side = PyUnicode_InternFromString("side");
    s_used = PyUnicode_InternFromString("used");
    if (!s_tab || !s_sh || !s_m || !s_side || !s_used) return NULL;
    return PyModule_Create(&module);
}
