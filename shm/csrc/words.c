/* Words: atomics on the 8-byte words of any 8-byte-aligned region, and the seqlock
 * a writer and its readers share (shm/state.py). */
#include "atomics.h"

#include <string.h>

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
    if (shm_acquire_region(obj, offset, nbytes, &self->view, &base, &length) < 0) {
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
        shm_released_error();
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

/* seqlock_run(first, slot_words, slots, seq, limit, capacity) -> (tags, payloads)
 *
 * Up to `limit` consecutive entries of a ring of seqlocked slots, from entry `seq`:
 * entry s lives in slot s % slots, whose words from first + slot * slot_words are its
 * seq, its payload's length and a tag, then the payload (at most `capacity` bytes).
 * Stops at the first slot that does not hold its entry whole (another seq, a writer
 * in it, a torn read). Each slot is read as seqlock_read reads one; this is its loop
 * in one call, for a consumer that takes a run of entries a poll (store.sqlite.
 * feed_ring), where a Python call per entry cost more than the copy. The tags and the
 * payloads' contents are the caller's to check. */
static PyObject *
Words_seqlock_run(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("seqlock_run", nargs, 6) < 0) return NULL;
    if (!self->held) return shm_released_error();
    Py_ssize_t first = PyLong_AsSsize_t(args[0]);
    Py_ssize_t slot_words = PyLong_AsSsize_t(args[1]);
    Py_ssize_t slots = PyLong_AsSsize_t(args[2]);
    uint64_t seq;
    if (PyErr_Occurred() || parse_u64(args[3], &seq) < 0) return NULL;
    Py_ssize_t limit = PyLong_AsSsize_t(args[4]);
    Py_ssize_t capacity = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    /* Every slot, its three words and its payload, inside the region. */
    if (first < 0 || slots < 1 || slot_words < 3 || capacity < 0 || limit < 0 ||
        capacity > (slot_words - 3) * 8 || slots > (self->nwords - first) / slot_words) {
        PyErr_SetString(PyExc_IndexError, "seqlock_run: slots outside the region");
        return NULL;
    }
    PyObject *tags = PyList_New(0);
    PyObject *payloads = tags ? PyList_New(0) : NULL;
    if (payloads == NULL) goto fail;
    for (Py_ssize_t i = 0; i < limit; i++, seq++) {
        aword *w = &self->words[first + (Py_ssize_t)(seq % (uint64_t)slots) * slot_words];
        uint64_t s1 = LOAD(&w[0]);
        if (s1 != seq || s1 == 0) break;
        uint64_t n = LOAD(&w[1]);
        uint64_t tag = LOAD(&w[2]);
        if (n > (uint64_t)capacity) break; /* torn length: never copy past the slot */
        PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)n);
        if (payload == NULL) goto fail;
        memcpy(PyBytes_AS_STRING(payload), (char *)&w[3], (size_t)n);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&w[0], memory_order_relaxed) != s1) {
            Py_DECREF(payload);
            break;
        }
        PyObject *boxed = PyLong_FromUnsignedLongLong(tag);
        int failed = boxed == NULL || PyList_Append(tags, boxed) < 0 ||
                     PyList_Append(payloads, payload) < 0;
        Py_XDECREF(boxed);
        Py_DECREF(payload);
        if (failed) goto fail;
    }
    return Py_BuildValue("(NN)", tags, payloads);
fail:
    Py_XDECREF(tags);
    Py_XDECREF(payloads);
    return NULL;
}

/* below(hashes, mask, bound, out) -> how many: out[i] = 1 when word (hashes[i] & mask)
 * is below `bound`, each a sequentially consistent load (as after a CAS: the write marks'
 * check follows a lease's). hashes: uint64[n]; out: writable bytes[n]; mask + 1 words at
 * most. */
static PyObject *
Words_below(WordsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("below", nargs, 4) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t mask, bound;
    if (parse_u64(args[1], &mask) < 0 || parse_u64(args[2], &bound) < 0) return NULL;
    if (mask >= (uint64_t)self->nwords) {
        PyErr_Format(PyExc_IndexError, "mask %llu reaches past a region of %zd words",
                     (unsigned long long)mask, self->nwords);
        return NULL;
    }
    Py_buffer in, out;
    if (PyObject_GetBuffer(args[0], &in, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[3], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    Py_ssize_t n = in.len / 8, below = 0;
    if ((in.len & 7) || out.len != n || ((uintptr_t)in.buf & 7u)) {
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "below wants aligned uint64 hashes and a byte per hash");
        return NULL;
    }
    const uint64_t *hs = in.buf;
    unsigned char *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        o[i] = LOAD_SC(&self->words[hs[i] & mask]) < bound;
        below += o[i];
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(below);
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
     "load($self, index, /)\n--\n\nload(i) -> int: load-acquire of word i."},
    {"store", (PyCFunction)(void (*)(void))Words_store, METH_FASTCALL,
     "store($self, index, value, /)\n--\n\nstore(i, value): store-release of word i."},
    {"fetch_add", (PyCFunction)(void (*)(void))Words_fetch_add, METH_FASTCALL,
     "fetch_add($self, index, delta, /)\n--\n\nfetch_add(i, delta) -> int: the old value (64-bit wrapping)."},
    {"cas", (PyCFunction)(void (*)(void))Words_cas, METH_FASTCALL,
     "cas($self, index, expected, desired, /)\n--\n\ncas(i, expected, desired) -> bool: compare-and-swap, sequentially consistent."},
    {"begin_write", (PyCFunction)(void (*)(void))Words_begin_write, METH_FASTCALL,
     "begin_write($self, index, value, /)\n--\n\nbegin_write(i, value): seqlock writer's invalidating store, then a full fence."},
    {"seqlock_read", (PyCFunction)(void (*)(void))Words_seqlock_read, METH_FASTCALL,
     "seqlock_read($self, seq, length, written_at, data_offset, capacity, /)\n--\n\nseqlock_read(seq, length, written_at, data_offset, capacity) -> (seq, at, bytes) | None."},
    {"seqlock_run", (PyCFunction)(void (*)(void))Words_seqlock_run, METH_FASTCALL,
     "seqlock_run($self, first, slot_words, slots, seq, limit, capacity, /)\n--\n\nseqlock_run(first, slot_words, slots, seq, limit, capacity) -> (tags, payloads): the run of whole entries from seq."},
    {"below", (PyCFunction)(void (*)(void))Words_below, METH_FASTCALL,
     "below($self, hashes, mask, bound, out, /)\n--\n\nbelow(hashes, mask, bound, out) -> int: out[i] = word (hashes[i] & mask) < bound."},
    {"release", (PyCFunction)Words_release, METH_NOARGS,
     "release($self)\n--\n\nGive the buffer back (idempotent); later operations raise ValueError."},
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
    .tp_doc = "Words(buffer, offset=0, nbytes=-1)\n--\n\n"
              "Atomics on the 8-byte words of a region.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Words_init,
    .tp_dealloc = (destructor)Words_dealloc,
    .tp_methods = Words_methods,
    .tp_getset = Words_getset,
};

int
shm_words_add(PyObject *m)
{
    if (PyType_Ready(&WordsType) < 0) return -1;
    Py_INCREF(&WordsType);
    if (PyModule_AddObject(m, "Words", (PyObject *)&WordsType) < 0) {
        Py_DECREF(&WordsType);
        return -1;
    }
    return 0;
}
