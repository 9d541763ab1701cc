/* The best-K read (keeper/select.py): the merge over class heads, and the columns it
 * fills.
 *
 * In Python the read was a series of numpy calls per batch of buckets plus a heap of
 * tuples; here it is one pass over the buckets' entries. The structures are the
 * queue's own (keeper/buckets.py, slots.py): per class a list of bucket starts and
 * ids, each bucket an array('i') of slots, and the records array('Q') of (hash, due,
 * version, place) per slot. Nothing is written to them.
 *
 *   QueueView.best_read(cadence, boost, paused, now, out: Picked, skips)
 *     -> (count, considered, next_upper, skipped)
 *
 * Buckets are taken in order of their upper bound (the rank at their start) from a
 * heap of class heads; a bucket's live, due entries are ranked. Reading stops once
 * `need` rows (out's size) are in hand and no untaken bucket's upper bound beats the
 * need-th best rank read. The best `need` (or all, if fewer) are written best first,
 * and `next_upper` is the best untaken bucket's upper bound (-inf if none): every row
 * outside the result ranks at or below the last one written.
 */
#include "native.h"
#include "skips.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double upper;
    Py_ssize_t class_id;
    Py_ssize_t index; /* bucket index within the class */
    Py_ssize_t end;   /* buckets of the class starting at or before now */
} head_t;

typedef struct {
    head_t *items;
    Py_ssize_t n;
} heap_t;

static void
heap_push(heap_t *h, head_t item)
{
    Py_ssize_t i = h->n++;
    while (i > 0) {
        Py_ssize_t parent = (i - 1) / 2;
        if (h->items[parent].upper >= item.upper) break;
        h->items[i] = h->items[parent];
        i = parent;
    }
    h->items[i] = item;
}

static head_t
heap_pop(heap_t *h)
{
    head_t top = h->items[0];
    head_t last = h->items[--h->n];
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t child = 2 * i + 1;
        if (child >= h->n) break;
        if (child + 1 < h->n && h->items[child + 1].upper > h->items[child].upper) child++;
        if (last.upper >= h->items[child].upper) break;
        h->items[i] = h->items[child];
        i = child;
    }
    if (h->n > 0) h->items[i] = last;
    return top;
}

/* Rows read so far: slot, rank, and the class they came from. */
typedef struct {
    int32_t *slot;
    double *rank;
    int32_t *class_id;
    Py_ssize_t n, cap;
} rows_t;

static int
rows_reserve(rows_t *r, Py_ssize_t more)
{
    if (r->n + more <= r->cap) return 0;
    Py_ssize_t cap = r->cap ? r->cap : 4096;
    while (cap < r->n + more) cap *= 2;
    int32_t *slot = PyMem_Realloc(r->slot, (size_t)cap * sizeof(int32_t));
    if (slot == NULL) return -1;
    r->slot = slot;
    double *rank = PyMem_Realloc(r->rank, (size_t)cap * sizeof(double));
    if (rank == NULL) return -1;
    r->rank = rank;
    int32_t *cls = PyMem_Realloc(r->class_id, (size_t)cap * sizeof(int32_t));
    if (cls == NULL) return -1;
    r->class_id = cls;
    r->cap = cap;
    return 0;
}

/* An order-preserving unsigned key of a double: larger rank, smaller key, so an
 * ascending sort of keys is best first. */
static inline uint64_t
desc_key(double rank)
{
    uint64_t bits;
    memcpy(&bits, &rank, 8);
    uint64_t asc = (bits & 0x8000000000000000ULL) ? ~bits : bits | 0x8000000000000000ULL;
    return ~asc;
}

/* The value at position `nth` (0-based) of `keys` in ascending order; reorders keys. */
static uint64_t
nth_key(uint64_t *keys, Py_ssize_t n, Py_ssize_t nth)
{
    Py_ssize_t lo = 0, hi = n - 1;
    while (lo < hi) {
        uint64_t pivot = keys[lo + (hi - lo) / 2];
        Py_ssize_t i = lo, j = hi;
        while (i <= j) {
            while (keys[i] < pivot) i++;
            while (keys[j] > pivot) j--;
            if (i <= j) {
                uint64_t t = keys[i];
                keys[i] = keys[j];
                keys[j] = t;
                i++;
                j--;
            }
        }
        if (nth <= j)
            hi = j;
        else if (nth >= i)
            lo = i;
        else
            return keys[nth];
    }
    return keys[nth];
}

/* LSD radix sort of (key, index) pairs by key, 11 bits a pass; passes where every
 * key shares the digit are skipped. */
static int
radix_sort(uint64_t *keys, uint32_t *index, Py_ssize_t n)
{
    uint64_t *k2 = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint64_t));
    uint32_t *i2 = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(uint32_t));
    if (k2 == NULL || i2 == NULL) {
        PyMem_Free(k2);
        PyMem_Free(i2);
        return -1;
    }
    uint64_t *ka = keys, *kb = k2;
    uint32_t *ia = index, *ib = i2;
    Py_ssize_t count[2048];
    for (int shift = 0; shift < 64; shift += 11) {
        memset(count, 0, sizeof(count));
        for (Py_ssize_t i = 0; i < n; i++) count[(ka[i] >> shift) & 2047]++;
        if (n == 0 || count[(ka[0] >> shift) & 2047] == n) continue;
        Py_ssize_t sum = 0;
        for (int d = 0; d < 2048; d++) {
            Py_ssize_t c = count[d];
            count[d] = sum;
            sum += c;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t at = count[(ka[i] >> shift) & 2047]++;
            kb[at] = ka[i];
            ib[at] = ia[i];
        }
        uint64_t *kt = ka;
        ka = kb;
        kb = kt;
        uint32_t *it = ia;
        ia = ib;
        ib = it;
    }
    if (ka != keys) {
        memcpy(keys, ka, (size_t)n * sizeof(uint64_t));
        memcpy(index, ia, (size_t)n * sizeof(uint32_t));
    }
    PyMem_Free(k2);
    PyMem_Free(i2);
    return 0;
}


#define PREFETCH_AHEAD 16

/* Take the best head's bucket: push the class's next bucket, rank the live, due
 * entries of this one. */
static int
read_bucket(heap_t *heap, rows_t *rows, Py_ssize_t *considered, PyObject *starts_of,
            PyObject *ids_of, PyObject *members, const uint64_t *records, Py_ssize_t n_slots,
            const double *cadence, const double *boost, long long now, const skips_t *skips,
            Py_ssize_t *skipped)
{
    head_t top = heap_pop(heap);
    PyObject *starts = PyList_GET_ITEM(starts_of, top.class_id);
    PyObject *ids = PyList_GET_ITEM(ids_of, top.class_id);
    if (top.index >= PyList_GET_SIZE(ids) || top.end > PyList_GET_SIZE(starts)) {
        PyErr_SetString(PyExc_ValueError, "best_read: a class's starts and ids differ");
        return -1;
    }
    Py_ssize_t bucket = PyLong_AsSsize_t(PyList_GET_ITEM(ids, top.index));
    if (bucket == -1 && PyErr_Occurred()) return -1;
    if (bucket < 0 || bucket >= PyList_GET_SIZE(members)) {
        PyErr_SetString(PyExc_IndexError, "best_read: bucket id out of range");
        return -1;
    }
    if (top.index + 1 < top.end) {
        long long next = PyLong_AsLongLong(PyList_GET_ITEM(starts, top.index + 1));
        if (next == -1 && PyErr_Occurred()) return -1;
        head_t head = {(double)(now - next) / cadence[top.class_id] + boost[top.class_id],
                       top.class_id, top.index + 1, top.end};
        heap_push(heap, head);
    }
    Py_buffer view;
    if (PyObject_GetBuffer(PyList_GET_ITEM(members, bucket), &view, PyBUF_C_CONTIGUOUS) < 0) {
        return -1;
    }
    const int32_t *entries = view.buf;
    Py_ssize_t n_entries = view.len / 4;
    if (rows_reserve(rows, n_entries) < 0) {
        PyBuffer_Release(&view);
        PyErr_NoMemory();
        return -1;
    }
    *considered += n_entries;
    uint64_t first_place = (uint64_t)bucket << 32;
    double cad = cadence[top.class_id], bst = boost[top.class_id];
    Py_ssize_t n = rows->n;
    for (Py_ssize_t j = 0; j < n_entries; j++) {
        /* Records are read in bucket order, which is random slot order over a table
         * far larger than the caches: ask for a later one's line while this one is read. */
        if (j + PREFETCH_AHEAD < n_entries) {
            int32_t later = entries[j + PREFETCH_AHEAD];
            if (later >= 0 && later < n_slots) __builtin_prefetch(records + (size_t)later * 4);
        }
        int32_t slot = entries[j];
        if (slot < 0 || slot >= n_slots) continue;
        const uint64_t *r = records + (size_t)slot * 4;
        /* Live while the slot's place points back at this entry. */
        if (r[3] != (first_place | (uint64_t)j)) continue;
        long long due = (long long)r[1];
        if (due > now) continue;
        if (skip_holds(skips, slot, skip_tag_of(r), now)) {
            (*skipped)++;
            continue;
        }
        rows->slot[n] = slot;
        rows->rank[n] = (double)(now - due) / cad + bst;
        rows->class_id[n] = (int32_t)top.class_id;
        n++;
    }
    rows->n = n;
    PyBuffer_Release(&view);
    return 0;
}

/* The need-th best rank read (need <= rows read). */
static int
nth_rank(const rows_t *rows, Py_ssize_t need, double *out)
{
    uint64_t *scratch = PyMem_Malloc((size_t)rows->n * sizeof(uint64_t));
    if (scratch == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < rows->n; i++) scratch[i] = desc_key(rows->rank[i]);
    uint64_t asc = ~nth_key(scratch, rows->n, need - 1);
    PyMem_Free(scratch);
    uint64_t bits = (asc & 0x8000000000000000ULL) ? asc & 0x7FFFFFFFFFFFFFFFULL : ~asc;
    memcpy(out, &bits, 8);
    return 0;
}

PyObject *
keeper_best_read(QueueViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("best_read", nargs, 6) < 0) return NULL;
    PyObject *starts_of = self->starts, *ids_of = self->ids, *members = self->members;
    PyObject *cadence_list = args[0], *boost_list = args[1], *paused_list = args[2];
    if (!PyList_Check(cadence_list) || !PyList_Check(boost_list) || !PyList_Check(paused_list)) {
        PyErr_SetString(PyExc_TypeError, "best_read wants lists of cadence, boost and paused");
        return NULL;
    }
    long long now = PyLong_AsLongLong(args[3]);
    if (now == -1 && PyErr_Occurred()) return NULL;
    if (!PyObject_TypeCheck(args[4], &PickedType) || !((PickedObject *)args[4])->held) {
        PyErr_SetString(PyExc_TypeError, "best_read writes into a Picked");
        return NULL;
    }
    PickedObject *out = (PickedObject *)args[4];
    Py_ssize_t need = out->n;

    PyObject *result = NULL;
    Py_buffer rec, skip_views[3];
    int have_rec = 0;
    skips_t skips = {NULL, NULL, NULL, 0};
    heap_t heap = {NULL, 0};
    rows_t rows = {NULL, NULL, NULL, 0, 0};
    uint64_t *keys = NULL;
    uint32_t *order = NULL;
    double *cadence = NULL, *boost = NULL;

    if (PyObject_GetBuffer(self->index->records, &rec, PyBUF_C_CONTIGUOUS) < 0) goto done;
    have_rec = 1;
    if (rec.len % 32 || (rec.len && ((uintptr_t)rec.buf & 7u))) {
        PyErr_SetString(PyExc_ValueError, "records are 32-byte, 8-aligned");
        goto done;
    }

    const uint64_t *records = rec.buf;
    Py_ssize_t n_slots = rec.len / 32;
    if (keeper_skips_acquire(args[5], 0, skip_views, &skips) < 0) goto done;
    Py_ssize_t n_classes = PyList_GET_SIZE(starts_of);
    if (PyList_GET_SIZE(ids_of) != n_classes || PyList_GET_SIZE(cadence_list) < n_classes ||
        PyList_GET_SIZE(boost_list) < n_classes || PyList_GET_SIZE(paused_list) < n_classes) {
        PyErr_SetString(PyExc_ValueError, "best_read: per-class lists differ in length");
        goto done;
    }
    heap.items = PyMem_Malloc((size_t)(n_classes ? n_classes : 1) * sizeof(head_t));
    cadence = PyMem_Malloc((size_t)(n_classes ? n_classes : 1) * sizeof(double));
    boost = PyMem_Malloc((size_t)(n_classes ? n_classes : 1) * sizeof(double));
    if (heap.items == NULL || cadence == NULL || boost == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t c = 0; c < n_classes; c++) {
        PyObject *starts = PyList_GET_ITEM(starts_of, c);
        if (!PyList_Check(starts) || !PyList_Check(PyList_GET_ITEM(ids_of, c))) {
            PyErr_SetString(PyExc_TypeError, "best_read: starts and ids are lists per class");
            goto done;
        }
        Py_ssize_t nb = PyList_GET_SIZE(starts);
        if (nb == 0) continue;
        int paused = PyObject_IsTrue(PyList_GET_ITEM(paused_list, c));
        if (paused < 0) goto done;
        cadence[c] = PyFloat_AsDouble(PyList_GET_ITEM(cadence_list, c));
        boost[c] = PyFloat_AsDouble(PyList_GET_ITEM(boost_list, c));
        long long first = PyLong_AsLongLong(PyList_GET_ITEM(starts, 0));
        if (PyErr_Occurred()) goto done;
        if (paused || first > now) continue;
        /* Buckets starting after now hold no due row: bisect for the end. */
        Py_ssize_t lo = 0, hi = nb;
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            long long s = PyLong_AsLongLong(PyList_GET_ITEM(starts, mid));
            if (s == -1 && PyErr_Occurred()) goto done;
            if (s <= now)
                lo = mid + 1;
            else
                hi = mid;
        }
        head_t head = {(double)(now - first) / cadence[c] + boost[c], c, 0, lo};
        heap_push(&heap, head);
    }

    Py_ssize_t considered = 0, skipped = 0;
    double kth = -INFINITY;
    int have_kth = 0;
    for (;;) {
        /* Read until `need` rows are in hand, or past every bucket that can beat kth. */
        while (heap.n > 0 && (rows.n < need || (have_kth && heap.items[0].upper > kth))) {
            if (read_bucket(&heap, &rows, &considered, starts_of, ids_of, members, records,
                            n_slots, cadence, boost, now, &skips, &skipped) < 0) {
                goto done;
            }
        }
        if (heap.n == 0 || need == 0) break;
        double now_kth;
        if (nth_rank(&rows, need, &now_kth) < 0) goto done;
        if (heap.items[0].upper <= now_kth) break;
        kth = now_kth;
        have_kth = 1;
    }
    double next_upper = heap.n > 0 ? heap.items[0].upper : -INFINITY;

    /* The best `need` read, best first. */
    keys = PyMem_Malloc((size_t)(rows.n ? rows.n : 1) * sizeof(uint64_t));
    order = PyMem_Malloc((size_t)(rows.n ? rows.n : 1) * sizeof(uint32_t));
    if (keys == NULL || order == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t take = rows.n < need ? rows.n : need;
    Py_ssize_t m = rows.n;
    for (Py_ssize_t i = 0; i < m; i++) keys[i] = desc_key(rows.rank[i]);
    if (take < m && take > 0) {
        /* Keep rows at or above the take-th key (ties at it: the first ones). */
        uint64_t *scratch = PyMem_Malloc((size_t)m * sizeof(uint64_t));
        if (scratch == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(scratch, keys, (size_t)m * sizeof(uint64_t));
        uint64_t cut = nth_key(scratch, m, take - 1);
        PyMem_Free(scratch);
        Py_ssize_t below = 0;
        for (Py_ssize_t i = 0; i < m; i++) below += keys[i] < cut;
        Py_ssize_t at_cut = take - below, kept = 0;
        for (Py_ssize_t i = 0; i < m; i++) {
            if (keys[i] < cut || (keys[i] == cut && at_cut-- > 0)) {
                keys[kept] = keys[i];
                order[kept] = (uint32_t)i;
                kept++;
            }
        }
        m = kept;
    } else {
        for (Py_ssize_t i = 0; i < m; i++) order[i] = (uint32_t)i;
        if (take == 0) m = 0;
    }
    if (radix_sort(keys, order, m) < 0) {
        PyErr_NoMemory();
        goto done;
    }
    int32_t *out_slot = out->slot, *out_class = out->class_id;
    double *out_rank = out->rank;
    int64_t *out_due = out->due;
    uint64_t *out_hash = out->hash;
    for (Py_ssize_t i = 0; i < m; i++) {
        uint32_t at = order[i];
        int32_t slot = rows.slot[at];
        out_slot[i] = slot;
        out_rank[i] = rows.rank[at];
        out_class[i] = rows.class_id[at];
        out_due[i] = (int64_t)records[(size_t)slot * 4 + 1];
        out_hash[i] = records[(size_t)slot * 4];
    }
    result = Py_BuildValue("(nndn)", m, considered, next_upper, skipped);

done:
    if (have_rec) PyBuffer_Release(&rec);
    keeper_skips_release(&skips, skip_views);
    PyMem_Free(heap.items);
    PyMem_Free(cadence);
    PyMem_Free(boost);
    PyMem_Free(rows.slot);
    PyMem_Free(rows.rank);
    PyMem_Free(rows.class_id);
    PyMem_Free(keys);
    PyMem_Free(order);
    return result;
}

/* ------------------------------------------------------------------ Picked */

static const Py_ssize_t picked_sizes[5] = {4, 8, 8, 8, 4};
static const char *const picked_names[5] = {"slots", "rank", "due", "hash", "class_id"};

static void
picked_release(PickedObject *self)
{
    if (!self->held) return;
    for (int i = 0; i < 5; i++) PyBuffer_Release(&self->views[i]);
    self->held = 0;
    self->n = 0;
}

static int
Picked_init(PickedObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"slots", "rank", "due", "hash", "class_id", NULL};
    PyObject *cols[5];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO", kwlist, &cols[0], &cols[1], &cols[2],
                                     &cols[3], &cols[4])) {
        return -1;
    }
    picked_release(self);
    int got = 0;
    Py_ssize_t n = 0;
    for (; got < 5; got++) {
        Py_buffer *v = &self->views[got];
        if (PyObject_GetBuffer(cols[got], v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) break;
        Py_ssize_t size = picked_sizes[got];
        if (got == 0) n = v->len / size;
        if (v->itemsize != size || v->len != n * size ||
            (n && ((uintptr_t)v->buf % (uintptr_t)size))) {
            PyErr_Format(PyExc_ValueError,
                         "Picked: %s is not an aligned array of %zd %zd-byte items",
                         picked_names[got], n, size);
            PyBuffer_Release(v);
            break;
        }
    }
    if (got < 5) {
        while (got > 0) PyBuffer_Release(&self->views[--got]);
        return -1;
    }
    self->slot = self->views[0].buf;
    self->rank = self->views[1].buf;
    self->due = self->views[2].buf;
    self->hash = self->views[3].buf;
    self->class_id = self->views[4].buf;
    self->n = n;
    self->held = 1;
    return 0;
}

static void
Picked_dealloc(PickedObject *self)
{
    picked_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* keep_unblocked(blocked_u8, limit) -> (kept, scanned)
 * After best_read and the lease table's blocked mask: move the rows not blocked to
 * the front of the five columns, in order, stopping at `limit`. One pass in place,
 * where numpy took a mask, an index and five gathers. `scanned` is how many rows it
 * looked at, so scanned - kept rows were blocked ahead of the last one kept: what the
 * next read's margin should allow for. */
static PyObject *
Picked_keep_unblocked(PickedObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("keep_unblocked", nargs, 2) < 0) return NULL;
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "Picked was not initialised");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    Py_buffer mask;
    if (PyObject_GetBuffer(args[0], &mask, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = mask.len;
    if (n > self->n) {
        PyBuffer_Release(&mask);
        PyErr_SetString(PyExc_ValueError, "keep_unblocked: more mask bytes than rows");
        return NULL;
    }
    const unsigned char *blocked = mask.buf;
    int32_t *slot = self->slot, *cls = self->class_id;
    double *rank = self->rank;
    int64_t *due = self->due;
    uint64_t *hash = self->hash;
    Py_ssize_t kept = 0, i = 0;
    for (; i < n && kept < limit; i++) {
        if (blocked[i]) continue;
        if (kept != i) {
            slot[kept] = slot[i];
            rank[kept] = rank[i];
            due[kept] = due[i];
            hash[kept] = hash[i];
            cls[kept] = cls[i];
        }
        kept++;
    }
    PyBuffer_Release(&mask);
    return Py_BuildValue("(nn)", kept, i);
}

/* keep_within(blocked_u8, limit, site_ids_i32, budget_i64) -> (kept, scanned, skipped,
 * sites)
 * keep_unblocked with each row's site held to a budget: row i belongs to site
 * site_ids[i], and a site whose budget (indexed by site id) is n >= 0 takes at most n
 * more rows, in order; -1 is no limit. Rows over their site's budget are left out like
 * blocked ones and counted (`skipped`), and so are the sites that left any out
 * (`sites`). The budget is spent in place. One pass, where numpy took a sort by site. */
static PyObject *
Picked_keep_within(PickedObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("keep_within", nargs, 4) < 0) return NULL;
    if (!self->held) {
        PyErr_SetString(PyExc_ValueError, "Picked was not initialised");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    Py_buffer mask, sites, budget;
    if (PyObject_GetBuffer(args[0], &mask, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[2], &sites, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&mask);
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &budget, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&mask);
        PyBuffer_Release(&sites);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = mask.len, n_sites = budget.len / 8;
    if (n > self->n || sites.len != n * 4 || sites.itemsize != 4 || budget.itemsize != 8 ||
        budget.len % 8 || (n && ((uintptr_t)sites.buf & 3u)) || ((uintptr_t)budget.buf & 7u)) {
        PyErr_SetString(PyExc_ValueError,
                        "keep_within: a mask byte and an int32 site id per row (at most the "
                        "rows held), and an aligned int64 budget per site id");
        goto done;
    }
    const unsigned char *blocked = mask.buf;
    const int32_t *site = sites.buf;
    int64_t *left = budget.buf;
    int32_t *slot = self->slot, *cls = self->class_id;
    double *rank = self->rank;
    int64_t *due = self->due;
    uint64_t *hash = self->hash;
    Py_ssize_t kept = 0, i = 0, skipped = 0, limited = 0;
    for (; i < n && kept < limit; i++) {
        if (blocked[i]) continue;
        int32_t s = site[i];
        if (s < 0 || s >= n_sites) {
            PyErr_SetString(PyExc_IndexError, "keep_within: a site id past the budget");
            goto done;
        }
        int64_t b = left[s];
        if (b == 0 || b == -2) {
            skipped++;
            if (b == 0) {
                left[s] = -2; /* spent, and counted once */
                limited++;
            }
            continue;
        }
        if (b > 0) left[s] = b - 1;
        if (kept != i) {
            slot[kept] = slot[i];
            rank[kept] = rank[i];
            due[kept] = due[i];
            hash[kept] = hash[i];
            cls[kept] = cls[i];
        }
        kept++;
    }
    result = Py_BuildValue("(nnnn)", kept, i, skipped, limited);
done:
    PyBuffer_Release(&mask);
    PyBuffer_Release(&sites);
    PyBuffer_Release(&budget);
    return result;
}

static PyObject *
Picked_len(PickedObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(self->n);
}

static PyMethodDef Picked_methods[] = {
    {"keep_unblocked", (PyCFunction)(void (*)(void))Picked_keep_unblocked, METH_FASTCALL,
     "keep_unblocked($self, blocked, limit, /)\n--\n\n"
     "Move the rows whose blocked byte is 0 to the front, in order, up to limit: "
     "(kept, scanned)."},
    {"keep_within", (PyCFunction)(void (*)(void))Picked_keep_within, METH_FASTCALL,
     "keep_within($self, blocked, limit, site_ids, budget, /)\n--\n\n"
     "keep_unblocked, each row's site spending its budget (-1: none): "
     "(kept, scanned, skipped, sites)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Picked_getset[] = {
    {"size", (getter)Picked_len, NULL, "rows the columns hold", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject PickedType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "keeper._native.Picked",
    .tp_basicsize = sizeof(PickedObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Picked(slots, rank, due, hash, class_id)\n--\n\n"
              "The columns a best read fills: int32, float64, int64, uint64, int32 arrays "
              "of one length, held until the object goes.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Picked_init,
    .tp_dealloc = (destructor)Picked_dealloc,
    .tp_methods = Picked_methods,
    .tp_getset = Picked_getset,
};
