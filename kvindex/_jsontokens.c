/* kvindex._jsontokens: lifts one top-level array of integers out of a JSON request body, in C.
 *
 * split(raw, key) -> (u32 bytes, remainder) | None
 * split_u64(raw, key) -> (u64 bytes, remainder) | None
 *
 * A router's /query body is ~60 KB of JSON, nearly all of it ``"token_ids": [..8k ints..]``;
 * a general JSON decoder spends ~200 us turning those digits into Python ints that kvindex
 * packs into an array("I") right after. Here one pass parses the digits straight into u32s.
 * /query_by_hash's ``block_hashes`` (512 signed 64-bit hashes, ~11 KB) the same way, into u64s.
 *
 * Contract (kvindex/http/bodies.py's read_body (decode_json) is the caller; msgspec.json.decode is the reference):
 * - Only the top-level member named exactly ``key`` is lifted, and only when its value is an
 *   array of plain integers (no fraction, exponent or leading zero):
 *   - split: non-negative, below 2**32 (no sign), packed as native u32s;
 *   - split_u64: from -2**63 to 2**64 - 1 (no "-0"), packed as native u64s holding each value's
 *     low 64 bits (two's complement: Dynamo's i64 hashes and their u64 form are the same u64).
 * - ``remainder`` is ``raw`` with that array replaced by ``[]``. The caller decodes the remainder
 *   with the reference decoder, which validates everything this scanner only skipped over; so
 *   for any input the caller's result is the reference result, or the reference's error.
 * - Anything unusual returns None and the caller takes the reference path for the whole body:
 *   no such member, a second one, a key with an escape, any other element type, bad structure.
 *
 * dynamo_answer(matches, block_size) -> bytes | None
 *
 * The other way: Dynamo's /query answer (kvindex/http/dynamo.py's ``query_answer``, then
 * ``json_body``, msgspec's encoder, is the reference) written as its JSON bytes in one pass, with
 * no dict per pod. The same bytes as the reference for every input it takes; None for anything
 * unusual (the caller then takes the reference): a pod id that is not plain printable ASCII
 * without '"' or '\' (msgspec's escapes are not redone here), a block size below 1, a depth or
 * rank that is negative, not an int or past 64 bits (also once multiplied by the block size).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    const char *p, *end;
} Cursor;

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

static void skip_ws(Cursor *c) {
    while (c->p < c->end && is_ws(*c->p)) c->p++;
}

static int at(Cursor *c, char ch) { return c->p < c->end && *c->p == ch; }

/* c->p at an opening quote: past the closing one. 0 on success. ``escaped`` says if any \ was seen. */
static int skip_string(Cursor *c, int *escaped) {
    c->p++;
    while (c->p < c->end) {
        char ch = *c->p++;
        if (ch == '"') return 0;
        if (ch == '\\') {
            if (escaped) *escaped = 1;
            if (c->p >= c->end) return -1;
            c->p++;
        }
    }
    return -1;
}

/* Past one JSON value, trusting the reference decoder to validate it later. 0 on success. */
static int skip_value(Cursor *c) {
    if (at(c, '"')) return skip_string(c, NULL);
    if (at(c, '{') || at(c, '[')) {
        int depth = 0;
        while (c->p < c->end) {
            char ch = *c->p;
            if (ch == '"') {
                if (skip_string(c, NULL) < 0) return -1;
                continue;
            }
            if (ch == '{' || ch == '[') depth++;
            else if (ch == '}' || ch == ']') depth--;
            c->p++;
            if (depth == 0) return 0;
        }
        return -1;
    }
    const char *start = c->p;
    while (c->p < c->end && !is_ws(*c->p) && *c->p != ',' && *c->p != '}' && *c->p != ']') c->p++;
    return c->p > start ? 0 : -1;
}

/* The lifted array's values, packed (u32s or u64s: ``width`` bytes each). */
typedef struct {
    void *items;
    Py_ssize_t len, cap, width;
} Values;

static int grow(Values *out) {
    Py_ssize_t cap = out->cap ? 2 * out->cap : 1024;
    void *grown = PyMem_Realloc(out->items, (size_t)(cap * out->width));
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    out->items = grown;
    out->cap = cap;
    return 0;
}

/* The digits of one number at p (at most 8 read at once): how many (0..8) in *n and, when fewer
 * than 8, their value. Reads 8 bytes: the caller makes sure they are there. Bytes are digits
 * when their high nibble is 3 and their low one at most 9; the value of up to 8 digits comes
 * from multiplying pairs, then fours, of them at once (one u64, the digits as its bytes). */
static inline uint64_t eight_digits(const char *p, unsigned *n) {
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    *n = 8; /* the byte order below is little-endian's: elsewhere the caller reads digit by digit */
    return 0;
#endif
    uint64_t w;
    memcpy(&w, p, 8); /* p[0] is the low byte */
    uint64_t not_digit = ((w & 0xF0F0F0F0F0F0F0F0ULL) ^ 0x3030303030303030ULL) |
                         (((w & 0x0F0F0F0F0F0F0F0FULL) + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL);
    *n = not_digit ? (unsigned)__builtin_ctzll(not_digit) / 8 : 8;
    if (*n == 0 || *n == 8) return 0;
    uint64_t keep = (1ULL << (8 * *n)) - 1;
    uint64_t v = ((w & keep) - (0x3030303030303030ULL & keep)) << (8 * (8 - *n)); /* leading zeros */
    v = v * 10 + (v >> 8);                                                  /* pairs */
    v = (((v & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32))) +
         (((v >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32)))) >> 32; /* fours, then all */
    return v;
}

/* Both kinds' loops keep their cursor in a local (a register). */
static inline const char *past_ws(const char *p, const char *end) {
    while (p < end && is_ws(*p)) p++;
    return p;
}

/* Plain digits at p (no leading zero) into *v, at most ``max``: past them, or NULL. */
static inline const char *past_digits(const char *p, const char *end, uint64_t max, uint64_t *v) {
    const char *start = p;
    uint64_t acc = 0;
    for (; p < end && (unsigned char)(*p - '0') < 10; p++)
        if (__builtin_mul_overflow(acc, 10, &acc) || __builtin_add_overflow(acc, (uint64_t)(*p - '0'), &acc) ||
            acc > max)
            return NULL;
    if (p == start || (p > start + 1 && *start == '0')) return NULL;
    *v = acc;
    return p;
}

/* At '[': past it and any whitespace. 1 when an item follows, 0 past an empty array's ']'. */
static inline int first_item(const char **pp, const char *end) {
    const char *p = past_ws(*pp + 1, end);
    int empty = p < end && *p == ']';
    *pp = empty ? p + 1 : p;
    return !empty;
}

/* After an item: 1 past ',' and whitespace (another item follows), 0 past ']', -1 at anything else. */
static inline int next_item(const char **pp, const char *end) {
    const char *p = past_ws(*pp, end);
    if (p < end && *p == ']') {
        *pp = p + 1;
        return 0;
    }
    if (p >= end || *p != ',') return -1;
    *pp = past_ws(p + 1, end);
    return 1;
}

/* c->p at '['; past the matching ']'. -1: not a plain u32 array (or memory). */
static int parse_array(Cursor *c, Values *out) {
    const char *p = c->p, *end = c->end;
    int more = first_item(&p, end);
    while (more == 1) {
        const char *start = p;
        unsigned n = 8;
        uint64_t v = end - p >= 8 ? eight_digits(p, &n) : 0;
        if (n < 8)
            p += n;
        else if ((p = past_digits(p, end, UINT32_MAX, &v)) == NULL) /* near the end, or 8 digits or more */
            return -1;
        if (p == start || (p > start + 1 && *start == '0')) return -1;
        if (out->len == out->cap && grow(out) < 0) return -1;
        ((uint32_t *)out->items)[out->len++] = (uint32_t)v;
        more = next_item(&p, end);
    }
    c->p = p;
    return more;
}

/* The value of 8 digits at p (the caller has checked they are digits), as ``eight_digits``. */
static inline uint64_t all_eight(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    v -= 0x3030303030303030ULL;
    v = v * 10 + (v >> 8);
    return (((v & 0x000000FF000000FFULL) * (100 + (1000000ULL << 32))) +
            (((v >> 16) & 0x000000FF000000FFULL) * (1 + (10000ULL << 32)))) >> 32;
}

/* ``past_digits`` for a number of at most 19 digits, read 8 at a time (a hash has 19 or 20; the
 * per-digit loop's two overflow checks a digit were most of split_u64's time): the same result
 * (the same value, NULL for the same inputs). Needs 24 readable bytes at p; 20 digits or more,
 * or little-endian's byte order not in force: ``past_digits`` itself. */
static inline const char *past_digits_wide(const char *p, const char *end, uint64_t max, uint64_t *v) {
    static const uint64_t tens[9] = {1, 10, 100, 1000, 10000, 100000, 1000000, 10000000, 100000000};
    if (end - p < 24) return past_digits(p, end, max, v);
    unsigned n0, n1, n2;
    uint64_t lo = eight_digits(p, &n0), acc;
    const char *q;
    if (n0 < 8) {
        acc = lo;
        q = p + n0;
    } else {
        uint64_t mid = eight_digits(p + 8, &n1);
        if (n1 < 8) {
            acc = all_eight(p) * tens[n1] + mid;
            q = p + 8 + n1;
        } else {
            uint64_t last = eight_digits(p + 16, &n2);
            if (n2 > 3) return past_digits(p, end, max, v); /* 20 digits or more: checked digit by digit */
            acc = (all_eight(p) * tens[8] + all_eight(p + 8)) * tens[n2] + last; /* < 10**19 < 2**64 */
            q = p + 16 + n2;
        }
    }
    if (q == p || (q > p + 1 && *p == '0') || acc > max) return NULL;
    *v = acc;
    return q;
}

/* The 64-bit kind (split_u64): an item is digits with an optional '-' (magnitude at most 2**63,
 * "-0" declined), kept as its low 64 bits. */
static int parse_array64(Cursor *c, Values *out) {
    const char *p = c->p, *end = c->end;
    int more = first_item(&p, end);
    while (more == 1) {
        int neg = p < end && *p == '-';
        uint64_t v;
        p = past_digits_wide(neg ? p + 1 : p, end, neg ? (uint64_t)1 << 63 : UINT64_MAX, &v);
        if (p == NULL || (neg && v == 0)) return -1;
        if (out->len == out->cap && grow(out) < 0) return -1;
        ((uint64_t *)out->items)[out->len++] = neg ? (uint64_t)0 - v : v;
        more = next_item(&p, end);
    }
    c->p = p;
    return more;
}

/* Finds the member, its array read by ``parse``; sets [*lo, *hi) to the array's span. 1 found, 0
 * not applicable, -1 memory. Inlined into each entry point with its own ``parse``. */
static inline int scan_object(Cursor *c, const char *key, Py_ssize_t key_len, Values *out,
                              int (*parse)(Cursor *, Values *), const char **lo, const char **hi) {
    int found = 0;
    skip_ws(c);
    if (!at(c, '{')) return 0;
    c->p++;
    skip_ws(c);
    if (at(c, '}')) return 0;
    for (;;) {
        if (!at(c, '"')) return 0;
        const char *name = c->p + 1;
        int escaped = 0;
        if (skip_string(c, &escaped) < 0 || escaped) return 0;
        int match = (c->p - 1 - name) == key_len && memcmp(name, key, (size_t)key_len) == 0;
        skip_ws(c);
        if (!at(c, ':')) return 0;
        c->p++;
        skip_ws(c);
        if (match) {
            if (found || !at(c, '[')) return 0;
            *lo = c->p;
            if (parse(c, out) < 0) return PyErr_Occurred() ? -1 : 0;
            *hi = c->p;
            found = 1;
        } else if (skip_value(c) < 0) {
            return 0;
        }
        skip_ws(c);
        if (at(c, '}')) return found;
        if (!at(c, ',')) return 0;
        c->p++;
        skip_ws(c);
    }
}

static PyObject *without_array(const char *raw, Py_ssize_t n, const char *lo, const char *hi) {
    Py_ssize_t head = lo - raw, tail = n - (hi - raw);
    PyObject *out = PyBytes_FromStringAndSize(NULL, head + 2 + tail);
    if (out == NULL) return NULL;
    char *dst = PyBytes_AS_STRING(out);
    memcpy(dst, raw, (size_t)head);
    memcpy(dst + head, "[]", 2);
    memcpy(dst + head + 2, hi, (size_t)tail);
    return out;
}

/* (packed values, raw without the array) for the member ``key`` of the JSON object in ``args``
 * (raw, key), its array read by ``parse`` into ``width``-byte values; None when that does not apply. */
static inline PyObject *lift(PyObject *args, int (*parse)(Cursor *, Values *), Py_ssize_t width) {
    Py_buffer raw;
    const char *key;
    Py_ssize_t key_len;
    if (!PyArg_ParseTuple(args, "y*s#", &raw, &key, &key_len)) return NULL;
    Cursor c = {raw.buf, (const char *)raw.buf + raw.len};
    Values values = {NULL, 0, 0, width};
    const char *lo = NULL, *hi = NULL;
    PyObject *result = NULL;
    int found = scan_object(&c, key, key_len, &values, parse, &lo, &hi);
    if (found == 1) {
        PyObject *data = PyBytes_FromStringAndSize((const char *)values.items, values.len * width);
        PyObject *rest = data ? without_array(raw.buf, raw.len, lo, hi) : NULL;
        if (rest != NULL) result = PyTuple_Pack(2, data, rest);
        Py_XDECREF(data);
        Py_XDECREF(rest);
    } else if (found == 0) {
        result = Py_NewRef(Py_None);
    }
    PyMem_Free(values.items);
    PyBuffer_Release(&raw);
    return result;
}

PyDoc_STRVAR(split_doc,
"split(raw, key) -> (bytes, bytes) | None\n\n"
"The top-level member ``key`` of the JSON object ``raw``, when it is an array of plain u32\n"
"integers: (its values as u32 native-endian bytes, raw with the array replaced by []).\n"
"None when that does not apply; then decode ``raw`` as a whole.");

static PyObject *split(PyObject *self, PyObject *args) { return lift(args, parse_array, 4); }

PyDoc_STRVAR(split_u64_doc,
"split_u64(raw, key) -> (bytes, bytes) | None\n\n"
"``split`` for an array of i64s or u64s (block hashes): each value's low 64 bits, as u64\n"
"native-endian bytes.");

static PyObject *split_u64(PyObject *self, PyObject *args) { return lift(args, parse_array64, 8); }

/* -- dynamo_answer: the answer out ---------------------------------------------------------- */

typedef struct {
    char *buf;
    size_t len, cap;
} Out;

static int reserve(Out *o, size_t more) {
    if (o->len + more <= o->cap) return 0;
    size_t cap = o->cap ? o->cap : 1024;
    while (cap < o->len + more) cap *= 2;
    char *grown = PyMem_Realloc(o->buf, cap);
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    o->buf = grown;
    o->cap = cap;
    return 0;
}

static int put(Out *o, const char *text, size_t n) {
    if (reserve(o, n) < 0) return -1;
    memcpy(o->buf + o->len, text, n);
    o->len += n;
    return 0;
}

#define PUT(o, lit) put((o), (lit), sizeof(lit) - 1)

static int put_int(Out *o, int64_t v) { /* v >= 0 */
    char digits[24];
    int n = 0;
    do {
        digits[sizeof(digits) - 1 - n++] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    return put(o, digits + sizeof(digits) - n, (size_t)n);
}

/* Whether msgspec writes ``name`` as it is, quoted: a str of printable ASCII, no '"' or '\\'. */
static int plain_name(PyObject *name) {
    if (!PyUnicode_CheckExact(name) || !PyUnicode_IS_ASCII(name)) return 0;
    const char *text = (const char *)PyUnicode_1BYTE_DATA(name);
    Py_ssize_t n = PyUnicode_GET_LENGTH(name);
    for (Py_ssize_t i = 0; i < n; i++)
        if (text[i] < 0x20 || text[i] > 0x7e || text[i] == '"' || text[i] == '\\') return 0;
    return 1;
}

/* A ``plain_name``, quoted. */
static int put_name(Out *o, PyObject *name) {
    Py_ssize_t n = PyUnicode_GET_LENGTH(name);
    if (reserve(o, (size_t)n + 2) < 0) return -1;
    o->buf[o->len++] = '"';
    memcpy(o->buf + o->len, PyUnicode_1BYTE_DATA(name), (size_t)n);
    o->len += (size_t)n;
    o->buf[o->len++] = '"';
    return 0;
}

/* A non-negative int of at most 63 bits: 1 and *v, else 0 (no Python error left). */
static int small_int(PyObject *x, int64_t *v) {
    if (!PyLong_CheckExact(x)) return 0;
    int overflow = 0;
    long long got = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow || got < 0) return 0;
    if (got == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *v = got;
    return 1;
}

#define MAX_DEPTH (1 << 24) /* blocks; past it (no index holds that many a prompt) the reference writes it */

/* One pod's ``dp``: its ranks and depths (at most ``cap``), checked; 1, 0 (declined) or -1. */
typedef struct {
    int64_t rank, depth;
} Rank;

static int read_ranks(PyObject *dp, Rank *ranks, Py_ssize_t *n) {
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (PyDict_Next(dp, &pos, &k, &v)) {
        if (!small_int(k, &ranks[i].rank) || !small_int(v, &ranks[i].depth) || ranks[i].depth > MAX_DEPTH) return 0;
        i++;
    }
    *n = i;
    return 1;
}

/* {"<rank>":tokens,...} of ``ranks`` (only those holding tokens when ``held``). */
static int put_ranks(Out *o, const Rank *ranks, Py_ssize_t n, int64_t bs, int held) {
    int first = 1;
    if (PUT(o, "{") < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (held && ranks[i].depth == 0) continue;
        if ((!first && PUT(o, ",") < 0) || PUT(o, "\"") < 0 || put_int(o, ranks[i].rank) < 0 || PUT(o, "\":") < 0 ||
            put_int(o, ranks[i].depth * bs) < 0)
            return -1;
        first = 0;
    }
    return PUT(o, "}");
}

static int cmp_depth(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* The pods' matches read and checked once: each pod's fields and ranks. */
typedef struct {
    PyObject *pod;
    int64_t gpu, cpu, disk;
    Py_ssize_t first, count; /* its ranks in the shared array */
} Pod;

static int read_pods(PyObject *matches, int64_t bs, Pod *pods, Rank *ranks, Py_ssize_t rank_cap, Py_ssize_t *total) {
    Py_ssize_t pos = 0, i = 0, used = 0;
    PyObject *pod, *m;
    while (PyDict_Next(matches, &pos, &pod, &m)) {
        if (!PyTuple_Check(m) || PyTuple_GET_SIZE(m) != 4) return 0;
        PyObject *dp = PyTuple_GET_ITEM(m, 3);
        Pod *p = &pods[i++];
        p->pod = pod;
        if (!plain_name(pod)) return 0;
        if (!small_int(PyTuple_GET_ITEM(m, 0), &p->gpu) || !small_int(PyTuple_GET_ITEM(m, 1), &p->cpu) ||
            !small_int(PyTuple_GET_ITEM(m, 2), &p->disk) || !PyDict_CheckExact(dp) ||
            PyDict_GET_SIZE(dp) > rank_cap - used)
            return 0;
        p->first = used;
        if (!read_ranks(dp, ranks + used, &p->count)) return 0;
        used += p->count;
        int64_t t;
        if (__builtin_mul_overflow(p->gpu, bs, &t) || __builtin_mul_overflow(p->cpu, bs, &t) ||
            __builtin_mul_overflow(p->disk, bs, &t))
            return 0;
        for (Py_ssize_t r = p->first; r < used; r++)
            if (__builtin_mul_overflow(ranks[r].depth, bs, &t)) return 0;
    }
    *total = used;
    return 1;
}

static int put_answer(Out *o, const Pod *pods, Py_ssize_t n, const Rank *ranks, Py_ssize_t total, int64_t bs,
                      int64_t *depths) {
    int first = 1;
    if (PUT(o, "{\"scores\":{") < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) { /* a pod with one rank: scored when that rank holds blocks */
        const Pod *p = &pods[i];
        int any = 0;
        for (Py_ssize_t r = p->first; r < p->first + p->count; r++) any |= ranks[r].depth != 0;
        if (!any) continue;
        if ((!first && PUT(o, ",") < 0) || put_name(o, p->pod) < 0 || PUT(o, ":") < 0 ||
            put_ranks(o, ranks + p->first, p->count, bs, p->count != 1) < 0)
            return -1;
        first = 0;
    }
    for (Py_ssize_t r = 0; r < total; r++) depths[r] = ranks[r].depth;
    qsort(depths, (size_t)total, sizeof(int64_t), cmp_depth);
    if (PUT(o, "},\"frequencies\":[") < 0) return -1;
    int64_t level = 1;
    for (Py_ssize_t i = 0; i < total; i++) /* levels up to depths[i]: held by the total - i from i on */
        for (; level <= depths[i]; level++)
            if ((level > 1 && PUT(o, ",") < 0) || put_int(o, (int64_t)(total - i)) < 0) return -1;
    if (PUT(o, "],\"instances\":{") < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        const Pod *p = &pods[i];
        if ((i && PUT(o, ",") < 0) || put_name(o, p->pod) < 0 || PUT(o, ":{\"longest_matched\":") < 0 ||
            put_int(o, p->gpu * bs) < 0 || PUT(o, ",\"gpu\":") < 0 || put_int(o, p->gpu * bs) < 0 ||
            PUT(o, ",\"dp\":") < 0 || put_ranks(o, ranks + p->first, p->count, bs, 0) < 0 || PUT(o, ",\"cpu\":") < 0 ||
            put_int(o, p->cpu * bs) < 0 || PUT(o, ",\"disk\":") < 0 || put_int(o, p->disk * bs) < 0 || PUT(o, "}") < 0)
            return -1;
    }
    return PUT(o, "}}");
}

PyDoc_STRVAR(dynamo_answer_doc,
"dynamo_answer(matches, block_size) -> bytes | None\n\n"
"json_body(query_answer(PreciseAnswer(block_size, _, _, matches))): Dynamo's /query answer as\n"
"JSON bytes, ``matches`` a dict of pod id -> PodMatch; None when that does not apply (then the\n"
"reference writes it).");

static PyObject *dynamo_answer(PyObject *self, PyObject *args) {
    PyObject *matches, *size;
    int64_t bs;
    if (!PyArg_ParseTuple(args, "O!O", &PyDict_Type, &matches, &size)) return NULL;
    if (!small_int(size, &bs) || bs < 1) Py_RETURN_NONE;
    Py_ssize_t n = PyDict_GET_SIZE(matches), rank_cap = 4 * n + 64;
    Pod *pods = PyMem_Malloc(sizeof(Pod) * (size_t)(n ? n : 1));
    Rank *ranks = PyMem_Malloc(sizeof(Rank) * (size_t)rank_cap);
    int64_t *depths = PyMem_Malloc(sizeof(int64_t) * (size_t)rank_cap);
    Out o = {NULL, 0, 0};
    PyObject *result = NULL;
    Py_ssize_t total = 0;
    if (pods == NULL || ranks == NULL || depths == NULL)
        PyErr_NoMemory();
    else if (!read_pods(matches, bs, pods, ranks, rank_cap, &total))
        result = Py_NewRef(Py_None);
    else if (put_answer(&o, pods, n, ranks, total, bs, depths) == 0)
        result = PyBytes_FromStringAndSize(o.buf, (Py_ssize_t)o.len);
    PyMem_Free(o.buf);
    PyMem_Free(depths);
    PyMem_Free(ranks);
    PyMem_Free(pods);
    return result;
}

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, split_doc},
    {"split_u64", split_u64, METH_VARARGS, split_u64_doc},
    {"dynamo_answer", dynamo_answer, METH_VARARGS, dynamo_answer_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvindex._jsontokens",
    "Lifts a top-level array of token ids or hashes out of a JSON body (msgspec.json.decode is the reference).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__jsontokens(void) { return PyModule_Create(&module); }
