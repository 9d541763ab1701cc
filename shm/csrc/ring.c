/* Ring: the ready ring's two sides (the protocol is shm/ring.py's). The keeper
 * publishes each batch into the inactive one of two buffers and flips; claimants
 * fetch-add the active buffer's cursor and keep what they copied only if the
 * buffer's generation held still. */
#include "atomics.h"

#include <string.h>

/* Control block, in words. Hot words sit on cache lines of their own: the
 * cursors take every claimant's fetch-add; the per-buffer descriptors are
 * written once per publish and read by every claim. */
enum {
    RING_ACTIVE = 0,
    RING_BUF0 = 8,   /* gen, count, published_at, arena_used */
    RING_CURSOR0 = 16,
    RING_BUF1 = 24,
    RING_CURSOR1 = 32,
    RING_GENERATION = 40, /* writer line: generation, entries published, publishes, truncated */
    RING_PUBLISHED = 41,
    RING_PUBLISHES = 42,
    RING_TRUNCATED = 43,
    RING_STRIPES = 48, /* STRIPES x STRIPE_WORDS claimant counters */
    RING_CTRL_WORDS = RING_STRIPES + STRIPES * STRIPE_WORDS,
};
enum { BUF_GEN = 0, BUF_COUNT = 1, BUF_PUBLISHED_AT = 2, BUF_ARENA_USED = 3 };
enum { RS_CLAIMED = 0, RS_CLAIM_CALLS = 1, RS_TORN = 2, RS_STALE = 3, RS_EMPTY = 4 };

#define RING_KEY_MAX 2048
#define RING_MAX_ATTEMPTS 64

typedef struct {
    int64_t due_at;
    uint64_t key_hash;
    uint32_t key_off;
    uint32_t key_len;
    int32_t class_id;
    uint32_t cadence_s; /* the row's effective cadence at publish; 0: not known */
    uint64_t site_hash; /* the key's site (shm/keys.py site_hash); 0: no site */
} ring_entry;

_Static_assert(sizeof(ring_entry) == 40, "ring entry is 40 bytes");

/* A claim copies entries and keys here first and builds Python objects only after
 * the generation check, so a torn copy never becomes an object. */
typedef struct {
    ring_entry *entries;
    char *keys;
    uint64_t cap, keys_cap;
} scratch_t;

static void
scratch_free(scratch_t *sc)
{
    PyMem_Free(sc->entries);
    PyMem_Free(sc->keys);
    memset(sc, 0, sizeof(*sc));
}

static int
scratch_reserve(scratch_t *sc, uint64_t n, uint64_t key_bytes)
{
    if (n > sc->cap) {
        ring_entry *p = PyMem_Realloc(sc->entries, n * sizeof(ring_entry));
        if (p == NULL) goto nomem;
        sc->entries = p;
        sc->cap = n;
    }
    if (sc->keys == NULL || key_bytes > sc->keys_cap) {
        uint64_t size = key_bytes > sc->keys_cap ? key_bytes : (sc->keys_cap ? sc->keys_cap : 64);
        char *p = PyMem_Realloc(sc->keys, size);
        if (p == NULL) goto nomem;
        sc->keys = p;
        sc->keys_cap = size;
    }
    return 0;
nomem:
    PyErr_NoMemory();
    return -1;
}

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    aword *ctrl;
    char *entries; /* 2 x capacity entries */
    char *arena;   /* 2 x arena_bytes */
    uint64_t capacity;
    uint64_t arena_bytes;
    PyObject *factory;
    aword *stripe;
    scratch_t scratch; /* reused between claims; a claim takes it while it runs */
} RingObject;

static int
Ring_init(RingObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "ctrl_offset", "entries_offset", "arena_offset",
                             "capacity", "arena_bytes", "factory", NULL};
    PyObject *obj, *factory;
    Py_ssize_t ctrl_off, entries_off, arena_off, capacity, arena_bytes;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnnnnnO", kwlist, &obj, &ctrl_off,
                                     &entries_off, &arena_off, &capacity, &arena_bytes,
                                     &factory)) {
        return -1;
    }
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "Ring is already initialised");
        return -1;
    }
    if (capacity <= 0 || capacity > (Py_ssize_t)UINT32_MAX || arena_bytes <= 0 ||
        arena_bytes > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "ring capacity and arena must be in 1..2**32-1");
        return -1;
    }
    char *base;
    Py_ssize_t length;
    if (shm_acquire_region(obj, 0, -1, &self->view, &base, &length) < 0) return -1;
    self->held = 1;
    Py_ssize_t need_ctrl = ctrl_off + RING_CTRL_WORDS * 8;
    Py_ssize_t need_entries = entries_off + 2 * capacity * (Py_ssize_t)sizeof(ring_entry);
    Py_ssize_t need_arena = arena_off + 2 * arena_bytes;
    if (ctrl_off < 0 || entries_off < 0 || arena_off < 0 || (ctrl_off & 63) ||
        (entries_off & 7) || need_ctrl > length || need_entries > length || need_arena > length) {
        PyErr_Format(PyExc_ValueError,
                     "ring layout (ctrl %zd, entries %zd, arena %zd; capacity %zd, arena %zd "
                     "bytes) does not fit a buffer of %zd bytes with aligned words",
                     ctrl_off, entries_off, arena_off, capacity, arena_bytes, length);
        PyBuffer_Release(&self->view);
        self->held = 0;
        return -1;
    }
    self->ctrl = (aword *)(base + ctrl_off);
    self->entries = base + entries_off;
    self->arena = base + arena_off;
    self->capacity = (uint64_t)capacity;
    self->arena_bytes = (uint64_t)arena_bytes;
    Py_INCREF(factory);
    self->factory = factory;
    self->stripe = self->ctrl + RING_STRIPES + stripe_of_process() * STRIPE_WORDS;
    return 0;
}

static void
Ring_dealloc(RingObject *self)
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    Py_CLEAR(self->factory);
    scratch_free(&self->scratch);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline aword *
ring_buf(RingObject *self, uint64_t b)
{
    return self->ctrl + (b ? RING_BUF1 : RING_BUF0);
}

static inline aword *
ring_cursor(RingObject *self, uint64_t b)
{
    return self->ctrl + (b ? RING_CURSOR1 : RING_CURSOR0);
}

/* claim(n) -> list of factory(key, due_at, class_id, key_hash, cadence_s).
 *
 * The cursor word packs (generation tag << 32 | index). A fetch-add returns the
 * old word, so a claimant learns which generation its reservation belongs to:
 * it copies the entries, then accepts them only if the buffer's generation
 * equals that tag and did not change during the copy. A reservation made on a
 * superseded generation is dropped (that generation is gone anyway); one made
 * on the live generation is always honoured, because the writer resets the
 * cursor only after the buffer's generation is final. */
static int64_t
claim_copy(RingObject *self, uint64_t n, scratch_t *sc, uint64_t *key_bytes_out)
{
    atomic_fetch_add_explicit(&self->stripe[RS_CLAIM_CALLS], 1, memory_order_relaxed);
    if (scratch_reserve(sc, n, 0) < 0) return -1;
    *key_bytes_out = 0;
    uint64_t got = 0;
    for (int attempt = 0; attempt < RING_MAX_ATTEMPTS; attempt++) {
        uint64_t b = LOAD(&self->ctrl[RING_ACTIVE]) & 1u;
        aword *desc = ring_buf(self, b);
        aword *cursor = ring_cursor(self, b);
        uint64_t g = LOAD(&desc[BUF_GEN]);
        if (g == 0) {
            if (LOAD(&self->ctrl[RING_GENERATION]) == 0) break; /* nothing published yet */
            atomic_fetch_add_explicit(&self->stripe[RS_TORN], 1, memory_order_relaxed);
            continue;
        }
        uint64_t count = LOAD(&desc[BUF_COUNT]);
        uint64_t cur = LOAD(cursor);
        if ((cur >> 32) == (g & 0xffffffffu) && (cur & 0xffffffffu) >= count) {
            /* Drained: do not fetch-add, so an idle ring never runs its cursor up. */
            if (LOAD(&desc[BUF_GEN]) == g && (LOAD(&self->ctrl[RING_ACTIVE]) & 1u) == b) break;
            continue;
        }
        uint64_t old = atomic_fetch_add_explicit(cursor, n, memory_order_seq_cst);
        uint64_t g1 = LOAD(&desc[BUF_GEN]);
        uint64_t tag = old >> 32, idx = old & 0xffffffffu;
        if (g1 == 0 || tag != (g1 & 0xffffffffu)) {
            atomic_fetch_add_explicit(&self->stripe[RS_STALE], 1, memory_order_relaxed);
            continue;
        }
        count = LOAD(&desc[BUF_COUNT]);
        if (count > self->capacity) count = self->capacity; /* torn; rejected below */
        if (idx >= count) {
            if (LOAD(&desc[BUF_GEN]) == g1) break;
            continue;
        }
        uint64_t end = idx + n < count ? idx + n : count;
        got = end - idx;
        const ring_entry *src = (const ring_entry *)(self->entries + b * self->capacity *
                                                                       sizeof(ring_entry));
        memcpy(sc->entries, src + idx, got * sizeof(ring_entry));
        uint64_t key_bytes = 0;
        int bad = 0;
        for (uint64_t i = 0; i < got; i++) {
            const ring_entry *e = &sc->entries[i];
            if (e->key_len > RING_KEY_MAX ||
                (uint64_t)e->key_off + e->key_len > self->arena_bytes) {
                bad = 1; /* only a torn copy can look like this; the check keeps memcpy inside */
                break;
            }
            key_bytes += e->key_len;
        }
        if (!bad) {
            if (scratch_reserve(sc, 0, key_bytes) < 0) return -1;
            const char *arena = self->arena + b * self->arena_bytes;
            char *dst = sc->keys;
            for (uint64_t i = 0; i < got; i++) {
                const ring_entry *e = &sc->entries[i];
                memcpy(dst, arena + e->key_off, e->key_len);
                dst += e->key_len;
            }
            *key_bytes_out = key_bytes;
        }
        atomic_thread_fence(memory_order_acquire);
        uint64_t g2 = atomic_load_explicit(&desc[BUF_GEN], memory_order_relaxed);
        if (g2 != g1 || bad) {
            atomic_fetch_add_explicit(&self->stripe[RS_TORN], 1, memory_order_relaxed);
            got = 0;
            continue;
        }
        break;
    }
    if (got == 0) {
        atomic_fetch_add_explicit(&self->stripe[RS_EMPTY], 1, memory_order_relaxed);
        return 0;
    }
    atomic_fetch_add_explicit(&self->stripe[RS_CLAIMED], got, memory_order_relaxed);
    /* Each copied entry's key_off now names its key in the scratch's keys (claim_batch
     * hands them out together); the arena's offsets are no longer needed. */
    uint64_t at = 0;
    for (uint64_t i = 0; i < got; i++) {
        sc->entries[i].key_off = (uint32_t)at;
        at += sc->entries[i].key_len;
    }
    return (int64_t)got;
}

/* The claim's count, clamped to the ring; -1 with an error set, 0 for nothing. */
static int64_t
claim_want(PyObject *arg, uint64_t capacity)
{
    Py_ssize_t want = PyLong_AsSsize_t(arg);
    if (want == -1 && PyErr_Occurred()) return -1;
    if (want <= 0) return 0;
    return (uint64_t)want > capacity ? (int64_t)capacity : (int64_t)want;
}

/* Give the scratch back unless a nested claim already did, or it grew large. */
static void
scratch_return(RingObject *self, scratch_t *sc)
{
    if (self->scratch.entries == NULL && self->scratch.keys == NULL && sc->cap <= 4096 &&
        sc->keys_cap <= 4096 * 256) {
        self->scratch = *sc;
    } else {
        scratch_free(sc);
    }
}

static PyObject *
Ring_claim(RingObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("claim", nargs, 1) < 0) return NULL;
    if (!self->held) return shm_released_error();
    int64_t want = claim_want(args[0], self->capacity);
    if (want < 0) return NULL;
    if (want == 0) return PyList_New(0);
    /* Taken, not borrowed: building objects can run arbitrary Python (a finalizer,
     * another thread), which may claim on this ring meanwhile. */
    scratch_t sc = self->scratch;
    memset(&self->scratch, 0, sizeof(self->scratch));
    PyObject *out = NULL;
    uint64_t key_bytes;
    int64_t copied = claim_copy(self, (uint64_t)want, &sc, &key_bytes);
    if (copied < 0) goto done;
    uint64_t got = (uint64_t)copied;
    if (got == 0) {
        out = PyList_New(0);
        goto done;
    }
    out = PyList_New((Py_ssize_t)got);
    if (out == NULL) goto done;
    const char *kp = sc.keys;
    for (uint64_t i = 0; i < got; i++) {
        const ring_entry *e = &sc.entries[i];
        PyObject *fields[6];
        fields[0] = PyBytes_FromStringAndSize(kp, e->key_len);
        fields[1] = PyLong_FromLongLong(e->due_at);
        fields[2] = PyLong_FromLong(e->class_id);
        fields[3] = PyLong_FromUnsignedLongLong(e->key_hash);
        fields[4] = PyLong_FromUnsignedLong(e->cadence_s);
        fields[5] = PyLong_FromUnsignedLongLong(e->site_hash);
        kp += e->key_len;
        PyObject *item = NULL;
        if (fields[0] && fields[1] && fields[2] && fields[3] && fields[4] && fields[5]) {
            item = PyObject_Vectorcall(self->factory, fields, 6, NULL);
        }
        for (int f = 0; f < 6; f++) Py_XDECREF(fields[f]);
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
done:
    scratch_return(self, &sc);
    return out;
}

/* claim_batch(n) -> (entries, keys): claim()'s entries as one bytes of ring entries
 * (RING_LAYOUT's entry layout; each key_off names its key in `keys`, not in the arena)
 * and one bytes of their keys, end to end: two objects per claim, none per entry. */
static PyObject *
Ring_claim_batch(RingObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("claim_batch", nargs, 1) < 0) return NULL;
    if (!self->held) return shm_released_error();
    int64_t want = claim_want(args[0], self->capacity);
    if (want < 0) return NULL;
    scratch_t sc = self->scratch;
    memset(&self->scratch, 0, sizeof(self->scratch));
    PyObject *out = NULL;
    uint64_t key_bytes = 0;
    int64_t got = want == 0 ? 0 : claim_copy(self, (uint64_t)want, &sc, &key_bytes);
    if (got >= 0) {
        out = Py_BuildValue("(y#y#)", got ? (const char *)sc.entries : "",
                            (Py_ssize_t)((uint64_t)got * sizeof(ring_entry)),
                            got ? sc.keys : "", (Py_ssize_t)key_bytes);
    }
    scratch_return(self, &sc);
    return out;
}

/* keys_of(entries, keys, indexes) -> list[str]: the keys of claim_batch's entries at
 * `indexes` (int64), decoded from UTF-8: a str only for the entries a claim answers. */
static PyObject *
Ring_keys_of(RingObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (check_nargs("keys_of", nargs, 3) < 0) return NULL;
    Py_buffer entries, keys, indexes;
    if (PyObject_GetBuffer(args[0], &entries, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &keys, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&entries);
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &indexes, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&entries);
        PyBuffer_Release(&keys);
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t count = entries.len / (Py_ssize_t)sizeof(ring_entry);
    Py_ssize_t n = indexes.len / 8;
    if (entries.len % (Py_ssize_t)sizeof(ring_entry) || (indexes.len & 7) ||
        ((uintptr_t)indexes.buf & 7u)) {
        PyErr_SetString(PyExc_ValueError, "keys_of wants claim_batch's entries and int64 indexes");
        goto done;
    }
    out = PyList_New(n);
    if (out == NULL) goto done;
    const int64_t *at = indexes.buf;
    for (Py_ssize_t j = 0; j < n; j++) {
        ring_entry e;
        if (at[j] < 0 || at[j] >= count) {
            PyErr_Format(PyExc_IndexError, "entry %lld of %zd", (long long)at[j], count);
            Py_CLEAR(out);
            goto done;
        }
        memcpy(&e, (const char *)entries.buf + at[j] * (Py_ssize_t)sizeof(ring_entry), sizeof(e));
        if ((Py_ssize_t)e.key_off + (Py_ssize_t)e.key_len > keys.len) {
            PyErr_SetString(PyExc_ValueError, "keys_of: an entry's key lies outside the keys");
            Py_CLEAR(out);
            goto done;
        }
        PyObject *key = PyUnicode_DecodeUTF8((const char *)keys.buf + e.key_off, e.key_len, NULL);
        if (key == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, j, key);
    }
done:
    PyBuffer_Release(&entries);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&indexes);
    return out;
}

static PyObject *
Ring_remaining(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->held) return shm_released_error();
    for (int attempt = 0; attempt < RING_MAX_ATTEMPTS; attempt++) {
        uint64_t b = LOAD(&self->ctrl[RING_ACTIVE]) & 1u;
        aword *desc = ring_buf(self, b);
        uint64_t g = LOAD(&desc[BUF_GEN]);
        if (g == 0) {
            if (LOAD(&self->ctrl[RING_GENERATION]) == 0) return PyLong_FromLong(0);
            continue;
        }
        uint64_t count = LOAD(&desc[BUF_COUNT]);
        uint64_t cur = LOAD(ring_cursor(self, b));
        if (LOAD(&desc[BUF_GEN]) != g) continue;
        if ((cur >> 32) != (g & 0xffffffffu)) continue;
        uint64_t idx = cur & 0xffffffffu;
        return PyLong_FromUnsignedLongLong(idx >= count ? 0 : count - idx);
    }
    return PyLong_FromLong(0);
}

/* publish(source, starts_i64, lengths_i64, due_i64, class_i32, hash_u64, cadence_u32 | None,
 *         site_hash_u64 | None, now) -> (generation, written)
 *
 * The writer's side of the ring (the protocol is shm/ring.py's), for keys that are
 * slices of one buffer: key i is source[starts[i] : starts[i] + lengths[i]]. The
 * keeper's keys already sit in its slot table's arena, so they are copied from
 * there into the inactive buffer's arena with no bytes object per key (a list of
 * them and a join would hold the GIL of the worker that also serves claims). Every
 * key is checked before anything is written, so a refused batch leaves the ring as
 * it was. The prefix that fits the ring's capacity and arena is written; the rest is
 * counted as truncated. Single writer. */
static PyObject *
Ring_publish(RingObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("publish", nargs, 9) < 0) return NULL;
    if (!self->held) return shm_released_error();
    int64_t now;
    if (parse_i64(args[8], &now) < 0) return NULL;
    enum { N_COLS = 7, FIRST_OPTIONAL = 5 };
    static const Py_ssize_t sizes[N_COLS] = {8, 8, 8, 4, 8, 4, 8};
    static const char *const names[N_COLS] = {"starts",   "lengths",   "due_at",   "class_id",
                                              "key_hash", "cadence_s", "site_hash"};
    Py_buffer src, cols[N_COLS];
    int given[N_COLS] = {0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n_in = -1;
    for (int c = 0; c < N_COLS; c++) {
        if (c >= FIRST_OPTIONAL && args[1 + c] == Py_None) continue;
        if (PyObject_GetBuffer(args[1 + c], &cols[c], PyBUF_C_CONTIGUOUS) < 0) goto done;
        given[c] = 1;
        Py_ssize_t n = cols[c].len / sizes[c];
        if (cols[c].len % sizes[c] || (n && ((uintptr_t)cols[c].buf % (uintptr_t)sizes[c]))) {
            PyErr_Format(PyExc_ValueError, "publish: %s is not an aligned array of %zd-byte items",
                         names[c], sizes[c]);
            goto done;
        }
        if (n_in < 0) n_in = n;
        if (n != n_in) {
            PyErr_Format(PyExc_ValueError, "publish: %zd starts but %zd %s", n_in, n, names[c]);
            goto done;
        }
    }
    const int64_t *starts = cols[0].buf, *lengths = cols[1].buf, *due = cols[2].buf;
    const int32_t *class_id = cols[3].buf;
    const uint64_t *hashes = cols[4].buf;
    const uint32_t *cadence = given[5] ? cols[5].buf : NULL;
    const uint64_t *sites = given[6] ? cols[6].buf : NULL;
    const char *source = src.buf;

    /* Check every key (as the list path does), and find the prefix that fits. */
    uint64_t n = 0, used = 0;
    int cut = 0;
    for (Py_ssize_t i = 0; i < n_in; i++) {
        int64_t len = lengths[i], start = starts[i];
        if (len < 0 || len > RING_KEY_MAX) {
            PyErr_Format(PyExc_ValueError, "publish: key %zd is %lld bytes; at most %d", i,
                         (long long)len, RING_KEY_MAX);
            goto done;
        }
        if (start < 0 || start > (int64_t)src.len - len) {
            PyErr_Format(PyExc_ValueError,
                         "publish: key %zd (%lld bytes at %lld) lies outside a source of %zd "
                         "bytes",
                         i, (long long)len, (long long)start, src.len);
            goto done;
        }
        if (!cut && (uint64_t)i < self->capacity && used + (uint64_t)len <= self->arena_bytes) {
            used += (uint64_t)len;
            n = (uint64_t)i + 1;
        } else {
            cut = 1;
        }
    }

    uint64_t b = 1 - (LOAD(&self->ctrl[RING_ACTIVE]) & 1u);
    aword *desc = ring_buf(self, b);
    /* Generation 0 first, and a fence so no entry or key store can overtake it: a
     * claimant that copies while this runs sees 0 or a changed generation. */
    atomic_store_explicit(&desc[BUF_GEN], 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    ring_entry *entries = (ring_entry *)(self->entries + b * self->capacity * sizeof(ring_entry));
    char *arena = self->arena + b * self->arena_bytes;
    uint64_t off = 0;
    for (uint64_t i = 0; i < n; i++) {
        /* The keys lie all over the keeper's arena, far larger than the caches: ask
         * for a later key's first lines while this one is copied. */
        if (i + 8 < n) {
            const char *later = source + starts[i + 8];
            __builtin_prefetch(later);
            if (lengths[i + 8] > 0) __builtin_prefetch(later + lengths[i + 8] - 1);
        }
        ring_entry *e = &entries[i];
        uint32_t len = (uint32_t)lengths[i];
        e->due_at = due[i];
        e->key_hash = hashes[i];
        e->key_off = (uint32_t)off;
        e->key_len = len;
        e->class_id = class_id[i];
        e->cadence_s = cadence ? cadence[i] : 0;
        e->site_hash = sites ? sites[i] : 0;
        memcpy(arena + off, source + starts[i], len);
        off += len;
    }
    STORE(&desc[BUF_COUNT], n);
    STORE(&desc[BUF_PUBLISHED_AT], (uint64_t)now);
    STORE(&desc[BUF_ARENA_USED], used);
    uint64_t generation = LOAD(&self->ctrl[RING_GENERATION]) + 1;
    STORE(&desc[BUF_GEN], generation);
    STORE(ring_cursor(self, b), (generation & 0xffffffffu) << 32);
    STORE(&self->ctrl[RING_ACTIVE], b);
    STORE(&self->ctrl[RING_GENERATION], generation);
    atomic_fetch_add_explicit(&self->ctrl[RING_PUBLISHED], n, memory_order_seq_cst);
    atomic_fetch_add_explicit(&self->ctrl[RING_PUBLISHES], 1, memory_order_seq_cst);
    atomic_fetch_add_explicit(&self->ctrl[RING_TRUNCATED], (uint64_t)n_in - n,
                              memory_order_seq_cst);
    result = Py_BuildValue("(KK)", (unsigned long long)generation, (unsigned long long)n);
done:
    for (int c = 0; c < N_COLS; c++) {
        if (given[c]) PyBuffer_Release(&cols[c]);
    }
    PyBuffer_Release(&src);
    return result;
}

static PyObject *
Ring_release(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        self->ctrl = NULL;
        self->entries = self->arena = NULL;
    }
    scratch_free(&self->scratch);
    Py_RETURN_NONE;
}

static PyMethodDef Ring_methods[] = {
    {"publish", (PyCFunction)(void (*)(void))Ring_publish, METH_FASTCALL,
     "publish($self, source, starts, lengths, due_at, class_id, key_hash, cadence_s, site_hash, now, /)\n--\n\npublish(source, starts, lengths, due_at, class_id, key_hash, cadence_s | None, site_hash | None, now) -> "
     "(generation, written): the writer's side, keys as slices of one buffer."},
    {"claim", (PyCFunction)(void (*)(void))Ring_claim, METH_FASTCALL,
     "claim($self, n, /)\n--\n\nclaim(n) -> list: up to n entries of the active buffer, in order, each to one claimant."},
    {"claim_batch", (PyCFunction)(void (*)(void))Ring_claim_batch, METH_FASTCALL,
     "claim_batch($self, n, /)\n--\n\nclaim_batch(n) -> (entries, keys): claim(n) as two bytes objects."},
    {"keys_of", (PyCFunction)(void (*)(void))Ring_keys_of, METH_FASTCALL,
     "keys_of($self, entries, keys, indexes, /)\n--\n\nkeys_of(entries, keys, indexes) -> list[str]: the keys of claim_batch's entries at indexes."},
    {"remaining", (PyCFunction)Ring_remaining, METH_NOARGS,
     "remaining($self)\n--\n\nremaining() -> int: unclaimed entries in the active buffer."},
    {"release", (PyCFunction)Ring_release, METH_NOARGS, "release($self)\n--\n\nGive the buffer back (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shm._atomics.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(buffer, ctrl_offset, entries_offset, arena_offset, capacity, arena_bytes, factory)\n--\n\n"
              "The ready ring's publish and claim paths.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
};

int
shm_ring_add(PyObject *m)
{
    if (PyType_Ready(&RingType) < 0) return -1;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        return -1;
    }
    static const char *const ring_keys[] = {
        "active", "buf0", "cursor0", "buf1", "cursor1", "generation", "published",
        "publishes", "truncated", "stripes", "ctrl_words", "buf_gen", "buf_count",
        "buf_published_at", "buf_arena_used", "s_claimed", "s_claim_calls", "s_torn",
        "s_stale", "s_empty", "entry_size", "entry_due_at", "entry_key_hash", "entry_key_off",
        "entry_key_len", "entry_class_id", "entry_cadence_s", "entry_site_hash", "key_max",
    };
    static const long ring_values[] = {
        RING_ACTIVE, RING_BUF0, RING_CURSOR0, RING_BUF1, RING_CURSOR1, RING_GENERATION,
        RING_PUBLISHED, RING_PUBLISHES, RING_TRUNCATED, RING_STRIPES, RING_CTRL_WORDS, BUF_GEN,
        BUF_COUNT, BUF_PUBLISHED_AT, BUF_ARENA_USED, RS_CLAIMED, RS_CLAIM_CALLS, RS_TORN,
        RS_STALE, RS_EMPTY, (long)sizeof(ring_entry), (long)offsetof(ring_entry, due_at),
        (long)offsetof(ring_entry, key_hash), (long)offsetof(ring_entry, key_off),
        (long)offsetof(ring_entry, key_len), (long)offsetof(ring_entry, class_id),
        (long)offsetof(ring_entry, cadence_s), (long)offsetof(ring_entry, site_hash),
        RING_KEY_MAX,
    };
    _Static_assert(sizeof(ring_keys) / sizeof(ring_keys[0]) ==
                       sizeof(ring_values) / sizeof(ring_values[0]),
                   "ring layout table");
    return shm_add_layout(m, "RING_LAYOUT", ring_keys, ring_values,
                          (int)(sizeof(ring_values) / sizeof(ring_values[0])));
}
