/* The skip table (keeper/skips.py): rows a selection passes over until an instant.
 *
 * Open addressing by slot with linear probing, over three columns Python owns: slot
 * (int32, -1 empty), until (epoch ms) and tag (the row the entry was taken for). The
 * capacity is a power of two. Entries are never emptied: one whose until has passed is
 * dead, and a later put may take it over; Python rebuilds the table before the live and
 * dead together fill half of it, so every chain ends at an empty entry.
 */
#ifndef KEEPER_SKIPS_H
#define KEEPER_SKIPS_H

#include "native.h"

typedef struct {
    int32_t *slot;
    int64_t *until;
    uint64_t *tag;
    Py_ssize_t cap; /* 0: no table */
} skips_t;

/* A skip entry names its row by hash and version (a store write gives a row a new
 * version), so a completion's write, or a slot given to another key, ends it without
 * touching the table. */
static inline uint64_t
skip_tag_of(const uint64_t *record)
{
    return record[0] ^ (record[2] * 0x9E3779B97F4A7C15ULL);
}

static inline Py_ssize_t
skip_home(int32_t slot, Py_ssize_t cap)
{
    return (Py_ssize_t)((uint32_t)slot * 0x9E3779B1u) & (cap - 1);
}

/* Whether the row in `slot`, of tag `tag`, is passed over at `now`. */
static inline int
skip_holds(const skips_t *s, int32_t slot, uint64_t tag, long long now)
{
    if (s->cap == 0) return 0;
    Py_ssize_t mask = s->cap - 1;
    for (Py_ssize_t i = skip_home(slot, s->cap), n = 0; n < s->cap; i = (i + 1) & mask, n++) {
        int32_t k = s->slot[i];
        if (k == -1) return 0;
        if (k == slot) return s->until[i] > now && s->tag[i] == tag;
    }
    return 0;
}

/* The table from a tuple of three buffers (int32 slot, int64 until, uint64 tag, of one
 * power-of-two length), or none for None; `flags`: PyBUF_WRITABLE to write. On success
 * with a table, the three views are held: keeper_skips_release gives them back. */
KEEPER_INTERNAL int keeper_skips_acquire(PyObject *table, int flags, Py_buffer *views,
                                         skips_t *out);
KEEPER_INTERNAL void keeper_skips_release(const skips_t *s, Py_buffer *views);

#endif
