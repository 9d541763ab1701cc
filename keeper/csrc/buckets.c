/* BucketOps: a bucket's entries rewritten (keeper/buckets.py): stale entries dropped,
 * a neighbour's live ones taken in, a given list of slots made the bucket's, or the
 * entries sorted by due time and cut. An entry is live while its slot's place
 * (bucket << 32 | index) points back at it. */
#include "native.h"

typedef struct {
    PyObject_HEAD
    SlotIndexObject *index; /* for the records: the place is word REC_PLACE */
    PyObject *members;      /* per bucket, array('i') of slots */
    PyObject *b_live, *b_stale;
} BucketOpsObject;

static inline uint64_t
place_of(Py_ssize_t bucket, Py_ssize_t position)
{
    return ((uint64_t)bucket << 32) | (uint64_t)position;
}

/* members[bucket], an array('i'), or NULL with an error set. Borrowed. */
static PyObject *
bucket_members(BucketOpsObject *self, Py_ssize_t bucket)
{
    if (bucket < 0 || bucket >= PyList_GET_SIZE(self->members)) {
        PyErr_Format(PyExc_IndexError, "bucket %zd is not a bucket", bucket);
        return NULL;
    }
    return PyList_GET_ITEM(self->members, bucket);
}

static int
hold_items(PyObject *obj, Py_buffer *view, int writable, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        return -1;
    }
    if (view->itemsize != itemsize || view->len % itemsize ||
        (view->len && ((uintptr_t)view->buf & (uintptr_t)(itemsize - 1)))) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_TypeError, "BucketOps: %s is not an aligned array of %zd-byte items",
                     what, itemsize);
        return -1;
    }
    return 0;
}

/* b_live[bucket] = live, b_stale[bucket] = stale. */
static int
set_counts(BucketOpsObject *self, Py_ssize_t bucket, Py_ssize_t live, Py_ssize_t stale)
{
    Py_buffer lv, sv;
    if (hold_items(self->b_live, &lv, 1, 4, "b_live") < 0) return -1;
    if (hold_items(self->b_stale, &sv, 1, 4, "b_stale") < 0) {
        PyBuffer_Release(&lv);
        return -1;
    }
    int ok = bucket < lv.len / 4 && bucket < sv.len / 4;
    if (ok) {
        ((int32_t *)lv.buf)[bucket] = (int32_t)live;
        ((int32_t *)sv.buf)[bucket] = (int32_t)stale;
    }
    PyBuffer_Release(&sv);
    PyBuffer_Release(&lv);
    if (!ok) {
        PyErr_Format(PyExc_IndexError, "bucket %zd has no counts", bucket);
        return -1;
    }
    return 0;
}

/* Append `n` slots to `members` (an array('i')) in one frombytes. */
static int
append_slots(PyObject *members, const int32_t *slots, Py_ssize_t n)
{
    if (n == 0) return 0;
    PyObject *data = PyBytes_FromStringAndSize((const char *)slots, n * 4);
    if (data == NULL) return -1;
    PyObject *done = PyObject_CallMethod(members, "frombytes", "O", data);
    Py_DECREF(data);
    if (done == NULL) return -1;
    Py_DECREF(done);
    return 0;
}

/* Set the places of `slots` to bucket << 32 | first + i. */
static int
set_places(BucketOpsObject *self, Py_ssize_t bucket, const int32_t *slots, Py_ssize_t n,
           Py_ssize_t first)
{
    if (n == 0) return 0;
    Py_buffer rv;
    if (hold_items(self->index->records, &rv, 1, 8, "the records") < 0) return -1;
    uint64_t *rec = rv.buf;
    Py_ssize_t n_slots = rv.len / 32;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= n_slots) {
            PyBuffer_Release(&rv);
            PyErr_Format(PyExc_IndexError, "slot %d is not a slot", (int)slots[i]);
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        rec[(size_t)slots[i] * REC_WORDS + REC_PLACE] = place_of(bucket, first + i);
    }
    PyBuffer_Release(&rv);
    return 0;
}

/* compact(bucket, source) -> the bucket's live entries
 *
 * Drops the bucket's stale entries, keeping the live ones in their order; then, if
 * source >= 0, appends source's live entries in their order (source's own entries and
 * counts are left for the caller to drop). The bucket's places, live and stale counts
 * follow: the bucket then holds what Buckets.live_of([bucket, source]) read, in that
 * order, all live. */
static PyObject *
BucketOps_compact(BucketOpsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("compact", nargs, 2) < 0) return NULL;
    Py_ssize_t bucket = PyLong_AsSsize_t(args[0]);
    Py_ssize_t source = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    PyObject *members = bucket_members(self, bucket);
    if (members == NULL) return NULL;
    PyObject *source_members = NULL;
    if (source >= 0) {
        if (source == bucket) {
            PyErr_SetString(PyExc_ValueError, "compact: a bucket cannot take in itself");
            return NULL;
        }
        source_members = bucket_members(self, source);
        if (source_members == NULL) return NULL;
    }
    Py_buffer rv, mv, sv;
    if (hold_items(self->index->records, &rv, 1, 8, "the records") < 0) return NULL;
    if (hold_items(members, &mv, 1, 4, "a bucket's members") < 0) {
        PyBuffer_Release(&rv);
        return NULL;
    }
    if (source_members != NULL && hold_items(source_members, &sv, 0, 4, "a bucket's members") < 0) {
        PyBuffer_Release(&mv);
        PyBuffer_Release(&rv);
        return NULL;
    }
    uint64_t *rec = rv.buf;
    Py_ssize_t n_slots = rv.len / 32;
    int32_t *m = mv.buf;
    Py_ssize_t n = mv.len / 4, kept = 0;
    int bad = 0;
    /* In place: a live entry moves to `kept` <= its index, so no later entry of the same
     * slot (stale: the place named an earlier index) can read as live. */
    for (Py_ssize_t j = 0; j < n; j++) {
        int32_t slot = m[j];
        if (slot < 0 || slot >= n_slots) {
            bad = 1;
            break;
        }
        uint64_t *place = &rec[(size_t)slot * REC_WORDS + REC_PLACE];
        if (*place != place_of(bucket, j)) continue;
        *place = place_of(bucket, kept);
        m[kept++] = slot;
    }
    /* The source's live slots, gathered; their places change once they are appended. */
    int32_t *taken = NULL;
    Py_ssize_t n_taken = 0;
    if (!bad && source_members != NULL) {
        const int32_t *s = sv.buf;
        Py_ssize_t n_source = sv.len / 4;
        taken = PyMem_Malloc((size_t)(n_source > 0 ? n_source : 1) * sizeof(int32_t));
        if (taken == NULL) {
            PyErr_NoMemory();
            bad = 2;
        }
        for (Py_ssize_t j = 0; !bad && j < n_source; j++) {
            int32_t slot = s[j];
            if (slot < 0 || slot >= n_slots) {
                bad = 1;
                break;
            }
            if (rec[(size_t)slot * REC_WORDS + REC_PLACE] == place_of(source, j)) {
                taken[n_taken++] = slot;
            }
        }
    }
    if (source_members != NULL) PyBuffer_Release(&sv);
    PyBuffer_Release(&mv);
    PyBuffer_Release(&rv);
    if (bad == 1) PyErr_SetString(PyExc_IndexError, "compact: a bucket names a slot past the "
                                                    "records");
    /* The entries past `kept` are stale now: a consistent bucket, whatever fails next. */
    if (set_counts(self, bucket, kept, n - kept) < 0 || bad) goto fail;
    if (kept < n && PySequence_DelSlice(members, kept, n) < 0) goto fail;
    if (set_counts(self, bucket, kept, 0) < 0) goto fail;
    if (n_taken) {
        if (append_slots(members, taken, n_taken) < 0) goto fail;
        if (set_places(self, bucket, taken, n_taken, kept) < 0) goto fail;
        if (set_counts(self, bucket, kept + n_taken, 0) < 0) goto fail;
    }
    PyMem_Free(taken);
    return PyLong_FromSsize_t(kept + n_taken);
fail:
    PyMem_Free(taken);
    return NULL;
}

/* refill(bucket, slots): make `slots` (int32) the bucket's entries, in this order,
 * all live (a split's pieces). */
static PyObject *
BucketOps_refill(BucketOpsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("refill", nargs, 2) < 0) return NULL;
    Py_ssize_t bucket = PyLong_AsSsize_t(args[0]);
    if (bucket == -1 && PyErr_Occurred()) return NULL;
    PyObject *members = bucket_members(self, bucket);
    if (members == NULL) return NULL;
    Py_buffer given;
    if (hold_items(args[1], &given, 0, 4, "refill's slots") < 0) return NULL;
    Py_ssize_t n = given.len / 4;
    /* A copy: nothing of the caller's stays held while the members are resized. */
    int32_t *slots = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    if (slots == NULL) {
        PyBuffer_Release(&given);
        return PyErr_NoMemory();
    }
    if (n) memcpy(slots, given.buf, (size_t)n * sizeof(int32_t));
    PyBuffer_Release(&given);
    Py_ssize_t old = PyObject_Length(members);
    int failed = old < 0;
    failed = failed || PySequence_DelSlice(members, 0, old) < 0;
    failed = failed || set_counts(self, bucket, 0, 0) < 0;
    failed = failed || append_slots(members, slots, n) < 0;
    failed = failed || set_places(self, bucket, slots, n, 0) < 0;
    failed = failed || set_counts(self, bucket, n, 0) < 0;
    PyMem_Free(slots);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

typedef struct {
    int64_t due;
    Py_ssize_t position;
    int32_t slot;
} due_entry;

static int
by_due(const void *a, const void *b)
{
    const due_entry *x = a, *y = b;
    if (x->due != y->due) return x->due < y->due ? -1 : 1;
    return x->position < y->position ? -1 : (x->position > y->position);
}

/* The first index in sorted `e[0:n)` whose due is at least (or, `after`, past) `due`. */
static Py_ssize_t
search(const due_entry *e, Py_ssize_t n, int64_t due, int after)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (e[mid].due < due || (after && e[mid].due == due))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* sort_cut(bucket, pieces) -> [(index, due), ...]
 *
 * Sorts the bucket's entries by due time, stably (every entry live, as compact leaves
 * them), with their places; then the cut points near `pieces` equal shares, each where
 * the due time changes, with the due time at each, so no two pieces share a due time.
 * Empty when the rows share one due time. */
static PyObject *
BucketOps_sort_cut(BucketOpsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("sort_cut", nargs, 2) < 0) return NULL;
    Py_ssize_t bucket = PyLong_AsSsize_t(args[0]);
    Py_ssize_t pieces = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    PyObject *members = bucket_members(self, bucket);
    if (members == NULL) return NULL;
    Py_buffer rv, mv;
    if (hold_items(self->index->records, &rv, 1, 8, "the records") < 0) return NULL;
    if (hold_items(members, &mv, 1, 4, "a bucket's members") < 0) {
        PyBuffer_Release(&rv);
        return NULL;
    }
    uint64_t *rec = rv.buf;
    Py_ssize_t n_slots = rv.len / 32;
    int32_t *m = mv.buf;
    Py_ssize_t n = mv.len / 4;
    due_entry *e = PyMem_Malloc((size_t)(n > 0 ? n : 1) * sizeof(due_entry));
    PyObject *cuts = e == NULL ? PyErr_NoMemory() : PyList_New(0);
    for (Py_ssize_t j = 0; cuts != NULL && j < n; j++) {
        if (m[j] < 0 || m[j] >= n_slots ||
            rec[(size_t)m[j] * REC_WORDS + REC_PLACE] != place_of(bucket, j)) {
            PyErr_SetString(PyExc_ValueError, "sort_cut: the bucket holds stale entries");
            Py_CLEAR(cuts);
            break;
        }
        e[j] = (due_entry){(int64_t)rec[(size_t)m[j] * REC_WORDS + REC_DUE], j, m[j]};
    }
    if (cuts != NULL) {
        qsort(e, (size_t)n, sizeof(due_entry), by_due);
        for (Py_ssize_t j = 0; j < n; j++) {
            m[j] = e[j].slot;
            rec[(size_t)e[j].slot * REC_WORDS + REC_PLACE] = place_of(bucket, j);
        }
    }
    Py_ssize_t last = 0;
    for (Py_ssize_t piece = 1; cuts != NULL && piece < pieces && n > 0; piece++) {
        int64_t due = e[piece * n / pieces].due;
        Py_ssize_t cut = search(e, n, due, 0);
        if (cut == 0) cut = search(e, n, due, 1);
        if (!(0 < cut && cut < n && cut > last)) continue;
        last = cut;
        PyObject *pair = Py_BuildValue("(nL)", cut, (long long)e[cut].due);
        if (pair == NULL || PyList_Append(cuts, pair) < 0) Py_CLEAR(cuts);
        Py_XDECREF(pair);
    }
    PyMem_Free(e);
    PyBuffer_Release(&mv);
    PyBuffer_Release(&rv);
    return cuts;
}

static int
BucketOps_init(BucketOpsObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"index", "members", "b_live", "b_stale", NULL};
    PyObject *index, *members, *b_live, *b_stale;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "$O!O!OO", kwlist, &SlotIndexType, &index,
                                     &PyList_Type, &members, &b_live, &b_stale)) {
        return -1;
    }
    if (keeper_check_items(b_live, 4, "BucketOps b_live") < 0 ||
        keeper_check_items(b_stale, 4, "BucketOps b_stale") < 0) {
        return -1;
    }
    Py_XSETREF(self->index, (SlotIndexObject *)Py_NewRef(index));
    Py_XSETREF(self->members, Py_NewRef(members));
    Py_XSETREF(self->b_live, Py_NewRef(b_live));
    Py_XSETREF(self->b_stale, Py_NewRef(b_stale));
    return 0;
}

static int
BucketOps_bound(BucketOpsObject *self)
{
    if (self->index == NULL) {
        PyErr_SetString(PyExc_ValueError, "BucketOps was not initialised");
        return -1;
    }
    return 0;
}

static PyObject *
BucketOps_compact_checked(BucketOpsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return BucketOps_bound(self) < 0 ? NULL : BucketOps_compact(self, args, nargs);
}

static PyObject *
BucketOps_refill_checked(BucketOpsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return BucketOps_bound(self) < 0 ? NULL : BucketOps_refill(self, args, nargs);
}

static PyObject *
BucketOps_sort_cut_checked(BucketOpsObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return BucketOps_bound(self) < 0 ? NULL : BucketOps_sort_cut(self, args, nargs);
}

static void
BucketOps_dealloc(BucketOpsObject *self)
{
    Py_CLEAR(self->index);
    Py_CLEAR(self->members);
    Py_CLEAR(self->b_live);
    Py_CLEAR(self->b_stale);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef BucketOps_methods[] = {
    {"compact", (PyCFunction)(void (*)(void))BucketOps_compact_checked, METH_FASTCALL,
     "compact($self, bucket, source, /)\n--\n\n"
     "Drop the bucket's stale entries; with source >= 0, append source's live entries "
     "too. Returns the bucket's entries, all live."},
    {"refill", (PyCFunction)(void (*)(void))BucketOps_refill_checked, METH_FASTCALL,
     "refill($self, bucket, slots, /)\n--\n\n"
     "Make the int32 slots the bucket's entries, in this order, all live."},
    {"sort_cut", (PyCFunction)(void (*)(void))BucketOps_sort_cut_checked, METH_FASTCALL,
     "sort_cut($self, bucket, pieces, /)\n--\n\n"
     "Sort the bucket's (live) entries by due time, stably; the cut points near `pieces` "
     "equal shares where the due time changes, as (index, due) pairs."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject BucketOpsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "keeper._native.BucketOps",
    .tp_basicsize = sizeof(BucketOpsObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "BucketOps(*, index, members, b_live, b_stale)\n--\n\n"
              "A bucket's entries rewritten in one call (keeper/buckets.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)BucketOps_init,
    .tp_dealloc = (destructor)BucketOps_dealloc,
    .tp_methods = BucketOps_methods,
};
