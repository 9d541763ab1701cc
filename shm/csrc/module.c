/* The shm._atomics module: what the types share (buffer acquisition, the released
 * error, layout tables) and the init that adds each file's part. */
#include "atomics.h"

int
shm_acquire_region(PyObject *obj, Py_ssize_t offset, Py_ssize_t nbytes, Py_buffer *view,
                   char **base, Py_ssize_t *length)
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

PyObject *
shm_released_error(void)
{
    PyErr_SetString(PyExc_ValueError, "operation on a released shared-memory view");
    return NULL;
}

int
shm_add_layout(PyObject *m, const char *name, const char *const *keys, const long *values, int n)
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
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_atomics",
    .m_doc = "C11 atomics on shared memory, and the hot paths on them.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__atomics(void)
{
    PyObject *m = PyModule_Create(&atomics_module);
    if (m == NULL) return NULL;
    if (shm_words_add(m) < 0 || shm_ring_add(m) < 0 || shm_leases_add(m) < 0 ||
        shm_hash_add(m) < 0 || shm_sites_add(m) < 0 || PyModule_AddIntConstant(m, "STRIPES", STRIPES) < 0 ||
        PyModule_AddIntConstant(m, "STRIPE_WORDS", STRIPE_WORDS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
