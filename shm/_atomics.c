/* C11 atomics on 8-byte words of a shared buffer, and the hot paths built on them.
 *
 * Python has no atomic operations on shared memory. Each object here acquires
 * its buffer (an mmap of a POSIX shared memory segment) once, at construction,
 * where bounds and alignment are checked; every operation after that is a
 * METH_FASTCALL call doing a single C11 atomic on a word that is known to lie
 * inside the buffer (an index compare stays per call: it costs a nanosecond and
 * keeps a wrong index from becoming a wild write into shared memory).
 * `release()` gives the buffer back so the owner can close the mmap without
 * BufferError.
 *
 *   Words   load-acquire, store-release, fetch-add, compare-and-swap, and a
 *           seqlock copy, on any 8-byte-aligned region.
 *   Ring    the ready ring's claim: fetch-add on the active buffer's cursor,
 *           copy, then check the buffer's generation; and its publish of keys
 *           that are slices of one buffer (see shm/ring.py).
 *   Leases  the lease table's grant / renew / complete / state / blocked mask /
 *           sweep, each one call over the 8-slot probe window (shm/leases.py).
 *   key_hash, key_hashes_into   XXH64 of key bytes, the lease table's key.
 *
 * Layout constants are exported (RING_LAYOUT, LEASE_LAYOUT, ...) so the Python
 * side describes the same words rather than restating them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

typedef _Atomic uint64_t aword;

_Static_assert(sizeof(aword) == 8, "8-byte atomic words");

#define LOAD(p) atomic_load_explicit((p), memory_order_acquire)
#define LOAD_SC(p) atomic_load_explicit((p), memory_order_seq_cst)
#define STORE(p, v) atomic_store_explicit((p), (v), memory_order_release)

static int
cas_word(aword *p, uint64_t expected, uint64_t desired)
{
    return atomic_compare_exchange_strong_explicit(p, &expected, desired, memory_order_seq_cst,
                                                   memory_order_seq_cst);
}

/* ------------------------------------------------------------------ buffers */

/* Acquire a writable, contiguous buffer and check that [offset, offset+nbytes)
 * lies inside it, 8-byte aligned. nbytes < 0 means "to the end". */
static int
acquire_region(PyObject *obj, Py_ssize_t offset, Py_ssize_t nbytes, Py_buffer *view, char **base,
               Py_ssize_t *length)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    if (offset < 0 || offset > view->len) {
        PyErr_Format(PyExc_ValueError, "offset %zd outside a buffer of %zd bytes", offset,
                     view->len);
        goto fail;
    }
    if (nbytes < 0) {
        nbytes = view->len - offset;
    }
    if (nbytes > view->len - offset) {
        PyErr_Format(PyExc_ValueError, "region of %zd bytes at %zd overruns a buffer of %zd bytes",
                     nbytes, offset, view->len);
        goto fail;
    }
    char *p = (char *)view->buf + offset;
    if (((uintptr_t)p & 7u) != 0 || (nbytes & 7) != 0) {
        PyErr_Format(PyExc_ValueError,
                     "region at offset %zd (%zd bytes) is not 8-byte aligned; atomic words "
                     "must never straddle a cache line",
                     offset, nbytes);
        goto fail;
    }
    *base = p;
    *length = nbytes;
    return 0;
fail:
    PyBuffer_Release(view);
    return -1;
}

static int
parse_u64(PyObject *o, uint64_t *out)
{
    /* Mask semantics: negative deltas wrap, which is what fetch_add wants. */
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int
parse_i64(PyObject *o, int64_t *out)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

static int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

static PyObject *
released_error(void)
{
    PyErr_SetString(PyExc_ValueError, "operation on a released shared-memory view");
    return NULL;
}

/* A per-process counter stripe keeps statistics counters from bouncing one cache
 * line between every process; statistics() sums the stripes. */
#define STRIPES 16
#define STRIPE_WORDS 16

static uint64_t
stripe_of_process(void)
{
    return (uint64_t)getpid() % STRIPES;
}

/* ==================================================================== Words */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    aword *words;
    Py_ssize_t nwords;
} WordsObject;

static int
Words_init(WordsObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "offset", "nbytes", NULL};
    PyObject *obj;
    Py_ssize_t offset = 0, nbytes = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|nn", kwlist, &obj, &offset, &nbytes)) {
        return -1;
    }
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    char *base;
    Py_ssize_t length;
    if (acquire_region(obj, offset, nbytes, &self->view, &base, &length) < 0) {
        return -1;
    }
    self->held = 1;
    self->words = (aword *)base;
    self->nwords = length / 8;
    return 0;
}

static void
Words_dealloc(WordsObject *self)
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline aword *
word_at(WordsObject *self, PyObject *index)
{
    if (!self->held) {
        released_error();
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(index);
    if (i == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if ((size_t)i >= (size_t)self->nwords) {
        PyErr_Format(PyExc_IndexError, "word %zd outside a region of %zd words", i, self->nwords);
        return NULL;
    }
    return &self->words[i];
}

static PyObject *
Words_load(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("load", nargs, 1) < 0) return NULL;
    aword *p = word_at(self, args[0]);
    if (p == NULL) return NULL;
    return PyLong_FromUnsignedLongLong(LOAD(p));
}

static PyObject *
Words_store(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("store", nargs, 2) < 0) return NULL;
    aword *p = word_at(self, args[0]);
    uint64_t v;
    if (p == NULL || parse_u64(args[1], &v) < 0) return NULL;
    STORE(p, v);
    Py_RETURN_NONE;
}

static PyObject *
Words_fetch_add(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("fetch_add", nargs, 2) < 0) return NULL;
    aword *p = word_at(self, args[0]);
    uint64_t v;
    if (p == NULL || parse_u64(args[1], &v) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(atomic_fetch_add_explicit(p, v, memory_order_seq_cst));
}

static PyObject *
Words_cas(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("cas", nargs, 3) < 0) return NULL;
    aword *p = word_at(self, args[0]);
    uint64_t expected, desired;
    if (p == NULL || parse_u64(args[1], &expected) < 0 || parse_u64(args[2], &desired) < 0) {
        return NULL;
    }
    return PyBool_FromLong(cas_word(p, expected, desired));
}

/* The seqlock writer's opening move: invalidate the sequence word, then fence so
 * the data stores that follow cannot become visible before it. */
static PyObject *
Words_begin_write(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("begin_write", nargs, 2) < 0) return NULL;
    aword *p = word_at(self, args[0]);
    uint64_t v;
    if (p == NULL || parse_u64(args[1], &v) < 0) return NULL;
    atomic_store_explicit(p, v, memory_order_relaxed);
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

/* Seqlock read of one buffer: (seq, written_at, payload) or None when the copy
 * was torn (sequence 0 = being written, or changed during the copy).
 * args: seq_word, length_word, written_at_word, data_offset_bytes, capacity_bytes;
 * the words and the data are relative to this region. */
static PyObject *
Words_seqlock_read(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("seqlock_read", nargs, 5) < 0) return NULL;
    aword *seq = word_at(self, args[0]);
    if (seq == NULL) return NULL;
    aword *len_w = word_at(self, args[1]);
    if (len_w == NULL) return NULL;
    aword *at_w = word_at(self, args[2]);
    if (at_w == NULL) return NULL;
    Py_ssize_t data_off = PyLong_AsSsize_t(args[3]);
    if (data_off == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t capacity = PyLong_AsSsize_t(args[4]);
    if (capacity == -1 && PyErr_Occurred()) return NULL;
    if (data_off < 0 || capacity < 0 || data_off > self->nwords * 8 ||
        capacity > self->nwords * 8 - data_off) {
        PyErr_SetString(PyExc_IndexError, "seqlock data outside the region");
        return NULL;
    }
    uint64_t s1 = LOAD(seq);
    if (s1 == 0) Py_RETURN_NONE;
    uint64_t n = LOAD(len_w);
    uint64_t at = LOAD(at_w);
    if (n > (uint64_t)capacity) Py_RETURN_NONE; /* torn length: never copy past the buffer */
    PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (payload == NULL) return NULL;
    memcpy(PyBytes_AS_STRING(payload), (char *)self->words + data_off, (size_t)n);
    atomic_thread_fence(memory_order_acquire);
    uint64_t s2 = atomic_load_explicit(seq, memory_order_relaxed);
    if (s1 != s2) {
        Py_DECREF(payload);
        Py_RETURN_NONE;
    }
    PyObject *out = Py_BuildValue("(KKN)", (unsigned long long)s1, (unsigned long long)at, payload);
    return out;
}

static PyObject *
Words_release(WordsObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        self->words = NULL;
        self->nwords = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *
Words_len(WordsObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->held ? self->nwords : 0);
}

static PyObject *
Words_released(WordsObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(!self->held);
}

static PyMethodDef Words_methods[] = {
    {"load", (PyCFunction)(void (*)(void))Words_load, METH_FASTCALL,
     "load(i) -> int: load-acquire of word i."},
    {"store", (PyCFunction)(void (*)(void))Words_store, METH_FASTCALL,
     "store(i, value): store-release of word i."},
    {"fetch_add", (PyCFunction)(void (*)(void))Words_fetch_add, METH_FASTCALL,
     "fetch_add(i, delta) -> int: the old value (64-bit wrapping)."},
    {"cas", (PyCFunction)(void (*)(void))Words_cas, METH_FASTCALL,
     "cas(i, expected, desired) -> bool: compare-and-swap, sequentially consistent."},
    {"begin_write", (PyCFunction)(void (*)(void))Words_begin_write, METH_FASTCALL,
     "begin_write(i, value): seqlock writer's invalidating store, then a full fence."},
    {"seqlock_read", (PyCFunction)(void (*)(void))Words_seqlock_read, METH_FASTCALL,
     "seqlock_read(seq, length, written_at, data_offset, capacity) -> (seq, at, bytes) | None."},
    {"release", (PyCFunction)Words_release, METH_NOARGS,
     "Give the buffer back (idempotent); later operations raise ValueError."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Words_getset[] = {
    {"nwords", (getter)Words_len, NULL, "words in the region (0 once released)", NULL},
    {"released", (getter)Words_released, NULL, "True once release() ran", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WordsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shm._atomics.Words",
    .tp_basicsize = sizeof(WordsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Words(buffer, offset=0, nbytes=-1): atomics on the 8-byte words of a region.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Words_init,
    .tp_dealloc = (destructor)Words_dealloc,
    .tp_methods = Words_methods,
    .tp_getset = Words_getset,
};

/* ===================================================================== Ring */

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
} ring_entry;

_Static_assert(sizeof(ring_entry) == 32, "ring entry is 32 bytes");

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
    if (acquire_region(obj, 0, -1, &self->view, &base, &length) < 0) return -1;
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
static PyObject *
Ring_claim(RingObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("claim", nargs, 1) < 0) return NULL;
    if (!self->held) return released_error();
    Py_ssize_t want = PyLong_AsSsize_t(args[0]);
    if (want == -1 && PyErr_Occurred()) return NULL;
    if (want <= 0) return PyList_New(0);
    if ((uint64_t)want > self->capacity) want = (Py_ssize_t)self->capacity;
    uint64_t n = (uint64_t)want;
    atomic_fetch_add_explicit(&self->stripe[RS_CLAIM_CALLS], 1, memory_order_relaxed);
    /* Taken, not borrowed: building objects can run arbitrary Python (a finalizer,
     * another thread), which may claim on this ring meanwhile. */
    scratch_t sc = self->scratch;
    memset(&self->scratch, 0, sizeof(self->scratch));
    PyObject *out = NULL;
    if (scratch_reserve(&sc, n, 0) < 0) goto done;

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
        memcpy(sc.entries, src + idx, got * sizeof(ring_entry));
        uint64_t key_bytes = 0;
        int bad = 0;
        for (uint64_t i = 0; i < got; i++) {
            const ring_entry *e = &sc.entries[i];
            if (e->key_len > RING_KEY_MAX ||
                (uint64_t)e->key_off + e->key_len > self->arena_bytes) {
                bad = 1; /* only a torn copy can look like this; the check keeps memcpy inside */
                break;
            }
            key_bytes += e->key_len;
        }
        if (!bad) {
            if (scratch_reserve(&sc, 0, key_bytes) < 0) goto done;
            const char *arena = self->arena + b * self->arena_bytes;
            char *dst = sc.keys;
            for (uint64_t i = 0; i < got; i++) {
                const ring_entry *e = &sc.entries[i];
                memcpy(dst, arena + e->key_off, e->key_len);
                dst += e->key_len;
            }
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
        out = PyList_New(0);
        goto done;
    }
    atomic_fetch_add_explicit(&self->stripe[RS_CLAIMED], got, memory_order_relaxed);
    out = PyList_New((Py_ssize_t)got);
    if (out == NULL) goto done;
    const char *kp = sc.keys;
    for (uint64_t i = 0; i < got; i++) {
        const ring_entry *e = &sc.entries[i];
        PyObject *fields[5];
        fields[0] = PyBytes_FromStringAndSize(kp, e->key_len);
        fields[1] = PyLong_FromLongLong(e->due_at);
        fields[2] = PyLong_FromLong(e->class_id);
        fields[3] = PyLong_FromUnsignedLongLong(e->key_hash);
        fields[4] = PyLong_FromUnsignedLong(e->cadence_s);
        kp += e->key_len;
        PyObject *item = NULL;
        if (fields[0] && fields[1] && fields[2] && fields[3] && fields[4]) {
            item = PyObject_Vectorcall(self->factory, fields, 5, NULL);
        }
        for (int f = 0; f < 5; f++) Py_XDECREF(fields[f]);
        if (item == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, item);
    }
done:
    /* Give the scratch back unless a nested claim already did, or it grew large. */
    if (self->scratch.entries == NULL && self->scratch.keys == NULL && sc.cap <= 4096 &&
        sc.keys_cap <= 4096 * 256) {
        self->scratch = sc;
    } else {
        scratch_free(&sc);
    }
    return out;
}

static PyObject *
Ring_remaining(RingObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->held) return released_error();
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
 *         now) -> (generation, written)
 *
 * The writer's side of the ring (the protocol is shm/ring.py's), for keys that are
 * slices of one buffer: key i is source[starts[i] : starts[i] + lengths[i]]. The
 * keeper's keys already sit in its slot table's arena, so they are copied from
 * there into the inactive buffer's arena with no bytes object per key (the list
 * and join took some 4 ms of worker 0's GIL for 8,192 keys). Every key is checked
 * before anything is written, so a refused batch leaves the ring as it was. The
 * prefix that fits the ring's capacity and arena is written; the rest is counted
 * as truncated. Single writer. */
static PyObject *
Ring_publish(RingObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("publish", nargs, 8) < 0) return NULL;
    if (!self->held) return released_error();
    int64_t now;
    if (parse_i64(args[7], &now) < 0) return NULL;
    static const Py_ssize_t sizes[6] = {8, 8, 8, 4, 8, 4};
    static const char *const names[6] = {"starts",   "lengths",  "due_at",
                                         "class_id", "key_hash", "cadence_s"};
    Py_buffer src, cols[6];
    int n_cols = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n_in = -1;
    for (int c = 0; c < 6; c++) {
        if (c == 5 && args[6] == Py_None) break;
        if (PyObject_GetBuffer(args[1 + c], &cols[c], PyBUF_C_CONTIGUOUS) < 0) goto done;
        n_cols++;
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
    const uint32_t *cadence = n_cols == 6 ? cols[5].buf : NULL;
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
        /* The keys lie all over the keeper's arena (75 MB at 1M rows): ask for a later
         * key's first lines while this one is copied. */
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
    while (n_cols > 0) PyBuffer_Release(&cols[--n_cols]);
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
     "publish(source, starts, lengths, due_at, class_id, key_hash, cadence_s | None, now) -> "
     "(generation, written): the writer's side, keys as slices of one buffer."},
    {"claim", (PyCFunction)(void (*)(void))Ring_claim, METH_FASTCALL,
     "claim(n) -> list: up to n entries of the active buffer, in order, each to one claimant."},
    {"remaining", (PyCFunction)Ring_remaining, METH_NOARGS,
     "remaining() -> int: unclaimed entries in the active buffer."},
    {"release", (PyCFunction)Ring_release, METH_NOARGS, "Give the buffer back (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shm._atomics.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Ring(buffer, ctrl_offset, entries_offset, arena_offset, capacity, arena_bytes, "
              "factory): the ready ring's publish and claim paths.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
};

/* =================================================================== Leases */

/* Slot: key hash (0 = empty), state word, hold word, spare. The state word is
 * the only word a grant, renew, complete or settle changes, always by CAS:
 *   bits 0-1  phase: FREE, LEASED, HELD, REMOVING
 *   bits 2-5  misses (saturating at 15)
 *   bits 6-21 token (16 bits, never 0 once granted)
 *   bits 22-63 time in epoch ms (42 bits, to year 2109): LEASED -> expiry,
 *             HELD -> hold end, else 0.
 * The hold word, written by the grant's winner, is (token << 48 | hold_ms): how
 * long the key is held back if this lease expires with no result. */
enum { PH_FREE = 0, PH_LEASED = 1, PH_HELD = 2, PH_REMOVING = 3 };
#define W_PHASE(w) ((w) & 3u)
#define W_MISSES(w) (((w) >> 2) & 15u)
#define W_TOKEN(w) (((w) >> 6) & 0xffffu)
#define W_TIME(w) ((w) >> 22)
#define W_MAKE(ph, m, tok, t)                                                                  \
    ((uint64_t)(ph) | ((uint64_t)(m) << 2) | ((uint64_t)(tok) << 6) | ((uint64_t)(t) << 22))
#define TIME_MAX ((((uint64_t)1) << 42) - 1)
#define HOLD_MASK ((((uint64_t)1) << 48) - 1)
#define MISSES_MAX 15u
#define PROBE 8
/* How long a sweep (by default) and a full window keep an ended hold's misses. */
#define KEEP_MISSES_MS 3600000ull
#define SLOT_WORDS 4
/* SLOT_COUNTED: the HELD state word whose hold the live held counter includes, 0
 * if none (see count_hold / uncount_hold). */
enum { SLOT_KEY = 0, SLOT_STATE = 1, SLOT_HOLD = 2, SLOT_COUNTED = 3 };

enum {
    LEASE_SWEEPER = 0,  /* pid of the process sweeping, 0 when none */
    LEASE_INCARNATION = 1, /* stamps each emptied slot's state word, see remove_slot */
    LEASE_STRIPES = 8,  /* STRIPES x STRIPE_WORDS counters */
    LEASE_CTRL_WORDS = LEASE_STRIPES + STRIPES * STRIPE_WORDS,
};
enum {
    LS_GRANTS = 0,
    LS_RENEWALS = 1,
    LS_COMPLETIONS = 2,
    LS_EXPIRIES = 3,
    LS_HOLD_EVENTS = 4,
    LS_REFUSED_TAKEN = 5,
    LS_REFUSED_HELD = 6,
    LS_REFUSED_PROBE_FULL = 7,
    LS_INSERTS = 8,
    LS_RECLAIMED = 9,
    LS_CONFLICTS = 10,
    LS_STALE_TOKENS = 11,
    LS_SWEEPS = 12,
    /* Live counts, kept by the ops so statistics() never scans the table. In the
     * process stripes like the counters above, so claimants on other cores never
     * share a cache line; each sums (mod 2**64, read as signed) over the stripes, as
     * one process may add what another takes off:
     *   occupied  slots with a key (+1 insert, -1 when a removal clears the key)
     *   leased    slots in phase LEASED (an expired lease stays until settled)
     *   held      settled holds not yet seen ended by a sweep, grant or removal */
    LS_OCCUPIED = 13,
    LS_LEASED = 14,
    LS_HELD = 15,
};
_Static_assert(LS_HELD < STRIPE_WORDS, "live counters inside a stripe");
enum { GRANTED = 0, REFUSED_TAKEN = 1, REFUSED_HELD = 2, REFUSED_PROBE_FULL = 3 };
#define LEASE_MAX_ATTEMPTS 256
/* Tag words for a capacity: one lane per slot, plus a word so a window's two-word
 * read never runs past the end. */
#define LEASE_TAG_WORDS(capacity) (((capacity) + 7) / 8 + 1)

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    aword *ctrl;
    aword *slots;
    /* One byte lane per slot, 8 lanes a word: bit (key hash & 7) of each key the
     * slot held since it was last emptied. A window whose lanes lack the key's bit
     * holds no slot of the key, so blocked_mask skips the probe (see mark_tag). */
    aword *tags;
    uint64_t capacity;
    aword *stripe;
    uint64_t rng;
} LeasesObject;

static int
Leases_init(LeasesObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "ctrl_offset", "slots_offset", "tags_offset", "capacity",
                             NULL};
    PyObject *obj;
    Py_ssize_t ctrl_off, slots_off, tags_off, capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnnn", kwlist, &obj, &ctrl_off, &slots_off,
                                     &tags_off, &capacity)) {
        return -1;
    }
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "Leases is already initialised");
        return -1;
    }
    if (capacity < PROBE || capacity > ((Py_ssize_t)1 << 32)) {
        PyErr_Format(PyExc_ValueError, "lease table capacity must be in %d..2**32", PROBE);
        return -1;
    }
    char *base;
    Py_ssize_t length;
    if (acquire_region(obj, 0, -1, &self->view, &base, &length) < 0) return -1;
    self->held = 1;
    if (ctrl_off < 0 || slots_off < 0 || tags_off < 0 || (ctrl_off & 63) || (slots_off & 63) ||
        (tags_off & 63) || ctrl_off + LEASE_CTRL_WORDS * 8 > length ||
        slots_off + capacity * SLOT_WORDS * 8 > length ||
        tags_off + LEASE_TAG_WORDS(capacity) * 8 > length) {
        PyErr_Format(PyExc_ValueError,
                     "lease layout (ctrl %zd, slots %zd, tags %zd, capacity %zd) does not fit a "
                     "buffer of %zd bytes with aligned words",
                     ctrl_off, slots_off, tags_off, capacity, length);
        PyBuffer_Release(&self->view);
        self->held = 0;
        return -1;
    }
    self->ctrl = (aword *)(base + ctrl_off);
    self->slots = (aword *)(base + slots_off);
    self->tags = (aword *)(base + tags_off);
    self->capacity = (uint64_t)capacity;
    self->stripe = self->ctrl + LEASE_STRIPES + stripe_of_process() * STRIPE_WORDS;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    self->rng = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ (uint64_t)(uintptr_t)self ^
                0x9e3779b97f4a7c15ull;
    return 0;
}

static void
Leases_dealloc(LeasesObject *self)
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline void
bump(LeasesObject *self, int which, uint64_t n)
{
    atomic_fetch_add_explicit(&self->stripe[which], n, memory_order_relaxed);
}

static inline uint64_t
window_start(LeasesObject *self, uint64_t h)
{
    return (uint64_t)(((unsigned __int128)h * self->capacity) >> 64);
}

static inline uint64_t
slot_at(LeasesObject *self, uint64_t start, int i)
{
    uint64_t s = start + (uint64_t)i;
    return s >= self->capacity ? s - self->capacity : s;
}

static inline aword *
slot_word(LeasesObject *self, uint64_t s, int which)
{
    return &self->slots[s * SLOT_WORDS + which];
}

static inline void
live_add(LeasesObject *self, int which, int64_t delta)
{
    atomic_fetch_add_explicit(&self->stripe[which], (uint64_t)delta, memory_order_relaxed);
}

static uint64_t
stripes_sum(LeasesObject *self, int which)
{
    uint64_t sum = 0;
    for (int stripe = 0; stripe < STRIPES; stripe++) {
        sum += LOAD(&self->ctrl[LEASE_STRIPES + stripe * STRIPE_WORDS + which]);
    }
    return sum;
}

_Static_assert(PROBE == 8, "a window is the 8 byte lanes of one tag word");

static inline uint64_t
tag_bit(uint64_t h)
{
    return 1ull << (h & 7u);
}

/* Set the key's bit in its slot's lane before the CAS that leases the slot, so a
 * lease or hold is never without its bit: lanes are cleared only by remove_slot,
 * on a slot parked REMOVING, and parking changes the state word, so a grant whose
 * CAS succeeds set its bit after any clear of that slot. */
static inline void
mark_tag(LeasesObject *self, uint64_t s, uint64_t h)
{
    aword *t = &self->tags[s >> 3];
    uint64_t bit = tag_bit(h) << (8 * (s & 7u));
    if (!(LOAD_SC(t) & bit)) atomic_fetch_or_explicit(t, bit, memory_order_seq_cst);
}

static inline void
clear_tag(LeasesObject *self, uint64_t s)
{
    atomic_fetch_and_explicit(&self->tags[s >> 3], ~(0xffull << (8 * (s & 7u))),
                              memory_order_seq_cst);
}

/* 0 if no slot of the key's window has the key's bit: then no slot holds the key
 * leased or held (mark_tag), and blocked_mask needs no probe. A false 1 (another
 * key's bit, about one window in eight per occupied slot) costs only the probe. */
static inline int
window_may_hold(LeasesObject *self, uint64_t h)
{
    uint64_t start = window_start(self, h);
    if (start + PROBE > self->capacity) {
        for (int i = 0; i < PROBE; i++) {
            uint64_t s = slot_at(self, start, i);
            if ((LOAD_SC(&self->tags[s >> 3]) >> (8 * (s & 7u))) & tag_bit(h)) return 1;
        }
        return 0;
    }
    uint64_t o = start & 7u;
    uint64_t lanes = LOAD_SC(&self->tags[start >> 3]) >> (8 * o);
    if (o) lanes |= LOAD_SC(&self->tags[(start >> 3) + 1]) << (64 - 8 * o);
    return (lanes & (0x0101010101010101ull << (h & 7u))) != 0;
}

/* The held counter: the winner of a settle CAS that started a hold ending after
 * now counts it, then names the HELD word in the slot's COUNTED word; exactly one
 * uncount_hold (a sweep that sees the hold ended, the grant or removal that takes
 * the slot) takes it off again, by CAS on that name. If the state moved on before
 * the name was written, nobody could take it off, so the settler does: one of the
 * two CASes on the name wins (all sequentially consistent). */
static void
count_hold(LeasesObject *self, uint64_t s, uint64_t held_word)
{
    aword *named = slot_word(self, s, SLOT_COUNTED);
    live_add(self, LS_HELD, 1);
    atomic_store_explicit(named, held_word, memory_order_seq_cst);
    if (LOAD_SC(slot_word(self, s, SLOT_STATE)) != held_word && cas_word(named, held_word, 0)) {
        live_add(self, LS_HELD, -1);
    }
}

static inline void
uncount_hold(LeasesObject *self, uint64_t s, uint64_t held_word)
{
    aword *named = slot_word(self, s, SLOT_COUNTED);
    if (held_word != 0 && LOAD_SC(named) == held_word && cas_word(named, held_word, 0)) {
        live_add(self, LS_HELD, -1);
    }
}

static uint64_t
next_token(LeasesObject *self, uint64_t w)
{
    uint64_t tok;
    if (W_TOKEN(w) == 0) {
        /* A fresh slot starts from a random token, so a token from the slot's
         * previous key (before a sweep) is unlikely to match the new one. */
        uint64_t x = self->rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self->rng = x;
        tok = x & 0xffffu;
    } else {
        tok = (W_TOKEN(w) + 1) & 0xffffu;
    }
    return tok ? tok : 1;
}

static uint64_t
hold_if_missed(uint64_t misses, uint64_t lease_ms, uint64_t cadence_ms)
{
    uint64_t m = misses + 1 > MISSES_MAX ? MISSES_MAX : misses + 1;
    uint64_t hold = (lease_ms > (HOLD_MASK >> m)) ? HOLD_MASK : (lease_ms << m);
    if (hold > cadence_ms) hold = cadence_ms;
    return hold & HOLD_MASK;
}

/* The hold an expired, unanswered lease earns: from the hold word if the grant's
 * winner got to write it (it always does unless killed between two stores). */
static uint64_t
settled_hold(LeasesObject *self, uint64_t s, uint64_t w)
{
    uint64_t p = LOAD_SC(slot_word(self, s, SLOT_HOLD));
    return (p >> 48) == W_TOKEN(w) ? (p & HOLD_MASK) : 0;
}

static uint64_t
settled_word(LeasesObject *self, uint64_t s, uint64_t w)
{
    uint64_t m = W_MISSES(w) + 1 > MISSES_MAX ? MISSES_MAX : W_MISSES(w) + 1;
    uint64_t until = W_TIME(w) + settled_hold(self, s, w);
    if (until > TIME_MAX) until = TIME_MAX;
    return W_MAKE(PH_HELD, m, W_TOKEN(w), until);
}

/* LEASED with expiry <= now and no result: record the miss and start the hold. */
static void
settle(LeasesObject *self, uint64_t s, uint64_t w, uint64_t now)
{
    uint64_t nw = settled_word(self, s, w);
    if (cas_word(slot_word(self, s, SLOT_STATE), w, nw)) {
        bump(self, LS_EXPIRIES, 1);
        if (W_TIME(nw) > W_TIME(w)) bump(self, LS_HOLD_EVENTS, 1);
        live_add(self, LS_LEASED, -1);
        if (W_TIME(nw) > now) count_hold(self, s, nw);
    }
}

static int
process_alive(uint64_t pid)
{
    if (pid == 0 || pid > (uint64_t)INT32_MAX) return 0;
    if (kill((pid_t)pid, 0) == 0) return 1;
    return errno != ESRCH;
}

/* The state word a remover parks a slot in: REMOVING, with the remover's pid so a
 * sweep can tell a live remover (leave it be) from a dead one (finish for it). */
static inline uint64_t
removing_word(void)
{
    return W_MAKE(PH_REMOVING, 0, 0, (uint64_t)getpid() & TIME_MAX);
}

/* Empty a slot whose state word the caller already moved to `parked` (REMOVING):
 * no grant can start on it, so clearing the key cannot orphan a lease. The emptied
 * slot's state word gets a stamp never used before (FREE, token 0, time =
 * incarnation): a claimant that read the slot's state before the removal can
 * never CAS it again (no ABA), which is what lets probe() trust a key read after
 * the state. */
static void
remove_slot(LeasesObject *self, uint64_t s, uint64_t k, uint64_t parked)
{
    uint64_t incarnation =
        atomic_fetch_add_explicit(&self->ctrl[LEASE_INCARNATION], 1, memory_order_relaxed) + 1;
    /* A hold still counted (ended, but no sweep saw it end) goes with its slot. */
    uncount_hold(self, s, LOAD_SC(slot_word(self, s, SLOT_COUNTED)));
    /* The lane before the key: once the key is 0 another key may take the slot and
     * set its own bit, which a later clear would wipe. */
    clear_tag(self, s);
    if (k != 0 && cas_word(slot_word(self, s, SLOT_KEY), k, 0)) live_add(self, LS_OCCUPIED, -1);
    cas_word(slot_word(self, s, SLOT_STATE), parked, W_MAKE(PH_FREE, 0, 0, incarnation & TIME_MAX));
}

static int
parse_time(PyObject *o, uint64_t *out, const char *what)
{
    int64_t v;
    if (parse_i64(o, &v) < 0) return -1;
    if (v < 0 || (uint64_t)v > TIME_MAX) {
        PyErr_Format(PyExc_ValueError, "%s %lld ms is outside 0..2**42", what, (long long)v);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int
parse_hash(PyObject *o, uint64_t *out)
{
    if (parse_u64(o, out) < 0) return -1;
    if (*out == 0) {
        PyErr_SetString(PyExc_ValueError, "key hash 0 marks an empty slot; use shm.key_hash()");
        return -1;
    }
    return 0;
}

/* What the window says about a key, read-only: its slots are every non-REMOVING
 * slot whose key word equals the hash. */
typedef struct {
    int n;
    uint64_t slot[PROBE];
    uint64_t word[PROBE];
    int64_t empty; /* first empty slot, -1 if none */
    int64_t spare; /* first slot another key no longer needs, -1 if none */
    uint64_t spare_key, spare_word;
} probe_t;

static void
probe(LeasesObject *self, uint64_t h, uint64_t now, probe_t *p)
{
    uint64_t start = window_start(self, h);
    p->n = 0;
    p->empty = -1;
    p->spare = -1;
    for (int i = 0; i < PROBE; i++) {
        uint64_t s = slot_at(self, start, i);
        /* State before key: a CAS that later succeeds on this state word proves the
         * slot was not emptied since (see remove_slot), so the key read after the
         * state is still the slot's key at the CAS. */
        uint64_t w = LOAD_SC(slot_word(self, s, SLOT_STATE));
        uint64_t k = LOAD_SC(slot_word(self, s, SLOT_KEY));
        if (W_PHASE(w) == PH_REMOVING) continue;
        if (k == h) {
            p->slot[p->n] = s;
            p->word[p->n] = w;
            p->n++;
        } else if (k == 0) {
            if (p->empty < 0) p->empty = (int64_t)s;
        } else if (p->spare < 0 &&
                   ((W_PHASE(w) == PH_FREE && W_TOKEN(w) != 0) ||
                    (W_PHASE(w) == PH_HELD && W_TIME(w) + KEEP_MISSES_MS <= now))) {
            /* Spare: a completed lease (token 0 is a fresh insert whose grant is under
             * way), or a hold that ended long ago, which a sweep would forget too. */
            p->spare = (int64_t)s;
            p->spare_key = k;
            p->spare_word = w;
        }
    }
}

/* grant(key_hash, now_ms, lease_ms, cadence_ms) -> (code, token, until)
 *
 * Duplicates: two claimants inserting one key at the same moment can land in two
 * slots (a sweep may empty a slot between their scans). Grants go to the first
 * of a key's slots, and after a winning CAS the winner re-reads the key's other
 * slots: if one holds a live lease it reverts its own and retries. Of two racing
 * winners at least one sees the other (both CAS before they re-read, all
 * sequentially consistent), so at most one grant survives; a reverted grant was
 * never returned. */
static PyObject *
Leases_grant(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("grant", nargs, 4) < 0) return NULL;
    if (!self->held) return released_error();
    uint64_t h, now, lease_ms, cadence_ms;
    if (parse_hash(args[0], &h) < 0 || parse_time(args[1], &now, "now") < 0 ||
        parse_time(args[2], &lease_ms, "lease") < 0 ||
        parse_time(args[3], &cadence_ms, "cadence") < 0) {
        return NULL;
    }
    if (lease_ms == 0 || now + lease_ms > TIME_MAX) {
        PyErr_SetString(PyExc_ValueError, "lease_ms must be positive and now + lease in range");
        return NULL;
    }
    probe_t p;
    for (int attempt = 0; attempt < LEASE_MAX_ATTEMPTS; attempt++) {
        probe(self, h, now, &p);
        uint64_t taken_until = 0, held_until = 0;
        int settled = 0;
        for (int i = 0; i < p.n; i++) {
            uint64_t w = p.word[i];
            if (W_PHASE(w) == PH_LEASED) {
                if (W_TIME(w) > now) {
                    if (W_TIME(w) > taken_until) taken_until = W_TIME(w);
                } else {
                    settle(self, p.slot[i], w, now);
                    settled = 1;
                }
            } else if (W_PHASE(w) == PH_HELD && W_TIME(w) > now) {
                if (W_TIME(w) > held_until) held_until = W_TIME(w);
            }
        }
        if (settled) continue;
        if (taken_until) {
            bump(self, LS_REFUSED_TAKEN, 1);
            return Py_BuildValue("(iKK)", REFUSED_TAKEN, 0ull, (unsigned long long)taken_until);
        }
        if (held_until) {
            bump(self, LS_REFUSED_HELD, 1);
            return Py_BuildValue("(iKK)", REFUSED_HELD, 0ull, (unsigned long long)held_until);
        }
        uint64_t s, w;
        if (p.n == 0) {
            if (p.empty < 0 && p.spare >= 0) {
                /* No empty slot, but one another key no longer needs: empty it here
                 * rather than wait for the sweep. */
                uint64_t parked = removing_word();
                uint64_t r = (uint64_t)p.spare;
                if (cas_word(slot_word(self, r, SLOT_STATE), p.spare_word, parked)) {
                    remove_slot(self, r, p.spare_key, parked);
                    bump(self, LS_RECLAIMED, 1);
                }
                continue;
            }
            if (p.empty < 0) {
                bump(self, LS_REFUSED_PROBE_FULL, 1);
                return Py_BuildValue("(iKK)", REFUSED_PROBE_FULL, 0ull, 0ull);
            }
            s = (uint64_t)p.empty;
            if (!cas_word(slot_word(self, s, SLOT_KEY), 0, h)) continue;
            live_add(self, LS_OCCUPIED, 1);
            bump(self, LS_INSERTS, 1);
            /* A sweep may have emptied the slot again since the insert: then the key
             * read after the state is no longer ours, and the probe starts over. */
            w = LOAD_SC(slot_word(self, s, SLOT_STATE));
            if (LOAD_SC(slot_word(self, s, SLOT_KEY)) != h || W_PHASE(w) != PH_FREE) continue;
        } else {
            s = p.slot[0];
            w = p.word[0];
        }
        uint64_t tok = next_token(self, w);
        uint64_t expires = now + lease_ms;
        uint64_t nw = W_MAKE(PH_LEASED, W_MISSES(w), tok, expires);
        mark_tag(self, s, h);
        if (!cas_word(slot_word(self, s, SLOT_STATE), w, nw)) continue;
        live_add(self, LS_LEASED, 1);
        /* A HELD slot is granted only once its hold ended: no longer held. */
        if (W_PHASE(w) == PH_HELD) uncount_hold(self, s, w);
        STORE(slot_word(self, s, SLOT_HOLD),
              (tok << 48) | hold_if_missed(W_MISSES(w), lease_ms, cadence_ms));
        /* Verify: no other slot of this key holds a live lease. */
        uint64_t start = window_start(self, h);
        int conflict = 0;
        for (int i = 0; i < PROBE && !conflict; i++) {
            uint64_t o = slot_at(self, start, i);
            if (o == s || LOAD_SC(slot_word(self, o, SLOT_KEY)) != h) continue;
            uint64_t ow = LOAD_SC(slot_word(self, o, SLOT_STATE));
            if (W_PHASE(ow) == PH_LEASED && W_TIME(ow) > now) conflict = 1;
        }
        if (conflict) {
            if (cas_word(slot_word(self, s, SLOT_STATE), nw, w)) live_add(self, LS_LEASED, -1);
            bump(self, LS_CONFLICTS, 1);
            continue;
        }
        bump(self, LS_GRANTS, 1);
        return Py_BuildValue("(iKK)", GRANTED, (unsigned long long)((s << 16) | tok),
                             (unsigned long long)expires);
    }
    /* Only a storm of concurrent changes to this one window gets here. */
    bump(self, LS_REFUSED_TAKEN, 1);
    return Py_BuildValue("(iKK)", REFUSED_TAKEN, 0ull, (unsigned long long)now);
}

/* The slot and 16-bit counter a token names; 0 if it names no slot. */
static int
token_slot(LeasesObject *self, PyObject *const *args, uint64_t *h, uint64_t *s, uint64_t *tok,
           uint64_t *now)
{
    uint64_t token;
    if (parse_hash(args[0], h) < 0 || parse_u64(args[1], &token) < 0 ||
        parse_time(args[2], now, "now") < 0) {
        return -1;
    }
    *s = token >> 16;
    *tok = token & 0xffffu;
    return *s < self->capacity && *tok != 0;
}

/* The slot's state word if the token's lease on this key is live, else 0. State
 * before key, as in probe(): a CAS on the returned word then acts on this key. */
static uint64_t
live_lease(LeasesObject *self, uint64_t h, uint64_t s, uint64_t tok, uint64_t now)
{
    uint64_t w = LOAD_SC(slot_word(self, s, SLOT_STATE));
    if (W_PHASE(w) != PH_LEASED || W_TOKEN(w) != tok || W_TIME(w) <= now) return 0;
    return LOAD_SC(slot_word(self, s, SLOT_KEY)) == h ? w : 0;
}

static PyObject *
Leases_holds(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("holds", nargs, 3) < 0) return NULL;
    if (!self->held) return released_error();
    uint64_t h, s, tok, now;
    int r = token_slot(self, args, &h, &s, &tok, &now);
    if (r < 0) return NULL;
    return PyBool_FromLong(r == 1 && live_lease(self, h, s, tok, now) != 0);
}

/* renew(h, token, now, lease_ms) -> new expiry or -1 */
static PyObject *
Leases_renew(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("renew", nargs, 4) < 0) return NULL;
    if (!self->held) return released_error();
    uint64_t h, s, tok, now, lease_ms;
    int r = token_slot(self, args, &h, &s, &tok, &now);
    if (r < 0 || parse_time(args[3], &lease_ms, "lease") < 0) return NULL;
    if (lease_ms == 0 || now + lease_ms > TIME_MAX) {
        PyErr_SetString(PyExc_ValueError, "lease_ms must be positive and now + lease in range");
        return NULL;
    }
    for (int attempt = 0; r == 1 && attempt < LEASE_MAX_ATTEMPTS; attempt++) {
        uint64_t w = live_lease(self, h, s, tok, now);
        if (w == 0) break;
        uint64_t nw = W_MAKE(PH_LEASED, W_MISSES(w), tok, now + lease_ms);
        if (cas_word(slot_word(self, s, SLOT_STATE), w, nw)) {
            bump(self, LS_RENEWALS, 1);
            return PyLong_FromUnsignedLongLong(now + lease_ms);
        }
    }
    bump(self, LS_STALE_TOKENS, 1);
    return PyLong_FromLong(-1);
}

static PyObject *
Leases_complete(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("complete", nargs, 3) < 0) return NULL;
    if (!self->held) return released_error();
    uint64_t h, s, tok, now;
    int r = token_slot(self, args, &h, &s, &tok, &now);
    if (r < 0) return NULL;
    for (int attempt = 0; r == 1 && attempt < LEASE_MAX_ATTEMPTS; attempt++) {
        uint64_t w = live_lease(self, h, s, tok, now);
        if (w == 0) break;
        /* A result ends the lease and forgives the misses. */
        if (cas_word(slot_word(self, s, SLOT_STATE), w, W_MAKE(PH_FREE, 0, tok, 0))) {
            live_add(self, LS_LEASED, -1);
            bump(self, LS_COMPLETIONS, 1);
            Py_RETURN_TRUE;
        }
    }
    bump(self, LS_STALE_TOKENS, 1);
    Py_RETURN_FALSE;
}

typedef struct {
    int leased, held;
    uint64_t lease_expires_at, held_until, misses;
} keystate_t;

/* Read-only view of a key: an expired lease with no result reads as the hold it
 * will become once a grant or sweep settles it. */
static void
key_state(LeasesObject *self, uint64_t h, uint64_t now, keystate_t *ks)
{
    probe_t p;
    probe(self, h, now, &p);
    memset(ks, 0, sizeof(*ks));
    for (int i = 0; i < p.n; i++) {
        uint64_t w = p.word[i];
        if (W_PHASE(w) == PH_LEASED && W_TIME(w) <= now) w = settled_word(self, p.slot[i], w);
        uint64_t t = W_TIME(w);
        if (W_MISSES(w) > ks->misses) ks->misses = W_MISSES(w);
        if (W_PHASE(w) == PH_LEASED) {
            ks->leased = 1;
            if (t > ks->lease_expires_at) ks->lease_expires_at = t;
        } else if (W_PHASE(w) == PH_HELD) {
            if (t > now) ks->held = 1;
            if (t > ks->held_until) ks->held_until = t;
        }
    }
}

static PyObject *
Leases_state(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("state", nargs, 2) < 0) return NULL;
    if (!self->held) return released_error();
    uint64_t h, now;
    if (parse_hash(args[0], &h) < 0 || parse_time(args[1], &now, "now") < 0) return NULL;
    keystate_t ks;
    key_state(self, h, now, &ks);
    return Py_BuildValue("(OKOKK)", ks.leased ? Py_True : Py_False,
                         (unsigned long long)ks.lease_expires_at, ks.held ? Py_True : Py_False,
                         (unsigned long long)ks.held_until, (unsigned long long)ks.misses);
}

/* A batch's probe windows are scattered over the table: fetching the windows a few
 * hashes ahead overlaps their cache misses instead of paying them one by one. */
#define BLOCKED_AHEAD 8

static inline void
prefetch_window(LeasesObject *self, uint64_t h)
{
    uint64_t start = window_start(self, h);
    for (int i = 0; i < PROBE; i += 2) {
        __builtin_prefetch(slot_word(self, slot_at(self, start, i), SLOT_KEY), 0, 1);
    }
}

/* blocked_mask(hashes, out, now): out[i] = 1 if hashes[i] is leased or held now.
 * hashes: contiguous uint64 buffer; out: writable contiguous uint8/bool buffer.
 * First the tag lanes (a compact array, mostly cached) rule out the keys no slot
 * can hold; only the rest are probed, their windows fetched a few keys ahead. */
static PyObject *
Leases_blocked_mask(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("blocked_mask", nargs, 3) < 0) return NULL;
    if (!self->held) return released_error();
    uint64_t now;
    if (parse_time(args[2], &now, "now") < 0) return NULL;
    Py_buffer in, out;
    if (PyObject_GetBuffer(args[0], &in, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    Py_ssize_t n = in.len / 8;
    if ((in.len & 7) || out.len != n || ((uintptr_t)in.buf & 7u)) {
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "blocked_mask wants aligned uint64 hashes and one "
                                          "byte of output per hash");
        return NULL;
    }
    const uint64_t *hs = in.buf;
    unsigned char *o = out.buf;
    Py_ssize_t *probe_at = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (probe_at == NULL) {
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        return PyErr_NoMemory();
    }
    Py_ssize_t candidates = 0, blocked = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        o[i] = 0;
        if (hs[i] != 0 && window_may_hold(self, hs[i])) probe_at[candidates++] = i;
    }
    for (Py_ssize_t c = 0; c < candidates; c++) {
        keystate_t ks;
        if (c + BLOCKED_AHEAD < candidates) prefetch_window(self, hs[probe_at[c + BLOCKED_AHEAD]]);
        Py_ssize_t i = probe_at[c];
        key_state(self, hs[i], now, &ks);
        if ((ks.leased && ks.lease_expires_at > now) || ks.held) {
            o[i] = 1;
            blocked++;
        }
    }
    PyMem_Free(probe_at);
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(blocked);
}

/* sweep(now, keep_misses_ms) -> reclaimed slots, or -1 if another live process is
 * sweeping. Settles expired leases; reclaims FREE slots and holds that ended
 * keep_misses_ms ago; finishes removals a dead sweeper left half done. */
static PyObject *
Leases_sweep(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("sweep", nargs, 2) < 0) return NULL;
    if (!self->held) return released_error();
    uint64_t now, keep;
    if (parse_time(args[0], &now, "now") < 0 || parse_time(args[1], &keep, "keep") < 0) {
        return NULL;
    }
    uint64_t me = (uint64_t)getpid();
    aword *sweeper = &self->ctrl[LEASE_SWEEPER];
    uint64_t owner = LOAD_SC(sweeper);
    if (owner != me) {
        if (owner != 0 && process_alive(owner)) return PyLong_FromLong(-1);
        if (!cas_word(sweeper, owner, me)) return PyLong_FromLong(-1);
    }
    bump(self, LS_SWEEPS, 1);
    uint64_t parked = removing_word();
    long reclaimed = 0;
    for (uint64_t s = 0; s < self->capacity; s++) {
        aword *kw = slot_word(self, s, SLOT_KEY);
        aword *sw = slot_word(self, s, SLOT_STATE);
        uint64_t w = LOAD_SC(sw); /* state before key, as in probe() */
        uint64_t k = LOAD_SC(kw);
        if (W_PHASE(w) == PH_REMOVING) {
            /* A remover killed between its steps: finish for it. A live one (another
             * process: within this one the GIL keeps removals whole) finishes itself. */
            uint64_t remover = W_TIME(w);
            if (remover != me && process_alive(remover)) continue;
            remove_slot(self, s, k, w);
            reclaimed++;
            continue;
        }
        if (k == 0) continue;
        if (W_PHASE(w) == PH_LEASED && W_TIME(w) <= now) {
            settle(self, s, w, now);
            w = LOAD_SC(sw);
        }
        if (W_PHASE(w) == PH_HELD && W_TIME(w) <= now) uncount_hold(self, s, w);
        int dead = W_PHASE(w) == PH_FREE ||
                   (W_PHASE(w) == PH_HELD && W_TIME(w) + keep <= now);
        if (dead && cas_word(sw, w, parked)) {
            remove_slot(self, s, k, parked);
            reclaimed++;
        }
    }
    cas_word(sweeper, me, 0);
    bump(self, LS_RECLAIMED, (uint64_t)reclaimed);
    return PyLong_FromLong(reclaimed);
}

/* census(now) -> (occupied, live, held, expired_unsettled, removing) */
static PyObject *
Leases_census(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("census", nargs, 1) < 0) return NULL;
    if (!self->held) return released_error();
    uint64_t now;
    if (parse_time(args[0], &now, "now") < 0) return NULL;
    uint64_t occupied = 0, live = 0, held = 0, expired = 0, removing = 0;
    for (uint64_t s = 0; s < self->capacity; s++) {
        uint64_t k = LOAD(slot_word(self, s, SLOT_KEY));
        uint64_t w = LOAD(slot_word(self, s, SLOT_STATE));
        if (W_PHASE(w) == PH_REMOVING) {
            removing++;
            continue;
        }
        if (k == 0) continue;
        occupied++;
        if (W_PHASE(w) == PH_LEASED) {
            if (W_TIME(w) > now) {
                live++;
            } else {
                expired++;
                if (W_TIME(settled_word(self, s, w)) > now) held++;
            }
        } else if (W_PHASE(w) == PH_HELD && W_TIME(w) > now) {
            held++;
        }
    }
    return Py_BuildValue("(KKKKK)", (unsigned long long)occupied, (unsigned long long)live,
                         (unsigned long long)held, (unsigned long long)expired,
                         (unsigned long long)removing);
}

/* live() -> (occupied, leased, held): the counters the ops keep, read as signed (a
 * process killed between a CAS and its count can leave one off until recount). */
static PyObject *
Leases_live(LeasesObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->held) return released_error();
    return Py_BuildValue("(LLL)", (long long)(int64_t)stripes_sum(self, LS_OCCUPIED),
                         (long long)(int64_t)stripes_sum(self, LS_LEASED),
                         (long long)(int64_t)stripes_sum(self, LS_HELD));
}

/* totals() -> each statistics counter summed over the process stripes (STRIPE_WORDS
 * values), in one call rather than STRIPES x STRIPE_WORDS loads from Python. */
static PyObject *
Leases_totals(LeasesObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->held) return released_error();
    PyObject *out = PyTuple_New(STRIPE_WORDS);
    if (out == NULL) return NULL;
    for (int i = 0; i < STRIPE_WORDS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(stripes_sum(self, i));
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* recount(now) -> (occupied, leased, held): rebuild the counters, the held names
 * and the tag lanes from the slots, for a table whose slots were written whole
 * (an import). Only while no other process uses the table: it stores, not CASes. */
static PyObject *
Leases_recount(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("recount", nargs, 1) < 0) return NULL;
    if (!self->held) return released_error();
    uint64_t now;
    if (parse_time(args[0], &now, "now") < 0) return NULL;
    for (uint64_t t = 0; t < LEASE_TAG_WORDS(self->capacity); t++) STORE(&self->tags[t], 0);
    uint64_t occupied = 0, leased = 0, held = 0;
    for (uint64_t s = 0; s < self->capacity; s++) {
        uint64_t k = LOAD_SC(slot_word(self, s, SLOT_KEY));
        uint64_t w = LOAD_SC(slot_word(self, s, SLOT_STATE));
        uint64_t named = 0;
        if (k != 0) occupied++; /* a removal's key too, until the key is cleared */
        if (k != 0 && W_PHASE(w) != PH_REMOVING) {
            mark_tag(self, s, k);
            if (W_PHASE(w) == PH_LEASED) {
                leased++;
            } else if (W_PHASE(w) == PH_HELD && W_TIME(w) > now) {
                held++;
                named = w;
            }
        }
        atomic_store_explicit(slot_word(self, s, SLOT_COUNTED), named, memory_order_seq_cst);
    }
    const int live[3] = {LS_OCCUPIED, LS_LEASED, LS_HELD};
    const uint64_t counted[3] = {occupied, leased, held};
    for (int j = 0; j < 3; j++) {
        for (int stripe = 0; stripe < STRIPES; stripe++) {
            atomic_store_explicit(&self->ctrl[LEASE_STRIPES + stripe * STRIPE_WORDS + live[j]],
                                  stripe == 0 ? counted[j] : 0, memory_order_seq_cst);
        }
    }
    return Py_BuildValue("(KKK)", (unsigned long long)occupied, (unsigned long long)leased,
                         (unsigned long long)held);
}

static PyObject *
Leases_release(LeasesObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        self->ctrl = self->slots = self->tags = NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Leases_methods[] = {
    {"grant", (PyCFunction)(void (*)(void))Leases_grant, METH_FASTCALL,
     "grant(key_hash, now, lease_ms, cadence_ms) -> (code, token, until)."},
    {"holds", (PyCFunction)(void (*)(void))Leases_holds, METH_FASTCALL,
     "holds(key_hash, token, now) -> bool."},
    {"renew", (PyCFunction)(void (*)(void))Leases_renew, METH_FASTCALL,
     "renew(key_hash, token, now, lease_ms) -> new expiry, or -1."},
    {"complete", (PyCFunction)(void (*)(void))Leases_complete, METH_FASTCALL,
     "complete(key_hash, token, now) -> bool."},
    {"state", (PyCFunction)(void (*)(void))Leases_state, METH_FASTCALL,
     "state(key_hash, now) -> (leased, lease_expires_at, held, held_until, misses)."},
    {"blocked_mask", (PyCFunction)(void (*)(void))Leases_blocked_mask, METH_FASTCALL,
     "blocked_mask(hashes_u64, out_u8, now) -> number blocked."},
    {"sweep", (PyCFunction)(void (*)(void))Leases_sweep, METH_FASTCALL,
     "sweep(now, keep_misses_ms) -> reclaimed, or -1 if another process is sweeping."},
    {"census", (PyCFunction)(void (*)(void))Leases_census, METH_FASTCALL,
     "census(now) -> (occupied, live, held, expired_unsettled, removing)."},
    {"live", (PyCFunction)Leases_live, METH_NOARGS,
     "live() -> (occupied, leased, held), the counters the ops keep."},
    {"totals", (PyCFunction)Leases_totals, METH_NOARGS,
     "totals() -> the statistics counters, each summed over the process stripes."},
    {"recount", (PyCFunction)(void (*)(void))Leases_recount, METH_FASTCALL,
     "recount(now) -> (occupied, leased, held): rebuild counters and tags from the slots."},
    {"release", (PyCFunction)Leases_release, METH_NOARGS, "Give the buffer back (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LeasesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shm._atomics.Leases",
    .tp_basicsize = sizeof(LeasesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Leases(buffer, ctrl_offset, slots_offset, tags_offset, capacity): the lease "
              "table's hot paths.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Leases_init,
    .tp_dealloc = (destructor)Leases_dealloc,
    .tp_methods = Leases_methods,
};

/* ================================================================ key hashes */

/* XXH64 (seed 0) of a key's bytes: the key's 64-bit identity in shared memory
 * (shm/keys.py says why this hash). 0 marks an empty lease slot, so 0 maps to 1.
 * Written out from the published algorithm; reads are memcpy'd (unaligned and
 * little-endian safe on the x86-64 and aarch64 hosts this runs on). */

#define XXH_P1 0x9E3779B185EBCA87ULL
#define XXH_P2 0xC2B2AE3D27D4EB4FULL
#define XXH_P3 0x165667B19E3779F9ULL
#define XXH_P4 0x85EBCA77C2B2AE63ULL
#define XXH_P5 0x27D4EB2F165667C5ULL

static inline uint64_t
xxh_rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t
xxh_read64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t
xxh_read32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t
xxh_round(uint64_t acc, uint64_t input)
{
    acc += input * XXH_P2;
    acc = xxh_rotl(acc, 31);
    return acc * XXH_P1;
}

static inline uint64_t
xxh_merge(uint64_t acc, uint64_t v)
{
    acc ^= xxh_round(0, v);
    return acc * XXH_P1 + XXH_P4;
}

static uint64_t
xxh64(const unsigned char *p, size_t len)
{
    const unsigned char *end = p + len;
    uint64_t h;
    if (len >= 32) {
        const unsigned char *limit = end - 32;
        uint64_t v1 = XXH_P1 + XXH_P2, v2 = XXH_P2, v3 = 0, v4 = 0 - XXH_P1;
        do {
            v1 = xxh_round(v1, xxh_read64(p));
            v2 = xxh_round(v2, xxh_read64(p + 8));
            v3 = xxh_round(v3, xxh_read64(p + 16));
            v4 = xxh_round(v4, xxh_read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = xxh_rotl(v1, 1) + xxh_rotl(v2, 7) + xxh_rotl(v3, 12) + xxh_rotl(v4, 18);
        h = xxh_merge(h, v1);
        h = xxh_merge(h, v2);
        h = xxh_merge(h, v3);
        h = xxh_merge(h, v4);
    } else {
        h = XXH_P5;
    }
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= xxh_round(0, xxh_read64(p));
        h = xxh_rotl(h, 27) * XXH_P1 + XXH_P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)xxh_read32(p) * XXH_P1;
        h = xxh_rotl(h, 23) * XXH_P2 + XXH_P3;
        p += 4;
    }
    while (p < end) {
        h ^= (*p) * XXH_P5;
        h = xxh_rotl(h, 11) * XXH_P1;
        p++;
    }
    h ^= h >> 33;
    h *= XXH_P2;
    h ^= h >> 29;
    h *= XXH_P3;
    h ^= h >> 32;
    return h ? h : 1;
}

/* The hash of one key's bytes (bytes fast, any contiguous buffer otherwise). */
static int
hash_object(PyObject *key, uint64_t *out)
{
    if (PyBytes_CheckExact(key)) {
        *out = xxh64((const unsigned char *)PyBytes_AS_STRING(key),
                     (size_t)PyBytes_GET_SIZE(key));
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(key, &view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    *out = xxh64((const unsigned char *)view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return 0;
}

/* key_hash(key) -> the key's nonzero 64-bit hash. */
static PyObject *
module_key_hash(PyObject *Py_UNUSED(module), PyObject *key)
{
    uint64_t h;
    if (hash_object(key, &h) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(h);
}

/* key_hashes_into(keys, out) -> None: hash each key of a list or tuple into the
 * aligned uint64 buffer `out` (one word per key). */
static PyObject *
module_key_hashes_into(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("key_hashes_into", nargs, 2) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "key_hashes_into wants a sequence of keys");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer out;
    if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    if (out.len != n * 8 || ((uintptr_t)out.buf & 7u)) {
        PyBuffer_Release(&out);
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError,
                        "key_hashes_into wants an aligned uint64 buffer of one word per key");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *o = out.buf;
    int failed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (hash_object(items[i], &o[i]) < 0) {
            failed = 1;
            break;
        }
    }
    PyBuffer_Release(&out);
    Py_DECREF(seq);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"key_hash", (PyCFunction)module_key_hash, METH_O,
     "key_hash(key) -> XXH64 of the key's bytes (seed 0), 0 mapped to 1."},
    {"key_hashes_into", (PyCFunction)(void (*)(void))module_key_hashes_into, METH_FASTCALL,
     "key_hashes_into(keys, out_u64) -> None: key_hash of each key into out."},
    {NULL, NULL, 0, NULL},
};

/* =================================================================== module */

static int
add_layout(PyObject *m, const char *name, const char *const *keys, const long *values, int n)
{
    PyObject *d = PyDict_New();
    if (d == NULL) return -1;
    for (int i = 0; i < n; i++) {
        PyObject *v = PyLong_FromLong(values[i]);
        if (v == NULL || PyDict_SetItemString(d, keys[i], v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(d);
            return -1;
        }
        Py_DECREF(v);
    }
    return PyModule_AddObject(m, name, d) < 0 ? (Py_DECREF(d), -1) : 0;
}

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT, "_atomics", "C11 atomics on shared memory, and the hot paths on them.",
    -1, module_methods,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    if (PyType_Ready(&WordsType) < 0 || PyType_Ready(&RingType) < 0 ||
        PyType_Ready(&LeasesType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&atomics_module);
    if (m == NULL) return NULL;
    Py_INCREF(&WordsType);
    Py_INCREF(&RingType);
    Py_INCREF(&LeasesType);
    if (PyModule_AddObject(m, "Words", (PyObject *)&WordsType) < 0 ||
        PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0 ||
        PyModule_AddObject(m, "Leases", (PyObject *)&LeasesType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    static const char *const ring_keys[] = {
        "active", "buf0", "cursor0", "buf1", "cursor1", "generation", "published",
        "publishes", "truncated", "stripes", "ctrl_words", "buf_gen", "buf_count",
        "buf_published_at", "buf_arena_used", "s_claimed", "s_claim_calls", "s_torn",
        "s_stale", "s_empty", "entry_size", "entry_due_at", "entry_key_hash", "entry_key_off",
        "entry_key_len", "entry_class_id", "entry_cadence_s", "key_max",
    };
    static const long ring_values[] = {
        RING_ACTIVE, RING_BUF0, RING_CURSOR0, RING_BUF1, RING_CURSOR1, RING_GENERATION,
        RING_PUBLISHED, RING_PUBLISHES, RING_TRUNCATED, RING_STRIPES, RING_CTRL_WORDS, BUF_GEN,
        BUF_COUNT, BUF_PUBLISHED_AT, BUF_ARENA_USED, RS_CLAIMED, RS_CLAIM_CALLS, RS_TORN,
        RS_STALE, RS_EMPTY, (long)sizeof(ring_entry), (long)offsetof(ring_entry, due_at),
        (long)offsetof(ring_entry, key_hash), (long)offsetof(ring_entry, key_off),
        (long)offsetof(ring_entry, key_len), (long)offsetof(ring_entry, class_id),
        (long)offsetof(ring_entry, cadence_s), RING_KEY_MAX,
    };
    static const char *const lease_keys[] = {
        "sweeper", "stripes", "ctrl_words", "slot_words", "probe", "s_grants", "s_renewals",
        "s_completions", "s_expiries", "s_hold_events", "s_refused_taken", "s_refused_held",
        "s_refused_probe_full", "s_inserts", "s_reclaimed", "s_conflicts", "s_stale_tokens",
        "s_sweeps", "granted", "refused_taken", "refused_held", "refused_probe_full",
        "misses_max", "keep_misses_ms", "s_occupied", "s_leased", "s_held", "incarnation",
        "phase_mask", "phase_removing", "token_shift", "token_mask", "time_shift",
    };
    static const long lease_values[] = {
        LEASE_SWEEPER, LEASE_STRIPES, LEASE_CTRL_WORDS, SLOT_WORDS, PROBE, LS_GRANTS,
        LS_RENEWALS, LS_COMPLETIONS, LS_EXPIRIES, LS_HOLD_EVENTS, LS_REFUSED_TAKEN,
        LS_REFUSED_HELD, LS_REFUSED_PROBE_FULL, LS_INSERTS, LS_RECLAIMED, LS_CONFLICTS,
        LS_STALE_TOKENS, LS_SWEEPS, GRANTED, REFUSED_TAKEN, REFUSED_HELD, REFUSED_PROBE_FULL,
        MISSES_MAX, (long)KEEP_MISSES_MS, LS_OCCUPIED, LS_LEASED, LS_HELD, LEASE_INCARNATION,
        3, PH_REMOVING, 6, 0xffff, 22, /* the state word's fields: see W_MAKE */
    };
    _Static_assert(sizeof(ring_keys) / sizeof(ring_keys[0]) ==
                       sizeof(ring_values) / sizeof(ring_values[0]),
                   "ring layout table");
    _Static_assert(sizeof(lease_keys) / sizeof(lease_keys[0]) ==
                       sizeof(lease_values) / sizeof(lease_values[0]),
                   "lease layout table");
    if (add_layout(m, "RING_LAYOUT", ring_keys, ring_values,
                   (int)(sizeof(ring_values) / sizeof(ring_values[0]))) < 0 ||
        add_layout(m, "LEASE_LAYOUT", lease_keys, lease_values,
                   (int)(sizeof(lease_values) / sizeof(lease_values[0]))) < 0 ||
        PyModule_AddIntConstant(m, "STRIPES", STRIPES) < 0 ||
        PyModule_AddIntConstant(m, "STRIPE_WORDS", STRIPE_WORDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
