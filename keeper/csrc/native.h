/* keeper._native: the keeper's C paths, behind five small types.
 *
 *   index.c   SlotIndex: the slot table's index (keeper/slots.py), bound to its
 *             records and index arrays: bulk find and insert by key hash.
 *   select.c  Picked: the five columns a best-K read fills (slot, rank, due, hash,
 *             class), checked once; keep_unblocked compacts them.
 *             QueueView.best_read: the merge over class heads (keeper/select.py).
 *   moves.c   QueueView: the held queue's structures (keeper/queue.py, buckets.py,
 *             tallies.py) bound once, by name; upsert_moved and apply_moves, the
 *             event path's common case. FeedShape: what a feed row event looks like
 *             to apply_moves (its type, the classifier's cache, the due bound).
 *   buckets.c BucketOps: a bucket's entries rewritten (keeper/buckets.py): stale
 *             entries dropped, a neighbour's taken in, or given slots made its own.
 *   module.c  the module.
 *
 * The objects hold references to the Python structures, never their buffers: the
 * arrays grow in place (an append, an index doubling), which an exported buffer
 * would forbid, so each call acquires the buffers it uses and gives them back before
 * it runs any Python that may resize them. What a call may assume (list types, item
 * sizes) is checked once, when the object is made.
 *
 * The Python paths these replace are kept once, as the fallback for what the C does
 * not take and as the reference the tests compare the C with
 * (tests/test_keeper_native.py).
 */
#ifndef RENDERQUEUE_KEEPER_NATIVE_H
#define RENDERQUEUE_KEEPER_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define KEEPER_INTERNAL __attribute__((visibility("hidden")))

/* A slot's record: four uint64 words (keeper/slots.py). */
enum { REC_HASH = 0, REC_DUE = 1, REC_VERSION = 2, REC_PLACE = 3, REC_WORDS = 4 };

typedef struct {
    PyObject_HEAD
    PyObject *records; /* array('Q') of REC_WORDS per slot */
    PyObject *table;   /* array('i') of slot numbers, -1 empty; its length a power of two */
} SlotIndexObject;

typedef struct {
    PyObject_HEAD
    /* Held for the object's life: the columns are fixed-size numpy arrays. */
    Py_buffer views[5];
    int held;
    int32_t *slot;
    double *rank;
    int64_t *due;
    uint64_t *hash;
    int32_t *class_id;
    Py_ssize_t n;
} PickedObject;

typedef struct {
    PyObject_HEAD
    SlotIndexObject *index;
    PyObject *b_class, *b_live, *b_stale, *b_split_at; /* array('i') per bucket */
    PyObject *starts, *ids;                          /* per class, lists of ints */
    PyObject *members;                               /* per bucket, array('i') of slots */
    PyObject *tally_counts, *tally_base;             /* per class: array('i'), first minute */
    PyObject *buckets;                               /* the Buckets, for rebuild and tidy */
    long long merge_below, stale_slack;
} QueueViewObject;

typedef struct {
    PyObject_HEAD
    PyObject *row_type;    /* the feed's row event type, matched exactly */
    PyObject *class_cache; /* dict (route, cadence_s, sitemap) -> class id */
    long long max_due;     /* due times at or past it are refused */
} FeedShapeObject;

KEEPER_INTERNAL extern PyTypeObject SlotIndexType;
KEEPER_INTERNAL extern PyTypeObject PickedType;
KEEPER_INTERNAL extern PyTypeObject QueueViewType;
KEEPER_INTERNAL extern PyTypeObject FeedShapeType;
KEEPER_INTERNAL extern PyTypeObject BucketOpsType;

/* QueueView's methods that live in select.c (the rest are moves.c's). */
KEEPER_INTERNAL PyObject *keeper_best_read(QueueViewObject *self, PyObject *const *args,
                                           Py_ssize_t nargs);
KEEPER_INTERNAL PyObject *keeper_skip_rows(QueueViewObject *self, PyObject *const *args,
                                           Py_ssize_t nargs);

/* "append", interned at import (module.c). */
KEEPER_INTERNAL extern PyObject *keeper_append_name;

/* Acquire the index's table and records for a call: the table as int32 of a power-of-two
 * length (*mask its length - 1), the records as 32-byte records, 8-aligned. */
KEEPER_INTERNAL int keeper_index_acquire(SlotIndexObject *index, int table_writable,
                                         int records_writable, Py_buffer *table,
                                         Py_buffer *records, uint64_t *mask);

/* A buffer's check at construction: C-contiguous, of the item size given. */
KEEPER_INTERNAL int keeper_check_items(PyObject *obj, Py_ssize_t itemsize, const char *what);

static inline int
keeper_check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

#endif /* RENDERQUEUE_KEEPER_NATIVE_H */
