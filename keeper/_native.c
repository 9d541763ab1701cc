/* The keeper's C paths: the best-K read (keeper/select.py) and the slot index's bulk
 * probes (keeper/slots.py).
 *
 * best_read: the merge over class heads.
 * In Python the read took about fifteen numpy calls per batch of buckets plus a
 * heap of tuples, 0.5 ms for 5,000 rows; here it is one pass over the buckets'
 * entries. The structures are the queue's own (keeper/buckets.py, slots.py):
 * per class a list of bucket starts and ids, each bucket an array('i') of slots,
 * and the records array('Q') of (hash, due, version, place) per slot. Nothing is
 * written to them.
 *
 *   best_read(starts_of, ids_of, members, records, cadence, boost, paused, now, need,
 *             out_slots, out_rank, out_due, out_hash, out_class)
 *     -> (count, considered, next_upper)
 *
 * Buckets are taken in order of their upper bound (the rank at their start) from
 * a heap of class heads; a bucket's live, due entries are ranked. Reading stops
 * once `need` rows are in hand and no untaken bucket's upper bound beats the
 * need-th best rank read. The best `need` (or all, if fewer) are written best
 * first, and `next_upper` is the best untaken bucket's upper bound (-inf if
 * none): every row outside the result ranks at or below the last one written.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
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

static int
get_out(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, Py_ssize_t n, const char *name)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view->len < n * itemsize || (n && ((uintptr_t)view->buf % (uintptr_t)itemsize))) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s is too short or misaligned", name);
        return -1;
    }
    return 0;
}

#define PREFETCH_AHEAD 16

/* Take the best head's bucket: push the class's next bucket, rank the live, due
 * entries of this one. */
static int
read_bucket(heap_t *heap, rows_t *rows, Py_ssize_t *considered, PyObject *starts_of,
            PyObject *ids_of, PyObject *members, const uint64_t *records, Py_ssize_t n_slots,
            const double *cadence, const double *boost, long long now)
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
         * of 32 MB at 1M rows: ask for a later one's line while this one is read. */
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

static PyObject *
best_read(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 14) {
        PyErr_Format(PyExc_TypeError, "best_read takes 14 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *starts_of = args[0], *ids_of = args[1], *members = args[2];
    PyObject *cadence_list = args[4], *boost_list = args[5], *paused_list = args[6];
    if (!PyList_Check(starts_of) || !PyList_Check(ids_of) || !PyList_Check(members) ||
        !PyList_Check(cadence_list) || !PyList_Check(boost_list) || !PyList_Check(paused_list)) {
        PyErr_SetString(PyExc_TypeError, "best_read wants lists for the queue's structures");
        return NULL;
    }
    long long now = PyLong_AsLongLong(args[7]);
    Py_ssize_t need = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred()) return NULL;
    if (need < 0) need = 0;

    PyObject *result = NULL;
    Py_buffer rec, outs[5];
    int have_rec = 0, n_outs = 0;
    heap_t heap = {NULL, 0};
    rows_t rows = {NULL, NULL, NULL, 0, 0};
    uint64_t *keys = NULL;
    uint32_t *order = NULL;
    double *cadence = NULL, *boost = NULL;
    static const Py_ssize_t out_sizes[5] = {4, 8, 8, 8, 4};
    static const char *const out_names[5] = {"out_slots", "out_rank", "out_due", "out_hash",
                                             "out_class"};

    if (PyObject_GetBuffer(args[3], &rec, PyBUF_C_CONTIGUOUS) < 0) goto done;
    have_rec = 1;
    if (rec.len % 32 || (rec.len && ((uintptr_t)rec.buf & 7u))) {
        PyErr_SetString(PyExc_ValueError, "records are 32-byte, 8-aligned");
        goto done;
    }
    for (; n_outs < 5; n_outs++) {
        if (get_out(args[9 + n_outs], &outs[n_outs], out_sizes[n_outs], need,
                    out_names[n_outs]) < 0) {
            goto done;
        }
    }

    const uint64_t *records = rec.buf;
    Py_ssize_t n_slots = rec.len / 32;
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

    Py_ssize_t considered = 0;
    double kth = -INFINITY;
    int have_kth = 0;
    for (;;) {
        /* Read until `need` rows are in hand, or past every bucket that can beat kth. */
        while (heap.n > 0 && (rows.n < need || (have_kth && heap.items[0].upper > kth))) {
            if (read_bucket(&heap, &rows, &considered, starts_of, ids_of, members, records,
                            n_slots, cadence, boost, now) < 0) {
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
    int32_t *out_slot = outs[0].buf, *out_class = outs[4].buf;
    double *out_rank = outs[1].buf;
    int64_t *out_due = outs[2].buf;
    uint64_t *out_hash = outs[3].buf;
    for (Py_ssize_t i = 0; i < m; i++) {
        uint32_t at = order[i];
        int32_t slot = rows.slot[at];
        out_slot[i] = slot;
        out_rank[i] = rows.rank[at];
        out_class[i] = rows.class_id[at];
        out_due[i] = (int64_t)records[(size_t)slot * 4 + 1];
        out_hash[i] = records[(size_t)slot * 4];
    }
    result = Py_BuildValue("(nnd)", m, considered, next_upper);

done:
    for (int i = 0; i < n_outs; i++) PyBuffer_Release(&outs[i]);
    if (have_rec) PyBuffer_Release(&rec);
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

/* ------------------------------------------------------------ slot index */

/* The slot index (keeper/slots.py): int32 slot numbers, -1 empty, linear probing
 * from hash & mask; a slot's hash is word 0 of its 32-byte record. */
typedef struct {
    Py_buffer table, records, hashes, slots;
    int n;
} index_args_t;

static void
index_release(index_args_t *a)
{
    Py_buffer *views[4] = {&a->table, &a->records, &a->hashes, &a->slots};
    for (int i = 0; i < a->n; i++) PyBuffer_Release(views[i]);
}

static int
index_acquire(PyObject *const *args, Py_ssize_t nargs, int table_flags, int slots_flags,
              index_args_t *a, uint64_t *mask, const char *name)
{
    a->n = 0;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "%s takes 5 arguments, got %zd", name, nargs);
        return -1;
    }
    *mask = (uint64_t)PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) return -1;
    PyObject *objs[4] = {args[0], args[1], args[3], args[4]};
    int flags[4] = {table_flags, PyBUF_C_CONTIGUOUS, PyBUF_C_CONTIGUOUS, slots_flags};
    Py_buffer *views[4] = {&a->table, &a->records, &a->hashes, &a->slots};
    for (; a->n < 4; a->n++) {
        if (PyObject_GetBuffer(objs[a->n], views[a->n], flags[a->n]) < 0) {
            index_release(a);
            return -1;
        }
    }
    Py_ssize_t n = a->hashes.len / 8;
    if (a->table.len != (Py_ssize_t)(*mask + 1) * 4 || a->records.len % 32 ||
        a->hashes.len % 8 || a->slots.len != n * 4 ||
        (a->records.len && ((uintptr_t)a->records.buf & 7u)) ||
        (n && (((uintptr_t)a->hashes.buf & 7u) || ((uintptr_t)a->slots.buf & 3u))) ||
        ((uintptr_t)a->table.buf & 3u)) {
        index_release(a);
        PyErr_Format(PyExc_ValueError, "%s: buffer sizes or alignment do not match", name);
        return -1;
    }
    return 0;
}

/* find_many(table, records, mask, hashes, out) -> None: out[i] = the slot holding
 * hashes[i], or -1. */
static PyObject *
find_many(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    index_args_t a;
    uint64_t mask;
    if (index_acquire(args, nargs, PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS, &a,
                      &mask, "find_many") < 0) {
        return NULL;
    }
    const int32_t *table = a.table.buf;
    const uint64_t *records = a.records.buf;
    const uint64_t *hashes = a.hashes.buf;
    int32_t *out = a.slots.buf;
    Py_ssize_t n = a.hashes.len / 8, n_slots = a.records.len / 32;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = hashes[i], at = h & mask;
        int32_t found = -1;
        for (uint64_t step = 0; step <= mask; step++) {
            int32_t slot = table[at];
            if (slot < 0) break;
            if (slot < n_slots && records[(size_t)slot * 4] == h) {
                found = slot;
                break;
            }
            at = (at + 1) & mask;
        }
        out[i] = found;
    }
    index_release(&a);
    Py_RETURN_NONE;
}

/* index_many(table, records, mask, hashes, slots) -> None: enter each slot at the
 * first empty place from its hash (the caller keeps the table below its load). */
static PyObject *
index_many(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    index_args_t a;
    uint64_t mask;
    if (index_acquire(args, nargs, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS, PyBUF_C_CONTIGUOUS, &a,
                      &mask, "index_many") < 0) {
        return NULL;
    }
    int32_t *table = a.table.buf;
    const uint64_t *hashes = a.hashes.buf;
    const int32_t *slots = a.slots.buf;
    Py_ssize_t n = a.hashes.len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t at = hashes[i] & mask, step = 0;
        while (table[at] >= 0 && step++ <= mask) at = (at + 1) & mask;
        if (table[at] >= 0) {
            index_release(&a);
            PyErr_SetString(PyExc_RuntimeError, "index_many: the index is full");
            return NULL;
        }
        table[at] = slots[i];
    }
    index_release(&a);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------ event path */

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

static PyObject *append_name; /* "append", interned at import */

/* upsert_moved(records, b_class, b_live, b_stale, b_split_at, starts_of, ids_of, members,
 *              tally_counts, tally_base, buckets, merge_below, stale_slack,
 *              table, mask, key_hash, class_id, due, version, now)
 * (the structures that live as long as the queue first, for a functools.partial)
 *   -> TRIGGERED (1), RESCHEDULED (2), UNCHANGED (3), or -1
 *
 * The common case of HeldQueue.upsert (keeper/queue.py), whole: a held row that
 * stays in its class, whose old and new due minutes are in the class's dense
 * tally range, and whose new due time is not before the class's first bucket.
 * Anything else returns -1 having changed nothing, and the Python path runs. A
 * bucket left needing a rebuild or a tidy gets it through `buckets` (after every
 * buffer is given back: those calls resize arrays). */
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

/* ctx from upsert_moved's first 15 arguments (records ... stale_slack, table, mask). */
static int
moved_open(moved_ctx *c, PyObject *const *args, const char *who)
{
    c->h.n = 0;
    c->mask = PyLong_AsUnsignedLongLong(args[14]);
    c->merge_below = PyLong_AsLongLong(args[11]);
    c->stale_slack = PyLong_AsLongLong(args[12]);
    if (PyErr_Occurred()) return -1;
    c->starts_of = args[5];
    c->ids_of = args[6];
    c->members = args[7];
    c->tally_counts = args[8];
    c->tally_base = args[9];
    c->buckets = args[10];
    if (!PyList_Check(c->starts_of) || !PyList_Check(c->ids_of) || !PyList_Check(c->members) ||
        !PyList_Check(c->tally_counts) || !PyList_Check(c->tally_base)) {
        PyErr_Format(PyExc_TypeError, "%s wants the queue's lists", who);
        return -1;
    }
    c->table = hold(&c->h, args[13], 0, 4);
    c->rec = c->table ? hold(&c->h, args[0], 1, 8) : NULL;
    c->b_class = c->rec ? hold(&c->h, args[1], 0, 4) : NULL;
    c->b_live = c->b_class ? hold(&c->h, args[2], 1, 4) : NULL;
    c->b_stale = c->b_live ? hold(&c->h, args[3], 1, 4) : NULL;
    c->b_split_at = c->b_stale ? hold(&c->h, args[4], 0, 4) : NULL;
    if (c->b_split_at == NULL) {
        unhold(&c->h);
        return -1;
    }
    if (c->h.views[0].len != (Py_ssize_t)(c->mask + 1) * 4) {
        unhold(&c->h);
        PyErr_Format(PyExc_ValueError, "%s: the index does not match its mask", who);
        return -1;
    }
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
            boxed ? PyObject_CallMethodOneArg(target_members, append_name, boxed) : NULL;
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

static PyObject *
upsert_moved(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 20) {
        PyErr_Format(PyExc_TypeError, "upsert_moved takes 20 arguments, got %zd", nargs);
        return NULL;
    }
    uint64_t key_hash = PyLong_AsUnsignedLongLong(args[15]);
    Py_ssize_t class_id = PyLong_AsSsize_t(args[16]);
    long long due = PyLong_AsLongLong(args[17]);
    unsigned long long version = PyLong_AsUnsignedLongLong(args[18]);
    long long now = PyLong_AsLongLong(args[19]);
    if (PyErr_Occurred()) return NULL;
    moved_ctx c;
    if (moved_open(&c, args, "upsert_moved") < 0) return NULL;
    Py_ssize_t split = -1, tidy = -1;
    long result = moved_one(&c, key_hash, class_id, due, version, now, &split, &tidy);
    unhold(&c.h);
    if (result == -2 || moved_finish(c.buckets, split, tidy) < 0) return NULL;
    return PyLong_FromLong(result);
}

/* apply_moves(<upsert_moved's first 15 arguments>, events, start, hashes, row_event_type,
 *             class_cache, touched, epoch, now, max_due, tally) -> the next index
 *
 * KeeperCore._apply_rows's loop for a run of events that move held rows within their
 * class, from events[start]: the same checks and the same moves as the Python loop,
 * one C loop with the buffers held once. It stops at the first event it does not
 * take whole (not a row event, a delete, a bad hash, a row that fails a check, a class
 * not yet in the classifier's cache, anything upsert_moved does not handle) and
 * returns its index, for the Python loop; or after an event whose bucket needs a
 * rebuild or tidy (done here, buffers given back), returning the index after it.
 * tally[result] += 1 for each event taken; touched[hash] = epoch if touched is not
 * None. */
static PyObject *
apply_moves(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 25) {
        PyErr_Format(PyExc_TypeError, "apply_moves takes 25 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *events = args[15], *hashes = args[17], *row_event_type = args[18];
    PyObject *cache = args[19], *touched = args[20], *epoch = args[21], *tally = args[24];
    Py_ssize_t start = PyLong_AsSsize_t(args[16]);
    long long now = PyLong_AsLongLong(args[22]);
    long long max_due = PyLong_AsLongLong(args[23]);
    if (PyErr_Occurred()) return NULL;
    if (!PyList_Check(events) || !PyList_Check(hashes) || !PyDict_Check(cache) ||
        !PyList_Check(tally) || PyList_GET_SIZE(tally) < 4 ||
        PyList_GET_SIZE(hashes) != PyList_GET_SIZE(events) ||
        (touched != Py_None && !PyDict_Check(touched))) {
        PyErr_SetString(PyExc_TypeError, "apply_moves: events and hashes lists, a cache dict, "
                                         "a tally list, touched a dict or None");
        return NULL;
    }
    static PyObject *s_row, *s_key, *s_route, *s_cadence, *s_sitemap, *s_due, *s_version;
    if (s_row == NULL) {
        s_row = PyUnicode_InternFromString("row");
        s_key = PyUnicode_InternFromString("key");
        s_route = PyUnicode_InternFromString("route");
        s_cadence = PyUnicode_InternFromString("cadence_s");
        s_sitemap = PyUnicode_InternFromString("sitemap");
        s_due = PyUnicode_InternFromString("next_render_at");
        s_version = PyUnicode_InternFromString("version");
        if (!s_row || !s_key || !s_route || !s_cadence || !s_sitemap || !s_due || !s_version) {
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
    if (moved_open(&c, args, "apply_moves") < 0) return NULL;
    Py_ssize_t split = -1, tidy = -1;
    long counted[4] = {0, 0, 0, 0};
    int failed = 0;
    for (; i < n && split < 0 && tidy < 0; i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        if ((PyObject *)Py_TYPE(event) != row_event_type) break;
        /* A hash is a uint64; -1 marks a key the Python loop encodes by itself. */
        PyObject *boxed_hash = PyList_GET_ITEM(hashes, i);
        int negative = 0;
        long long signed_hash = PyLong_AsLongLongAndOverflow(boxed_hash, &negative);
        if (signed_hash == -1 && PyErr_Occurred()) {
            failed = 1;
            break;
        }
        if (negative < 0 || (negative == 0 && signed_hash < 0)) break;
        uint64_t h = PyLong_AsUnsignedLongLong(boxed_hash);
        if (h == (uint64_t)-1 && PyErr_Occurred()) {
            failed = 1;
            break;
        }
        PyObject *row = PyObject_GetAttr(event, s_row);
        if (row == NULL) {
            failed = 1;
            break;
        }
        PyObject *f[7] = {NULL};
        long result = NOT_HANDLED;
        if (row == Py_None) goto next;
        f[0] = PyObject_GetAttr(row, s_due);
        f[1] = f[0] ? PyObject_GetAttr(row, s_version) : NULL;
        f[2] = f[1] ? PyObject_GetAttr(row, s_cadence) : NULL;
        f[3] = f[2] ? PyObject_GetAttr(row, s_key) : NULL;
        f[4] = f[3] ? PyObject_GetAttr(event, s_key) : NULL;
        f[5] = f[4] ? PyObject_GetAttr(row, s_route) : NULL;
        f[6] = f[5] ? PyObject_GetAttr(row, s_sitemap) : NULL;
        if (f[6] == NULL) {
            result = -2;
            goto next;
        }
        /* The checks the Python loop makes (a bad field must not leave half a row):
         * anything doubtful goes back to it, which logs and counts it. */
        if (!PyLong_CheckExact(f[0]) || !PyLong_CheckExact(f[1]) ||
            !(f[2] == Py_None || PyLong_CheckExact(f[2]))) {
            goto next;
        }
        int overflow = 0;
        long long due = PyLong_AsLongLongAndOverflow(f[0], &overflow);
        if (overflow || due < 0 || due >= max_due) goto next;
        long long version = PyLong_AsLongLongAndOverflow(f[1], &overflow);
        if (overflow || version < 0) goto next;
        if (f[2] != Py_None) {
            long long cadence = PyLong_AsLongLongAndOverflow(f[2], &overflow);
            if (overflow || cadence <= 0) goto next;
        }
        if (!PyUnicode_CheckExact(f[3]) || !PyUnicode_CheckExact(f[4])) goto next;
        int same = PyUnicode_Compare(f[3], f[4]);
        if (same == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            goto next;
        }
        if (same != 0) goto next;
        PyObject *class_key = PyTuple_Pack(3, f[5], f[2], f[6]);
        if (class_key == NULL) {
            result = -2;
            goto next;
        }
        PyObject *cls = PyDict_GetItemWithError(cache, class_key); /* borrowed */
        Py_DECREF(class_key);
        if (cls == NULL) {
            if (PyErr_Occurred()) PyErr_Clear(); /* unhashable: the Python loop says so */
            goto next;
        }
        Py_ssize_t class_id = PyLong_AsSsize_t(cls);
        if (class_id == -1 && PyErr_Occurred()) {
            result = -2;
            goto next;
        }
        if (touched != Py_None) {
            if (PyDict_SetItem(touched, boxed_hash, epoch) < 0) {
                result = -2;
                goto next;
            }
        }
        result = moved_one(&c, h, class_id, due, (unsigned long long)version, now,
                           &split, &tidy);
    next:
        Py_DECREF(row);
        for (int j = 0; j < 7; j++) Py_XDECREF(f[j]);
        if (result == -2) {
            failed = 1;
            break;
        }
        if (result == NOT_HANDLED) break;
        counted[result]++;
    }
    unhold(&c.h);
    for (int j = 1; j < 4; j++) {
        if (!counted[j]) continue;
        PyObject *more = failed ? NULL : PyLong_FromLong(counted[j]);
        PyObject *sum = more ? PyNumber_Add(PyList_GET_ITEM(tally, j), more) : NULL;
        Py_XDECREF(more);
        if (sum == NULL) {
            failed = 1;
            break;
        }
        PyList_SetItem(tally, j, sum); /* steals sum, releases old */
    }
    if (failed || moved_finish(c.buckets, split, tidy) < 0) return NULL;
    return PyLong_FromSsize_t(i);
}

/* keep_unblocked(blocked_u8, limit, slots_i32, rank_f64, due_i64, hash_u64, class_i32)
 *   -> (kept, scanned)
 * After best_read and the lease table's blocked mask: move the rows not blocked to
 * the front of the five arrays, in order, stopping at `limit`. One pass in place,
 * where numpy took a mask, an index and five gathers (about 30 us for 5,000 rows).
 * `scanned` is how many rows it looked at, so scanned - kept rows were blocked ahead
 * of the last one kept: what the next read's margin should allow for. */
static PyObject *
keep_unblocked(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "keep_unblocked takes 7 arguments");
        return NULL;
    }
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (limit == -1 && PyErr_Occurred()) return NULL;
    Py_buffer mask;
    if (PyObject_GetBuffer(args[0], &mask, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    Py_ssize_t n = mask.len;
    static const Py_ssize_t sizes[5] = {4, 8, 8, 8, 4};
    static const char *const names[5] = {"slots", "rank", "due", "hash", "class"};
    Py_buffer out[5];
    int got = 0;
    for (; got < 5; got++) {
        if (get_out(args[2 + got], &out[got], sizes[got], n, names[got]) < 0) break;
    }
    if (got < 5) {
        while (got > 0) PyBuffer_Release(&out[--got]);
        PyBuffer_Release(&mask);
        return NULL;
    }
    const unsigned char *blocked = mask.buf;
    int32_t *slot = out[0].buf, *cls = out[4].buf;
    double *rank = out[1].buf;
    int64_t *due = out[2].buf;
    uint64_t *hash = out[3].buf;
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
    for (int j = 0; j < 5; j++) PyBuffer_Release(&out[j]);
    PyBuffer_Release(&mask);
    return Py_BuildValue("(nn)", kept, i);
}

static PyMethodDef select_methods[] = {
    {"apply_moves", (PyCFunction)(void (*)(void))apply_moves, METH_FASTCALL,
     "apply_moves(...upsert_moved's first 15, events, start, hashes, row_event_type, "
     "class_cache, touched, epoch, now, max_due, tally) -> next index."},
    {"keep_unblocked", (PyCFunction)(void (*)(void))keep_unblocked, METH_FASTCALL,
     "keep_unblocked(blocked_u8, limit, slots, rank, due, hash, class) -> (kept, scanned): "
     "the rows kept moved to the front in order, and the rows looked at."},
    {"best_read", (PyCFunction)(void (*)(void))best_read, METH_FASTCALL,
     "best_read(starts_of, ids_of, members, records, cadence, boost, paused, now, need, "
     "out_slots, out_rank, out_due, out_hash, out_class) -> (count, considered, next_upper)"},
    {"upsert_moved", (PyCFunction)(void (*)(void))upsert_moved, METH_FASTCALL,
     "upsert_moved(...) -> TRIGGERED, RESCHEDULED, UNCHANGED, or -1: HeldQueue.upsert's "
     "common case."},
    {"find_many", (PyCFunction)(void (*)(void))find_many, METH_FASTCALL,
     "find_many(table_i32, records, mask, hashes_u64, out_i32) -> None."},
    {"index_many", (PyCFunction)(void (*)(void))index_many, METH_FASTCALL,
     "index_many(table_i32, records, mask, hashes_u64, slots_i32) -> None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef select_module = {
    PyModuleDef_HEAD_INIT, "_native", "The keeper's C paths: best-K read, slot index probes.", -1,
    select_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    append_name = PyUnicode_InternFromString("append");
    if (append_name == NULL) return NULL;
    return PyModule_Create(&select_module);
}
