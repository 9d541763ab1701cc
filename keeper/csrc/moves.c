/* The event path (keeper/queue.py, keeper/core.py): a held row moving within its
 * class, one row (upsert_moved) or a run of feed events (apply_moves), in one C call
 * with the queue's buffers held once. */
#include "native.h"

/* A view of an int32 array('i') or int64 / uint64 one, for the duration of a call. */
typedef struct {
    Py_buffer views[9];
    int n;
} held_t;

static void *
hold(held_t *h, PyObject *obj, int writable, Py_ssize_t itemsize)
{
    Py_buffer *v = &h->views[h->n];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        return NULL;
    }
    h->n++;
    if (v->itemsize != itemsize) {
        PyErr_SetString(PyExc_TypeError, "upsert_moved: an array has the wrong item size");
        return NULL;
    }
    static uint64_t nothing[1];
    return v->buf != NULL ? v->buf : (void *)nothing; /* an empty array may have no buffer */
}

static void
unhold(held_t *h)
{
    while (h->n > 0) PyBuffer_Release(&h->views[--h->n]);
}

static inline long long
list_ll(PyObject *list, Py_ssize_t i)
{
    return PyLong_AsLongLong(PyList_GET_ITEM(list, i));
}

#define NOT_HANDLED (-1)

static int view_bound(QueueViewObject *self);

/* The structures upsert_moved works on, their buffers held for a call (upsert_moved)
 * or a run of events (apply_moves). Nothing here may resize them while held: the
 * Python calls that can (a bucket's rebuild or tidy, an add) run after unhold. */
typedef struct {
    held_t h;
    const int32_t *table;
    uint64_t *rec;
    int32_t *b_class, *b_live, *b_stale, *b_split_at;
    Py_ssize_t n_slots, n_buckets;
    uint64_t mask;
    long long merge_below, stale_slack;
    PyObject *starts_of, *ids_of, *members, *tally_counts, *tally_base, *buckets;
} moved_ctx;

/* ctx from the view: every buffer held for the call, the mask from the index's length. */
static int
moved_open(moved_ctx *c, QueueViewObject *v)
{
    c->h.n = 0;
    c->merge_below = v->merge_below;
    c->stale_slack = v->stale_slack;
    c->starts_of = v->starts;
    c->ids_of = v->ids;
    c->members = v->members;
    c->tally_counts = v->tally_counts;
    c->tally_base = v->tally_base;
    c->buckets = v->buckets;
    c->table = hold(&c->h, v->index->table, 0, 4);
    c->rec = c->table ? hold(&c->h, v->index->records, 1, 8) : NULL;
    c->b_class = c->rec ? hold(&c->h, v->b_class, 0, 4) : NULL;
    c->b_live = c->b_class ? hold(&c->h, v->b_live, 1, 4) : NULL;
    c->b_stale = c->b_live ? hold(&c->h, v->b_stale, 1, 4) : NULL;
    c->b_split_at = c->b_stale ? hold(&c->h, v->b_split_at, 0, 4) : NULL;
    if (c->b_split_at == NULL) {
        unhold(&c->h);
        return -1;
    }
    Py_ssize_t places = c->h.views[0].len / 4;
    if (places == 0 || (places & (places - 1))) {
        unhold(&c->h);
        PyErr_SetString(PyExc_ValueError, "the slot index's length is not a power of two");
        return -1;
    }
    c->mask = (uint64_t)places - 1;
    c->n_slots = c->h.views[1].len / 32;
    c->n_buckets = c->h.views[2].len / 4;
    return 0;
}

/* HeldQueue.upsert's common case for one row: TRIGGERED (1), RESCHEDULED (2),
 * UNCHANGED (3); NOT_HANDLED having changed nothing; -2 on an error. A bucket that
 * now needs a rebuild (split) or a tidy is named in *split / *tidy, for the caller
 * to call once the buffers are given back. */
static long
moved_one(moved_ctx *c, uint64_t key_hash, Py_ssize_t class_id, long long due,
          unsigned long long version, long long now, Py_ssize_t *split, Py_ssize_t *tidy)
{
    const int32_t *table = c->table;
    uint64_t *rec = c->rec;
    uint64_t mask = c->mask;
    /* The slot: linear probing on the hash. */
    uint64_t at = key_hash & mask;
    int32_t slot = -1;
    for (uint64_t step = 0; step <= mask; step++) {
        int32_t s = table[at];
        if (s < 0) break;
        if (s < c->n_slots && rec[(size_t)s * 4] == key_hash) {
            slot = s;
            break;
        }
        at = (at + 1) & mask;
    }
    if (slot < 0) return NOT_HANDLED; /* a new row */
    uint64_t *r = rec + (size_t)slot * 4;
    long long old_due = (long long)r[1];
    Py_ssize_t old_bucket = (Py_ssize_t)(r[3] >> 32);
    if (old_bucket >= c->n_buckets || c->b_class[old_bucket] != class_id) return NOT_HANDLED;
    if (due == old_due) {
        r[2] = version;
        return 3; /* UNCHANGED */
    }
    if (class_id >= PyList_GET_SIZE(c->starts_of) || class_id >= PyList_GET_SIZE(c->tally_counts) ||
        class_id >= PyList_GET_SIZE(c->tally_base)) {
        return NOT_HANDLED;
    }
    /* The tallies: both minutes inside the class's dense range, or not handled here. */
    long long minute = due >= 0 ? due / 60000 : -((-due + 59999) / 60000);
    long long old_minute = old_due >= 0 ? old_due / 60000 : -((-old_due + 59999) / 60000);
    Py_buffer counts_view;
    int32_t *counts = NULL;
    long long first = 0;
    if (minute != old_minute) {
        first = list_ll(c->tally_base, class_id);
        if (first == -1 && PyErr_Occurred()) return -2;
        PyObject *arr = PyList_GET_ITEM(c->tally_counts, class_id);
        if (PyObject_GetBuffer(arr, &counts_view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
            return -2;
        }
        if (counts_view.itemsize != 4) {
            PyBuffer_Release(&counts_view);
            PyErr_SetString(PyExc_TypeError, "upsert_moved: tallies of the wrong item size");
            return -2;
        }
        counts = counts_view.buf;
        long long n_counts = counts_view.len / 4;
        if (!(0 <= old_minute - first && old_minute - first < n_counts && 0 <= minute - first &&
              minute - first < n_counts)) {
            PyBuffer_Release(&counts_view);
            return NOT_HANDLED;
        }
    }
    long result = NOT_HANDLED;
    /* The bucket: the last whose start is at or before due. */
    PyObject *starts = PyList_GET_ITEM(c->starts_of, class_id);
    PyObject *ids = PyList_GET_ITEM(c->ids_of, class_id);
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(starts);
    if (hi == 0 || PyList_GET_SIZE(ids) != hi) goto out;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        long long start = list_ll(starts, mid);
        if (start == -1 && PyErr_Occurred()) {
            result = -2;
            goto out;
        }
        if (due < start)
            hi = mid;
        else
            lo = mid + 1;
    }
    if (lo == 0) goto out; /* before the class's first bucket: lower_first, in Python */
    Py_ssize_t target = PyLong_AsSsize_t(PyList_GET_ITEM(ids, lo - 1));
    if (target == -1 && PyErr_Occurred()) {
        result = -2;
        goto out;
    }
    if (target < 0 || target >= c->n_buckets || target >= PyList_GET_SIZE(c->members)) goto out;
    if (target != old_bucket) {
        /* Push first: the new place makes the old entry stale before the old bucket
         * looks at its entries. */
        PyObject *target_members = PyList_GET_ITEM(c->members, target);
        Py_ssize_t index = PyObject_Length(target_members);
        PyObject *boxed = index < 0 ? NULL : PyLong_FromLong(slot);
        PyObject *appended =
            boxed ? PyObject_CallMethodOneArg(target_members, keeper_append_name, boxed) : NULL;
        Py_XDECREF(boxed);
        if (appended == NULL) {
            result = -2;
            goto out;
        }
        Py_DECREF(appended);
        r[3] = ((uint64_t)target << 32) | (uint64_t)index;
        c->b_live[target] += 1;
        if (index + 1 >= c->b_split_at[target]) *split = target;
        int32_t left = c->b_live[old_bucket] - 1;
        c->b_live[old_bucket] = left;
        int32_t stale = c->b_stale[old_bucket] + 1;
        c->b_stale[old_bucket] = stale;
        if (left < c->merge_below || stale > left + c->stale_slack) *tidy = old_bucket;
    }
    r[1] = (uint64_t)due;
    r[2] = version;
    if (counts != NULL) {
        counts[old_minute - first] -= 1;
        counts[minute - first] += 1;
    }
    result = (due <= now && now < old_due) ? 1 : 2; /* TRIGGERED : RESCHEDULED */
out:
    if (counts != NULL) PyBuffer_Release(&counts_view);
    return result;
}

/* The rebuild and tidy a move asked for, once the buffers are given back. */
static int
moved_finish(PyObject *buckets, Py_ssize_t split, Py_ssize_t tidy)
{
    if (split >= 0) {
        PyObject *kw = Py_BuildValue("{s:O}", "split", Py_True);
        PyObject *pos = kw ? Py_BuildValue("(n)", split) : NULL;
        PyObject *rebuild = pos ? PyObject_GetAttrString(buckets, "rebuild") : NULL;
        PyObject *ok = rebuild ? PyObject_Call(rebuild, pos, kw) : NULL;
        Py_XDECREF(kw);
        Py_XDECREF(pos);
        Py_XDECREF(rebuild);
        if (ok == NULL) return -1;
        Py_DECREF(ok);
    }
    if (tidy >= 0) {
        PyObject *ok = PyObject_CallMethod(buckets, "tidy", "n", tidy);
        if (ok == NULL) return -1;
        Py_DECREF(ok);
    }
    return 0;
}

/* upsert_moved(key_hash, class_id, due, version, now)
 *   -> TRIGGERED (1), RESCHEDULED (2), UNCHANGED (3), or -1
 *
 * The common case of HeldQueue.upsert (keeper/queue.py), whole: a held row that stays
 * in its class, whose old and new due minutes are in the class's dense tally range,
 * and whose new due time is not before the class's first bucket. Anything else
 * returns -1 having changed nothing, and the Python path runs. A bucket left needing
 * a rebuild or a tidy gets it through the Buckets (after every buffer is given back:
 * those calls resize arrays). */
static PyObject *
QueueView_upsert_moved(QueueViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("upsert_moved", nargs, 5) < 0 || view_bound(self) < 0) return NULL;
    uint64_t key_hash = PyLong_AsUnsignedLongLong(args[0]);
    Py_ssize_t class_id = PyLong_AsSsize_t(args[1]);
    long long due = PyLong_AsLongLong(args[2]);
    unsigned long long version = PyLong_AsUnsignedLongLong(args[3]);
    long long now = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    moved_ctx c;
    if (moved_open(&c, self) < 0) return NULL;
    Py_ssize_t split = -1, tidy = -1;
    long result = moved_one(&c, key_hash, class_id, due, version, now, &split, &tidy);
    unhold(&c.h);
    if (result == -2 || moved_finish(c.buckets, split, tidy) < 0) return NULL;
    return PyLong_FromLong(result);
}

/* One feed row's fields (borrowed), checked as KeeperCore._apply_rows checks them, its
 * class found in the shape's cache, touched recorded, then moved: moved_one's result,
 * NOT_HANDLED having changed nothing (anything doubtful, for the Python loop, which logs
 * and counts it), -2 on an error. `cadence`: the scheduled one (learned first). Both
 * apply_moves (RowEvents) and apply_records (the feed's records) take a row through it. */
static long
move_checked(moved_ctx *c, FeedShapeObject *shape, PyObject *due_o, PyObject *version_o,
             PyObject *cadence_o, PyObject *route_o, PyObject *sitemap_o, PyObject *boxed_hash,
             uint64_t h, PyObject *touched, PyObject *epoch, long long now, Py_ssize_t *split,
             Py_ssize_t *tidy)
{
    if (!PyLong_CheckExact(due_o) || !PyLong_CheckExact(version_o) ||
        !(cadence_o == Py_None || PyLong_CheckExact(cadence_o))) {
        return NOT_HANDLED;
    }
    int overflow = 0;
    long long due = PyLong_AsLongLongAndOverflow(due_o, &overflow);
    if (overflow || due < 0 || due >= shape->max_due) return NOT_HANDLED;
    long long version = PyLong_AsLongLongAndOverflow(version_o, &overflow);
    if (overflow || version < 0) return NOT_HANDLED;
    if (cadence_o != Py_None) {
        long long cadence = PyLong_AsLongLongAndOverflow(cadence_o, &overflow);
        if (overflow || cadence <= 0) return NOT_HANDLED;
    }
    PyObject *class_key = PyTuple_Pack(3, route_o, cadence_o, sitemap_o);
    if (class_key == NULL) return -2;
    PyObject *cls = PyDict_GetItemWithError(shape->class_cache, class_key); /* borrowed */
    Py_DECREF(class_key);
    if (cls == NULL) {
        if (PyErr_Occurred()) PyErr_Clear(); /* unhashable: the Python loop says so */
        return NOT_HANDLED;
    }
    Py_ssize_t class_id = PyLong_AsSsize_t(cls);
    if (class_id == -1 && PyErr_Occurred()) return -2;
    if (touched != Py_None && PyDict_SetItem(touched, boxed_hash, epoch) < 0) return -2;
    return moved_one(c, h, class_id, due, (unsigned long long)version, now, split, tidy);
}

/* A hash from the hashes list: 0 with *h set, 1 for a key the Python loop encodes by
 * itself (-1, or anything negative), -1 on an error. */
static int
hash_at(PyObject *hashes, Py_ssize_t i, uint64_t *h)
{
    PyObject *boxed = PyList_GET_ITEM(hashes, i);
    int negative = 0;
    long long signed_hash = PyLong_AsLongLongAndOverflow(boxed, &negative);
    if (signed_hash == -1 && PyErr_Occurred()) return -1;
    if (negative < 0 || (negative == 0 && signed_hash < 0)) return 1;
    *h = PyLong_AsUnsignedLongLong(boxed);
    if (*h == (uint64_t)-1 && PyErr_Occurred()) return -1;
    return 0;
}

/* tally[j] += counted[j] for the moves a run made (TRIGGERED, RESCHEDULED, UNCHANGED). */
static int
add_tally(PyObject *tally, const long *counted)
{
    for (int j = 1; j < 4; j++) {
        if (!counted[j]) continue;
        PyObject *more = PyLong_FromLong(counted[j]);
        PyObject *sum = more ? PyNumber_Add(PyList_GET_ITEM(tally, j), more) : NULL;
        Py_XDECREF(more);
        if (sum == NULL) return -1;
        PyList_SetItem(tally, j, sum); /* steals sum, releases old */
    }
    return 0;
}

/* apply_moves(events, start, hashes, shape, touched, epoch, now, tally) -> the next index
 *
 * KeeperCore._apply_rows's loop for a run of events that move held rows within their
 * class, from events[start]: the same checks and the same moves as the Python loop,
 * one C loop with the buffers held once. It stops at the first event it does not
 * take whole (not a row event of the shape's type, a delete, a retired row, a bad hash,
 * a row that fails a check, a class not yet in the shape's class cache, anything upsert_moved
 * does not handle) and returns its index, for the Python loop; or after an event
 * whose bucket needs a rebuild or tidy (done here, buffers given back), returning the
 * index after it. tally[result] += 1 for each event taken; touched[hash] = epoch if
 * touched is not None. */
static PyObject *
QueueView_apply_moves(QueueViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("apply_moves", nargs, 8) < 0 || view_bound(self) < 0) return NULL;
    PyObject *events = args[0], *hashes = args[2];
    PyObject *touched = args[4], *epoch = args[5], *tally = args[7];
    if (!PyObject_TypeCheck(args[3], &FeedShapeType) ||
        ((FeedShapeObject *)args[3])->row_type == NULL) {
        PyErr_SetString(PyExc_TypeError, "apply_moves: the shape is a FeedShape");
        return NULL;
    }
    FeedShapeObject *shape = (FeedShapeObject *)args[3];
    PyObject *row_event_type = shape->row_type;
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    long long now = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (!PyList_Check(events) || !PyList_Check(hashes) || !PyList_Check(tally) ||
        PyList_GET_SIZE(tally) < 4 || PyList_GET_SIZE(hashes) != PyList_GET_SIZE(events) ||
        (touched != Py_None && !PyDict_Check(touched))) {
        PyErr_SetString(PyExc_TypeError, "apply_moves: events and hashes lists of one length, "
                                         "a tally list, touched a dict or None");
        return NULL;
    }
    static PyObject *s_row, *s_key, *s_route, *s_cadence, *s_sitemap, *s_due, *s_version,
        *s_learned, *s_retired;
    if (s_row == NULL) {
        s_learned = PyUnicode_InternFromString("learned_cadence_s");
        s_retired = PyUnicode_InternFromString("retired_at");
        if (!s_learned || !s_retired) return NULL;
        s_row = PyUnicode_InternFromString("row");
        s_key = PyUnicode_InternFromString("key");
        s_route = PyUnicode_InternFromString("route");
        s_cadence = PyUnicode_InternFromString("cadence_s");
        s_sitemap = PyUnicode_InternFromString("sitemap");
        s_due = PyUnicode_InternFromString("next_render_at");
        s_version = PyUnicode_InternFromString("version");
        if (!s_row || !s_key || !s_route || !s_cadence || !s_sitemap || !s_due || !s_version ||
            !s_retired) {
            return NULL;
        }
    }
    Py_ssize_t n = PyList_GET_SIZE(events), i = start;
    if (i >= n) return PyLong_FromSsize_t(i);
    /* A run that cannot start (a delete, or not a row event) costs no buffers. */
    PyObject *first = PyList_GET_ITEM(events, i);
    if ((PyObject *)Py_TYPE(first) != row_event_type) return PyLong_FromSsize_t(i);
    PyObject *first_row = PyObject_GetAttr(first, s_row);
    if (first_row == NULL) return NULL;
    Py_DECREF(first_row); /* the event still holds it */
    if (first_row == Py_None) return PyLong_FromSsize_t(i);
    moved_ctx c;
    if (moved_open(&c, self) < 0) return NULL;
    Py_ssize_t split = -1, tidy = -1;
    long counted[4] = {0, 0, 0, 0};
    int failed = 0;
    for (; i < n && split < 0 && tidy < 0; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        if ((PyObject *)Py_TYPE(event) != row_event_type) break;
        /* A hash is a uint64; -1 marks a key the Python loop encodes by itself. */
        PyObject *boxed_hash = PyList_GET_ITEM(hashes, i);
        uint64_t h = 0;
        int hashed = hash_at(hashes, i, &h);
        if (hashed < 0) {
            failed = 1;
            break;
        }
        if (hashed > 0) break;
        PyObject *row = PyObject_GetAttr(event, s_row);
        if (row == NULL) {
            failed = 1;
            break;
        }
        PyObject *f[8] = {NULL};
        long result = NOT_HANDLED;
        if (row == Py_None) goto next;
        f[0] = PyObject_GetAttr(row, s_due);
        f[1] = f[0] ? PyObject_GetAttr(row, s_version) : NULL;
        /* The row's scheduled cadence: what it learned (store.cadence), else its own. */
        f[2] = f[1] ? PyObject_GetAttr(row, s_learned) : NULL;
        if (f[2] == Py_None) {
            Py_DECREF(f[2]);
            f[2] = PyObject_GetAttr(row, s_cadence);
        }
        f[3] = f[2] ? PyObject_GetAttr(row, s_key) : NULL;
        f[4] = f[3] ? PyObject_GetAttr(event, s_key) : NULL;
        f[5] = f[4] ? PyObject_GetAttr(row, s_route) : NULL;
        f[6] = f[5] ? PyObject_GetAttr(row, s_sitemap) : NULL;
        f[7] = f[6] ? PyObject_GetAttr(row, s_retired) : NULL;
        if (f[7] == NULL) {
            result = -2;
            goto next;
        }
        /* A retired row leaves the queue and is counted apart: the Python loop's. */
        if (f[7] != Py_None) goto next;
        if (!PyUnicode_CheckExact(f[3]) || !PyUnicode_CheckExact(f[4])) goto next;
        int same = PyUnicode_Compare(f[3], f[4]);
        if (same == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto next;
        }
        if (same != 0) goto next;
        result = move_checked(&c, shape, f[0], f[1], f[2], f[5], f[6], boxed_hash, h, touched,
                              epoch, now, &split, &tidy);
    next:
        Py_DECREF(row);
        for (int j = 0; j < 8; j++) Py_XDECREF(f[j]);
        if (result == -2) {
            failed = 1;
            break;
        }
        if (result == NOT_HANDLED) break;
        counted[result]++;
    }
    unhold(&c.h);
    if (!failed && add_tally(tally, counted) < 0) failed = 1;
    if (failed || moved_finish(c.buckets, split, tidy) < 0) return NULL;
    return PyLong_FromSsize_t(i);
}

/* The positions in a feed record (store.rows.RowRecord: seq, kind, key, stamp, then the
 * row's columns after its key, all None for a key whose row is gone). */
enum {
    FEED_KEY = 2,
    FEED_ROUTE = 4,
    FEED_CADENCE = 5,
    FEED_SITEMAP = 6,
    FEED_DUE = 7,
    FEED_VERSION = 10,
    FEED_LEARNED = 11,
    FEED_RETIRED = 14,
    FEED_FIELDS = 16,
};

/* How far ahead apply_records touches the slot index (PREFETCH_SLOT) and then the
 * record the index names (PREFETCH_RECORD): a batch's keys are random in tables of
 * megabytes, so each move waits on a cache miss for each, one after the other, unless
 * the next keys' are under way meanwhile. */
#define PREFETCH_SLOT 8
#define PREFETCH_RECORD 4

/* apply_records(records, start, hashes, shape, touched, epoch, now, tally) -> the next index
 *
 * apply_moves for the feed's records themselves (KeeperCore.apply_records), so a batch
 * of moves makes no Row and no RowEvent: the same checks and moves, each field read
 * from its place in the record, the sitemap flag as the bool a Row would hold.
 * `hashes`: the records' key hashes, a uint64 array (shm.key_hashes). It stops where
 * apply_moves would, and also at a record that is not a tuple of the record's length
 * or whose sitemap is not 0 or 1; the caller takes those as events. */
static PyObject *
QueueView_apply_records(QueueViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("apply_records", nargs, 8) < 0 || view_bound(self) < 0) return NULL;
    PyObject *records = args[0];
    PyObject *touched = args[4], *epoch = args[5], *tally = args[7];
    if (!PyObject_TypeCheck(args[3], &FeedShapeType) ||
        ((FeedShapeObject *)args[3])->class_cache == NULL) {
        PyErr_SetString(PyExc_TypeError, "apply_records: the shape is a FeedShape");
        return NULL;
    }
    FeedShapeObject *shape = (FeedShapeObject *)args[3];
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    long long now = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (!PyList_Check(records) || !PyList_Check(tally) || PyList_GET_SIZE(tally) < 4 ||
        (touched != Py_None && !PyDict_Check(touched))) {
        PyErr_SetString(PyExc_TypeError, "apply_records: records a list, a tally list, touched "
                                         "a dict or None");
        return NULL;
    }
    Py_buffer hashes_view;
    if (PyObject_GetBuffer(args[2], &hashes_view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(records), i = start;
    if (hashes_view.itemsize != 8 || hashes_view.len != n * 8) {
        PyBuffer_Release(&hashes_view);
        PyErr_SetString(PyExc_TypeError, "apply_records: hashes are uint64, one a record");
        return NULL;
    }
    const uint64_t *hashes = hashes_view.buf;
    if (i < 0 || i >= n) {
        PyBuffer_Release(&hashes_view);
        return PyLong_FromSsize_t(i < 0 ? 0 : i);
    }
    moved_ctx c;
    if (moved_open(&c, self) < 0) {
        PyBuffer_Release(&hashes_view);
        return NULL;
    }
    Py_ssize_t split = -1, tidy = -1;
    long counted[4] = {0, 0, 0, 0};
    int failed = 0;
    for (Py_ssize_t j = i; j < n && j < i + PREFETCH_SLOT; j++) {
        __builtin_prefetch(&c.table[hashes[j] & c.mask]);
    }
    for (; i < n && split < 0 && tidy < 0; i++) {
        if (i + PREFETCH_SLOT < n) __builtin_prefetch(&c.table[hashes[i + PREFETCH_SLOT] & c.mask]);
        if (i + PREFETCH_RECORD < n) {
            int32_t ahead = c.table[hashes[i + PREFETCH_RECORD] & c.mask];
            if (ahead >= 0 && ahead < c.n_slots) __builtin_prefetch(c.rec + (size_t)ahead * 4);
        }
        PyObject *r = PyList_GET_ITEM(records, i);
        if (!PyTuple_CheckExact(r) || PyTuple_GET_SIZE(r) != FEED_FIELDS) break;
        PyObject *route = PyTuple_GET_ITEM(r, FEED_ROUTE);
        /* A delete (no row), a retired row, a key that is not text: the Python loop's. */
        if (route == Py_None || PyTuple_GET_ITEM(r, FEED_RETIRED) != Py_None ||
            !PyUnicode_CheckExact(PyTuple_GET_ITEM(r, FEED_KEY))) {
            break;
        }
        /* The class cache's keys hold the Row's bool (row_from: bool(sitemap)). */
        PyObject *flag = PyTuple_GET_ITEM(r, FEED_SITEMAP);
        if (!PyLong_CheckExact(flag)) break;
        int overflow = 0;
        long long bit = PyLong_AsLongLongAndOverflow(flag, &overflow);
        if (overflow || (bit != 0 && bit != 1)) break;
        PyObject *cadence = PyTuple_GET_ITEM(r, FEED_LEARNED);
        if (cadence == Py_None) cadence = PyTuple_GET_ITEM(r, FEED_CADENCE);
        /* touched is keyed by the hash as Python holds it: boxed only while a window is
         * open (a walk). */
        PyObject *boxed_hash = NULL;
        if (touched != Py_None) {
            boxed_hash = PyLong_FromUnsignedLongLong(hashes[i]);
            if (boxed_hash == NULL) {
                failed = 1;
                break;
            }
        }
        long result = move_checked(&c, shape, PyTuple_GET_ITEM(r, FEED_DUE),
                                   PyTuple_GET_ITEM(r, FEED_VERSION), cadence, route,
                                   bit ? Py_True : Py_False, boxed_hash, hashes[i], touched,
                                   epoch, now, &split, &tidy);
        Py_XDECREF(boxed_hash);
        if (result == -2) {
            failed = 1;
            break;
        }
        if (result == NOT_HANDLED) break;
        counted[result]++;
    }
    unhold(&c.h);
    PyBuffer_Release(&hashes_view);
    if (!failed && add_tally(tally, counted) < 0) failed = 1;
    if (failed || moved_finish(c.buckets, split, tidy) < 0) return NULL;
    return PyLong_FromSsize_t(i);
}

/* ---------------------------------------------------------------- QueueView */

static int
view_bound(QueueViewObject *self)
{
    if (self->index == NULL) {
        PyErr_SetString(PyExc_ValueError, "QueueView was not initialised");
        return -1;
    }
    return 0;
}

static void
QueueView_clear(QueueViewObject *self)
{
    Py_CLEAR(self->index);
    Py_CLEAR(self->b_class);
    Py_CLEAR(self->b_live);
    Py_CLEAR(self->b_stale);
    Py_CLEAR(self->b_split_at);
    Py_CLEAR(self->starts);
    Py_CLEAR(self->ids);
    Py_CLEAR(self->members);
    Py_CLEAR(self->tally_counts);
    Py_CLEAR(self->tally_base);
    Py_CLEAR(self->buckets);
}

static int
QueueView_init(QueueViewObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"index",   "b_class",      "b_live",     "b_stale",
                             "b_split_at", "starts",    "ids",        "members",
                             "tally_counts", "tally_base", "buckets", "merge_below",
                             "stale_slack", NULL};
    PyObject *o[11] = {NULL};
    long long merge_below = -1, stale_slack = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|$OOOOOOOOOOOLL", kwlist, &o[0], &o[1], &o[2],
                                     &o[3], &o[4], &o[5], &o[6], &o[7], &o[8], &o[9], &o[10],
                                     &merge_below, &stale_slack)) {
        return -1;
    }
    for (int i = 0; i < 11; i++) {
        if (o[i] == NULL) {
            PyErr_Format(PyExc_TypeError, "QueueView() wants %s", kwlist[i]);
            return -1;
        }
    }
    if (merge_below < 0 || stale_slack < 0) {
        PyErr_SetString(PyExc_TypeError, "QueueView() wants merge_below and stale_slack >= 0");
        return -1;
    }
    if (!PyObject_TypeCheck(o[0], &SlotIndexType) || ((SlotIndexObject *)o[0])->table == NULL) {
        PyErr_SetString(PyExc_TypeError, "QueueView: index is a SlotIndex");
        return -1;
    }
    for (int i = 1; i <= 4; i++) {
        if (keeper_check_items(o[i], 4, kwlist[i]) < 0) return -1;
    }
    for (int i = 5; i <= 9; i++) {
        if (!PyList_Check(o[i])) {
            PyErr_Format(PyExc_TypeError, "QueueView: %s is a list", kwlist[i]);
            return -1;
        }
    }
    QueueView_clear(self);
    PyObject **fields[11] = {(PyObject **)&self->index, &self->b_class, &self->b_live,
                             &self->b_stale, &self->b_split_at, &self->starts, &self->ids,
                             &self->members, &self->tally_counts, &self->tally_base,
                             &self->buckets};
    for (int i = 0; i < 11; i++) *fields[i] = Py_NewRef(o[i]);
    self->merge_below = merge_below;
    self->stale_slack = stale_slack;
    return 0;
}

static void
QueueView_dealloc(QueueViewObject *self)
{
    QueueView_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
QueueView_best_read(QueueViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (view_bound(self) < 0) return NULL;
    return keeper_best_read(self, args, nargs);
}

static PyObject *
QueueView_skip_rows(QueueViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (view_bound(self) < 0) return NULL;
    return keeper_skip_rows(self, args, nargs);
}

static PyMethodDef QueueView_methods[] = {
    {"best_read", (PyCFunction)(void (*)(void))QueueView_best_read, METH_FASTCALL,
     "best_read($self, cadence, boost, paused, now, out, skips, /)\n--\n\n"
     "The best out.size due rows of unpaused classes into out, best first, passing over "
     "rows the skip table (slot, until, tag) holds (None: none): "
     "(count, considered, next_upper, skipped)."},
    {"skip_rows", (PyCFunction)(void (*)(void))QueueView_skip_rows, METH_FASTCALL,
     "skip_rows($self, slots, until, skips, now, tags, /)\n--\n\n"
     "Pass over each slot's row in best_read until its end (epoch ms), while the row "
     "keeps its hash and version (tags None: the rows' now): (written, taken)."},
    {"upsert_moved", (PyCFunction)(void (*)(void))QueueView_upsert_moved, METH_FASTCALL,
     "upsert_moved($self, key_hash, class_id, due, version, now, /)\n--\n\n"
     "HeldQueue.upsert's common case: TRIGGERED, RESCHEDULED, UNCHANGED, or -1 having "
     "changed nothing."},
    {"apply_moves", (PyCFunction)(void (*)(void))QueueView_apply_moves, METH_FASTCALL,
     "apply_moves($self, events, start, hashes, shape, touched, epoch, now, tally, /)\n--\n\n"
     "KeeperCore._apply_rows's loop over a run of held rows moving within their class: "
     "the index of the first event not taken."},
    {"apply_records", (PyCFunction)(void (*)(void))QueueView_apply_records, METH_FASTCALL,
     "apply_records($self, records, start, hashes, shape, touched, epoch, now, tally, /)\n--\n\n"
     "apply_moves over the feed's records (seq, kind, key, stamp, the row's columns): "
     "the index of the first record not taken."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject QueueViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "keeper._native.QueueView",
    .tp_basicsize = sizeof(QueueViewObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "QueueView(*, index, b_class, b_live, b_stale, b_split_at, starts, ids, members, "
              "tally_counts, tally_base, buckets, merge_below, stale_slack)\n--\n\n"
              "The held queue's structures, bound once by name, for its C paths.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)QueueView_init,
    .tp_dealloc = (destructor)QueueView_dealloc,
    .tp_methods = QueueView_methods,
};

/* ---------------------------------------------------------------- FeedShape */

static int
FeedShape_init(FeedShapeObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"row_type", "class_cache", "max_due", NULL};
    PyObject *row_type, *cache;
    long long max_due;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!L", kwlist, &PyType_Type, &row_type,
                                     &PyDict_Type, &cache, &max_due)) {
        return -1;
    }
    Py_XSETREF(self->row_type, Py_NewRef(row_type));
    Py_XSETREF(self->class_cache, Py_NewRef(cache));
    self->max_due = max_due;
    return 0;
}

static void
FeedShape_dealloc(FeedShapeObject *self)
{
    Py_CLEAR(self->row_type);
    Py_CLEAR(self->class_cache);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyTypeObject FeedShapeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "keeper._native.FeedShape",
    .tp_basicsize = sizeof(FeedShapeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "FeedShape(row_type, class_cache, max_due)\n--\n\n"
              "What apply_moves takes a feed row event to be: exactly of row_type, its "
              "class found in class_cache (which the classifier fills), due before max_due.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FeedShape_init,
    .tp_dealloc = (destructor)FeedShape_dealloc,
};
