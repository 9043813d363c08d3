/* adapters._vllm: the vLLM KV-event payload decoded in C, for the batches engines really send.
 *
 * decode(payload, kinds, groups=None) -> EventBatch | None
 *   kinds = (BlockStored, BlockRemoved, AllBlocksCleared, EventBatch, array("I", [0]), array("Q", [0]), GPU,
 *            NON_PREFIX_GROUP)
 *   groups = the decoder's [prefix group or None] (adapters/vllm_groups.py), set when learned
 *
 * adapters/vllm.py is the reference: VllmDecoder's typed path (msgspec structs, then
 * ``_from_typed``). This twin parses the msgpack bytes itself and builds the same kvindex events,
 * with token ids going straight into an array("I") and block hashes into an array("Q") (no Python
 * int per token or per block). Contract:
 * - For any payload, the result is None or equal to ``VllmDecoder().decode(payload)``; tests hold
 *   it to that on the recorded vLLM captures, the benchmark workloads and fuzzed bytes.
 * - None means "not the common case, decode it in Python": anything the typed path would refuse
 *   or hand to the tolerant path (byte or negative hashes, a map batch, SGLang's dict in the LoRA
 *   slot, ext types, mixed dialects, an unknown event type, trailing bytes, invalid UTF-8, ...).
 * - Wire format (vllm/distributed/kv_events.py): payload = [ts, events, dp_rank?]; an event is a
 *   tagged array ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
 *   medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
 *   locality, ownership, session_id, lookahead_token_ids, ...] (vLLM 0.34's order, docs/vllm-versions.md;
 *   missing trailing fields are nil, extra ones ignored) or a map with "type" (unknown keys ignored,
 *   the last of duplicate keys wins).
 * - Adjacent BlockRemoved events of one (medium, group) are merged into one, as in Python.
 * - Hybrid models (adapters/vllm_groups.py; only maps carry kv_cache_spec_kind, an array's trailing
 *   fields are ignored): the prefix group is learned from the batch's first store when ``groups``
 *   holds None (a removal or another kind before it is declined: Python looks ahead); once known,
 *   another group's event, or a store of a kind that is not full attention, is skipped as Python
 *   skips it (named in ``skipped``; runs of removals go on across it). ``groups`` changes only
 *   when a batch is taken, so only to the group of a store that was accepted: the store that
 *   teaches the group is built (make_stored) or, refused, declines the whole batch to Python.
 * Bounds: every read is checked against the end of the payload; counts are checked against the
 * bytes left before anything is allocated; nesting deeper than MAX_DEPTH is declined.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../kvindex/kx_u64s.h"

#define MAX_DEPTH 32
#define MAX_BLOCK_SIZE (1u << 16) /* adapters/vllm.py MAX_BLOCK_SIZE */

typedef struct {
    const uint8_t *p, *end;
} Buf;

enum Kind { K_NIL, K_BOOL, K_UINT, K_INT, K_FLOAT, K_STR, K_BIN, K_ARRAY, K_MAP, K_EXT };

typedef struct {
    enum Kind kind;
    uint64_t u;      /* K_UINT: value; K_INT: value as two's complement (negative) */
    double f;        /* K_FLOAT */
    const uint8_t *s; /* K_STR, K_BIN, K_EXT: payload */
    uint32_t n;      /* length (str, bin, ext) or element count (array, map) */
} Item;

typedef struct {
    PyObject *stored, *removed, *cleared, *batch, *u32_one, *u64_one, *gpu, *non_prefix;
} Kinds;

static int take(Buf *b, size_t n, const uint8_t **out) {
    if ((size_t)(b->end - b->p) < n) return -1;
    *out = b->p;
    b->p += n;
    return 0;
}

static uint64_t be(const uint8_t *s, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | s[i];
    return v;
}

static int fixed(Buf *b, int n, uint64_t *v) {
    const uint8_t *s;
    if (take(b, (size_t)n, &s) < 0) return -1;
    *v = be(s, n);
    return 0;
}

static int sized(Buf *b, Item *it, enum Kind kind, int width) {
    uint64_t n;
    if (fixed(b, width, &n) < 0) return -1;
    it->kind = kind;
    it->n = (uint32_t)n;
    return take(b, (size_t)n, &it->s);
}

static int counted(Buf *b, Item *it, enum Kind kind, int width) {
    uint64_t n;
    if (fixed(b, width, &n) < 0) return -1;
    it->kind = kind;
    it->n = (uint32_t)n;
    /* every element takes at least one byte (two for a map entry): a count beyond the bytes left
       is malformed, and is refused before anyone allocates for it */
    return (uint64_t)(b->end - b->p) < n * (kind == K_MAP ? 2 : 1) ? -1 : 0;
}

static int signed_int(Buf *b, Item *it, int width) {
    uint64_t v;
    if (fixed(b, width, &v) < 0) return -1;
    int64_t s = width == 1 ? (int8_t)v : width == 2 ? (int16_t)v : width == 4 ? (int32_t)v : (int64_t)v;
    it->kind = s < 0 ? K_INT : K_UINT;
    it->u = (uint64_t)s;
    return 0;
}

static int ext(Buf *b, Item *it, int width_or_fixed, int fixed_len) {
    uint64_t n = (uint64_t)fixed_len;
    if (!fixed_len && fixed(b, width_or_fixed, &n) < 0) return -1;
    it->kind = K_EXT;
    it->n = (uint32_t)n;
    return take(b, (size_t)n + 1, &it->s); /* the type byte, then the data */
}

/* The header of the next item: a scalar's value, a str/bin's bytes, a container's count. */
static int next(Buf *b, Item *it) {
    const uint8_t *t;
    if (take(b, 1, &t) < 0) return -1;
    uint8_t c = *t;
    uint64_t v;
    if (c <= 0x7f) { it->kind = K_UINT; it->u = c; return 0; }
    if (c >= 0xe0) { it->kind = K_INT; it->u = (uint64_t)(int64_t)(int8_t)c; return 0; }
    if (c >= 0xa0 && c <= 0xbf) { it->kind = K_STR; it->n = c & 0x1f; return take(b, it->n, &it->s); }
    if (c >= 0x90 && c <= 0x9f) { it->kind = K_ARRAY; it->n = c & 0x0f; return (uint32_t)(b->end - b->p) < it->n ? -1 : 0; }
    if (c >= 0x80 && c <= 0x8f) { it->kind = K_MAP; it->n = c & 0x0f; return (uint32_t)(b->end - b->p) < 2u * it->n ? -1 : 0; }
    switch (c) {
    case 0xc0: it->kind = K_NIL; return 0;
    case 0xc2: case 0xc3: it->kind = K_BOOL; it->u = c == 0xc3; return 0;
    case 0xc4: return sized(b, it, K_BIN, 1);
    case 0xc5: return sized(b, it, K_BIN, 2);
    case 0xc6: return sized(b, it, K_BIN, 4);
    case 0xc7: return ext(b, it, 1, 0);
    case 0xc8: return ext(b, it, 2, 0);
    case 0xc9: return ext(b, it, 4, 0);
    case 0xca: {
        if (fixed(b, 4, &v) < 0) return -1;
        uint32_t bits = (uint32_t)v;
        float f;
        memcpy(&f, &bits, 4);
        it->kind = K_FLOAT; it->f = f;
        return 0;
    }
    case 0xcb: {
        if (fixed(b, 8, &v) < 0) return -1;
        double d;
        memcpy(&d, &v, 8);
        it->kind = K_FLOAT; it->f = d;
        return 0;
    }
    case 0xcc: it->kind = K_UINT; return fixed(b, 1, &it->u);
    case 0xcd: it->kind = K_UINT; return fixed(b, 2, &it->u);
    case 0xce: it->kind = K_UINT; return fixed(b, 4, &it->u);
    case 0xcf: it->kind = K_UINT; return fixed(b, 8, &it->u);
    case 0xd0: return signed_int(b, it, 1);
    case 0xd1: return signed_int(b, it, 2);
    case 0xd2: return signed_int(b, it, 4);
    case 0xd3: return signed_int(b, it, 8);
    case 0xd4: return ext(b, it, 0, 1);
    case 0xd5: return ext(b, it, 0, 2);
    case 0xd6: return ext(b, it, 0, 4);
    case 0xd7: return ext(b, it, 0, 8);
    case 0xd8: return ext(b, it, 0, 16);
    case 0xd9: return sized(b, it, K_STR, 1);
    case 0xda: return sized(b, it, K_STR, 2);
    case 0xdb: return sized(b, it, K_STR, 4);
    case 0xdc: return counted(b, it, K_ARRAY, 2);
    case 0xdd: return counted(b, it, K_ARRAY, 4);
    case 0xde: return counted(b, it, K_MAP, 2);
    case 0xdf: return counted(b, it, K_MAP, 4);
    default: return -1; /* 0xc1: never used */
    }
}

/* The two readers below are the common bytes of ``next`` read in place (hashes, skipped ints and
   nil; ``tokens`` has its own loop for the 32-bit ids): same results, no call. 1 read, 0 not such a header (nothing read: ask ``next``), -1 short. */
static inline int uint_fast(Buf *b, uint64_t *v) {
    if (b->p >= b->end) return -1;
    uint8_t c = *b->p;
    if (c <= 0x7f) { *v = c; b->p++; return 1; }
    if (c < 0xcc || c > 0xcf) return 0;
    size_t w = (size_t)1 << (c - 0xcc);
    if ((size_t)(b->end - b->p) < w + 1) return -1;
    *v = be(b->p + 1, (int)w);
    b->p += w + 1;
    return 1;
}

static inline int skip_scalar(Buf *b) {
    if (b->p >= b->end) return -1;
    uint8_t c = *b->p;
    size_t n;
    if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) n = 1;
    else if (c >= 0xcc && c <= 0xd3) n = 1 + ((size_t)1 << ((c - 0xcc) & 3));
    else return 0;
    if ((size_t)(b->end - b->p) < n) return -1;
    b->p += n;
    return 1;
}

static int valid_utf8(const uint8_t *s, uint32_t n) {
    uint32_t i = 0;
    while (i < n && s[i] < 0x80) i++;
    if (i == n) return 1; /* ASCII: the common case, no object made */
    PyObject *u = PyUnicode_DecodeUTF8((const char *)s, n, NULL);
    if (u == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(u);
    return 1;
}

/* Past one whole item, declining (-1) what the reference might read differently: ext types,
   invalid UTF-8, map keys that are containers, nesting beyond MAX_DEPTH. */
static int skip(Buf *b, int depth) {
    Item it;
    if (depth > MAX_DEPTH) return -1;
    int done = skip_scalar(b);
    if (done) return done < 0 ? -1 : 0;
    if (next(b, &it) < 0) return -1;
    switch (it.kind) {
    case K_EXT: return -1;
    case K_STR: return valid_utf8(it.s, it.n) ? 0 : -1;
    case K_ARRAY:
        for (uint32_t i = 0; i < it.n; i++)
            if (skip(b, depth + 1) < 0) return -1;
        return 0;
    case K_MAP:
        for (uint32_t i = 0; i < it.n; i++) {
            const uint8_t *at = b->p;
            Item key;
            if (next(b, &key) < 0 || key.kind == K_ARRAY || key.kind == K_MAP) return -1;
            b->p = at;
            if (skip(b, depth + 1) < 0 || skip(b, depth + 1) < 0) return -1;
        }
        return 0;
    default: return 0;
    }
}

static int str_is(const Item *it, const char *s) {
    size_t n = strlen(s);
    return it->kind == K_STR && it->n == n && memcmp(it->s, s, n) == 0;
}

/* -- fields ------------------------------------------------------------------------------- */

/* A non-empty array of u64 hashes, as one array("Q"): no Python int per hash (anything else goes to Python). */
static PyObject *hashes(Buf *b, const Kinds *k) {
    Item it, h;
    uint64_t *vals;
    if (next(b, &it) < 0 || it.kind != K_ARRAY || it.n == 0) return NULL;
    PyObject *out = kx_zeros(k->u64_one, it.n, (void **)&vals);
    for (uint32_t i = 0; out != NULL && i < it.n; i++) {
        int fast = uint_fast(b, &h.u);
        if (fast > 0 || (fast == 0 && next(b, &h) == 0 && h.kind == K_UINT)) vals[i] = h.u;
        else Py_CLEAR(out);
    }
    return out;
}

static PyObject *tokens(Buf *b, const Kinds *k) {
    Item it, t;
    uint32_t *vals;
    if (next(b, &it) < 0 || it.kind != K_ARRAY) return NULL;
    PyObject *out = kx_zeros(k->u32_one, it.n, (void **)&vals);
    if (out == NULL) return NULL;
    uint32_t i = 0, n = it.n; /* n a local: the stores into vals could alias it.n */
    const uint8_t *p = b->p, *end = b->end;
    for (; i < n && p < end; i++) { /* the token ids vLLM sends (fixint, u8, u16, u32) read in place */
        uint8_t c = *p;
        if (c <= 0x7f) { vals[i] = c; p++; continue; }
        if (c == 0xcd && end - p >= 3) { vals[i] = (uint32_t)p[1] << 8 | p[2]; p += 3; continue; }
        if (c == 0xcc && end - p >= 2) { vals[i] = p[1]; p += 2; continue; }
        if (c == 0xce && end - p >= 5) { vals[i] = (uint32_t)be(p + 1, 4); p += 5; continue; }
        b->p = p; /* any other header: the general reader */
        if (next(b, &t) < 0 || t.kind != K_UINT || t.u > UINT32_MAX) break;
        vals[i] = (uint32_t)t.u;
        p = b->p;
    }
    b->p = p;
    if (i != n) Py_CLEAR(out);
    return out;
}

/* nil -> Py_None (new ref), an int -> int; anything else NULL. */
static PyObject *opt_int(Buf *b) {
    Item it;
    if (next(b, &it) < 0) return NULL;
    if (it.kind == K_NIL) return Py_NewRef(Py_None);
    if (it.kind == K_UINT) return PyLong_FromUnsignedLongLong(it.u);
    if (it.kind == K_INT) return PyLong_FromLongLong((long long)(int64_t)it.u);
    return NULL;
}

/* A block size: an int of at most MAX_BLOCK_SIZE tokens (adapters/vllm.py's bound); 0 only for a
   tier placeholder, which make_stored checks once the medium and token ids are known. */
static PyObject *block_size(Buf *b) {
    Item it;
    if (next(b, &it) < 0 || it.kind != K_UINT || it.u > MAX_BLOCK_SIZE) return NULL;
    return PyLong_FromUnsignedLongLong(it.u);
}

static PyObject *opt_str(Buf *b) {
    Item it;
    if (next(b, &it) < 0) return NULL;
    if (it.kind == K_NIL) return Py_NewRef(Py_None);
    if (it.kind != K_STR) return NULL;
    PyObject *s = PyUnicode_DecodeUTF8((const char *)it.s, it.n, NULL);
    if (s == NULL) PyErr_Clear();
    return s;
}

/* nil -> None; an int 0 or a u64 -> that int (0 -> None: "no parent", as ``parent or None``). */
static PyObject *parent(Buf *b) {
    Item it;
    if (next(b, &it) < 0) return NULL;
    if (it.kind == K_NIL || (it.kind == K_UINT && it.u == 0)) return Py_NewRef(Py_None);
    return it.kind == K_UINT ? PyLong_FromUnsignedLongLong(it.u) : NULL;
}

/* A medium as sent: "GPU" is the shared GPU object (most events), else as opt_str. */
static PyObject *opt_medium(Buf *b, PyObject *gpu) {
    const uint8_t *at = b->p;
    Item it;
    if (next(b, &it) < 0) return NULL;
    if (str_is(&it, "GPU")) return Py_NewRef(gpu);
    b->p = at;
    return opt_str(b);
}

/* The medium as kvindex names it: nil or "" is the device tier, anything else upper-cased. */
static PyObject *medium_of(PyObject *raw, PyObject *gpu) {
    if (raw == gpu) return Py_NewRef(gpu);
    if (raw == Py_None || PyUnicode_GET_LENGTH(raw) == 0) return Py_NewRef(gpu);
    return PyObject_CallMethod(raw, "upper", NULL);
}

/* vLLM's cache_salt, by position (adapters/vllm_fields.py cache_salt_of is the reference): the last
   string of the first block's extra keys, not counting position 0 when it is the LoRA name.
   Sets *salt (new ref, maybe None). -1: declined (a first entry of another shape). */
static int cache_salt(Buf *b, PyObject *lora_name, PyObject **salt) {
    Item it, first;
    *salt = Py_NewRef(Py_None);
    if (next(b, &it) < 0) return -1;
    if (it.kind == K_NIL || (it.kind == K_ARRAY && it.n == 0)) return 0;
    if (it.kind != K_ARRAY || next(b, &first) < 0) return -1;
    if (first.kind == K_ARRAY) {
        for (uint32_t i = 0; i < first.n; i++) {
            const uint8_t *at = b->p;
            Item k;
            if (next(b, &k) < 0) return -1;
            if (k.kind != K_STR) {
                b->p = at;
                if (skip(b, 2) < 0) return -1;
                continue;
            }
            PyObject *s = PyUnicode_DecodeUTF8((const char *)k.s, k.n, NULL);
            if (s == NULL) {
                PyErr_Clear();
                return -1;
            }
            int adapter = i == 0 && lora_name != Py_None && PyUnicode_Compare(s, lora_name) == 0;
            if (adapter) Py_DECREF(s);
            else Py_SETREF(*salt, s);
        }
    } else if (first.kind == K_MAP || first.kind == K_EXT) {
        return -1; /* SGLang's {"cache_salt": ...} and the rest: the Python path */
    } else if (first.kind == K_STR && !valid_utf8(first.s, first.n)) {
        return -1;
    }
    for (uint32_t i = 1; i < it.n; i++)
        if (skip(b, 1) < 0) return -1;
    return 0;
}

/* -- events ------------------------------------------------------------------------------- */

typedef struct {
    PyObject *hashes, *parent, *tokens, *block_size, *medium, *lora_name, *salt, *group;
    PyObject *lookahead, *locality, *ownership, *session; /* vLLM 0.34 (docs/vllm-versions.md) */
    int other_kind; /* kv_cache_spec_kind is a string other than a full-attention kind */
} Stored;

/* kv_cache_spec_kind: nil or a string (vllm_groups.FULL_ATTENTION_KINDS, else *other = 1); -1 otherwise. */
static int spec_kind(Buf *b, int *other) {
    Item it;
    if (next(b, &it) < 0) return -1;
    if (it.kind == K_NIL) return *other = 0;
    if (it.kind != K_STR || !valid_utf8(it.s, it.n)) return -1;
    *other = !(str_is(&it, "full_attention") || str_is(&it, "mla_attention") || str_is(&it, "sink_full_attention"));
    return 0;
}

/* lookahead_token_ids: nil -> None, else a tuple of (nil -> None | array("I")) per entry; NULL declines.
   Its length and entry sizes are checked by make_stored (vllm_fields.lookahead_of is the reference). */
static PyObject *lookaheads(Buf *b, const Kinds *k) {
    const uint8_t *at;
    Item it, e;
    if (next(b, &it) < 0) return NULL;
    if (it.kind == K_NIL) return Py_NewRef(Py_None);
    if (it.kind != K_ARRAY || it.n > (uint32_t)(b->end - b->p)) return NULL; /* each entry takes a byte */
    PyObject *out = PyTuple_New(it.n);
    for (uint32_t i = 0; out != NULL && i < it.n; i++) {
        at = b->p;
        if (next(b, &e) < 0) { Py_CLEAR(out); break; }
        PyObject *entry = NULL;
        if (e.kind == K_NIL) entry = Py_NewRef(Py_None);
        else { b->p = at; entry = tokens(b, k); }
        if (entry == NULL) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, i, entry);
    }
    return out;
}

static void stored_clear(Stored *s) {
    Py_CLEAR(s->hashes); Py_CLEAR(s->parent); Py_CLEAR(s->tokens); Py_CLEAR(s->block_size);
    Py_CLEAR(s->medium); Py_CLEAR(s->lora_name); Py_CLEAR(s->salt); Py_CLEAR(s->group);
    Py_CLEAR(s->lookahead); Py_CLEAR(s->locality); Py_CLEAR(s->ownership); Py_CLEAR(s->session);
}

/* Each of ``lookahead`` (a tuple) nil or at most ``block_size`` tokens, one per hash: 0 yes, -1 no. */
static int lookahead_fits(PyObject *lookahead, PyObject *hashes, PyObject *block_size) {
    if (lookahead == Py_None) return 0;
    Py_ssize_t n = PyTuple_GET_SIZE(lookahead), bs = PyLong_AsSsize_t(block_size);
    if (n != PyObject_Length(hashes) || bs < 0) return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyTuple_GET_ITEM(lookahead, i);
        if (e != Py_None && PyObject_Length(e) > bs) return -1;
    }
    return 0;
}

/* Defaults of a field the event does not carry (msgspec's struct defaults). */
static int stored_defaults(Stored *s, const Kinds *k) {
    if (s->parent == NULL) s->parent = Py_NewRef(Py_None);
    if (s->tokens == NULL && (s->tokens = PySequence_Repeat(k->u32_one, 0)) == NULL) return -1;
    if (s->medium == NULL) s->medium = Py_NewRef(Py_None);
    if (s->lora_name == NULL) s->lora_name = Py_NewRef(Py_None);
    if (s->salt == NULL) s->salt = Py_NewRef(Py_None);
    if (s->group == NULL) s->group = Py_NewRef(Py_None);
    if (s->lookahead == NULL) s->lookahead = Py_NewRef(Py_None);
    if (s->locality == NULL) s->locality = Py_NewRef(Py_None);
    if (s->ownership == NULL) s->ownership = Py_NewRef(Py_None);
    if (s->session == NULL) s->session = Py_NewRef(Py_None);
    return s->hashes != NULL && s->block_size != NULL ? 0 : -1; /* required */
}

/* The typed path's BlockStored: medium upper-cased, group_idx ``or 0``. */
static PyObject *make_stored(Stored *s, const Kinds *k) {
    if (stored_defaults(s, k) < 0 || lookahead_fits(s->lookahead, s->hashes, s->block_size) < 0) return NULL;
    PyObject *medium = medium_of(s->medium, k->gpu);
    if (medium == NULL) return NULL;
    /* block size 0: a tier placeholder (is_tier_placeholder: not on GPU, no token ids), else declined */
    int zero = PyObject_IsTrue(s->block_size) == 0;
    if (zero && (PyObject_RichCompareBool(medium, k->gpu, Py_EQ) != 0 || PyObject_Length(s->tokens) != 0)) {
        Py_DECREF(medium);
        return NULL;
    }
    PyObject *group = s->group == Py_None ? PyLong_FromLong(0) : Py_NewRef(s->group);
    PyObject *ev = group ? PyObject_CallFunctionObjArgs(k->stored, s->hashes, s->parent, s->tokens, s->block_size,
                                                        medium, s->lora_name, s->salt, group, s->lookahead,
                                                        s->locality, s->ownership, s->session, NULL) : NULL;
    Py_DECREF(medium);
    Py_XDECREF(group);
    return ev;
}

typedef struct {
    PyObject *hashes, *medium, *group;
} Removed;

static void removed_clear(Removed *r) { Py_CLEAR(r->hashes); Py_CLEAR(r->medium); Py_CLEAR(r->group); }

typedef enum { E_STORED, E_REMOVED, E_CLEARED } Tag;

static int set_field(PyObject **slot, PyObject *v) {
    if (v == NULL) return -1;
    Py_XSETREF(*slot, v);
    return 0;
}

/* An event's type string as its tag; -1 for any other value. */
static int tag_of(Buf *b, Tag *tag) {
    Item t;
    if (next(b, &t) < 0) return -1;
    if (str_is(&t, "BlockStored")) *tag = E_STORED;
    else if (str_is(&t, "BlockRemoved")) *tag = E_REMOVED;
    else if (str_is(&t, "AllBlocksCleared")) *tag = E_CLEARED;
    else return -1;
    return 0;
}

/* One map-dialect event: its type and fields. 0 ok (*tag set), -1 declined. */
static int map_event(Buf *b, uint32_t n, const Kinds *k, Tag *tag, Stored *s, Removed *r) {
    const uint8_t *extra = NULL, *type = NULL, *fields_start = b->p;
    /* "type" first (as vLLM sends it) and a store or removal: one pass, which checks each key as
       pass 1 would; otherwise pass 1 finds it first */
    Buf head = {b->p, b->end};
    Item k0;
    int one_pass = n > 0 && next(&head, &k0) == 0 && str_is(&k0, "type") && tag_of(&head, tag) == 0
                   && *tag != E_CLEARED;
    /* pass 1: find "type" (it may come anywhere; twice is declined) and check every key */
    for (uint32_t i = 0; !one_pass && i < n; i++) {
        Item key;
        if (next(b, &key) < 0 || key.kind != K_STR || !valid_utf8(key.s, key.n)) return -1;
        if (str_is(&key, "type")) {
            if (type != NULL) return -1;
            type = b->p;
        }
        if (skip(b, 0) < 0) return -1;
    }
    if (!one_pass) {
        if (type == NULL) return -1;
        Buf tb = {type, b->end};
        if (tag_of(&tb, tag) < 0) return -1;
        if (*tag == E_CLEARED) return 0;
    }
    /* pass 2: the fields this type has (others are ignored, as msgspec ignores unknown keys) */
    Buf fb = {fields_start, one_pass ? b->end : b->p};
    for (uint32_t i = 0; i < n; i++) {
        Item key;
        if (next(&fb, &key) < 0) return -1;
        if (one_pass && (key.kind != K_STR || !valid_utf8(key.s, key.n) || (i > 0 && str_is(&key, "type"))))
            return -1;
        int rc = 0, known = 1;
        if (*tag == E_REMOVED) {
            if (str_is(&key, "block_hashes")) rc = set_field(&r->hashes, hashes(&fb, k));
            else if (str_is(&key, "medium")) rc = set_field(&r->medium, opt_medium(&fb, k->gpu));
            else if (str_is(&key, "group_idx")) rc = set_field(&r->group, opt_int(&fb));
            else known = 0;
        } else {
            if (str_is(&key, "block_hashes")) rc = set_field(&s->hashes, hashes(&fb, k));
            else if (str_is(&key, "parent_block_hash")) rc = set_field(&s->parent, parent(&fb));
            else if (str_is(&key, "token_ids")) rc = set_field(&s->tokens, tokens(&fb, k));
            else if (str_is(&key, "block_size")) rc = set_field(&s->block_size, block_size(&fb));
            else if (str_is(&key, "medium")) rc = set_field(&s->medium, opt_medium(&fb, k->gpu));
            else if (str_is(&key, "lora_name")) rc = set_field(&s->lora_name, opt_str(&fb));
            else if (str_is(&key, "group_idx")) rc = set_field(&s->group, opt_int(&fb));
            else if (str_is(&key, "kv_cache_spec_kind")) rc = spec_kind(&fb, &s->other_kind);
            else if (str_is(&key, "lookahead_token_ids")) rc = set_field(&s->lookahead, lookaheads(&fb, k));
            else if (str_is(&key, "locality")) rc = set_field(&s->locality, opt_str(&fb));
            else if (str_is(&key, "ownership")) rc = set_field(&s->ownership, opt_str(&fb));
            else if (str_is(&key, "session_id")) rc = set_field(&s->session, opt_str(&fb));
            else if (str_is(&key, "extra_keys")) { extra = fb.p; known = 0; }
            else known = 0;
        }
        if (rc < 0 || PyErr_Occurred()) return -1;
        if (!known && skip(&fb, 0) < 0) return -1;
    }
    if (one_pass) b->p = fb.p;
    if (*tag == E_STORED && extra != NULL) {
        Buf eb = {extra, b->end};
        if (s->lora_name == NULL) s->lora_name = Py_NewRef(Py_None);
        Py_CLEAR(s->salt);
        if (cache_salt(&eb, s->lora_name, &s->salt) < 0) return -1;
    }
    return 0;
}

/* One array-dialect event: fields by position, missing trailing ones default, extra ignored. */
static int array_event(Buf *b, uint32_t n, const Kinds *k, Tag *tag, Stored *s, Removed *r) {
    if (n == 0 || tag_of(b, tag) < 0) return -1;
    for (uint32_t i = 1; i < n; i++) {
        int rc = 0, known = 1;
        if (*tag == E_REMOVED && i <= 3) {
            rc = i == 1 ? set_field(&r->hashes, hashes(b, k))
               : i == 2 ? set_field(&r->medium, opt_medium(b, k->gpu)) : set_field(&r->group, opt_int(b));
        } else if (*tag == E_STORED && i <= 15 && i != 5 && i != 10 && i != 11) { /* 10, 11: no kind (vllm_groups) */
            switch (i) {
            case 1: rc = set_field(&s->hashes, hashes(b, k)); break;
            case 2: rc = set_field(&s->parent, parent(b)); break;
            case 3: rc = set_field(&s->tokens, tokens(b, k)); break;
            case 4: rc = set_field(&s->block_size, block_size(b)); break;
            case 6: rc = set_field(&s->medium, opt_medium(b, k->gpu)); break;
            case 7: rc = set_field(&s->lora_name, opt_str(b)); break;
            case 8:
                if (s->lora_name == NULL) s->lora_name = Py_NewRef(Py_None);
                rc = cache_salt(b, s->lora_name, &s->salt);
                break;
            case 9: rc = set_field(&s->group, opt_int(b)); break;
            case 12: rc = set_field(&s->locality, opt_str(b)); break;
            case 13: rc = set_field(&s->ownership, opt_str(b)); break;
            case 14: rc = set_field(&s->session, opt_str(b)); break;
            case 15: rc = set_field(&s->lookahead, lookaheads(b, k)); break;
            }
        } else {
            known = 0;
        }
        if (rc < 0 || PyErr_Occurred()) return -1;
        if (!known && skip(b, 0) < 0) return -1;
    }
    return 0;
}

/* -- the batch ---------------------------------------------------------------------------- */

/* A run of removals of one (medium, group), merged into one BlockRemoved as in Python. */
typedef struct {
    PyObject *hashes; /* array("Q"), or NULL when no run is open */
    PyObject *medium, *group;
} Run;

static int flush(Run *run, PyObject *events, const Kinds *k) {
    if (run->hashes == NULL) return 0;
    PyObject *ev = PyObject_CallFunctionObjArgs(k->removed, run->hashes, run->medium, run->group, NULL);
    Py_CLEAR(run->hashes);
    if (ev == NULL) return -1;
    int rc = PyList_Append(events, ev);
    Py_DECREF(ev);
    return rc;
}

static int add_removal(Run *run, Removed *r, PyObject *events, const Kinds *k) {
    if (r->hashes == NULL) return -1;
    PyObject *medium = medium_of(r->medium ? r->medium : Py_None, k->gpu);
    PyObject *group = (r->group == NULL || r->group == Py_None) ? PyLong_FromLong(0) : Py_NewRef(r->group);
    int rc = -1;
    if (medium != NULL && group != NULL) {
        int same = run->hashes != NULL && PyObject_RichCompareBool(medium, run->medium, Py_EQ) == 1
                   && PyObject_RichCompareBool(group, run->group, Py_EQ) == 1;
        if (!same && flush(run, events, k) < 0) goto done;
        if (run->hashes == NULL) { /* the run's first removal: its hashes, the run's to extend */
            run->hashes = Py_NewRef(r->hashes);
            Py_XSETREF(run->medium, Py_NewRef(medium));
            Py_XSETREF(run->group, Py_NewRef(group));
            rc = 0;
        } else {
            PyObject *more = PySequence_InPlaceConcat(run->hashes, r->hashes); /* array += array: in place */
            if (more != NULL) {
                Py_SETREF(run->hashes, more);
                rc = 0;
            }
        }
    }
done:
    Py_XDECREF(medium);
    Py_XDECREF(group);
    return rc;
}

/* The stream's prefix group as far as the batch has learned it (vllm_groups). */
typedef struct {
    int known;
    long long group;
} Prefix;

/* Whether an event of ``group`` (NULL or None: 0) is the prefix group's; a store of a full-attention
   kind teaches it when it is not known. 0 yes, 1 skipped, -1 declined (Python looks ahead). */
static int prefix_event(Prefix *pre, PyObject *group, int stored, int other_kind) {
    long long g = 0;
    if (group != NULL && group != Py_None) {
        int overflow = 0;
        g = PyLong_AsLongLongAndOverflow(group, &overflow);
        if (overflow || (g == -1 && PyErr_Occurred())) return -1;
    }
    if (!pre->known) {
        if (!stored || other_kind) return -1;
        pre->known = 1;
        pre->group = g;
    }
    return g == pre->group && !(stored && other_kind) ? 0 : 1;
}

/* One event of the batch, appended to ``events`` (removals through ``run``). 0 ok, -1 declined. */
static int one_event(Buf *b, const Kinds *k, int *dialect, PyObject *events, Run *run, Prefix *pre, Py_ssize_t *skipped) {
    Item it;
    if (next(b, &it) < 0 || (it.kind != K_ARRAY && it.kind != K_MAP)) return -1;
    if (*dialect == -1) *dialect = it.kind;
    if ((int)it.kind != *dialect) return -1; /* mixed dialects: the typed path refuses them */
    Tag tag;
    Stored s = {0};
    Removed r = {0};
    int rc = it.kind == K_MAP ? map_event(b, it.n, k, &tag, &s, &r) : array_event(b, it.n, k, &tag, &s, &r);
    if (rc == 0 && tag != E_CLEARED)
        rc = tag == E_STORED ? prefix_event(pre, s.group, 1, s.other_kind) : prefix_event(pre, r.group, 0, 0);
    if (rc == 1) { /* skipped, once its required fields are there (else Python's typed path refuses it) */
        rc = (tag == E_STORED ? s.hashes != NULL && s.block_size != NULL : r.hashes != NULL) ? 0 : -1;
        *skipped += rc == 0;
    } else if (rc == 0 && tag == E_REMOVED) {
        rc = add_removal(run, &r, events, k);
    } else if (rc == 0) {
        PyObject *ev = NULL;
        if (flush(run, events, k) == 0)
            ev = tag == E_STORED ? make_stored(&s, k) : PyObject_CallNoArgs(k->cleared);
        rc = ev != NULL && PyList_Append(events, ev) == 0 ? 0 : -1;
        Py_XDECREF(ev);
    }
    stored_clear(&s);
    removed_clear(&r);
    return rc;
}

static PyObject *events_of(Buf *b, uint32_t n, const Kinds *k, Prefix *pre, Py_ssize_t *skipped) {
    PyObject *events = PyList_New(0);
    Run run = {0};
    int dialect = -1, ok = events != NULL;
    for (uint32_t i = 0; ok && i < n; i++) ok = one_event(b, k, &dialect, events, &run, pre, skipped) == 0;
    ok = ok && flush(&run, events, k) == 0;
    Py_XDECREF(run.hashes);
    Py_XDECREF(run.medium);
    Py_XDECREF(run.group);
    if (!ok) {
        Py_XDECREF(events);
        return NULL;
    }
    PyObject *t = PyList_AsTuple(events);
    Py_DECREF(events);
    return t;
}

static int parse_kinds(PyObject *obj, Kinds *k) {
    if (!PyArg_ParseTuple(obj, "OOOOOOUU;kinds must be (BlockStored, BlockRemoved, AllBlocksCleared, EventBatch, "
                          "array('I', [0]), array('Q', [0]), GPU, NON_PREFIX_GROUP)", &k->stored, &k->removed,
                          &k->cleared, &k->batch, &k->u32_one, &k->u64_one, &k->gpu, &k->non_prefix))
        return 0;
    if (PyObject_Length(k->u32_one) != 1 || PyObject_Length(k->u64_one) != 1) { /* each repeats into an array */
        PyErr_SetString(PyExc_ValueError, "kinds: the array templates must hold one item each");
        return 0;
    }
    return 1;
}

/* [ts, events, dp_rank?] with a numeric ts and a small rank; NULL (no error set) to decline. */
static PyObject *batch(Buf *b, const Kinds *k, Prefix *pre) {
    Item top, ts, evs, rank;
    if (next(b, &top) < 0 || top.kind != K_ARRAY || (top.n != 2 && top.n != 3)) return NULL;
    if (next(b, &ts) < 0) return NULL;
    double when;
    if (ts.kind == K_FLOAT) when = ts.f;
    else if (ts.kind == K_UINT && ts.u < (1ULL << 53)) when = (double)ts.u; /* exact: no rounding to agree on */
    else if (ts.kind == K_INT && (int64_t)ts.u > -(1LL << 53)) when = (double)(int64_t)ts.u;
    else return NULL;
    if (next(b, &evs) < 0 || evs.kind != K_ARRAY) return NULL;
    Py_ssize_t skipped = 0;
    PyObject *events = events_of(b, evs.n, k, pre, &skipped);
    if (events == NULL) return NULL;
    long dp = 0;
    if (top.n == 3) {
        if (next(b, &rank) < 0 || !(rank.kind == K_NIL || (rank.kind == K_UINT && rank.u < (1u << 16)))) {
            Py_DECREF(events);
            return NULL;
        }
        dp = rank.kind == K_UINT ? (long)rank.u : 0;
    }
    if (b->p != b->end) { /* trailing bytes */
        Py_DECREF(events);
        return NULL;
    }
    PyObject *pts = PyFloat_FromDouble(when), *prank = PyLong_FromLong(dp), *pskipped = PyTuple_New(skipped);
    for (Py_ssize_t i = 0; pskipped != NULL && i < skipped; i++) PyTuple_SET_ITEM(pskipped, i, Py_NewRef(k->non_prefix));
    PyObject *out = pts && prank && pskipped ? PyObject_CallFunctionObjArgs(k->batch, pts, events, prank, pskipped, NULL) : NULL;
    Py_XDECREF(pts);
    Py_XDECREF(prank);
    Py_XDECREF(pskipped);
    Py_DECREF(events);
    return out;
}

PyDoc_STRVAR(decode_doc,
"decode(payload, kinds, groups=None) -> EventBatch | None\n\n"
"The payload's events, as adapters.vllm.VllmDecoder would decode them; None when it is not the\n"
"common case (then decode it in Python). kinds: (BlockStored, BlockRemoved, AllBlocksCleared,\n"
"EventBatch, array('I', [0]), array('Q', [0]), GPU, NON_PREFIX_GROUP); groups: the decoder's [prefix group or None], set when learned.");

static PyObject *decode(PyObject *self, PyObject *args) {
    Py_buffer payload;
    PyObject *kinds_obj, *groups = NULL;
    Kinds k;
    Prefix pre = {0, 0};
    if (!PyArg_ParseTuple(args, "y*O!|O!", &payload, &PyTuple_Type, &kinds_obj, &PyList_Type, &groups)) return NULL;
    if (!parse_kinds(kinds_obj, &k) || (groups != NULL && PyList_GET_SIZE(groups) != 1)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "groups must be a list of one element");
        PyBuffer_Release(&payload);
        return NULL;
    }
    PyObject *known = groups != NULL ? PyList_GET_ITEM(groups, 0) : Py_None;
    if (known != Py_None) {
        int overflow = 0;
        if (!PyLong_Check(known) || ((pre.group = PyLong_AsLongLongAndOverflow(known, &overflow)) == -1 && PyErr_Occurred())
            || overflow) {
            PyErr_Clear();
            PyBuffer_Release(&payload);
            Py_RETURN_NONE; /* a prefix group C cannot hold: Python's */
        }
        pre.known = 1;
    }
    Buf b = {payload.buf, (const uint8_t *)payload.buf + payload.len};
    PyObject *out = batch(&b, &k, &pre);
    PyBuffer_Release(&payload);
    if (out != NULL && groups != NULL && pre.known && known == Py_None) {
        PyObject *g = PyLong_FromLongLong(pre.group);
        if (g == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SetItem(groups, 0, g); /* steals g */
    }
    if (out == NULL) {
        /* declined, or a value the constructors refused: the Python path decides. MemoryError
           and what is not an Exception (KeyboardInterrupt, SystemExit) propagate. */
        if (PyErr_Occurred() && PyErr_ExceptionMatches(PyExc_Exception) && !PyErr_ExceptionMatches(PyExc_MemoryError))
            PyErr_Clear();
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, decode_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "adapters._vllm",
    "vLLM's KV-event payload decoded in C (adapters/vllm.py is the reference).", -1, methods,
};

PyMODINIT_FUNC PyInit__vllm(void) { return PyModule_Create(&module); }
