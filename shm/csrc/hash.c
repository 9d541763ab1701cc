/* key_hash, key_hashes_into: a key's 64-bit identity in shared memory; key_site_hash,
 * key_site_hashes_into: its site's. */
#include "atomics.h"

#include <string.h>

/* SipHash-2-4 of a key's bytes under the database's hash secret: the key's 64-bit
 * identity in shared memory (shm/keys.py says why a keyed hash). 0 marks an empty
 * lease slot, so 0 maps to 1. Written out from the published algorithm (Aumasson and
 * Bernstein); reads are memcpy'd (unaligned and little-endian safe on the x86-64 and
 * aarch64 hosts this runs on). */

/* Words are read in host order: a big-endian host would hash differently, and a hash
 * is persisted (the lease snapshot), so such a build must not exist. */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "SipHash words are little-endian");

#define SECRET_BYTES 16

/* The state each hash starts from: the constants XORed with the secret once, when it is
 * set. Every key of this process hashes under the one secret (its store's), so it is
 * process state, read under the GIL, and set before any thread hashes. */
static uint64_t sip_init[4];
static int sip_keyed = 0;

static inline uint64_t
sip_rotl(uint64_t x, int r)
{
    return (x << r) | (x >> (64 - r));
}

static inline uint64_t
sip_read64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

#define SIPROUND                                                                            \
    do {                                                                                    \
        v0 += v1;                                                                           \
        v1 = sip_rotl(v1, 13);                                                              \
        v1 ^= v0;                                                                           \
        v0 = sip_rotl(v0, 32);                                                              \
        v2 += v3;                                                                           \
        v3 = sip_rotl(v3, 16);                                                              \
        v3 ^= v2;                                                                           \
        v0 += v3;                                                                           \
        v3 = sip_rotl(v3, 21);                                                              \
        v3 ^= v0;                                                                           \
        v2 += v1;                                                                           \
        v1 = sip_rotl(v1, 17);                                                              \
        v1 ^= v2;                                                                           \
        v2 = sip_rotl(v2, 32);                                                              \
    } while (0)

static void
sip_start(const unsigned char *secret, uint64_t init[4])
{
    uint64_t k0 = sip_read64(secret), k1 = sip_read64(secret + 8);
    init[0] = 0x736f6d6570736575ULL ^ k0;
    init[1] = 0x646f72616e646f6dULL ^ k1;
    init[2] = 0x6c7967656e657261ULL ^ k0;
    init[3] = 0x7465646279746573ULL ^ k1;
}

/* SipHash-2-4 with the 64-bit output, from a started state. */
static uint64_t
siphash24(const uint64_t init[4], const unsigned char *p, size_t len)
{
    uint64_t v0 = init[0], v1 = init[1], v2 = init[2], v3 = init[3];
    const unsigned char *end = p + (len & ~(size_t)7);
    for (; p != end; p += 8) {
        uint64_t m = sip_read64(p);
        v3 ^= m;
        SIPROUND;
        SIPROUND;
        v0 ^= m;
    }
    uint64_t tail = 0;
    memcpy(&tail, p, len & 7); /* the last 0-7 bytes, little-endian, the rest zero */
    uint64_t b = ((uint64_t)len << 56) | tail;
    v3 ^= b;
    SIPROUND;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

static inline uint64_t
key_hash_of(const unsigned char *p, size_t len)
{
    if (len == 0) p = (const unsigned char *)""; /* an empty buffer may have no address */
    uint64_t h = siphash24(sip_init, p, len);
    return h ? h : 1;
}

/* The site hash (shm/keys.py: site_of, site_hash): the same SipHash under a second secret
 * derived from the key secret, over the key's host. Set beside the key secret. */
static uint64_t site_init[4];
static int site_keyed = 0;

#define SITE_MAX_BYTES 253

static inline unsigned char
ascii_lower(unsigned char c)
{
    return (c >= 'A' && c <= 'Z') ? (unsigned char)(c + ('a' - 'A')) : c;
}

/* The key's site as site_of finds it, lower-cased into `out` (SITE_MAX_BYTES at least);
 * returns its length, 0 when the key names no host. Each step is site_of's, in its order:
 * after the first "://", up to the first '/', '?' or '#'; after the last '@'; an IPv6
 * literal up to its ']', else up to the first ':'; lower-cased; trailing dots dropped; a
 * leading "www." dropped; at most SITE_MAX_BYTES. */
static size_t
site_of_key(const unsigned char *key, size_t len, unsigned char *out)
{
    size_t start = 0;
    for (;; start++) {
        if (start + 3 > len) return 0;
        if (key[start] == ':' && key[start + 1] == '/' && key[start + 2] == '/') break;
    }
    start += 3;
    size_t end = start;
    while (end < len && key[end] != '/' && key[end] != '?' && key[end] != '#') end++;
    for (size_t at = end; at > start; at--) {
        if (key[at - 1] == '@') {
            start = at;
            break;
        }
    }
    if (start < end && key[start] == '[') {
        for (size_t at = start; at < end; at++) {
            if (key[at] == ']') {
                end = at + 1;
                break;
            }
        }
    } else {
        for (size_t at = start; at < end; at++) {
            if (key[at] == ':') {
                end = at;
                break;
            }
        }
    }
    while (end > start && key[end - 1] == '.') end--;
    if (end - start >= 4 && ascii_lower(key[start]) == 'w' && ascii_lower(key[start + 1]) == 'w' &&
        ascii_lower(key[start + 2]) == 'w' && key[start + 3] == '.') {
        start += 4;
    }
    size_t n = end - start;
    if (n > SITE_MAX_BYTES) n = SITE_MAX_BYTES;
    for (size_t i = 0; i < n; i++) out[i] = ascii_lower(key[start + i]);
    return n;
}

/* The hash of a site name's bytes (not empty). */
static inline uint64_t
site_name_hash(const unsigned char *site, size_t n)
{
    uint64_t h = siphash24(site_init, site, n);
    return h ? h : 1;
}

static inline uint64_t
key_site_hash_of(const unsigned char *p, size_t len)
{
    unsigned char site[SITE_MAX_BYTES];
    size_t n = site_of_key(p, len, site);
    if (n == 0) return 0; /* NO_SITE */
    return site_name_hash(site, n);
}

/* The key's site under a route's site pattern (shm/keys.py: site_of with a pattern, which
 * checked it): none (empty), the key's host; "*.NAME", NAME for NAME and every host under
 * it, else the host; any other NAME, NAME for every key. */
static inline uint64_t
key_site_hash_under(const unsigned char *key, size_t len, const unsigned char *pattern,
                    size_t plen)
{
    if (plen == 0) return key_site_hash_of(key, len);
    if (plen < 2 || pattern[0] != '*' || pattern[1] != '.') return site_name_hash(pattern, plen);
    const unsigned char *name = pattern + 2;
    size_t nlen = plen - 2;
    unsigned char site[SITE_MAX_BYTES];
    size_t n = site_of_key(key, len, site);
    if (n == 0) return 0; /* NO_SITE */
    if (n >= nlen && memcmp(site + (n - nlen), name, nlen) == 0 &&
        (n == nlen || site[n - nlen - 1] == '.')) {
        return site_name_hash(name, nlen);
    }
    return site_name_hash(site, n);
}

static int
need_secret(void)
{
    if (sip_keyed) return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "no hash secret: call shm.keys.use_secret with the store's before "
                    "hashing a key");
    return -1;
}

/* The bytes of a contiguous buffer of exactly SECRET_BYTES bytes into `out`. */
static int
read_secret(PyObject *obj, unsigned char out[SECRET_BYTES])
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    if (view.len != SECRET_BYTES) {
        PyErr_Format(PyExc_ValueError, "a hash secret is %d bytes, got %zd", SECRET_BYTES,
                     view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    memcpy(out, view.buf, SECRET_BYTES);
    PyBuffer_Release(&view);
    return 0;
}

/* The hash of one key's bytes (bytes fast, any contiguous buffer otherwise). */
static int
hash_object(PyObject *key, uint64_t *out)
{
    if (PyBytes_CheckExact(key)) {
        *out = key_hash_of((const unsigned char *)PyBytes_AS_STRING(key),
                           (size_t)PyBytes_GET_SIZE(key));
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(key, &view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    *out = key_hash_of((const unsigned char *)view.buf, (size_t)view.len);
    PyBuffer_Release(&view);
    return 0;
}

/* The site hash of one key's site under a site pattern (empty: none), bytes fast, any
 * contiguous buffer otherwise. */
static int
site_hash_object(PyObject *key, const unsigned char *pattern, size_t plen, uint64_t *out)
{
    if (PyBytes_CheckExact(key)) {
        *out = key_site_hash_under((const unsigned char *)PyBytes_AS_STRING(key),
                                   (size_t)PyBytes_GET_SIZE(key), pattern, plen);
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(key, &view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    *out = key_site_hash_under((const unsigned char *)view.buf, (size_t)view.len, pattern, plen);
    PyBuffer_Release(&view);
    return 0;
}

/* A site pattern's bytes: exactly bytes (shm.keys checked it), at most "*." and a name. */
static int
read_pattern(PyObject *pattern, const unsigned char **out, size_t *len)
{
    if (!PyBytes_CheckExact(pattern) || PyBytes_GET_SIZE(pattern) > SITE_MAX_BYTES + 2) {
        PyErr_SetString(PyExc_TypeError, "a site pattern is bytes of at most 255");
        return -1;
    }
    *out = (const unsigned char *)PyBytes_AS_STRING(pattern);
    *len = (size_t)PyBytes_GET_SIZE(pattern);
    return 0;
}

static int
need_site_secret(void)
{
    if (site_keyed) return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    "no site secret: call shm.keys.use_secret with the store's before "
                    "hashing a key's site");
    return -1;
}

/* key_hash(key) -> the key's nonzero 64-bit hash. */
static PyObject *
module_key_hash(PyObject *Py_UNUSED(module), PyObject *key)
{
    uint64_t h;
    if (need_secret() < 0 || hash_object(key, &h) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(h);
}

/* key_hashes_into(keys, out) -> None: hash each key of a list or tuple into the
 * aligned uint64 buffer `out` (one word per key). */
static PyObject *
module_key_hashes_into(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("key_hashes_into", nargs, 2) < 0 || need_secret() < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "key_hashes_into wants a sequence of keys");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer out;
    if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    if (out.len != n * 8 || ((uintptr_t)out.buf & 7u)) {
        PyBuffer_Release(&out);
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError,
                        "key_hashes_into wants an aligned uint64 buffer of one word per key");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *o = out.buf;
    int failed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (hash_object(items[i], &o[i]) < 0) {
            failed = 1;
            break;
        }
    }
    PyBuffer_Release(&out);
    Py_DECREF(seq);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* key_site_hash(key[, pattern]) -> site_hash(site_of(key, pattern)): 0 when the key has
 * no site. */
static PyObject *
module_key_site_hash(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 && nargs != 2) {
        PyErr_Format(PyExc_TypeError, "key_site_hash takes 1 or 2 arguments, got %zd", nargs);
        return NULL;
    }
    const unsigned char *pattern = (const unsigned char *)"";
    size_t plen = 0;
    if (nargs == 2 && read_pattern(args[1], &pattern, &plen) < 0) return NULL;
    uint64_t h;
    if (need_site_secret() < 0 || site_hash_object(args[0], pattern, plen, &h) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(h);
}

/* key_site_hashes_into(keys, out[, patterns, which]) -> None: key_site_hash of each key
 * of a list or tuple into the aligned uint64 buffer `out` (one word per key); with
 * `patterns` (a tuple of site patterns) and `which` (an aligned int32 buffer, one index
 * into it per key), each key under its own. */
static PyObject *
module_key_site_hashes_into(PyObject *Py_UNUSED(module), PyObject *const *args,
                            Py_ssize_t nargs)
{
    if (nargs != 2 && nargs != 4) {
        PyErr_Format(PyExc_TypeError, "key_site_hashes_into takes 2 or 4 arguments, got %zd",
                     nargs);
        return NULL;
    }
    if (need_site_secret() < 0) return NULL;
    Py_ssize_t n_patterns = 0;
    if (nargs == 4) {
        if (!PyTuple_CheckExact(args[2])) {
            PyErr_SetString(PyExc_TypeError, "key_site_hashes_into wants a tuple of patterns");
            return NULL;
        }
        n_patterns = PyTuple_GET_SIZE(args[2]);
        const unsigned char *unused;
        size_t unused_len;
        for (Py_ssize_t p = 0; p < n_patterns; p++) {
            if (read_pattern(PyTuple_GET_ITEM(args[2], p), &unused, &unused_len) < 0) return NULL;
        }
    }
    PyObject *seq = PySequence_Fast(args[0], "key_site_hashes_into wants a sequence of keys");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer out, which = {0};
    if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    if (nargs == 4 && PyObject_GetBuffer(args[3], &which, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&out);
        Py_DECREF(seq);
        return NULL;
    }
    const char *bad = NULL;
    if (out.len != n * 8 || ((uintptr_t)out.buf & 7u)) {
        bad = "key_site_hashes_into wants an aligned uint64 buffer of one word per key";
    } else if (nargs == 4 && (which.len != n * 4 || ((uintptr_t)which.buf & 3u))) {
        bad = "key_site_hashes_into wants an aligned int32 buffer of one index per key";
    } else if (nargs == 4) {
        const int32_t *w = which.buf;
        for (Py_ssize_t i = 0; i < n && bad == NULL; i++) {
            if (w[i] < 0 || w[i] >= n_patterns) bad = "a pattern index is out of range";
        }
    }
    if (bad != NULL) {
        if (nargs == 4) PyBuffer_Release(&which);
        PyBuffer_Release(&out);
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *o = out.buf;
    int failed = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *pattern = (const unsigned char *)"";
        size_t plen = 0;
        if (nargs == 4) {
            PyObject *chosen = PyTuple_GET_ITEM(args[2], ((const int32_t *)which.buf)[i]);
            pattern = (const unsigned char *)PyBytes_AS_STRING(chosen);
            plen = (size_t)PyBytes_GET_SIZE(chosen);
        }
        if (site_hash_object(items[i], pattern, plen, &o[i]) < 0) {
            failed = 1;
            break;
        }
    }
    if (nargs == 4) PyBuffer_Release(&which);
    PyBuffer_Release(&out);
    Py_DECREF(seq);
    if (failed) return NULL;
    Py_RETURN_NONE;
}

/* set_site_secret(secret) -> None: every later key_site_hash is keyed by these 16 bytes
 * (shm.keys.use_secret derives them from the key secret). */
static PyObject *
module_set_site_secret(PyObject *Py_UNUSED(module), PyObject *secret)
{
    unsigned char raw[SECRET_BYTES];
    if (read_secret(secret, raw) < 0) return NULL;
    sip_start(raw, site_init);
    site_keyed = 1;
    Py_RETURN_NONE;
}

/* set_hash_secret(secret) -> None: every later key_hash of this process is keyed by
 * these 16 bytes (shm.keys.use_secret decides when that may happen). */
static PyObject *
module_set_hash_secret(PyObject *Py_UNUSED(module), PyObject *secret)
{
    unsigned char raw[SECRET_BYTES];
    if (read_secret(secret, raw) < 0) return NULL;
    sip_start(raw, sip_init);
    sip_keyed = 1;
    Py_RETURN_NONE;
}

/* clear_hash_secret() -> None: key_hash and key_site_hash raise again until the next
 * set_hash_secret and set_site_secret. */
static PyObject *
module_clear_hash_secret(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(unused))
{
    memset(sip_init, 0, sizeof sip_init);
    sip_keyed = 0;
    memset(site_init, 0, sizeof site_init);
    site_keyed = 0;
    Py_RETURN_NONE;
}

/* siphash24(secret, data) -> SipHash-2-4 of data under secret, as published (0 stays 0),
 * so the known-answer tests reach the very function key_hash runs. */
static PyObject *
module_siphash24(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("siphash24", nargs, 2) < 0) return NULL;
    unsigned char raw[SECRET_BYTES];
    if (read_secret(args[0], raw) < 0) return NULL;
    uint64_t init[4];
    sip_start(raw, init);
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    const unsigned char *p = view.len ? (const unsigned char *)view.buf : (const unsigned char *)"";
    uint64_t h = siphash24(init, p, (size_t)view.len);
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef hash_methods[] = {
    {"key_hash", (PyCFunction)module_key_hash, METH_O,
     "key_hash($module, key, /)\n--\n\nkey_hash(key) -> SipHash-2-4 of the key's bytes under the process's secret, 0 mapped to 1."},
    {"key_hashes_into", (PyCFunction)(void (*)(void))module_key_hashes_into, METH_FASTCALL,
     "key_hashes_into($module, keys, out, /)\n--\n\nkey_hashes_into(keys, out_u64) -> None: key_hash of each key into out."},
    {"key_site_hash", (PyCFunction)(void (*)(void))module_key_site_hash, METH_FASTCALL,
     "key_site_hash($module, key, pattern=b'', /)\n--\n\nkey_site_hash(key[, pattern]) -> site_hash(site_of(key, pattern)): the key's site's hash, 0 for none."},
    {"key_site_hashes_into", (PyCFunction)(void (*)(void))module_key_site_hashes_into, METH_FASTCALL,
     "key_site_hashes_into($module, keys, out, patterns=(), which=None, /)\n--\n\nkey_site_hashes_into(keys, out_u64[, patterns, which_i32]) -> None: key_site_hash of each key (under patterns[which[i]]) into out."},
    {"set_site_secret", (PyCFunction)module_set_site_secret, METH_O,
     "set_site_secret($module, secret, /)\n--\n\nset_site_secret(secret) -> None: key every later key_site_hash with these 16 bytes."},
    {"set_hash_secret", (PyCFunction)module_set_hash_secret, METH_O,
     "set_hash_secret($module, secret, /)\n--\n\nset_hash_secret(secret) -> None: key every later key_hash with these 16 bytes."},
    {"clear_hash_secret", (PyCFunction)module_clear_hash_secret, METH_NOARGS,
     "clear_hash_secret($module, /)\n--\n\nclear_hash_secret() -> None: key_hash raises until the next set_hash_secret."},
    {"siphash24", (PyCFunction)(void (*)(void))module_siphash24, METH_FASTCALL,
     "siphash24($module, secret, data, /)\n--\n\nsiphash24(secret, data) -> SipHash-2-4 of data under the 16-byte secret (0 not remapped)."},
    {NULL, NULL, 0, NULL},
};

int
shm_hash_add(PyObject *m)
{
    return PyModule_AddFunctions(m, hash_methods);
}
