/* SlotIndex: bulk probes of the slot table's index (keeper/slots.py): int32 slot
 * numbers, -1 empty, linear probing from hash & mask; a slot's hash is word 0 of its
 * 32-byte record. */
#include "native.h"

int
keeper_check_items(PyObject *obj, Py_ssize_t itemsize, const char *what)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    int ok = view.itemsize == itemsize;
    PyBuffer_Release(&view);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "%s: an array of %zd-byte items is wanted", what, itemsize);
        return -1;
    }
    return 0;
}

int
keeper_index_acquire(SlotIndexObject *index, int table_writable, int records_writable,
                     Py_buffer *table, Py_buffer *records, uint64_t *mask)
{
    int flags = PyBUF_C_CONTIGUOUS;
    if (PyObject_GetBuffer(index->table, table, flags | (table_writable ? PyBUF_WRITABLE : 0)) <
        0) {
        return -1;
    }
    if (PyObject_GetBuffer(index->records, records,
                           flags | (records_writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyBuffer_Release(table);
        return -1;
    }
    Py_ssize_t places = table->len / 4;
    if (table->len % 4 || places == 0 || (places & (places - 1)) || ((uintptr_t)table->buf & 3u) ||
        records->len % 32 || (records->len && ((uintptr_t)records->buf & 7u))) {
        PyBuffer_Release(table);
        PyBuffer_Release(records);
        PyErr_SetString(PyExc_ValueError,
                        "slot index: the table is not a power-of-two int32 array, or the "
                        "records are not 32-byte aligned records");
        return -1;
    }
    *mask = (uint64_t)places - 1;
    return 0;
}

static int
SlotIndex_init(SlotIndexObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"records", "table", NULL};
    PyObject *records, *table;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO", kwlist, &records, &table)) return -1;
    if (keeper_check_items(records, 8, "SlotIndex records") < 0 ||
        keeper_check_items(table, 4, "SlotIndex table") < 0) {
        return -1;
    }
    Py_INCREF(records);
    Py_INCREF(table);
    Py_XSETREF(self->records, records);
    Py_XSETREF(self->table, table);
    return 0;
}

static void
SlotIndex_dealloc(SlotIndexObject *self)
{
    Py_CLEAR(self->records);
    Py_CLEAR(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
bound(SlotIndexObject *self)
{
    if (self->table == NULL) {
        PyErr_SetString(PyExc_ValueError, "SlotIndex was not initialised");
        return -1;
    }
    return 0;
}

/* find_many(hashes, out) -> None: out[i] = the slot holding hashes[i], or -1. */
static PyObject *
SlotIndex_find_many(SlotIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("find_many", nargs, 2) < 0 || bound(self) < 0) return NULL;
    Py_buffer tv, rv, hv, ov;
    uint64_t mask;
    if (keeper_index_acquire(self, 0, 0, &tv, &rv, &mask) < 0) return NULL;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &hv, PyBUF_C_CONTIGUOUS) < 0) goto no_hashes;
    if (PyObject_GetBuffer(args[1], &ov, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) goto no_out;
    Py_ssize_t n = hv.len / 8;
    if (hv.len % 8 || ov.len != n * 4 ||
        (n && (((uintptr_t)hv.buf & 7u) || ((uintptr_t)ov.buf & 3u)))) {
        PyErr_SetString(PyExc_ValueError, "find_many: aligned uint64 hashes and an int32 out "
                                          "of one item per hash");
        goto done;
    }
    const int32_t *table = tv.buf;
    const uint64_t *records = rv.buf;
    const uint64_t *hashes = hv.buf;
    int32_t *out = ov.buf;
    Py_ssize_t n_slots = rv.len / 32;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = hashes[i], at = h & mask;
        int32_t found = -1;
        for (uint64_t step = 0; step <= mask; step++) {
            int32_t slot = table[at];
            if (slot < 0) break;
            if (slot < n_slots && records[(size_t)slot * REC_WORDS + REC_HASH] == h) {
                found = slot;
                break;
            }
            at = (at + 1) & mask;
        }
        out[i] = found;
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&ov);
no_out:
    PyBuffer_Release(&hv);
no_hashes:
    PyBuffer_Release(&tv);
    PyBuffer_Release(&rv);
    return result;
}

/* index_many(hashes, slots) -> None: enter each slot at the first empty place from
 * its hash (the caller keeps the table below its load). */
static PyObject *
SlotIndex_index_many(SlotIndexObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (keeper_check_nargs("index_many", nargs, 2) < 0 || bound(self) < 0) return NULL;
    Py_buffer tv, rv, hv, sv;
    uint64_t mask;
    if (keeper_index_acquire(self, 1, 0, &tv, &rv, &mask) < 0) return NULL;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &hv, PyBUF_C_CONTIGUOUS) < 0) goto no_hashes;
    if (PyObject_GetBuffer(args[1], &sv, PyBUF_C_CONTIGUOUS) < 0) goto no_slots;
    Py_ssize_t n = hv.len / 8;
    if (hv.len % 8 || sv.len != n * 4 ||
        (n && (((uintptr_t)hv.buf & 7u) || ((uintptr_t)sv.buf & 3u)))) {
        PyErr_SetString(PyExc_ValueError, "index_many: aligned uint64 hashes and int32 slots "
                                          "of one item per hash");
        goto done;
    }
    int32_t *table = tv.buf;
    const uint64_t *hashes = hv.buf;
    const int32_t *slots = sv.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t at = hashes[i] & mask, step = 0;
        while (table[at] >= 0 && step++ <= mask) at = (at + 1) & mask;
        if (table[at] >= 0) {
            PyErr_SetString(PyExc_RuntimeError, "index_many: the index is full");
            goto done;
        }
        table[at] = slots[i];
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&sv);
no_slots:
    PyBuffer_Release(&hv);
no_hashes:
    PyBuffer_Release(&tv);
    PyBuffer_Release(&rv);
    return result;
}

static PyMethodDef SlotIndex_methods[] = {
    {"find_many", (PyCFunction)(void (*)(void))SlotIndex_find_many, METH_FASTCALL,
     "find_many($self, hashes, out, /)\n--\n\n"
     "out[i] = the slot holding hashes[i] (uint64), or -1 (int32 out)."},
    {"index_many", (PyCFunction)(void (*)(void))SlotIndex_index_many, METH_FASTCALL,
     "index_many($self, hashes, slots, /)\n--\n\n"
     "Enter each slot (int32) at the first empty place from its hash (uint64)."},
    {NULL, NULL, 0, NULL},
};

PyTypeObject SlotIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "keeper._native.SlotIndex",
    .tp_basicsize = sizeof(SlotIndexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SlotIndex(records, table)\n--\n\n"
              "The slot table's index over its records; both arrays grow in place.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)SlotIndex_init,
    .tp_dealloc = (destructor)SlotIndex_dealloc,
    .tp_methods = SlotIndex_methods,
};
