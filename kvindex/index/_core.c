/* kvindex.index._core: the precise index's memory and hot loops, owned by C.
 *
 * ``Core`` holds, with no Python object per entry:
 *   - per worker (one (pod, dp_rank), a small int "slot") and medium: engine hash -> key. The
 *     common entry (keyed, one copy, hash != 0) is 16 bytes in an open-addressed table; the rest
 *     (keyless "orphans", copies beyond the first, hash 0) live in the table's side map;
 *   - per tier (0 gpu, 1 cpu, 2 disk): key -> the set of worker slots holding it. A lone holder
 *     is stored as its slot; several as the id of an interned, reference-counted bitset (the same
 *     few holder sets recur across millions of keys);
 *   - holdings of one key in one tier by one worker beyond its first (several hashes or copies
 *     with that key): ``dups``, (key, tier, slot) -> count; a release takes a duplicate first.
 *
 * The rules are those of kvindex/index/reference.py (the readable oracle), as
 * kvindex/index/precise.py states them per event; ``store`` / ``remove`` apply one event's hashes
 * by those rules: a new hash, one more copy, a keyless hash learning its key (and its keyless
 * copies in other media), a re-announcement (no copy). Python decides per event what only it
 * knows (the block size, the keys from the tokens); tests hold the result equal to the reference
 * on every capture and on generated and fuzzed workloads (tests/test_core.py).
 *
 * Tables: capacity 2^bits, home slot = top bits of hash * golden ratio (Fibonacci hashing),
 * linear probing with wrap-around, backward-shift deletion (no tombstones); grown past 3/4 load,
 * shrunk below 1/16 after removals. Key 0 and every u64 are valid keys; hash 0 is valid (side).
 *
 * Snapshot rows (``export`` / ``load``, kvindex/index/rows.py): per entry 24 bytes, little-endian:
 * hash u64, key u64, copies u64 with bit 63 set when keyless. One linear pass each way.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../kx_u64s.h"
#include "../kx_xxh3.h"

#define MIX 0x9E3779B97F4A7C15ULL
#define NTIERS 3
#define SINGLE 0x80000000u /* a holder ref: SINGLE | slot, or an interned mask id (>= 1) */
#define MIN_BITS 3
#define ROW 24

static inline size_t home(uint64_t x, uint32_t bits) { return (size_t)((x * MIX) >> (64 - bits)); }
static inline int grow_at(size_t used, uint32_t bits) { return used * 4 > ((size_t)3 << bits); }
/* Backward-shift deletion, for every table here: with a hole at i, the entry at j (home k, found
 * further along i's probe run, wrapping around) moves into the hole unless its home lies
 * cyclically in (i, j]. */
static inline int moves_back(size_t i, size_t j, size_t k) {
    return (j > i && (k <= i || k > j)) || (j < i && k <= i && k > j);
}

/* ---- the side map: entries that are not a plain keyed single copy ---------------------------- */
typedef struct { uint64_t h, key, extra; uint8_t orphan, used; } SEnt;
typedef struct { SEnt *e; uint32_t bits; size_t used; } Side;

static SEnt *side_find(const Side *s, uint64_t h) {
    if (!s->used) return NULL;
    size_t m = ((size_t)1 << s->bits) - 1, j = home(h, s->bits);
    while (s->e[j].used) {
        if (s->e[j].h == h) return &s->e[j];
        j = (j + 1) & m;
    }
    return NULL;
}

static int side_resize(Side *s, uint32_t bits) {
    SEnt *old = s->e;
    size_t oldcap = old ? (size_t)1 << s->bits : 0, m = ((size_t)1 << bits) - 1;
    SEnt *e = PyMem_Calloc((size_t)1 << bits, sizeof *e);
    if (!e) { PyErr_NoMemory(); return -1; }
    for (size_t i = 0; i < oldcap; i++) {
        if (!old[i].used) continue;
        size_t j = home(old[i].h, bits);
        while (e[j].used) j = (j + 1) & m;
        e[j] = old[i];
    }
    PyMem_Free(old);
    s->e = e;
    s->bits = bits;
    return 0;
}

/* A new side entry for h (absent): a pointer to it, zeroed but for h. */
static SEnt *side_add(Side *s, uint64_t h) {
    if (!s->e && side_resize(s, MIN_BITS) < 0) return NULL;
    if (grow_at(s->used + 1, s->bits) && side_resize(s, s->bits + 1) < 0) return NULL;
    size_t m = ((size_t)1 << s->bits) - 1, j = home(h, s->bits);
    while (s->e[j].used) j = (j + 1) & m;
    memset(&s->e[j], 0, sizeof s->e[j]);
    s->e[j].h = h;
    s->e[j].used = 1;
    s->used++;
    return &s->e[j];
}

static void side_del(Side *s, SEnt *at) {
    size_t m = ((size_t)1 << s->bits) - 1, i = (size_t)(at - s->e), j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!s->e[j].used) break;
        size_t k = home(s->e[j].h, s->bits);
        if (moves_back(i, j, k)) {
            s->e[i] = s->e[j];
            i = j;
        }
    }
    s->e[i].used = 0;
    if (--s->used == 0) { PyMem_Free(s->e); s->e = NULL; s->bits = 0; }
}

/* ---- one worker's table for one medium ------------------------------------------------------ */
typedef struct { uint64_t h, key; } Ent; /* h == 0: empty */
typedef struct { Ent *e; uint32_t bits; size_t used; Side side; } Tab;

typedef struct { int present, orphan; uint64_t key, extra; } Got;

static int tab_resize(Tab *t, uint32_t bits) {
    Ent *old = t->e;
    size_t oldcap = old ? (size_t)1 << t->bits : 0, m = ((size_t)1 << bits) - 1;
    Ent *e = PyMem_Calloc((size_t)1 << bits, sizeof *e);
    if (!e) { PyErr_NoMemory(); return -1; }
    for (size_t i = 0; i < oldcap; i++) {
        if (!old[i].h) continue;
        size_t j = home(old[i].h, bits);
        while (e[j].h) j = (j + 1) & m;
        e[j] = old[i];
    }
    PyMem_Free(old);
    t->e = e;
    t->bits = bits;
    return 0;
}

static int tab_reserve(Tab *t, size_t n) {
    if (t->e && !grow_at(t->used + n, t->bits)) return 0;
    uint32_t bits = t->e ? t->bits : MIN_BITS;
    while (grow_at(t->used + n, bits)) bits++;
    return (!t->e || bits != t->bits) ? tab_resize(t, bits) : 0;
}

static Ent *tab_find(const Tab *t, uint64_t h) {
    if (!h || !t->used) return NULL;
    size_t m = ((size_t)1 << t->bits) - 1, j = home(h, t->bits);
    while (t->e[j].h) {
        if (t->e[j].h == h) return &t->e[j];
        j = (j + 1) & m;
    }
    return NULL;
}

/* store and remove ask for the cache lines of the hash (and key) AHEAD places further on while
 * they apply one: the table lookups of a batch overlap instead of waiting for memory one by one.
 * A prefetch changes nothing but the cache. */
#define AHEAD 4

static inline void tab_prefetch(const Tab *t, uint64_t h) {
    if (t->e) __builtin_prefetch(&t->e[home(h, t->bits)]);
}

static Got tab_get(const Tab *t, uint64_t h) {
    Got g = {0, 0, 0, 0};
    Ent *e = tab_find(t, h);
    if (e) { g.present = 1; g.key = e->key; return g; }
    SEnt *s = side_find(&t->side, h);
    if (s) { g.present = 1; g.orphan = s->orphan; g.key = s->key; g.extra = s->extra; }
    return g;
}

static int tab_put_main(Tab *t, uint64_t h, uint64_t key) {
    if (tab_reserve(t, 1) < 0) return -1;
    size_t m = ((size_t)1 << t->bits) - 1, j = home(h, t->bits);
    while (t->e[j].h) j = (j + 1) & m;
    t->e[j].h = h;
    t->e[j].key = key;
    t->used++;
    return 0;
}

static void tab_del_main(Tab *t, Ent *at) {
    size_t m = ((size_t)1 << t->bits) - 1, i = (size_t)(at - t->e), j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!t->e[j].h) break;
        size_t k = home(t->e[j].h, t->bits);
        if (moves_back(i, j, k)) {
            t->e[i] = t->e[j];
            i = j;
        }
    }
    t->e[i].h = 0;
    t->used--;
}

static void tab_shrink(Tab *t) {
    if (t->e && t->bits > MIN_BITS && t->used * 16 < ((size_t)1 << t->bits)) {
        uint32_t bits = MIN_BITS;
        while (grow_at(t->used * 2, bits)) bits++;
        if (bits < t->bits && tab_resize(t, bits) < 0) PyErr_Clear(); /* on no memory: stays as it is */
    }
}

static size_t tab_len(const Tab *t) { return t->used + t->side.used; }

static void tab_free(Tab *t) {
    PyMem_Free(t->e);
    PyMem_Free(t->side.e);
    memset(t, 0, sizeof *t);
}

/* Set h's state (replacing what it had): keyed single copies go to the main table, the rest to the side. */
static int tab_set(Tab *t, uint64_t h, int orphan, uint64_t key, uint64_t extra) {
    Ent *e = tab_find(t, h);
    SEnt *s = e ? NULL : side_find(&t->side, h);
    if (!orphan && !extra && h) {
        if (e) { e->key = key; return 0; }
        if (s) side_del(&t->side, s);
        return tab_put_main(t, h, key);
    }
    if (e) tab_del_main(t, e);
    if (!s && !(s = side_add(&t->side, h))) return -1;
    s->orphan = (uint8_t)orphan;
    s->key = orphan ? 0 : key;
    s->extra = extra;
    return 0;
}

static void tab_drop(Tab *t, uint64_t h) {
    Ent *e = tab_find(t, h);
    if (e) { tab_del_main(t, e); return; }
    SEnt *s = side_find(&t->side, h);
    if (s) side_del(&t->side, s);
}

/* ---- holder sets ---------------------------------------------------------------------------- */
typedef struct {
    uint64_t *w;   /* cap * W words; id 0 unused */
    uint32_t *rc;  /* references; 0: free */
    uint64_t *hv;  /* hash of each mask */
    uint32_t n, cap, W;
    uint32_t *freel; uint32_t nfree;
    uint32_t *map; uint32_t mbits; uint32_t mused; /* intern map: id, 0 empty */
} Masks;

static uint64_t words_hash(const uint64_t *w, uint32_t W) {
    uint64_t x = 0x243F6A8885A308D3ULL;
    for (uint32_t i = 0; i < W; i++) x = (x ^ w[i]) * MIX + (x >> 29);
    return x | 1;
}

static int map_resize(Masks *m, uint32_t bits) {
    uint32_t *map = PyMem_Calloc((size_t)1 << bits, sizeof *map);
    if (!map) { PyErr_NoMemory(); return -1; }
    size_t mk = ((size_t)1 << bits) - 1;
    for (uint32_t id = 1; id < m->n; id++) {
        if (!m->rc[id]) continue;
        size_t j = home(m->hv[id], bits);
        while (map[j]) j = (j + 1) & mk;
        map[j] = id;
    }
    PyMem_Free(m->map);
    m->map = map;
    m->mbits = bits;
    return 0;
}

static void map_del(Masks *m, uint32_t id) {
    size_t mk = ((size_t)1 << m->mbits) - 1, i = home(m->hv[id], m->mbits), j;
    while (m->map[i] != id) i = (i + 1) & mk;
    j = i;
    for (;;) {
        j = (j + 1) & mk;
        if (!m->map[j]) break;
        size_t k = home(m->hv[m->map[j]], m->mbits);
        if (moves_back(i, j, k)) {
            m->map[i] = m->map[j];
            i = j;
        }
    }
    m->map[i] = 0;
    m->mused--;
}

/* Widen every mask to W words (more slots than the masks have bits). */
static int masks_widen(Masks *m, uint32_t W) {
    if (W <= m->W) return 0;
    uint64_t *w = PyMem_Calloc((size_t)(m->cap ? m->cap : 1) * W, sizeof *w);
    if (!w) { PyErr_NoMemory(); return -1; }
    for (uint32_t id = 1; id < m->n; id++) {
        memcpy(w + (size_t)id * W, m->w + (size_t)id * m->W, m->W * sizeof *w);
        if (m->rc[id]) m->hv[id] = words_hash(w + (size_t)id * W, W);
    }
    PyMem_Free(m->w);
    m->w = w;
    m->W = W;
    return m->map ? map_resize(m, m->mbits) : 0;
}

static void masks_decref(Masks *m, uint32_t ref) {
    if (ref & SINGLE) return;
    if (--m->rc[ref] == 0) {
        map_del(m, ref);
        m->freel[m->nfree++] = ref;
    }
}

/* The id of the mask ``w`` (of popcount >= 2), with one more reference; 0 on no memory. */
static uint32_t masks_intern(Masks *m, const uint64_t *w) {
    uint32_t W = m->W;
    uint64_t hv = words_hash(w, W);
    if (m->map) {
        size_t mk = ((size_t)1 << m->mbits) - 1, j = home(hv, m->mbits);
        for (uint32_t id; (id = m->map[j]); j = (j + 1) & mk)
            if (m->hv[id] == hv && !memcmp(m->w + (size_t)id * W, w, W * sizeof *w)) { m->rc[id]++; return id; }
    }
    if ((!m->map || grow_at(m->mused + 1, m->mbits)) && map_resize(m, m->map ? m->mbits + 1 : 6) < 0) return 0;
    uint32_t id;
    if (m->nfree) id = m->freel[--m->nfree];
    else {
        if (m->n == m->cap) {
            uint32_t cap = m->cap ? 2 * m->cap : 64;
            uint64_t *nw = PyMem_Realloc(m->w, (size_t)cap * W * sizeof *nw);
            if (!nw) { PyErr_NoMemory(); return 0; }
            m->w = nw;
            uint32_t *rc = PyMem_Realloc(m->rc, (size_t)cap * sizeof *rc);
            if (!rc) { PyErr_NoMemory(); return 0; }
            m->rc = rc;
            uint64_t *h = PyMem_Realloc(m->hv, (size_t)cap * sizeof *h);
            if (!h) { PyErr_NoMemory(); return 0; }
            m->hv = h;
            uint32_t *fl = PyMem_Realloc(m->freel, (size_t)cap * sizeof *fl);
            if (!fl) { PyErr_NoMemory(); return 0; }
            m->freel = fl;
            m->cap = cap;
            if (m->n == 0) m->n = 1;
        }
        id = m->n++;
    }
    memcpy(m->w + (size_t)id * W, w, W * sizeof *w);
    m->rc[id] = 1;
    m->hv[id] = hv;
    size_t mk = ((size_t)1 << m->mbits) - 1, j = home(hv, m->mbits);
    while (m->map[j]) j = (j + 1) & mk;
    m->map[j] = id;
    m->mused++;
    return id;
}

/* ---- per tier: key -> holder ref ------------------------------------------------------------ */
/* One entry is 12 bytes, key beside its ref: a lookup touches one cache line, not two. */
typedef struct __attribute__((packed)) { uint64_t k; uint32_t r; } HEnt; /* r == 0: empty */
typedef struct { HEnt *e; uint32_t bits; size_t used; } Hold;

static HEnt *hold_find(const Hold *t, uint64_t key) {
    if (!t->used) return NULL;
    size_t m = ((size_t)1 << t->bits) - 1, j = home(key, t->bits);
    while (t->e[j].r) {
        if (t->e[j].k == key) return &t->e[j];
        j = (j + 1) & m;
    }
    return NULL;
}

static inline void hold_prefetch(const Hold *t, uint64_t key) {
    if (t->e) __builtin_prefetch(&t->e[home(key, t->bits)]);
}

static int hold_resize(Hold *t, uint32_t bits) {
    size_t cap = (size_t)1 << bits, m = cap - 1, oldcap = t->e ? (size_t)1 << t->bits : 0;
    HEnt *e = PyMem_Calloc(cap, sizeof *e);
    if (!e) { PyErr_NoMemory(); return -1; }
    for (size_t i = 0; i < oldcap; i++) {
        if (!t->e[i].r) continue;
        size_t j = home(t->e[i].k, bits);
        while (e[j].r) j = (j + 1) & m;
        e[j] = t->e[i];
    }
    PyMem_Free(t->e);
    t->e = e;
    t->bits = bits;
    return 0;
}

static int hold_reserve(Hold *t, size_t n) {
    if (t->e && !grow_at(t->used + n, t->bits)) return 0;
    uint32_t bits = t->e ? t->bits : MIN_BITS;
    while (grow_at(t->used + n, bits)) bits++;
    return (!t->e || bits != t->bits) ? hold_resize(t, bits) : 0;
}

/* The entry of key, added with an empty ref (0) if absent (the caller sets it nonzero): one probe. */
static HEnt *hold_cell(Hold *t, uint64_t key) {
    if (hold_reserve(t, 1) < 0) return NULL;
    size_t m = ((size_t)1 << t->bits) - 1, j = home(key, t->bits);
    for (; t->e[j].r; j = (j + 1) & m)
        if (t->e[j].k == key) return &t->e[j];
    t->e[j].k = key;
    t->used++;
    return &t->e[j];
}

static void hold_del(Hold *t, HEnt *at) {
    size_t m = ((size_t)1 << t->bits) - 1, i = (size_t)(at - t->e), j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!t->e[j].r) break;
        size_t k = home(t->e[j].k, t->bits);
        if (moves_back(i, j, k)) {
            t->e[i] = t->e[j];
            i = j;
        }
    }
    t->e[i].r = 0;
    t->used--;
    if (t->bits > MIN_BITS && t->used * 16 < ((size_t)1 << t->bits)) {
        uint32_t bits = MIN_BITS;
        while (grow_at(t->used * 2, bits)) bits++;
        if (hold_resize(t, bits) < 0) PyErr_Clear();
    }
}

/* ---- dups: (key, tier, slot) -> holdings beyond the first ---------------------------------- */
typedef struct { uint64_t key, n; uint32_t ts; } DEnt; /* n == 0: empty */
typedef struct { DEnt *e; uint32_t bits; size_t used; } Dups;

static inline size_t dhome(uint64_t key, uint32_t ts, uint32_t bits) { return home(key ^ ((uint64_t)ts * 0xC2B2AE3D27D4EB4FULL), bits); }

static DEnt *dups_find(const Dups *d, uint64_t key, uint32_t ts) {
    if (!d->used) return NULL;
    size_t m = ((size_t)1 << d->bits) - 1, j = dhome(key, ts, d->bits);
    while (d->e[j].n) {
        if (d->e[j].key == key && d->e[j].ts == ts) return &d->e[j];
        j = (j + 1) & m;
    }
    return NULL;
}

static int dups_resize(Dups *d, uint32_t bits) {
    size_t oldcap = d->e ? (size_t)1 << d->bits : 0, m = ((size_t)1 << bits) - 1;
    DEnt *e = PyMem_Calloc((size_t)1 << bits, sizeof *e);
    if (!e) { PyErr_NoMemory(); return -1; }
    for (size_t i = 0; i < oldcap; i++) {
        if (!d->e[i].n) continue;
        size_t j = dhome(d->e[i].key, d->e[i].ts, bits);
        while (e[j].n) j = (j + 1) & m;
        e[j] = d->e[i];
    }
    PyMem_Free(d->e);
    d->e = e;
    d->bits = bits;
    return 0;
}

static int dups_add(Dups *d, uint64_t key, uint32_t ts, uint64_t n) {
    DEnt *x = dups_find(d, key, ts);
    if (x) { x->n += n; return 0; }
    if ((!d->e || grow_at(d->used + 1, d->bits)) && dups_resize(d, d->e ? d->bits + 1 : MIN_BITS) < 0) return -1;
    size_t m = ((size_t)1 << d->bits) - 1, j = dhome(key, ts, d->bits);
    while (d->e[j].n) j = (j + 1) & m;
    d->e[j].key = key;
    d->e[j].ts = ts;
    d->e[j].n = n;
    d->used++;
    return 0;
}

static void dups_del_at(Dups *d, size_t i) {
    size_t m = ((size_t)1 << d->bits) - 1, j = i;
    for (;;) {
        j = (j + 1) & m;
        if (!d->e[j].n) break;
        size_t k = dhome(d->e[j].key, d->e[j].ts, d->bits);
        if (moves_back(i, j, k)) {
            d->e[i] = d->e[j];
            i = j;
        }
    }
    d->e[i].n = 0;
    if (--d->used == 0) { PyMem_Free(d->e); d->e = NULL; d->bits = 0; }
}

/* ---- workers -------------------------------------------------------------------------------- */
typedef struct { int32_t mid, tier; Tab t; } Med;
typedef struct { int live; int32_t nmed, capmed; Med *med; Py_ssize_t orphans; } Wk;

typedef struct {
    PyObject_HEAD
    Wk *wk;
    uint32_t nwk, capwk;
    Hold hold[NTIERS];
    Masks masks;
    Dups dups;
    uint64_t *tmp; /* W words of scratch */
    uint64_t *acc; /* 4 * W words of scratch for the walk */
    int32_t *depth; /* 3 * nwk */
    uint32_t depthcap;
} Core;

static inline uint32_t ts_of(int tier, uint32_t slot) { return ((uint32_t)tier << 28) | slot; }

static int core_width(Core *c, uint32_t slots) {
    uint32_t W = (slots + 63) / 64;
    if (W < 1) W = 1;
    if (W <= c->masks.W && c->tmp) return 0;
    if (masks_widen(&c->masks, W) < 0) return -1;
    uint64_t *tmp = PyMem_Realloc(c->tmp, W * sizeof *tmp), *acc;
    if (!tmp) { PyErr_NoMemory(); return -1; }
    c->tmp = tmp;
    acc = PyMem_Realloc(c->acc, 4 * (size_t)W * sizeof *acc);
    if (!acc) { PyErr_NoMemory(); return -1; }
    c->acc = acc;
    return 0;
}

/* The words of ref into out (W words). */
static void ref_words(const Core *c, uint32_t ref, uint64_t *out) {
    uint32_t W = c->masks.W;
    if (ref & SINGLE) {
        memset(out, 0, W * sizeof *out);
        uint32_t s = ref & ~SINGLE;
        out[s >> 6] = 1ULL << (s & 63);
    } else if (ref) memcpy(out, c->masks.w + (size_t)ref * W, W * sizeof *out);
    else memset(out, 0, W * sizeof *out);
}

static int ref_has(const Core *c, uint32_t ref, uint32_t slot) {
    if (ref & SINGLE) return (ref & ~SINGLE) == slot;
    return (c->masks.w[(size_t)ref * c->masks.W + (slot >> 6)] >> (slot & 63)) & 1;
}

/* The ref of tmp (W words), one reference taken; 0 for an empty set. -1 on no memory. */
static int64_t ref_of_tmp(Core *c) {
    uint32_t W = c->masks.W, ones = 0, at = 0; /* ones: 0, 1 or 2 (two or more) */
    for (uint32_t i = 0; i < W && ones < 2; i++) {
        uint64_t w = c->tmp[i];
        if (w) { ones += (w & (w - 1)) ? 2 : 1; at = i; } /* no popcount: without -mpopcnt it is a call */
    }
    if (ones == 0) return 0;
    if (ones == 1) return SINGLE | (at * 64 + (uint32_t)__builtin_ctzll(c->tmp[at]));
    uint32_t id = masks_intern(&c->masks, c->tmp);
    return id ? (int64_t)id : -1;
}

/* The worker of slot holds key in tier once more. */
static int hold(Core *c, int tier, uint64_t key, uint32_t slot) {
    HEnt *cell = hold_cell(&c->hold[tier], key);
    if (!cell) return -1;
    uint32_t ref = cell->r;
    if (!ref) { cell->r = SINGLE | slot; return 0; }
    if (ref_has(c, ref, slot)) return dups_add(&c->dups, key, ts_of(tier, slot), 1);
    ref_words(c, ref, c->tmp);
    c->tmp[slot >> 6] |= 1ULL << (slot & 63);
    int64_t nr = ref_of_tmp(c);
    if (nr < 0) return -1;
    masks_decref(&c->masks, ref);
    cell->r = (uint32_t)nr;
    return 0;
}

/* The bit of slot off key in tier, whatever its duplicates. */
static int clear_bit(Core *c, int tier, uint64_t key, uint32_t slot) {
    HEnt *cell = hold_find(&c->hold[tier], key);
    if (!cell || !ref_has(c, cell->r, slot)) return 0;
    uint32_t ref = cell->r;
    if (ref & SINGLE) { hold_del(&c->hold[tier], cell); return 0; } /* its lone holder */
    ref_words(c, ref, c->tmp);
    c->tmp[slot >> 6] &= ~(1ULL << (slot & 63));
    int64_t nr = ref_of_tmp(c);
    if (nr < 0) return -1;
    masks_decref(&c->masks, ref);
    if (nr) cell->r = (uint32_t)nr;
    else hold_del(&c->hold[tier], cell);
    return 0;
}

/* The worker of slot holds key in tier once less: a duplicate first. */
static int release(Core *c, int tier, uint64_t key, uint32_t slot) {
    DEnt *d = dups_find(&c->dups, key, ts_of(tier, slot));
    if (d) {
        if (--d->n == 0) { d->n = 1; dups_del_at(&c->dups, (size_t)(d - c->dups.e)); }
        return 0;
    }
    return clear_bit(c, tier, key, slot);
}

/* n holdings at once (n copies of one hash): the first may set the bit, the rest are duplicates. */
static int hold_n(Core *c, int tier, uint64_t key, uint32_t slot, uint64_t n) {
    if (!n) return 0;
    if (hold(c, tier, key, slot) < 0) return -1;
    return n > 1 ? dups_add(&c->dups, key, ts_of(tier, slot), n - 1) : 0;
}

/* n holdings fewer: duplicates first, the bit with the last. */
static int release_n(Core *c, int tier, uint64_t key, uint32_t slot, uint64_t n) {
    DEnt *d = dups_find(&c->dups, key, ts_of(tier, slot));
    if (d) {
        uint64_t take = n < d->n ? n : d->n;
        n -= take;
        if ((d->n -= take) == 0) { d->n = 1; dups_del_at(&c->dups, (size_t)(d - c->dups.e)); }
    }
    return n ? clear_bit(c, tier, key, slot) : 0;
}

static Wk *worker(Core *c, Py_ssize_t slot) {
    if (slot < 0 || (size_t)slot >= c->nwk || !c->wk[slot].live) {
        PyErr_Format(PyExc_KeyError, "no worker in slot %zd", slot);
        return NULL;
    }
    return &c->wk[slot];
}

static Med *medium(Wk *w, int32_t mid, int32_t tier, int create) {
    for (int32_t i = 0; i < w->nmed; i++)
        if (w->med[i].mid == mid) return &w->med[i];
    if (!create) return NULL;
    if (w->nmed == w->capmed) {
        int32_t cap = w->capmed ? 2 * w->capmed : 2;
        Med *m = PyMem_Realloc(w->med, (size_t)cap * sizeof *m);
        if (!m) { PyErr_NoMemory(); return NULL; }
        w->med = m;
        w->capmed = cap;
    }
    Med *m = &w->med[w->nmed++];
    memset(m, 0, sizeof *m);
    m->mid = mid;
    m->tier = tier;
    return m;
}

/* The key of hash h: its first medium's (media in order, GPU first) that holds it keyed, else
 * none (as reference.py: GPU's entry if it has one, else the first medium's that holds it). */
static int key_of(const Wk *w, uint64_t h, uint64_t *key) {
    for (int32_t i = 0; i < w->nmed; i++) {
        Got g = tab_get(&w->med[i].t, h);
        if (g.present) {
            if (g.orphan) return 0;
            *key = g.key;
            return 1;
        }
    }
    return 0;
}

/* Keyless copies of h in other media get its key (offload events carry no tokens). */
static int adopt_elsewhere(Core *c, Wk *w, uint32_t slot, uint64_t h, uint64_t key) {
    for (int32_t i = 0; i < w->nmed; i++) {
        Med *m = &w->med[i];
        SEnt *s = side_find(&m->t.side, h);
        if (!s || !s->orphan) continue;
        uint64_t copies = 1 + s->extra;
        if (tab_set(&m->t, h, 0, key, s->extra) < 0) return -1;
        w->orphans--;
        if (hold_n(c, m->tier, key, slot, copies) < 0) return -1;
    }
    return 0;
}

/* One stored copy of h (copy 0: re-announced). Returns 1 if it is keyless, 0, or -1 on error. */
static int store_one(Core *c, Wk *w, uint32_t slot, Med *m, uint64_t h, int keyed, uint64_t key, int copy) {
    Tab *t = &m->t;
    if (h && keyed && (!t->side.used || !side_find(&t->side, h))) { /* common: one probe finds h or its place */
        size_t mk = ((size_t)1 << t->bits) - 1, j = home(h, t->bits);
        for (; t->e[j].h; j = (j + 1) & mk)
            if (t->e[j].h == h) break;
        if (!t->e[j].h) {
            if (grow_at(t->used + 1, t->bits)) goto general; /* not reserved (an adopted copy elsewhere) */
            t->e[j].h = h;
            t->e[j].key = key;
            t->used++;
            if (w->nmed > 1 && adopt_elsewhere(c, w, slot, h, key) < 0) return -1;
            return hold(c, m->tier, key, slot) < 0 ? -1 : 0;
        }
    }
general:;
    Got g = tab_get(&m->t, h);
    if (!g.present) {
        if (tab_set(&m->t, h, !keyed, key, 0) < 0) return -1;
        if (!keyed) { w->orphans++; return 1; }
        if (w->nmed > 1 && adopt_elsewhere(c, w, slot, h, key) < 0) return -1;
        return hold(c, m->tier, key, slot) < 0 ? -1 : 0;
    }
    uint64_t copies = g.extra + (uint64_t)copy;
    if (g.orphan && keyed) { /* a keyless hash learns its key: its copies are indexed */
        if (tab_set(&m->t, h, 0, key, copies) < 0) return -1;
        w->orphans--;
        return hold_n(c, m->tier, key, slot, copies + 1) < 0 ? -1 : 0;
    }
    if (copies != g.extra && tab_set(&m->t, h, g.orphan, g.key, copies) < 0) return -1;
    if (g.orphan) return 1;
    if (!copy) return 0;
    return hold(c, m->tier, g.key, slot) < 0 ? -1 : 0; /* a hash keeps the key it was first stored with */
}

/* One removed copy of h: 1, or 0 if not held. -1 on error. */
static int remove_one(Core *c, Wk *w, uint32_t slot, Med *m, uint64_t h) {
    Ent *e = tab_find(&m->t, h);
    if (e) { /* a plain keyed single copy */
        uint64_t key = e->key;
        tab_del_main(&m->t, e);
        return release(c, m->tier, key, slot) < 0 ? -1 : 1;
    }
    Got g = tab_get(&m->t, h);
    if (!g.present) return 0;
    if (g.extra) {
        if (tab_set(&m->t, h, g.orphan, g.key, g.extra - 1) < 0) return -1;
    } else {
        tab_drop(&m->t, h);
        if (g.orphan) w->orphans--;
    }
    if (!g.orphan && release(c, m->tier, g.key, slot) < 0) return -1;
    return 1;
}

/* ---- Python ----------------------------------------------------------------------------------- */
static int as_u64(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) { PyErr_Format(PyExc_TypeError, "a hash or key must be an int, not %.50s", Py_TYPE(o)->tp_name); return -1; }
#if PY_VERSION_HEX < 0x030D0000
    /* up to 3.12 PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray for any int of 2^30 or
       more (every hash): the range checked from sign and bit length, the value read as a mask */
    if (_PyLong_Sign(o) >= 0 && _PyLong_NumBits(o) <= 64) {
        *out = (uint64_t)PyLong_AsUnsignedLongLongMask(o);
        return 0;
    }
#endif
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_SetString(PyExc_OverflowError, "a hash or key must be a u64 (0 <= x < 2**64)");
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static void core_dealloc(Core *c) {
    for (uint32_t i = 0; i < c->nwk; i++) {
        for (int32_t j = 0; j < c->wk[i].nmed; j++) tab_free(&c->wk[i].med[j].t);
        PyMem_Free(c->wk[i].med);
    }
    PyMem_Free(c->wk);
    for (int t = 0; t < NTIERS; t++) PyMem_Free(c->hold[t].e);
    PyMem_Free(c->masks.w); PyMem_Free(c->masks.rc); PyMem_Free(c->masks.hv);
    PyMem_Free(c->masks.freel); PyMem_Free(c->masks.map);
    PyMem_Free(c->dups.e);
    PyMem_Free(c->tmp); PyMem_Free(c->acc); PyMem_Free(c->depth);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (c && core_width(c, 64) < 0) { Py_DECREF(c); return NULL; }
    return (PyObject *)c;
}

/* new_worker() -> slot: the lowest free slot, with an empty GPU medium (mid 0, tier 0). */
static PyObject *core_new_worker(Core *c, PyObject *unused) {
    uint32_t slot = 0;
    while (slot < c->nwk && c->wk[slot].live) slot++;
    if (slot == c->nwk) {
        if (c->nwk == c->capwk) {
            uint32_t cap = c->capwk ? 2 * c->capwk : 16;
            Wk *wk = PyMem_Realloc(c->wk, (size_t)cap * sizeof *wk);
            if (!wk) return PyErr_NoMemory();
            c->wk = wk;
            c->capwk = cap;
        }
        if (core_width(c, c->nwk + 1) < 0) return NULL;
        memset(&c->wk[c->nwk], 0, sizeof c->wk[c->nwk]);
        c->nwk++;
    }
    Wk *w = &c->wk[slot];
    w->live = 1;
    if (!medium(w, 0, 0, 1)) { w->live = 0; return NULL; }
    return PyLong_FromUnsignedLong(slot);
}

/* free_worker(slot): forget every holding of the worker, free its slot. */
static PyObject *core_free_worker(Core *c, PyObject *arg) {
    Py_ssize_t slot = PyLong_AsSsize_t(arg);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    Wk *w = worker(c, slot);
    if (!w) return NULL;
    for (int32_t i = 0; i < w->nmed; i++) {
        Med *m = &w->med[i];
        Tab *t = &m->t;
        size_t cap = t->e ? (size_t)1 << t->bits : 0;
        for (size_t j = 0; j < cap; j++)
            if (t->e[j].h && clear_bit(c, m->tier, t->e[j].key, (uint32_t)slot) < 0) return NULL;
        cap = t->side.e ? (size_t)1 << t->side.bits : 0;
        for (size_t j = 0; j < cap; j++)
            if (t->side.e[j].used && !t->side.e[j].orphan && clear_bit(c, m->tier, t->side.e[j].key, (uint32_t)slot) < 0)
                return NULL;
        tab_free(t);
    }
    if (c->dups.used) {
        size_t cap = (size_t)1 << c->dups.bits;
        for (size_t j = 0; j < cap && c->dups.e;) {
            if (c->dups.e[j].n && (c->dups.e[j].ts & 0x0FFFFFFFu) == (uint32_t)slot) dups_del_at(&c->dups, j);
            else j++;  /* a backward shift may have moved another entry into j: look again */
        }
    }
    PyMem_Free(w->med);
    memset(w, 0, sizeof *w);
    while (c->nwk && !c->wk[c->nwk - 1].live) c->nwk--;
    Py_RETURN_NONE;
}

/* The u64s of a packed buffer of them (an adapter's array("Q")): one copy, no int read. -2 when
 * seq is no such buffer (the caller reads it as a sequence), -1 on no memory. */
static Py_ssize_t packed_u64s(PyObject *seq, uint64_t **out) {
    Py_buffer view;
    if (!kx_u64_view(seq, &view)) return -2;
    Py_ssize_t n = view.len / 8;
    uint64_t *v = PyMem_Malloc((size_t)(view.len ? view.len : 8));
    if (v) {
        memcpy(v, view.buf, (size_t)view.len);
        *out = v;
    } else {
        PyErr_NoMemory();
        n = -1;
    }
    PyBuffer_Release(&view);
    return n;
}

/* The u64s of a packed buffer or a sequence of ints, all converted before anything changes (an
 * event applies whole or not at all); *out is PyMem-owned. */
static Py_ssize_t u64s(PyObject *seq, const char *what, uint64_t **out) {
    Py_ssize_t n = packed_u64s(seq, out);
    if (n != -2) return n;
    PyObject *f = PySequence_Fast(seq, what);
    if (!f) return -1;
    n = PySequence_Fast_GET_SIZE(f);
    PyObject **items = PySequence_Fast_ITEMS(f);
    uint64_t *v = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *v);
    if (!v) { Py_DECREF(f); PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < n; i++)
        if (as_u64(items[i], &v[i]) < 0) { PyMem_Free(v); Py_DECREF(f); return -1; }
    Py_DECREF(f);
    *out = v;
    return n;
}

/* One event's hashes H[0..n) into medium mid: the first nk keyed K[i], the rest the worker's key
 * for them; parentless as ``store``. Every input converted by the caller: nothing can fail before
 * the first change but memory. (orphans, reannounced), or NULL with an exception. */
static PyObject *store_hashes(Core *c, Wk *w, Py_ssize_t slot, int mid, int tier, const uint64_t *H, Py_ssize_t n,
                              const uint64_t *K, Py_ssize_t nk, int parentless) {
    Py_ssize_t orphans = 0;
    int again = 0;
    Med *m = medium(w, mid, tier, 1);
    if (!m || tab_reserve(&m->t, (size_t)n) < 0) return NULL;
    if (parentless)
        for (again = 1; again && orphans < n; orphans++) again = tab_get(&m->t, H[orphans]).present;
    orphans = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t a = i + AHEAD;
        if (a < n) tab_prefetch(&m->t, H[a]);
        if (a < nk) hold_prefetch(&c->hold[tier], K[a]);
        uint64_t key = i < nk ? K[i] : 0;
        int keyed = i < nk ? 1 : key_of(w, H[i], &key), r;
        if ((r = store_one(c, w, (uint32_t)slot, m, H[i], keyed, key, !again)) < 0) return NULL;
        orphans += r;
    }
    return Py_BuildValue("(nN)", orphans, PyBool_FromLong(again));
}

/* store(slot, mid, tier, hashes, keys, parentless) -> (orphans, reannounced)
 * keys: the keys of the first len(keys) hashes; the rest take the worker's key for them.
 * parentless: a GPU store with no parent hash, which is a re-announcement when the medium
 * already holds every hash (vLLM's report mode; reference.py). */
static PyObject *core_store(Core *c, PyObject *args) {
    Py_ssize_t slot, n, nk;
    int mid, tier, parentless;
    PyObject *hs, *ks, *out = NULL;
    uint64_t *H = NULL, *K = NULL;
    if (!PyArg_ParseTuple(args, "niiOOp", &slot, &mid, &tier, &hs, &ks, &parentless)) return NULL;
    if (tier < 0 || tier >= NTIERS) return PyErr_Format(PyExc_ValueError, "tier %d", tier);
    Wk *w = worker(c, slot);
    if (!w || (n = u64s(hs, "hashes must be a sequence", &H)) < 0) return NULL;
    if ((nk = u64s(ks, "keys must be a sequence", &K)) >= 0)
        out = store_hashes(c, w, slot, mid, tier, H, n, K, nk, parentless);
    PyMem_Free(H);
    PyMem_Free(K);
    return out;
}

#define LOCAL_SEED 1337ULL

/* key_i = XXH3-64(LE64(key_{i-1}) || LE64(local_i)): kvindex/keys.py's chain (kvindex/_keys.c's). */
static uint64_t chain_key(uint64_t parent, uint64_t local) {
    unsigned char pair[16];
    kx_put_le64(pair, parent);
    kx_put_le64(pair + 8, local);
    return kx_xxh3_64(pair, sizeof pair, 0);
}

/* store_tokens(slot, tier, hashes, parent, root, tokens, block_size) -> (orphans, reannounced)
 * ``store`` of a device event (medium 0) at its model's block size, with its keys made here from
 * its tokens (a buffer of u32: array("I")) exactly as ``kvindex.keys.prompt_keys`` makes them
 * (at most one per hash, full blocks only): chained from ``root`` when ``parent`` is None (the
 * store is then parentless), else from the worker's key for ``parent``; a parent it holds no
 * key for gives no keys (every hash takes the worker's key for it, else is keyless), as
 * PreciseIndex._event_keys decides in Python. One call instead of key_of + prompt_keys + store. */
static PyObject *core_store_tokens(Core *c, PyObject *args) {
    Py_ssize_t slot, bs, n, nk = 0;
    int tier;
    PyObject *hs, *parent, *root_o, *tokens, *out = NULL;
    uint64_t *H = NULL, *K = NULL, key = 0, ph;
    if (!PyArg_ParseTuple(args, "niOOOOn", &slot, &tier, &hs, &parent, &root_o, &tokens, &bs)) return NULL;
    if (tier < 0 || tier >= NTIERS) return PyErr_Format(PyExc_ValueError, "tier %d", tier);
    if (bs <= 0) return PyErr_Format(PyExc_ValueError, "block_size must be positive");
    Wk *w = worker(c, slot);
    if (!w || (n = u64s(hs, "hashes must be a sequence", &H)) < 0) return NULL;
    int keyed = 0;
    if (parent == Py_None) {
        if (as_u64(root_o, &key) < 0) goto done;
        keyed = 1;
    } else {
        if (as_u64(parent, &ph) < 0) goto done;
        keyed = key_of(w, ph, &key);
    }
    if (keyed) {
        Py_buffer view;
        if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto done;
        if (view.itemsize != 4) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "token ids must be a buffer of u32 (array('I'))");
            goto done;
        }
        nk = (view.len / 4) / bs; /* divides first: any block size, as kvindex._keys */
        if (nk > n) nk = n;
        K = PyMem_Malloc((size_t)(nk ? nk : 1) * sizeof *K);
        if (!K) {
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            goto done;
        }
        const unsigned char *data = view.buf;
        size_t width = (size_t)(4 * bs);
        for (Py_ssize_t i = 0; i < nk; i++) K[i] = key = chain_key(key, kx_xxh3_64(data + i * width, width, LOCAL_SEED));
        PyBuffer_Release(&view);
    }
    out = store_hashes(c, w, slot, 0, tier, H, n, K, nk, parent == Py_None);
done:
    PyMem_Free(H);
    PyMem_Free(K);
    return out;
}

/* remove(slot, mid, hashes) -> copies removed (the rest were not held). */
static PyObject *core_remove(Core *c, PyObject *args) {
    Py_ssize_t slot, removed = 0, n;
    int mid;
    PyObject *hs;
    uint64_t *H;
    if (!PyArg_ParseTuple(args, "niO", &slot, &mid, &hs)) return NULL;
    Wk *w = worker(c, slot);
    if (!w || (n = u64s(hs, "hashes must be a sequence", &H)) < 0) return NULL;
    Med *m = medium(w, mid, 0, 0);
    for (Py_ssize_t i = 0; m && i < n; i++) {
        if (i + 2 * AHEAD < n) tab_prefetch(&m->t, H[i + 2 * AHEAD]);
        Ent *e = i + AHEAD < n ? tab_find(&m->t, H[i + AHEAD]) : NULL; /* asked for AHEAD hashes ago */
        if (e) hold_prefetch(&c->hold[m->tier], e->key);
        int r = remove_one(c, w, (uint32_t)slot, m, H[i]);
        if (r < 0) { PyMem_Free(H); return NULL; }
        removed += r;
    }
    PyMem_Free(H);
    if (removed) tab_shrink(&m->t);
    return PyLong_FromSsize_t(removed);
}

/* The event fields apply_device reads (interned once, at import). */
static PyObject *S_hashes, *S_parent, *S_tokens, *S_size, *S_medium, *S_lora, *S_salt;

/* Whether ``o`` is the device medium's name ``gpu``. -1 with an exception. */
static int is_gpu(PyObject *o, PyObject *gpu) {
    if (o == gpu) return 1;
    if (!PyUnicode_Check(o)) return 0;
    return PyUnicode_Compare(o, gpu) == 0 ? 1 : (PyErr_Occurred() ? -1 : 0);
}

/* One device store (see store_tokens), its fields read from the event; 1 applied, 0 when the event
 * is not for this loop (Python's: another medium, size, a LoRA or salt root, tokens not u32), -1. */
static int device_store(Core *c, Wk *w, Py_ssize_t slot, int tier, PyObject *ev, Py_ssize_t bs, uint64_t root,
                        PyObject *gpu, Py_ssize_t *acc) {
    PyObject *med = NULL, *size = NULL, *lora = NULL, *salt = NULL, *hs = NULL, *parent = NULL, *tokens = NULL, *r = NULL;
    uint64_t *H = NULL, *K = NULL, key = root, ph;
    Py_ssize_t n, nk = 0;
    int ok = -1, g, keyed = 1;
    Py_buffer view;
    view.obj = NULL;
    if (!(med = PyObject_GetAttr(ev, S_medium)) || (g = is_gpu(med, gpu)) < 0) goto done;
    if (!g) { ok = 0; goto done; }
    if (!(size = PyObject_GetAttr(ev, S_size)) || !(lora = PyObject_GetAttr(ev, S_lora)) ||
        !(salt = PyObject_GetAttr(ev, S_salt))) goto done;
    if (!PyLong_Check(size) || PyLong_AsSsize_t(size) != bs || lora != Py_None || salt != Py_None) {
        PyErr_Clear();
        ok = 0;
        goto done;
    }
    if (!(tokens = PyObject_GetAttr(ev, S_tokens))) goto done;
    if (PyObject_GetBuffer(tokens, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0 || view.itemsize != 4 ||
        !view.format || strcmp(view.format, "I") != 0) {
        PyErr_Clear();
        ok = 0;
        goto done;
    }
    if (!(hs = PyObject_GetAttr(ev, S_hashes)) || !(parent = PyObject_GetAttr(ev, S_parent))) goto done;
    if ((n = u64s(hs, "hashes must be a sequence", &H)) < 0) goto done;
    if (parent != Py_None) {
        if (as_u64(parent, &ph) < 0) goto done;
        keyed = key_of(w, ph, &key);
    }
    if (keyed) {
        nk = (view.len / 4) / bs;
        if (nk > n) nk = n;
        if (!(K = PyMem_Malloc((size_t)(nk ? nk : 1) * sizeof *K))) { PyErr_NoMemory(); goto done; }
        const unsigned char *data = view.buf;
        size_t width = (size_t)(4 * bs);
        for (Py_ssize_t i = 0; i < nk; i++) K[i] = key = chain_key(key, kx_xxh3_64(data + i * width, width, LOCAL_SEED));
    }
    if (!(r = store_hashes(c, w, slot, 0, tier, H, n, K, nk, parent == Py_None))) goto done;
    Py_ssize_t orphans = PyLong_AsSsize_t(PyTuple_GET_ITEM(r, 0));
    int again = PyTuple_GET_ITEM(r, 1) == Py_True;
    acc[0] += 1;                        /* stored_events */
    acc[again ? 2 : 1] += n;            /* reannounced or stored */
    acc[3] += orphans;
    ok = 1;
done:
    if (view.obj) PyBuffer_Release(&view);
    Py_XDECREF(med); Py_XDECREF(size); Py_XDECREF(lora); Py_XDECREF(salt); Py_XDECREF(hs); Py_XDECREF(parent);
    Py_XDECREF(tokens); Py_XDECREF(r);
    PyMem_Free(H);
    PyMem_Free(K);
    return ok;
}

/* One device removal (core_remove's loop, medium 0); 1 applied, 0 another medium's, -1. */
static int device_remove(Core *c, Wk *w, Py_ssize_t slot, PyObject *ev, PyObject *gpu, Py_ssize_t *acc) {
    PyObject *med = PyObject_GetAttr(ev, S_medium), *hs = NULL;
    uint64_t *H = NULL;
    Py_ssize_t n, removed = 0;
    int g = med ? is_gpu(med, gpu) : -1, ok = -1;
    Py_XDECREF(med);
    if (g <= 0) return g;
    if (!(hs = PyObject_GetAttr(ev, S_hashes)) || (n = u64s(hs, "hashes must be a sequence", &H)) < 0) goto done;
    Med *m = medium(w, 0, 0, 0);
    for (Py_ssize_t i = 0; m && i < n; i++) {
        if (i + 2 * AHEAD < n) tab_prefetch(&m->t, H[i + 2 * AHEAD]);
        Ent *e = i + AHEAD < n ? tab_find(&m->t, H[i + AHEAD]) : NULL;
        if (e) hold_prefetch(&c->hold[m->tier], e->key);
        int r = remove_one(c, w, (uint32_t)slot, m, H[i]);
        if (r < 0) goto done;
        removed += r;
    }
    if (removed) tab_shrink(&m->t);
    acc[4] += 1;             /* removed_events */
    acc[5] += removed;
    acc[6] += n - removed;   /* unknown_removals */
    ok = 1;
done:
    Py_XDECREF(hs);
    PyMem_Free(H);
    return ok;
}

/* apply_device(slot, tier, events, start, block_size, root, stored_type, removed_type, gpu)
 *   -> (stop, stored_events, stored, reannounced, orphans, removed_events, removed, unknown_removals)
 * Applies events[start:] in order while each is a device (``gpu``) BlockStored at ``block_size``
 * with no LoRA name and no salt (its keys chained from ``root``, as store_tokens) or a device
 * BlockRemoved (as remove on medium 0); ``stop`` is the index of the first other event (Python
 * applies it by the general rules, then calls again after it), or len(events). One call for a
 * batch's common events: no Python frame per event (PreciseIndex.apply_batch; tests hold the
 * result equal to the reference's). */
static PyObject *core_apply_device(Core *c, PyObject *args) {
    Py_ssize_t slot, start, bs;
    int tier;
    PyObject *events, *root_o, *stored_t, *removed_t, *gpu;
    uint64_t root;
    Py_ssize_t acc[7] = {0};
    if (!PyArg_ParseTuple(args, "niOnnOOOU", &slot, &tier, &events, &start, &bs, &root_o, &stored_t, &removed_t, &gpu))
        return NULL;
    if (tier < 0 || tier >= NTIERS) return PyErr_Format(PyExc_ValueError, "tier %d", tier);
    if (bs <= 0) return PyErr_Format(PyExc_ValueError, "block_size must be positive");
    if (!PyTuple_Check(events) && !PyList_Check(events)) return PyErr_Format(PyExc_TypeError, "events must be a tuple or list");
    if (as_u64(root_o, &root) < 0) return NULL;
    Wk *w = worker(c, slot);
    if (!w) return NULL;
    Py_ssize_t i = start < 0 ? 0 : start;
    for (; i < PySequence_Fast_GET_SIZE(events); i++) {
        PyObject *ev = PySequence_Fast_GET_ITEM(events, i);
        int r;
        if ((PyObject *)Py_TYPE(ev) == stored_t) r = device_store(c, w, slot, tier, ev, bs, root, gpu, acc);
        else if ((PyObject *)Py_TYPE(ev) == removed_t) r = device_remove(c, w, slot, ev, gpu, acc);
        else r = 0;
        if (r < 0) return NULL;
        if (r == 0) break;
    }
    return Py_BuildValue("(nnnnnnnn)", i, acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6]);
}

/* empty(slot) -> whether the worker holds nothing. */
static PyObject *core_empty(Core *c, PyObject *arg) {
    Py_ssize_t slot = PyLong_AsSsize_t(arg);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    Wk *w = worker(c, slot);
    if (!w) return NULL;
    for (int32_t i = 0; i < w->nmed; i++)
        if (tab_len(&w->med[i].t)) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* key_of(slot, hash) -> key or None. */
static PyObject *core_key_of(Core *c, PyObject *args) {
    Py_ssize_t slot;
    PyObject *ho;
    uint64_t h, key;
    if (!PyArg_ParseTuple(args, "nO", &slot, &ho)) return NULL;
    Wk *w = worker(c, slot);
    if (!w || as_u64(ho, &h) < 0) return NULL;
    if (key_of(w, h, &key)) return PyLong_FromUnsignedLongLong(key);
    Py_RETURN_NONE;
}

/* media(slot) -> [(mid, entries, copies)], in order (GPU first); and the worker's keyless count. */
static PyObject *core_media(Core *c, PyObject *arg) {
    Py_ssize_t slot = PyLong_AsSsize_t(arg);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    Wk *w = worker(c, slot);
    if (!w) return NULL;
    PyObject *out = PyList_New(w->nmed);
    if (!out) return NULL;
    for (int32_t i = 0; i < w->nmed; i++) {
        Tab *t = &w->med[i].t;
        size_t copies = tab_len(t), cap = t->side.e ? (size_t)1 << t->side.bits : 0;
        for (size_t j = 0; j < cap; j++)
            if (t->side.e[j].used) copies += t->side.e[j].extra;
        PyObject *row = Py_BuildValue("(inn)", w->med[i].mid, (Py_ssize_t)tab_len(t), (Py_ssize_t)copies);
        if (!row) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, i, row);
    }
    return Py_BuildValue("(Nn)", out, w->orphans);
}

#define KEYLESS_BIT (1ULL << 63) /* in a row's third word: the entry is keyless */

static void put_row(unsigned char *p, uint64_t h, uint64_t key, uint64_t copies, int keyless) {
    uint64_t meta = copies | (keyless ? KEYLESS_BIT : 0);
    memcpy(p, &h, 8); memcpy(p + 8, &key, 8); memcpy(p + 16, &meta, 8);
}

/* One row: 0, or -1 (ValueError) when its copies are not in [1, 2**63). */
static int get_row(const unsigned char *p, uint64_t *h, uint64_t *key, uint64_t *copies, int *keyless) {
    uint64_t meta;
    memcpy(h, p, 8); memcpy(key, p + 8, 8); memcpy(&meta, p + 16, 8);
    *keyless = (meta & KEYLESS_BIT) != 0;
    *copies = meta & ~KEYLESS_BIT;
    if (*keyless && *key) {
        PyErr_SetString(PyExc_ValueError, "a keyless snapshot row with a key");
        return -1;
    }
    if (*copies) return 0;
    PyErr_SetString(PyExc_ValueError, "a snapshot row with 0 copies");
    return -1;
}

/* export(slot, mid) -> bytes: the medium's entries as snapshot rows (see the top). */
static PyObject *core_export(Core *c, PyObject *args) {
    Py_ssize_t slot;
    int mid;
    if (!PyArg_ParseTuple(args, "ni", &slot, &mid)) return NULL;
    Wk *w = worker(c, slot);
    if (!w) return NULL;
    Med *m = medium(w, mid, 0, 0);
    if (!m) return PyBytes_FromStringAndSize(NULL, 0);
    Tab *t = &m->t;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(tab_len(t) * ROW));
    if (!out) return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    size_t cap = t->e ? (size_t)1 << t->bits : 0;
    for (size_t j = 0; j < cap; j++)
        if (t->e[j].h) { put_row(p, t->e[j].h, t->e[j].key, 1, 0); p += ROW; }
    cap = t->side.e ? (size_t)1 << t->side.bits : 0;
    for (size_t j = 0; j < cap; j++) {
        SEnt *s = &t->side.e[j];
        if (s->used) { put_row(p, s->h, s->key, 1 + s->extra, s->orphan); p += ROW; }
    }
    return out;
}

static int rows_view(PyObject *data, Py_buffer *view) {
    if (PyObject_GetBuffer(data, view, PyBUF_SIMPLE) < 0) return -1;
    if (view->len % ROW) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "snapshot rows must be a multiple of %d bytes, got %zd", ROW, view->len);
        return -1;
    }
    return 0;
}

/* load(slot, mid, tier, rows) -> entries added: exported rows into a medium. A row replaces
 * what the medium held for its hash (its holdings with it), as the reference's load does. Every
 * row is checked before the index changes (a bad one refuses the whole call). */
static PyObject *core_load(Core *c, PyObject *args) {
    Py_ssize_t slot;
    int mid, tier, keyless;
    PyObject *data;
    Py_buffer v;
    uint64_t h, key, copies;
    if (!PyArg_ParseTuple(args, "niiO", &slot, &mid, &tier, &data)) return NULL;
    if (tier < 0 || tier >= NTIERS) return PyErr_Format(PyExc_ValueError, "tier %d", tier);
    Wk *w = worker(c, slot);
    if (!w || rows_view(data, &v) < 0) return NULL;
    Py_ssize_t n = v.len / ROW, i;
    const unsigned char *p = v.buf;
    for (i = 0; i < n; i++)
        if (get_row(p + i * ROW, &h, &key, &copies, &keyless) < 0) goto fail;
    Med *m = n ? medium(w, mid, tier, 1) : NULL;
    if (n && (!m || tab_reserve(&m->t, (size_t)n) < 0 || hold_reserve(&c->hold[tier], (size_t)n) < 0)) goto fail;
    for (i = 0; i < n; i++, p += ROW) {
        get_row(p, &h, &key, &copies, &keyless);
        Got g = tab_get(&m->t, h);
        if (g.present && g.orphan) w->orphans--;
        else if (g.present && release_n(c, tier, g.key, (uint32_t)slot, 1 + g.extra) < 0) goto fail;
        if (tab_set(&m->t, h, keyless, key, copies - 1) < 0) goto fail;
        if (keyless) w->orphans++;
        else if (hold_n(c, tier, key, (uint32_t)slot, copies) < 0) goto fail;
    }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t(n);
fail:
    PyBuffer_Release(&v);
    return NULL;
}

/* rows(data) -> [(hash, key or None, copies)]: snapshot rows read back. */
static PyObject *core_rows(PyObject *mod, PyObject *data) {
    Py_buffer v;
    if (rows_view(data, &v) < 0) return NULL;
    Py_ssize_t n = v.len / ROW;
    const unsigned char *p = v.buf;
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++, p += ROW) {
        uint64_t h, key, copies;
        int keyless;
        if (get_row(p, &h, &key, &copies, &keyless) < 0) { Py_CLEAR(out); break; }
        PyObject *k = keyless ? Py_NewRef(Py_None) : PyLong_FromUnsignedLongLong(key);
        PyObject *row = k ? Py_BuildValue("(KNK)", (unsigned long long)h, k, (unsigned long long)copies) : NULL;
        if (!row) { Py_CLEAR(out); break; }
        PyList_SET_ITEM(out, i, row);
    }
    PyBuffer_Release(&v);
    return out;
}

/* check(data) -> the number of rows; ValueError unless every row is well formed. */
static PyObject *core_check(PyObject *mod, PyObject *data) {
    Py_buffer v;
    uint64_t h, key, copies;
    int keyless;
    if (rows_view(data, &v) < 0) return NULL;
    Py_ssize_t n = v.len / ROW;
    for (Py_ssize_t i = 0; i < n; i++)
        if (get_row((const unsigned char *)v.buf + i * ROW, &h, &key, &copies, &keyless) < 0) {
            PyBuffer_Release(&v);
            return NULL;
        }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t(n);
}

/* pack(rows) -> bytes: [(hash, key or None, copies)] as snapshot rows. */
static PyObject *core_pack(PyObject *mod, PyObject *rows) {
    PyObject *f = PySequence_Fast(rows, "rows must be a sequence");
    if (!f) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * ROW);
    if (!out) { Py_DECREF(f); return NULL; }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++, p += ROW) {
        PyObject *r = PySequence_Fast_GET_ITEM(f, i), *ho, *ko, *co;
        uint64_t h, key = 0, copies = 0;
        if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) != 3) { PyErr_SetString(PyExc_TypeError, "a row is (hash, key or None, copies)"); goto fail; }
        ho = PyTuple_GET_ITEM(r, 0); ko = PyTuple_GET_ITEM(r, 1); co = PyTuple_GET_ITEM(r, 2);
        if (as_u64(ho, &h) < 0 || (ko != Py_None && as_u64(ko, &key) < 0)) goto fail;
        if (!PyLong_Check(co) || as_u64(co, &copies) < 0 || copies < 1 || copies >= KEYLESS_BIT) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "copies must be in [1, 2**63)");
            goto fail;
        }
        put_row(p, h, key, copies, ko == Py_None);
    }
    Py_DECREF(f);
    return out;
fail:
    Py_DECREF(f);
    Py_DECREF(out);
    return NULL;
}

/* tiered() -> whether any key is held in a lower tier (cpu, disk). */
static PyObject *core_tiered(Core *c, PyObject *unused) {
    return PyBool_FromLong(c->hold[1].used || c->hold[2].used);
}

static int cmp_depth(const void *a, const void *b) {
    const int32_t *x = a, *y = b; /* (gpu depth, slot) */
    if (x[0] != y[0]) return x[0] > y[0] ? -1 : 1;
    return x[1] < y[1] ? -1 : x[1] > y[1];
}

/* match(keys, allowed) -> [(gpu, cpu, disk, slot)], deepest gpu first, then lowest slot.
 * Each slot's depth in a tier is the longest prefix of keys whose every key it holds in that
 * tier or a faster one (tiers are cumulative); only slots in allowed (an int mask) answer, and
 * only those with a depth >= 1 in some tier are listed. */
/* A walk's keys: a packed buffer of u64s (an array("Q"), read in place) or a sequence of ints
 * (each read when the walk reaches it; one that is not a u64 is a key nobody holds). */
typedef struct {
    Py_buffer view;
    const uint64_t *packed; /* NULL: read from fast */
    PyObject *fast;
    Py_ssize_t n;
} Keys;

static int keys_open(PyObject *o, Keys *k) {
    memset(k, 0, sizeof *k);
    if (kx_u64_view(o, &k->view)) {
        k->packed = k->view.buf;
        k->n = k->view.len / 8;
        return 0;
    }
    if (!(k->fast = PySequence_Fast(o, "keys must be a sequence"))) return -1;
    k->n = PySequence_Fast_GET_SIZE(k->fast);
    return 0;
}

static int key_at(const Keys *k, Py_ssize_t i, uint64_t *key) {
    if (k->packed) { *key = k->packed[i]; return 1; }
    if (as_u64(PySequence_Fast_ITEMS(k->fast)[i], key) == 0) return 1;
    PyErr_Clear();
    return 0;
}

static void keys_close(Keys *k) {
    if (k->packed) PyBuffer_Release(&k->view);
    Py_XDECREF(k->fast);
}

static PyObject *core_match(Core *c, PyObject *args) {
    PyObject *ks, *allowed, *out = NULL;
    Keys kf;
    if (!PyArg_ParseTuple(args, "OO!", &ks, &PyLong_Type, &allowed)) return NULL;
    if (keys_open(ks, &kf) < 0) return NULL;
    uint32_t W = c->masks.W, nwk = c->nwk, tiers = (c->hold[1].used || c->hold[2].used) ? 3 : 1;
    uint64_t *ag = c->acc, *ac = ag + W, *ad = ac + W, *mw = ad + W;
    memset(ag, 0, W * sizeof *ag);
    if (_PyLong_AsByteArray((PyLongObject *)allowed, (unsigned char *)ag, W * 8, 1, 0) < 0) {
        PyErr_Clear(); /* wider than the slots: keep the slots' words */
        PyObject *mask = PyLong_FromUnsignedLongLong(0), *one = PyLong_FromLong(1), *sh = NULL, *lim = NULL;
        if (mask && one) { sh = PyLong_FromUnsignedLong(W * 64); if (sh) lim = PyNumber_Lshift(one, sh); }
        PyObject *m1 = lim ? PyNumber_Subtract(lim, one) : NULL, *cut = m1 ? PyNumber_And(allowed, m1) : NULL;
        int bad = !cut || _PyLong_AsByteArray((PyLongObject *)cut, (unsigned char *)ag, W * 8, 1, 0) < 0;
        Py_XDECREF(mask); Py_XDECREF(one); Py_XDECREF(sh); Py_XDECREF(lim); Py_XDECREF(m1); Py_XDECREF(cut);
        if (bad) { keys_close(&kf); return NULL; }
    }
    if (nwk < W * 64) { /* no bits past the live slots */
        for (uint32_t s = nwk; s < W * 64; s++) ag[s >> 6] &= ~(1ULL << (s & 63));
    }
    memcpy(ac, ag, W * 8);
    memcpy(ad, ag, W * 8);
    if (c->depthcap < 3 * (nwk ? nwk : 1)) {
        int32_t *d = PyMem_Realloc(c->depth, 3 * (size_t)(nwk ? nwk : 1) * sizeof *d);
        if (!d) { keys_close(&kf); return PyErr_NoMemory(); }
        c->depth = d;
        c->depthcap = 3 * (nwk ? nwk : 1);
    }
    int32_t *dg = c->depth, *dc = dg + nwk, *dd = dc + nwk;
    Py_ssize_t n = kf.n, i;
    for (uint32_t s = 0; s < nwk; s++) dg[s] = dc[s] = dd[s] = -1;
    uint64_t *accs[3] = {ag, ac, ad};
    int32_t *deps[3] = {dg, dc, dd};
    for (i = 0; i < n; i++) {
        uint64_t key = 0, any = 0;
        int known = key_at(&kf, i, &key);
        memset(mw, 0, W * 8);
        for (uint32_t t = 0; t < tiers; t++) {
            HEnt *cell = known ? hold_find(&c->hold[t], key) : NULL;
            if (cell) {
                uint32_t ref = cell->r;
                if (ref & SINGLE) { uint32_t s = ref & ~SINGLE; mw[s >> 6] |= 1ULL << (s & 63); }
                else { const uint64_t *src = c->masks.w + (size_t)ref * W; for (uint32_t x = 0; x < W; x++) mw[x] |= src[x]; }
            }
            /* mw: the holders of key in tier t or a faster one */
            uint64_t *acc = accs[t];
            int32_t *dep = deps[t];
            for (uint32_t x = 0; x < W; x++) {
                uint64_t drop = acc[x] & ~mw[x];
                if (drop) {
                    acc[x] &= mw[x];
                    while (drop) { dep[x * 64 + (uint32_t)__builtin_ctzll(drop)] = (int32_t)i; drop &= drop - 1; }
                }
                any |= acc[x];
            }
        }
        if (!any) break;
    }
    /* slots still in after the last key hold the whole prefix */
    for (uint32_t t = 0; t < tiers; t++)
        for (uint32_t x = 0; x < W; x++)
            for (uint64_t b = accs[t][x]; b; b &= b - 1) deps[t][x * 64 + (uint32_t)__builtin_ctzll(b)] = (int32_t)n;
    if (tiers == 1)
        for (uint32_t s = 0; s < nwk; s++) dc[s] = dd[s] = dg[s];
    {
        int32_t *pairs = PyMem_Malloc(2 * (size_t)(nwk ? nwk : 1) * sizeof *pairs);
        if (!pairs) { PyErr_NoMemory(); goto done; }
        size_t np = 0;
        for (uint32_t s = 0; s < nwk; s++)
            if (dd[s] > 0) { pairs[2 * np] = dg[s] < 0 ? 0 : dg[s]; pairs[2 * np + 1] = (int32_t)s; np++; }
        qsort(pairs, np, 2 * sizeof *pairs, cmp_depth);
        out = PyList_New((Py_ssize_t)np);
        for (size_t j = 0; out && j < np; j++) {
            uint32_t s = (uint32_t)pairs[2 * j + 1];
            PyObject *row = Py_BuildValue("(iiiI)", pairs[2 * j], dc[s] < 0 ? 0 : dc[s], dd[s], s);
            if (!row) { Py_CLEAR(out); break; }
            PyList_SET_ITEM(out, (Py_ssize_t)j, row);
        }
        PyMem_Free(pairs);
    }
done:
    keys_close(&kf);
    return out;
}

/* holders(tier, key) -> [slot]: who holds key in tier (for tests and /dump). */
static PyObject *core_holders(Core *c, PyObject *args) {
    int tier;
    PyObject *ko;
    uint64_t key;
    if (!PyArg_ParseTuple(args, "iO", &tier, &ko) || as_u64(ko, &key) < 0) return NULL;
    if (tier < 0 || tier >= NTIERS) return PyErr_Format(PyExc_ValueError, "tier %d", tier);
    PyObject *out = PyList_New(0);
    HEnt *cell = hold_find(&c->hold[tier], key);
    if (!out || !cell) return out;
    ref_words(c, cell->r, c->tmp);
    for (uint32_t x = 0; x < c->masks.W; x++)
        for (uint64_t b = c->tmp[x]; b; b &= b - 1) {
            PyObject *s = PyLong_FromUnsignedLong(x * 64 + (uint32_t)__builtin_ctzll(b));
            if (!s || PyList_Append(out, s) < 0) { Py_XDECREF(s); Py_DECREF(out); return NULL; }
            Py_DECREF(s);
        }
    return out;
}

/* stats() -> {name: int}: sizes, for tests and the memory benchmark. */
static PyObject *core_stats(Core *c, PyObject *unused) {
    size_t bytes = 0, entries = 0, side = 0;
    for (uint32_t i = 0; i < c->nwk; i++)
        for (int32_t j = 0; j < c->wk[i].nmed; j++) {
            Tab *t = &c->wk[i].med[j].t;
            bytes += (t->e ? ((size_t)1 << t->bits) * sizeof(Ent) : 0) + (t->side.e ? ((size_t)1 << t->side.bits) * sizeof(SEnt) : 0);
            entries += t->used;
            side += t->side.used;
        }
    size_t keys = 0;
    for (int t = 0; t < NTIERS; t++) {
        keys += c->hold[t].used;
        bytes += c->hold[t].e ? ((size_t)1 << c->hold[t].bits) * sizeof(HEnt) : 0;
    }
    size_t live = 0;
    for (uint32_t id = 1; id < c->masks.n; id++) live += c->masks.rc[id] != 0;
    bytes += (size_t)c->masks.cap * (c->masks.W * 8 + 16) + (c->masks.map ? ((size_t)1 << c->masks.mbits) * 4 : 0);
    bytes += c->dups.e ? ((size_t)1 << c->dups.bits) * sizeof(DEnt) : 0;
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n}", "bytes", (Py_ssize_t)bytes, "entries", (Py_ssize_t)entries,
                         "side", (Py_ssize_t)side, "keys", (Py_ssize_t)keys, "masks", (Py_ssize_t)live,
                         "dups", (Py_ssize_t)c->dups.used);
}

/* reserve(slot, mid, tier, n): room for n more entries in the medium (and its tier's keys). */
static PyObject *core_reserve(Core *c, PyObject *args) {
    Py_ssize_t slot, n;
    int mid, tier;
    if (!PyArg_ParseTuple(args, "niin", &slot, &mid, &tier, &n)) return NULL;
    if (tier < 0 || tier >= NTIERS || n < 0) return PyErr_Format(PyExc_ValueError, "tier %d, n %zd", tier, n);
    Wk *w = worker(c, slot);
    Med *m = w ? medium(w, mid, tier, 1) : NULL;
    if (!m || tab_reserve(&m->t, (size_t)n) < 0 || hold_reserve(&c->hold[tier], (size_t)n) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"new_worker", (PyCFunction)core_new_worker, METH_NOARGS, "new_worker() -> slot"},
    {"free_worker", (PyCFunction)core_free_worker, METH_O, "free_worker(slot): forget all it holds"},
    {"store", (PyCFunction)core_store, METH_VARARGS, "store(slot, mid, tier, hashes, keys, parentless) -> (orphans, reannounced)"},
    {"store_tokens", (PyCFunction)core_store_tokens, METH_VARARGS,
     "store_tokens(slot, tier, hashes, parent, root, tokens, block_size) -> (orphans, reannounced)"},
    {"apply_device", (PyCFunction)core_apply_device, METH_VARARGS,
     "apply_device(slot, tier, events, start, block_size, root, stored_type, removed_type, gpu) -> (stop, counts...)"},
    {"remove", (PyCFunction)core_remove, METH_VARARGS, "remove(slot, mid, hashes) -> removed"},
    {"empty", (PyCFunction)core_empty, METH_O, "empty(slot) -> bool"},
    {"key_of", (PyCFunction)core_key_of, METH_VARARGS, "key_of(slot, hash) -> key or None"},
    {"media", (PyCFunction)core_media, METH_O, "media(slot) -> ([(mid, entries, copies)], orphans)"},
    {"export", (PyCFunction)core_export, METH_VARARGS, "export(slot, mid) -> snapshot rows"},
    {"load", (PyCFunction)core_load, METH_VARARGS, "load(slot, mid, tier, rows) -> n"},
    {"reserve", (PyCFunction)core_reserve, METH_VARARGS, "reserve(slot, mid, tier, n)"},
    {"tiered", (PyCFunction)core_tiered, METH_NOARGS, "tiered() -> bool"},
    {"match", (PyCFunction)core_match, METH_VARARGS, "match(keys, allowed) -> [(gpu, cpu, disk, slot)]"},
    {"holders", (PyCFunction)core_holders, METH_VARARGS, "holders(tier, key) -> [slot]"},
    {"stats", (PyCFunction)core_stats, METH_NOARGS, "stats() -> dict"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvindex.index._core.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The precise index's memory: workers' hash -> key tables, per-tier holders, and the walk.",
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_methods = core_methods,
};

static PyMethodDef module_methods[] = {
    {"rows", (PyCFunction)core_rows, METH_O, "rows(data) -> [(hash, key or None, copies)]"},
    {"pack", (PyCFunction)core_pack, METH_O, "pack(rows) -> snapshot rows"},
    {"check", (PyCFunction)core_check, METH_O, "check(data) -> the number of well-formed rows (else ValueError)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvindex.index._core", NULL, -1, module_methods};

PyMODINIT_FUNC PyInit__core(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    if (!(S_hashes = PyUnicode_InternFromString("block_hashes")) || !(S_parent = PyUnicode_InternFromString("parent_hash")) ||
        !(S_tokens = PyUnicode_InternFromString("token_ids")) || !(S_size = PyUnicode_InternFromString("block_size")) ||
        !(S_medium = PyUnicode_InternFromString("medium")) || !(S_lora = PyUnicode_InternFromString("lora_name")) ||
        !(S_salt = PyUnicode_InternFromString("cache_salt")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0 || PyModule_AddIntConstant(m, "ROW", ROW) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
