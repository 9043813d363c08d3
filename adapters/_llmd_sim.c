/* adapters._llmd_sim: llm-d-inference-sim's dummy tokenizer in C.
 *
 * tokenize(text) -> array("I")
 *
 * adapters/llmd_sim.py is the reference (``py_tokenize_prompt``: ``[fnv1a_32(tok) for tok in
 * split_tokens(text)]``); tests/test_llmd_sim_native.py compares the two. Contract:
 * - The tokens are the matches of ``_TOKEN_RE``, read left to right over the str's UTF-8 bytes: at
 *   each position one punctuation character of ``_PUNCT``, else a maximal run of ASCII
 *   [0-9A-Za-z_], then the whitespace run [\t\n\f\r ] after it, which belongs to the token. A
 *   position where neither starts is skipped: every non-ASCII byte (no match is ever non-ASCII,
 *   so bytes and code points give the same tokens), \v, a space after nothing, ...
 * - ``_`` and ``-`` are punctuation and punctuation is tried first (leftmost-first alternation):
 *   a ``_`` that starts a token is a token of its own ("_abc" is "_", "abc"; "__" is "_", "_"),
 *   one inside a word run is part of it ("a_b" is one token); ``-`` always stands alone.
 * - A token's id is FNV-1a-32 of its bytes (Go's hash/fnv New32a), hashed as it is scanned.
 * - A str that has no UTF-8 form (a lone surrogate) raises UnicodeEncodeError, a ValueError: the
 *   Python caller then tokenizes it in Python, where such a character is simply dropped.
 *   (PyUnicode_AsUTF8AndSize keeps the UTF-8 form of a non-ASCII str with the str; an ASCII str
 *   is its own UTF-8, no copy.)
 * The ids are collected in a growing buffer (a token is at least one byte: at most len(bytes) of
 * them), then copied into one new array("I"), a repeat of the module's array("I", [0]).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../kvindex/kx_u64s.h"

#define FNV32_OFFSET 0x811C9DC5u
#define FNV32_PRIME 0x01000193u

enum { PUNCT = 1, WORD = 2, SPACE = 4, STARTS = PUNCT | WORD };

/* Each byte's classes (filled at import): '_' is both PUNCT and WORD. */
static unsigned char cls[256];

static void fill_classes(void) {
    static const char punct[] = "{}:,-.?!;@#$%^&*()+_~/\\><[]=\"'"; /* _PUNCT's characters */
    static const char space[] = "\t\n\f\r ";
    for (const char *c = punct; *c; c++) cls[(unsigned char)*c] |= PUNCT;
    for (const char *c = space; *c; c++) cls[(unsigned char)*c] |= SPACE;
    for (int c = '0'; c <= '9'; c++) cls[c] |= WORD;
    for (int c = 'A'; c <= 'Z'; c++) cls[c] |= WORD;
    for (int c = 'a'; c <= 'z'; c++) cls[c] |= WORD;
    cls['_'] |= WORD;
}

/* The module's state: array("I", [0]), which every answer is a repeat of (made at import). */
typedef struct {
    PyObject *u32_one;
} State;

typedef struct {
    uint32_t *items;
    Py_ssize_t len, cap;
} Ids;

static int grow(Ids *ids, Py_ssize_t most) {
    Py_ssize_t cap = ids->cap ? 2 * ids->cap : 1024;
    if (cap > most) cap = most;
    uint32_t *grown = PyMem_Realloc(ids->items, (size_t)cap * sizeof(uint32_t));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    ids->items = grown;
    ids->cap = cap;
    return 0;
}

/* The ids of the tokens of s[0:n] into ids. 0, or -1 with MemoryError. */
static int scan(const unsigned char *s, Py_ssize_t n, Ids *ids) {
    const unsigned char *p = s, *end = s + n;
    uint32_t *items = ids->items;
    Py_ssize_t len = 0, cap = ids->cap;
    while (p < end) {
        unsigned c = cls[*p];
        if (!(c & STARTS)) { /* no token starts here: the byte is dropped */
            p++;
            continue;
        }
        uint32_t h = (FNV32_OFFSET ^ *p++) * FNV32_PRIME;
        if (!(c & PUNCT)) /* a word: the whole run (its '_' included) */
            while (p < end && (cls[*p] & WORD)) h = (h ^ *p++) * FNV32_PRIME;
        while (p < end && (cls[*p] & SPACE)) h = (h ^ *p++) * FNV32_PRIME;
        if (len == cap) {
            ids->len = len;
            if (grow(ids, n) < 0) return -1;
            items = ids->items;
            cap = ids->cap;
        }
        items[len++] = h;
    }
    ids->len = len;
    return 0;
}

PyDoc_STRVAR(tokenize_doc,
"tokenize(text) -> array('I')\n\n"
"The simulator's token ids of ``text``: [fnv1a_32(tok) for tok in split_tokens(text)], as\n"
"adapters.llmd_sim.py_tokenize_prompt gives them. UnicodeEncodeError (a ValueError) for a str\n"
"with no UTF-8 form (lone surrogates): tokenize those in Python.");

static PyObject *tokenize(PyObject *module, PyObject *text) {
    if (!PyUnicode_Check(text)) {
        PyErr_Format(PyExc_TypeError, "tokenize() argument must be str, not %.100s", Py_TYPE(text)->tp_name);
        return NULL;
    }
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    if (s == NULL) return NULL;
    Ids ids = {NULL, 0, 0};
    if (n > 0) {
        /* a first guess of one token per 4 bytes (prose runs 4 to 9), doubled when short */
        ids.cap = n / 4 + 16 < n ? n / 4 + 16 : n;
        if ((ids.items = PyMem_Malloc((size_t)ids.cap * sizeof(uint32_t))) == NULL) return PyErr_NoMemory();
    }
    PyObject *out = NULL;
    uint32_t *data;
    if (scan((const unsigned char *)s, n, &ids) == 0) {
        out = kx_zeros(((State *)PyModule_GetState(module))->u32_one, ids.len, (void **)&data);
        if (out != NULL && ids.len > 0) memcpy(data, ids.items, (size_t)ids.len * sizeof(uint32_t));
    }
    PyMem_Free(ids.items);
    return out;
}

static PyMethodDef methods[] = {
    {"tokenize", tokenize, METH_O, tokenize_doc},
    {NULL, NULL, 0, NULL},
};

static int state_clear(PyObject *module) {
    Py_CLEAR(((State *)PyModule_GetState(module))->u32_one);
    return 0;
}

static int state_traverse(PyObject *module, visitproc visit, void *arg) {
    Py_VISIT(((State *)PyModule_GetState(module))->u32_one);
    return 0;
}

static void state_free(void *module) { state_clear((PyObject *)module); }

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "adapters._llmd_sim",
    "llm-d-inference-sim's dummy tokenizer in C (adapters/llmd_sim.py is the reference).", sizeof(State), methods,
    NULL, state_traverse, state_clear, state_free,
};

PyMODINIT_FUNC PyInit__llmd_sim(void) {
    fill_classes();
    PyObject *m = PyModule_Create(&module), *array = m ? PyImport_ImportModule("array") : NULL;
    State *st = m ? PyModule_GetState(m) : NULL;
    if (array != NULL) st->u32_one = PyObject_CallMethod(array, "array", "s[i]", "I", 0);
    Py_XDECREF(array);
    if (m != NULL && (st == NULL || st->u32_one == NULL)) Py_CLEAR(m);
    Py_buffer view; /* the ids are written as uint32_t: "I" must be 4 bytes wide */
    if (m != NULL && PyObject_GetBuffer(st->u32_one, &view, PyBUF_SIMPLE) == 0) {
        Py_ssize_t width = view.len;
        PyBuffer_Release(&view);
        if (width != (Py_ssize_t)sizeof(uint32_t)) {
            PyErr_SetString(PyExc_ImportError, "array('I') items are not 4 bytes wide here");
            Py_CLEAR(m);
        }
    } else if (m != NULL) {
        Py_CLEAR(m);
    }
    return m;
}
