/* shm._atomics: C11 atomics on 8-byte words of a shared buffer, and the hot paths
 * built on them. The one header of the extension's sources:
 *
 *   words.c   Words: load-acquire, store-release, fetch-add, compare-and-swap and a
 *             seqlock copy, on any 8-byte-aligned region.
 *   ring.c    Ring: the ready ring's claim (fetch-add on the active buffer's cursor,
 *             copy, then check the buffer's generation) and its publish of keys that
 *             are slices of one buffer (the protocol is shm/ring.py's).
 *   leases.c  Leases: the lease table's grant / renew / complete / fail / forgive /
 *             state / blocked mask / sweep, each one call over the 8-slot probe
 *             window (shm/leases.py).
 *   sites.c   Sites: the site table's permits, spacing, blocks and failure streaks,
 *             each one call over the site's 8-slot probe window (shm/sites.py).
 *   hash.c    key_hash, key_hashes_into: SipHash-2-4 of key bytes under the database's
 *             secret, the lease table's key.
 *   module.c  the module: buffer acquisition and argument checks shared by the
 *             types, and the layout tables.
 *
 * Python has no atomic operations on shared memory. Each object acquires its buffer
 * (an mmap of a POSIX shared memory segment) once, at construction, where bounds and
 * alignment are checked; every operation after that is a METH_FASTCALL call doing
 * C11 atomics on words known to lie inside the buffer (an index compare stays per
 * call: it costs a nanosecond and keeps a wrong index from becoming a wild write into
 * shared memory). `release()` gives the buffer back so the owner can close the mmap
 * without BufferError.
 *
 * Layout constants are exported (RING_LAYOUT, LEASE_LAYOUT, ...) so the Python side
 * describes the same words rather than restating them.
 *
 * What the files share is declared here: the word type and its orderings and the
 * argument helpers as static inline (they sit on every call's path, and a call across
 * translation units would not be inlined), the cold helpers and each file's entry
 * (ready its type, add it to the module) as hidden symbols, so no other library
 * loaded into the process can interpose on them.
 */
#ifndef RENDERQUEUE_SHM_ATOMICS_H
#define RENDERQUEUE_SHM_ATOMICS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#define SHM_INTERNAL __attribute__((visibility("hidden")))

/* ------------------------------------------------------------------ words */

typedef _Atomic uint64_t aword;

_Static_assert(sizeof(aword) == 8, "8-byte atomic words");

#define LOAD(p) atomic_load_explicit((p), memory_order_acquire)
#define LOAD_SC(p) atomic_load_explicit((p), memory_order_seq_cst)
#define STORE(p, v) atomic_store_explicit((p), (v), memory_order_release)

static inline int
cas_word(aword *p, uint64_t expected, uint64_t desired)
{
    return atomic_compare_exchange_strong_explicit(p, &expected, desired, memory_order_seq_cst,
                                                   memory_order_seq_cst);
}

/* A per-process counter stripe keeps statistics counters from bouncing one cache
 * line between every process; statistics() sums the stripes. */
#define STRIPES 16
#define STRIPE_WORDS 16

static inline uint64_t
stripe_of_process(void)
{
    return (uint64_t)getpid() % STRIPES;
}

/* -------------------------------------------------------------- arguments */

static inline int
parse_u64(PyObject *o, uint64_t *out)
{
    /* Mask semantics: negative deltas wrap, which is what fetch_add wants. */
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static inline int
parse_i64(PyObject *o, int64_t *out)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

static inline int
check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------- module.c */

/* Acquire a writable, contiguous buffer and check that [offset, offset+nbytes) lies
 * inside it, 8-byte aligned. nbytes < 0 means "to the end". */
SHM_INTERNAL int shm_acquire_region(PyObject *obj, Py_ssize_t offset, Py_ssize_t nbytes,
                                    Py_buffer *view, char **base, Py_ssize_t *length);

/* ValueError for an operation after release(); returns NULL. */
SHM_INTERNAL PyObject *shm_released_error(void);

/* Add a dict name -> value of n entries to the module as `name`. */
SHM_INTERNAL int shm_add_layout(PyObject *m, const char *name, const char *const *keys,
                                const long *values, int n);

/* ------------------------------------------------------------- sites.c */

/* What the lease table's batch grant (leases.c) calls of a site table inside its loop,
 * with the meaning of Sites.acquire and Sites.undo. */
enum { SHM_SITE_GRANTED = 0, SHM_SITE_PERMIT = 1 };
/* 1 if `sites` is a Sites still holding its buffer, 0 if None, -1 with an error set. */
SHM_INTERNAL int shm_sites_usable(PyObject *sites);
SHM_INTERNAL int shm_sites_acquire(PyObject *sites, uint64_t h, uint64_t now, uint64_t lease_ms,
                                   uint64_t *until, int64_t *previous_last);
SHM_INTERNAL void shm_sites_undo(PyObject *sites, uint64_t h, uint64_t expires, uint64_t now,
                                 int64_t previous_last);

/* ------------------------------------------------------ each file's entry */

/* Ready the file's type (or functions) and add them, and its layout, to the module;
 * -1 with an exception set on failure. */
SHM_INTERNAL int shm_words_add(PyObject *m);
SHM_INTERNAL int shm_ring_add(PyObject *m);
SHM_INTERNAL int shm_leases_add(PyObject *m);
SHM_INTERNAL int shm_hash_add(PyObject *m);
SHM_INTERNAL int shm_sites_add(PyObject *m);

#endif /* RENDERQUEUE_SHM_ATOMICS_H */
