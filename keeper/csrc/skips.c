/* The skip table's writes (skips.h): QueueView.skip_rows.
 *
 *   QueueView.skip_rows(slots, until, table, now, tags) -> (written, taken)
 *
 * Each slot's row is passed over until its end; `tags` None takes each row's tag from
 * its record now, else the tags given (a rebuild copies the entries it keeps).
 * `taken`: entries that were empty before, which the caller counts toward its rebuild.
 */
#include "skips.h"

int
keeper_skips_acquire(PyObject *table, int flags, Py_buffer *views, skips_t *out)
{
    static const Py_ssize_t sizes[3] = {4, 8, 8};
    out->slot = NULL;
    out->until = NULL;
    out->tag = NULL;
    out->cap = 0;
    if (table == Py_None) return 0;
    if (!PyTuple_Check(table) || PyTuple_GET_SIZE(table) != 3) {
        PyErr_SetString(PyExc_TypeError, "a skip table is a tuple (slot, until, tag) or None");
        return -1;
    }
    PyObject *const *objs = &PyTuple_GET_ITEM(table, 0);
    int got = 0;
    for (; got < 3; got++) {
        if (PyObject_GetBuffer(objs[got], &views[got], flags | PyBUF_C_CONTIGUOUS) < 0) break;
    }
    Py_ssize_t cap = got == 3 ? views[0].len / 4 : 0;
    int bad = got < 3;
    for (int i = 0; i < got && !bad; i++) {
        bad = views[i].itemsize != sizes[i] || views[i].len != cap * sizes[i] ||
              ((uintptr_t)views[i].buf % (uintptr_t)sizes[i]);
    }
    if (!bad && (cap == 0 || (cap & (cap - 1)))) bad = 1;
    if (bad) {
        for (int i = 0; i < got; i++) PyBuffer_Release(&views[i]);
        if (got == 3) {
            PyErr_SetString(PyExc_ValueError, "the skip table is int32 slots, int64 ends and "
                                              "uint64 tags, of one power-of-two length");
        }
        return -1;
    }
    out->slot = views[0].buf;
    out->until = views[1].buf;
    out->tag = views[2].buf;
    out->cap = cap;
    return 0;
}

void
keeper_skips_release(const skips_t *s, Py_buffer *views)
{
    if (s->cap == 0) return;
    for (int i = 0; i < 3; i++) PyBuffer_Release(&views[i]);
}

/* Put an entry: 1 if it took an empty one, 0 if it replaced the slot's own or a dead
 * one, -1 if the table has no room (the caller rebuilds before that can happen). */
static int
skip_put(skips_t *s, int32_t slot, int64_t until, uint64_t tag, long long now)
{
    Py_ssize_t mask = s->cap - 1, reuse = -1;
    for (Py_ssize_t i = skip_home(slot, s->cap), n = 0; n < s->cap; i = (i + 1) & mask, n++) {
        int32_t k = s->slot[i];
        if (k == slot) {
            s->until[i] = until;
            s->tag[i] = tag;
            return 0;
        }
        if (k == -1) {
            /* The chain ends here: the slot is in none of it. */
            int taken = reuse < 0;
            Py_ssize_t at = taken ? i : reuse;
            s->slot[at] = slot;
            s->until[at] = until;
            s->tag[at] = tag;
            return taken;
        }
        if (reuse < 0 && s->until[i] <= now) reuse = i;
    }
    if (reuse < 0) return -1;
    s->slot[reuse] = slot;
    s->until[reuse] = until;
    s->tag[reuse] = tag;
    return 0;
}

PyObject *
keeper_skip_rows(QueueViewObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("skip_rows", nargs, 5) < 0) return NULL;
    long long now = PyLong_AsLongLong(args[3]);
    if (now == -1 && PyErr_Occurred()) return NULL;
    Py_buffer rec, in[3], table[3];
    int held_in = 0;
    skips_t skips = {NULL, NULL, NULL, 0};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(self->index->records, &rec, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *inputs[3] = {args[0], args[1], args[4]};
    int n_in = args[4] == Py_None ? 2 : 3;
    for (; held_in < n_in; held_in++) {
        if (PyObject_GetBuffer(inputs[held_in], &in[held_in], PyBUF_C_CONTIGUOUS) < 0) goto done;
    }
    if (keeper_skips_acquire(args[2], PyBUF_WRITABLE, table, &skips) < 0) goto done;
    if (skips.cap == 0) {
        PyErr_SetString(PyExc_TypeError, "skip_rows writes into a skip table");
        goto done;
    }
    Py_ssize_t n = in[0].len / 4;
    if (rec.len % 32 || ((uintptr_t)rec.buf & 7u) || in[0].itemsize != 4 ||
        in[1].itemsize != 8 || in[1].len != n * 8 || ((uintptr_t)in[0].buf & 3u) ||
        ((uintptr_t)in[1].buf & 7u) ||
        (n_in == 3 && (in[2].itemsize != 8 || in[2].len != n * 8 || ((uintptr_t)in[2].buf & 7u)))) {
        PyErr_SetString(PyExc_ValueError,
                        "skip_rows wants int32 slots and one int64 end (and tag) per slot");
        goto done;
    }
    const uint64_t *records = rec.buf;
    Py_ssize_t n_slots = rec.len / 32, written = 0, taken = 0;
    const int32_t *slots = in[0].buf;
    const int64_t *ends = in[1].buf;
    const uint64_t *tags = n_in == 3 ? in[2].buf : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t slot = slots[i];
        if (slot < 0 || slot >= n_slots) continue;
        uint64_t tag = tags ? tags[i] : skip_tag_of(records + (size_t)slot * 4);
        int put = skip_put(&skips, slot, ends[i], tag, now);
        if (put < 0) {
            PyErr_SetString(PyExc_OverflowError, "the skip table is full");
            goto done;
        }
        taken += put;
        written++;
    }
    result = Py_BuildValue("(nn)", written, taken);
done:
    keeper_skips_release(&skips, table);
    for (int i = 0; i < held_in; i++) PyBuffer_Release(&in[i]);
    PyBuffer_Release(&rec);
    return result;
}
