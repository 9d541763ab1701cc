/* The keeper._native module: its five types. */
#include "native.h"

PyObject *keeper_append_name;

static struct PyModuleDef native_module = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_native",
    .m_doc = "The keeper's C paths: the slot index's bulk probes, the best-K read, the "
             "event path's common case, a bucket's rewrites.",
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    keeper_append_name = PyUnicode_InternFromString("append");
    if (keeper_append_name == NULL) return NULL;
    PyTypeObject *types[5] = {&SlotIndexType, &PickedType, &QueueViewType, &FeedShapeType,
                              &BucketOpsType};
    const char *names[5] = {"SlotIndex", "Picked", "QueueView", "FeedShape", "BucketOps"};
    for (int i = 0; i < 5; i++) {
        if (PyType_Ready(types[i]) < 0) return NULL;
    }
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) return NULL;
    for (int i = 0; i < 5; i++) {
        if (PyModule_AddObjectRef(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
