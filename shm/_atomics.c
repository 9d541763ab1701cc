/* Placeholder module so the package builds; the shared-memory work replaces it
 * with C11 atomics on a buffer acquired once at attach. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static struct PyModuleDef atomics_module = {
    PyModuleDef_HEAD_INIT, "_atomics", "C11 atomics on shared memory.", -1, NULL,
};

PyMODINIT_FUNC PyInit__atomics(void) { return PyModule_Create(&atomics_module); }
