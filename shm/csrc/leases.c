/* Leases: the lease table (shm/leases.py). Each key's slots lie in an 8-slot probe
 * window from its hash; a slot's state word, changed only by CAS, says whether the
 * key is free, leased until a time, held back until a time, or being removed. */
#include "atomics.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

/* Slot: key hash (0 = empty), state word, hold word, spare. The state word is
 * the only word a grant, renew, complete or settle changes, always by CAS:
 *   bits 0-1  phase: FREE, LEASED, HELD, REMOVING
 *   bits 2-5  misses (saturating at 15)
 *   bits 6-21 token (16 bits, never 0 once granted)
 *   bits 22-63 time in epoch ms (42 bits, to year 2109): LEASED -> expiry,
 *             HELD -> hold end, else 0.
 * The hold word, written by the grant's winner, is (token << 48 | permit << 47 |
 * hold_ms): how long the key is held back if this lease expires with no result, and
 * whether the lease holds a permit of its site (shm/sites.py). Beside the slots, a site
 * word per slot names the site of the key its grant's winner leased (0: none). */
enum { PH_FREE = 0, PH_LEASED = 1, PH_HELD = 2, PH_REMOVING = 3 };
#define W_PHASE(w) ((w) & 3u)
#define W_MISSES(w) (((w) >> 2) & 15u)
#define W_TOKEN(w) (((w) >> 6) & 0xffffu)
#define W_TIME(w) ((w) >> 22)
#define W_MAKE(ph, m, tok, t)                                                                  \
    ((uint64_t)(ph) | ((uint64_t)(m) << 2) | ((uint64_t)(tok) << 6) | ((uint64_t)(t) << 22))
#define TIME_MAX ((((uint64_t)1) << 42) - 1)
#define HOLD_MASK ((((uint64_t)1) << 47) - 1)
#define HOLD_PERMIT (((uint64_t)1) << 47)
#define MISSES_MAX 15u
#define PROBE 8
/* How long a sweep (by default) and a full window keep an ended hold's misses. */
#define KEEP_MISSES_MS 3600000ull
#define SLOT_WORDS 4
/* SLOT_COUNTED: the HELD state word whose hold the live held counter includes, 0
 * if none (see count_hold / uncount_hold). */
enum { SLOT_KEY = 0, SLOT_STATE = 1, SLOT_HOLD = 2, SLOT_COUNTED = 3 };

enum {
    LEASE_SWEEPER = 0,  /* pid of the process sweeping, 0 when none */
    LEASE_INCARNATION = 1, /* stamps each emptied slot's state word, see remove_slot */
    LEASE_FAILURES = 2, /* failed results that started a hold (rare: not striped) */
    LEASE_FORGIVEN = 3, /* slots an operator's forgive() released */
    /* The fingerprint of the hash secret the keys were hashed under (shm.keys), set by
     * the creator; 0 if none was given. No op reads it: it is what lets the next start
     * tell whether a killed run's slots are keyed as its own (shm/lease_survivor.py). */
    LEASE_SECRET_PRINT = 4,
    LEASE_STRIPES = 8,  /* STRIPES x STRIPE_WORDS counters */
    LEASE_CTRL_WORDS = LEASE_STRIPES + STRIPES * STRIPE_WORDS,
};
/* Words 4-7 were always zero, so an older build's table reads as "no secret recorded". */
_Static_assert(LEASE_SECRET_PRINT < LEASE_STRIPES, "the secret's word is outside the stripes");
enum {
    LS_GRANTS = 0,
    LS_RENEWALS = 1,
    LS_COMPLETIONS = 2,
    LS_EXPIRIES = 3,
    LS_HOLD_EVENTS = 4,
    LS_REFUSED_TAKEN = 5,
    LS_REFUSED_HELD = 6,
    LS_REFUSED_PROBE_FULL = 7,
    LS_INSERTS = 8,
    LS_RECLAIMED = 9,
    LS_CONFLICTS = 10,
    LS_STALE_TOKENS = 11,
    LS_SWEEPS = 12,
    /* Live counts, kept by the ops so statistics() never scans the table. In the
     * process stripes like the counters above, so claimants on other cores never
     * share a cache line; each sums (mod 2**64, read as signed) over the stripes, as
     * one process may add what another takes off:
     *   occupied  slots with a key (+1 insert, -1 when a removal clears the key)
     *   leased    slots in phase LEASED (an expired lease stays until settled)
     *   held      settled holds not yet seen ended by a sweep, grant or removal */
    LS_OCCUPIED = 13,
    LS_LEASED = 14,
    LS_HELD = 15,
};
_Static_assert(LS_HELD < STRIPE_WORDS, "live counters inside a stripe");
enum { GRANTED = 0, REFUSED_TAKEN = 1, REFUSED_HELD = 2, REFUSED_PROBE_FULL = 3 };
#define LEASE_MAX_ATTEMPTS 256
/* Tag words for a capacity: one lane per slot, plus a word so a window's two-word
 * read never runs past the end. */
#define LEASE_TAG_WORDS(capacity) (((capacity) + 7) / 8 + 1)

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    aword *ctrl;
    aword *slots;
    /* One byte lane per slot, 8 lanes a word: bit (key hash & 7) of each key the
     * slot held since it was last emptied. A window whose lanes lack the key's bit
     * holds no slot of the key, so blocked_mask skips the probe (see mark_tag). */
    aword *tags;
    aword *sites; /* a word per slot: the site hash of the lease its grant's winner made */
    uint64_t capacity;
    aword *stripe;
    uint64_t rng;
} LeasesObject;

static int
Leases_init(LeasesObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer",      "ctrl_offset",  "slots_offset", "tags_offset",
                             "sites_offset", "capacity", NULL};
    PyObject *obj;
    Py_ssize_t ctrl_off, slots_off, tags_off, sites_off, capacity;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnnnn", kwlist, &obj, &ctrl_off, &slots_off,
                                     &tags_off, &sites_off, &capacity)) {
        return -1;
    }
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "Leases is already initialised");
        return -1;
    }
    if (capacity < PROBE || capacity > ((Py_ssize_t)1 << 32)) {
        PyErr_Format(PyExc_ValueError, "lease table capacity must be in %d..2**32", PROBE);
        return -1;
    }
    char *base;
    Py_ssize_t length;
    if (shm_acquire_region(obj, 0, -1, &self->view, &base, &length) < 0) return -1;
    self->held = 1;
    if (ctrl_off < 0 || slots_off < 0 || tags_off < 0 || sites_off < 0 || (ctrl_off & 63) ||
        (slots_off & 63) || (tags_off & 63) || (sites_off & 63) ||
        ctrl_off + LEASE_CTRL_WORDS * 8 > length || slots_off + capacity * SLOT_WORDS * 8 > length ||
        tags_off + LEASE_TAG_WORDS(capacity) * 8 > length || sites_off + capacity * 8 > length) {
        PyErr_Format(PyExc_ValueError,
                     "lease layout (ctrl %zd, slots %zd, tags %zd, sites %zd, capacity %zd) does "
                     "not fit a buffer of %zd bytes with aligned words",
                     ctrl_off, slots_off, tags_off, sites_off, capacity, length);
        PyBuffer_Release(&self->view);
        self->held = 0;
        return -1;
    }
    self->ctrl = (aword *)(base + ctrl_off);
    self->slots = (aword *)(base + slots_off);
    self->tags = (aword *)(base + tags_off);
    self->sites = (aword *)(base + sites_off);
    self->capacity = (uint64_t)capacity;
    self->stripe = self->ctrl + LEASE_STRIPES + stripe_of_process() * STRIPE_WORDS;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    self->rng = ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_nsec ^ (uint64_t)(uintptr_t)self ^
                0x9e3779b97f4a7c15ull;
    return 0;
}

static void
Leases_dealloc(LeasesObject *self)
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline void
bump(LeasesObject *self, int which, uint64_t n)
{
    atomic_fetch_add_explicit(&self->stripe[which], n, memory_order_relaxed);
}

static inline uint64_t
window_start(LeasesObject *self, uint64_t h)
{
    return (uint64_t)(((unsigned __int128)h * self->capacity) >> 64);
}

static inline uint64_t
slot_at(LeasesObject *self, uint64_t start, int i)
{
    uint64_t s = start + (uint64_t)i;
    return s >= self->capacity ? s - self->capacity : s;
}

static inline aword *
slot_word(LeasesObject *self, uint64_t s, int which)
{
    return &self->slots[s * SLOT_WORDS + which];
}

static inline void
live_add(LeasesObject *self, int which, int64_t delta)
{
    atomic_fetch_add_explicit(&self->stripe[which], (uint64_t)delta, memory_order_relaxed);
}

static uint64_t
stripes_sum(LeasesObject *self, int which)
{
    uint64_t sum = 0;
    for (int stripe = 0; stripe < STRIPES; stripe++) {
        sum += LOAD(&self->ctrl[LEASE_STRIPES + stripe * STRIPE_WORDS + which]);
    }
    return sum;
}

_Static_assert(PROBE == 8, "a window is the 8 byte lanes of one tag word");

static inline uint64_t
tag_bit(uint64_t h)
{
    return 1ull << (h & 7u);
}

/* Set the key's bit in its slot's lane before the CAS that leases the slot, so a
 * lease or hold is never without its bit: lanes are cleared only by remove_slot,
 * on a slot parked REMOVING, and parking changes the state word, so a grant whose
 * CAS succeeds set its bit after any clear of that slot. */
static inline void
mark_tag(LeasesObject *self, uint64_t s, uint64_t h)
{
    aword *t = &self->tags[s >> 3];
    uint64_t bit = tag_bit(h) << (8 * (s & 7u));
    if (!(LOAD_SC(t) & bit)) atomic_fetch_or_explicit(t, bit, memory_order_seq_cst);
}

static inline void
clear_tag(LeasesObject *self, uint64_t s)
{
    atomic_fetch_and_explicit(&self->tags[s >> 3], ~(0xffull << (8 * (s & 7u))),
                              memory_order_seq_cst);
}

/* 0 if no slot of the key's window has the key's bit: then no slot holds the key
 * leased or held (mark_tag), and blocked_mask needs no probe. A false 1 (another
 * key's bit, about one window in eight per occupied slot) costs only the probe. */
static inline int
window_may_hold(LeasesObject *self, uint64_t h)
{
    uint64_t start = window_start(self, h);
    if (start + PROBE > self->capacity) {
        for (int i = 0; i < PROBE; i++) {
            uint64_t s = slot_at(self, start, i);
            if ((LOAD_SC(&self->tags[s >> 3]) >> (8 * (s & 7u))) & tag_bit(h)) return 1;
        }
        return 0;
    }
    uint64_t o = start & 7u;
    uint64_t lanes = LOAD_SC(&self->tags[start >> 3]) >> (8 * o);
    if (o) lanes |= LOAD_SC(&self->tags[(start >> 3) + 1]) << (64 - 8 * o);
    return (lanes & (0x0101010101010101ull << (h & 7u))) != 0;
}

/* The held counter: the winner of a settle CAS that started a hold ending after
 * now counts it, then names the HELD word in the slot's COUNTED word; exactly one
 * uncount_hold (a sweep that sees the hold ended, the grant or removal that takes
 * the slot) takes it off again, by CAS on that name. If the state moved on before
 * the name was written, nobody could take it off, so the settler does: one of the
 * two CASes on the name wins (all sequentially consistent). */
static void
count_hold(LeasesObject *self, uint64_t s, uint64_t held_word)
{
    aword *named = slot_word(self, s, SLOT_COUNTED);
    live_add(self, LS_HELD, 1);
    atomic_store_explicit(named, held_word, memory_order_seq_cst);
    if (LOAD_SC(slot_word(self, s, SLOT_STATE)) != held_word && cas_word(named, held_word, 0)) {
        live_add(self, LS_HELD, -1);
    }
}

static inline void
uncount_hold(LeasesObject *self, uint64_t s, uint64_t held_word)
{
    aword *named = slot_word(self, s, SLOT_COUNTED);
    if (held_word != 0 && LOAD_SC(named) == held_word && cas_word(named, held_word, 0)) {
        live_add(self, LS_HELD, -1);
    }
}

static uint64_t
next_token(LeasesObject *self, uint64_t w)
{
    uint64_t tok;
    if (W_TOKEN(w) == 0) {
        /* A fresh slot starts from a random token, so a token from the slot's
         * previous key (before a sweep) is unlikely to match the new one. */
        uint64_t x = self->rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self->rng = x;
        tok = x & 0xffffu;
    } else {
        tok = (W_TOKEN(w) + 1) & 0xffffu;
    }
    return tok ? tok : 1;
}

static uint64_t
hold_if_missed(uint64_t misses, uint64_t lease_ms, uint64_t cadence_ms)
{
    uint64_t m = misses + 1 > MISSES_MAX ? MISSES_MAX : misses + 1;
    uint64_t hold = (lease_ms > (HOLD_MASK >> m)) ? HOLD_MASK : (lease_ms << m);
    if (hold > cadence_ms) hold = cadence_ms;
    return hold & HOLD_MASK;
}

/* The hold an expired, unanswered lease earns: from the hold word if the grant's
 * winner got to write it (it always does unless killed between two stores). */
static uint64_t
settled_hold(LeasesObject *self, uint64_t s, uint64_t w)
{
    uint64_t p = LOAD_SC(slot_word(self, s, SLOT_HOLD));
    return (p >> 48) == W_TOKEN(w) ? (p & HOLD_MASK) : 0;
}

static uint64_t
settled_word(LeasesObject *self, uint64_t s, uint64_t w)
{
    uint64_t m = W_MISSES(w) + 1 > MISSES_MAX ? MISSES_MAX : W_MISSES(w) + 1;
    uint64_t until = W_TIME(w) + settled_hold(self, s, w);
    if (until > TIME_MAX) until = TIME_MAX;
    return W_MAKE(PH_HELD, m, W_TOKEN(w), until);
}

/* LEASED with expiry <= now and no result: record the miss and start the hold. */
static void
settle(LeasesObject *self, uint64_t s, uint64_t w, uint64_t now)
{
    uint64_t nw = settled_word(self, s, w);
    if (cas_word(slot_word(self, s, SLOT_STATE), w, nw)) {
        bump(self, LS_EXPIRIES, 1);
        if (W_TIME(nw) > W_TIME(w)) bump(self, LS_HOLD_EVENTS, 1);
        live_add(self, LS_LEASED, -1);
        if (W_TIME(nw) > now) count_hold(self, s, nw);
    }
}

static int
process_alive(uint64_t pid)
{
    if (pid == 0 || pid > (uint64_t)INT32_MAX) return 0;
    if (kill((pid_t)pid, 0) == 0) return 1;
    return errno != ESRCH;
}

/* The state word a remover parks a slot in: REMOVING, with the remover's pid so a
 * sweep can tell a live remover (leave it be) from a dead one (finish for it). */
static inline uint64_t
removing_word(void)
{
    return W_MAKE(PH_REMOVING, 0, 0, (uint64_t)getpid() & TIME_MAX);
}

/* Empty a slot whose state word the caller already moved to `parked` (REMOVING):
 * no grant can start on it, so clearing the key cannot orphan a lease. The emptied
 * slot's state word gets a stamp never used before (FREE, token 0, time =
 * incarnation): a claimant that read the slot's state before the removal can
 * never CAS it again (no ABA), which is what lets probe() trust a key read after
 * the state. */
static void
remove_slot(LeasesObject *self, uint64_t s, uint64_t k, uint64_t parked)
{
    uint64_t incarnation =
        atomic_fetch_add_explicit(&self->ctrl[LEASE_INCARNATION], 1, memory_order_relaxed) + 1;
    /* A hold still counted (ended, but no sweep saw it end) goes with its slot. */
    uncount_hold(self, s, LOAD_SC(slot_word(self, s, SLOT_COUNTED)));
    /* The lane before the key: once the key is 0 another key may take the slot and
     * set its own bit, which a later clear would wipe. */
    clear_tag(self, s);
    if (k != 0 && cas_word(slot_word(self, s, SLOT_KEY), k, 0)) live_add(self, LS_OCCUPIED, -1);
    cas_word(slot_word(self, s, SLOT_STATE), parked, W_MAKE(PH_FREE, 0, 0, incarnation & TIME_MAX));
}

static int
parse_time(PyObject *o, uint64_t *out, const char *what)
{
    int64_t v;
    if (parse_i64(o, &v) < 0) return -1;
    if (v < 0 || (uint64_t)v > TIME_MAX) {
        PyErr_Format(PyExc_ValueError, "%s %lld ms is outside 0..2**42", what, (long long)v);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

static int
parse_hash(PyObject *o, uint64_t *out)
{
    if (parse_u64(o, out) < 0) return -1;
    if (*out == 0) {
        PyErr_SetString(PyExc_ValueError, "key hash 0 marks an empty slot; use shm.key_hash()");
        return -1;
    }
    return 0;
}

/* What the window says about a key, read-only: its slots are every non-REMOVING
 * slot whose key word equals the hash. */
typedef struct {
    int n;
    uint64_t slot[PROBE];
    uint64_t word[PROBE];
    int64_t empty; /* first empty slot, -1 if none */
    int64_t spare; /* first slot another key no longer needs, -1 if none */
    uint64_t spare_key, spare_word;
} probe_t;

static void
probe(LeasesObject *self, uint64_t h, uint64_t now, probe_t *p)
{
    uint64_t start = window_start(self, h);
    p->n = 0;
    p->empty = -1;
    p->spare = -1;
    for (int i = 0; i < PROBE; i++) {
        uint64_t s = slot_at(self, start, i);
        /* State before key: a CAS that later succeeds on this state word proves the
         * slot was not emptied since (see remove_slot), so the key read after the
         * state is still the slot's key at the CAS. */
        uint64_t w = LOAD_SC(slot_word(self, s, SLOT_STATE));
        uint64_t k = LOAD_SC(slot_word(self, s, SLOT_KEY));
        if (W_PHASE(w) == PH_REMOVING) continue;
        if (k == h) {
            p->slot[p->n] = s;
            p->word[p->n] = w;
            p->n++;
        } else if (k == 0) {
            if (p->empty < 0) p->empty = (int64_t)s;
        } else if (p->spare < 0 &&
                   ((W_PHASE(w) == PH_FREE && W_TOKEN(w) != 0) ||
                    (W_PHASE(w) == PH_HELD && W_TIME(w) + KEEP_MISSES_MS <= now))) {
            /* Spare: a completed lease (token 0 is a fresh insert whose grant is under
             * way), or a hold that ended long ago, which a sweep would forget too. */
            p->spare = (int64_t)s;
            p->spare_key = k;
            p->spare_word = w;
        }
    }
}

/* grant(key_hash, now_ms, lease_ms, cadence_ms, site_hash, permit) -> (code, token, until)
 *
 * site_hash names the key's site (0: none) and permit says the caller holds a permit of
 * it until now + lease_ms (shm/sites.py); the winner writes both beside the lease, so
 * its renewals and result find the permit.
 *
 * Duplicates: two claimants inserting one key at the same moment can land in two
 * slots (a sweep may empty a slot between their scans). Grants go to the first
 * of a key's slots, and after a winning CAS the winner re-reads the key's other
 * slots: if one holds a live lease it reverts its own and retries. Of two racing
 * winners at least one sees the other (both CAS before they re-read, all
 * sequentially consistent), so at most one grant survives; a reverted grant was
 * never returned. */
static inline int
granted_as(int code, uint64_t tok, uint64_t at, uint64_t *token, uint64_t *until)
{
    *token = tok;
    *until = at;
    return code;
}

/* grant's decision for one key, its arguments checked: the code, and through `token`
 * and `until` what grant() returns beside it. */
static int
grant_one(LeasesObject *self, uint64_t h, uint64_t now, uint64_t lease_ms, uint64_t cadence_ms,
          uint64_t site, int with_permit, uint64_t *token, uint64_t *until)
{
    probe_t p;
    for (int attempt = 0; attempt < LEASE_MAX_ATTEMPTS; attempt++) {
        probe(self, h, now, &p);
        uint64_t taken_until = 0, held_until = 0;
        int settled = 0;
        for (int i = 0; i < p.n; i++) {
            uint64_t w = p.word[i];
            if (W_PHASE(w) == PH_LEASED) {
                if (W_TIME(w) > now) {
                    if (W_TIME(w) > taken_until) taken_until = W_TIME(w);
                } else {
                    settle(self, p.slot[i], w, now);
                    settled = 1;
                }
            } else if (W_PHASE(w) == PH_HELD && W_TIME(w) > now) {
                if (W_TIME(w) > held_until) held_until = W_TIME(w);
            }
        }
        if (settled) continue;
        if (taken_until) {
            bump(self, LS_REFUSED_TAKEN, 1);
            return granted_as(REFUSED_TAKEN, 0, taken_until, token, until);
        }
        if (held_until) {
            bump(self, LS_REFUSED_HELD, 1);
            return granted_as(REFUSED_HELD, 0, held_until, token, until);
        }
        uint64_t s, w;
        if (p.n == 0) {
            if (p.empty < 0 && p.spare >= 0) {
                /* No empty slot, but one another key no longer needs: empty it here
                 * rather than wait for the sweep. */
                uint64_t parked = removing_word();
                uint64_t r = (uint64_t)p.spare;
                if (cas_word(slot_word(self, r, SLOT_STATE), p.spare_word, parked)) {
                    remove_slot(self, r, p.spare_key, parked);
                    bump(self, LS_RECLAIMED, 1);
                }
                continue;
            }
            if (p.empty < 0) {
                bump(self, LS_REFUSED_PROBE_FULL, 1);
                return granted_as(REFUSED_PROBE_FULL, 0, 0, token, until);
            }
            s = (uint64_t)p.empty;
            if (!cas_word(slot_word(self, s, SLOT_KEY), 0, h)) continue;
            live_add(self, LS_OCCUPIED, 1);
            bump(self, LS_INSERTS, 1);
            /* A sweep may have emptied the slot again since the insert: then the key
             * read after the state is no longer ours, and the probe starts over. */
            w = LOAD_SC(slot_word(self, s, SLOT_STATE));
            if (LOAD_SC(slot_word(self, s, SLOT_KEY)) != h || W_PHASE(w) != PH_FREE) continue;
        } else {
            s = p.slot[0];
            w = p.word[0];
        }
        uint64_t tok = next_token(self, w);
        uint64_t expires = now + lease_ms;
        uint64_t nw = W_MAKE(PH_LEASED, W_MISSES(w), tok, expires);
        mark_tag(self, s, h);
        if (!cas_word(slot_word(self, s, SLOT_STATE), w, nw)) continue;
        live_add(self, LS_LEASED, 1);
        /* A HELD slot is granted only once its hold ended: no longer held. */
        if (W_PHASE(w) == PH_HELD) uncount_hold(self, s, w);
        STORE(&self->sites[s], site);
        STORE(slot_word(self, s, SLOT_HOLD), (tok << 48) | (with_permit ? HOLD_PERMIT : 0) |
                                                 hold_if_missed(W_MISSES(w), lease_ms, cadence_ms));
        /* Verify: no other slot of this key holds a live lease. */
        uint64_t start = window_start(self, h);
        int conflict = 0;
        for (int i = 0; i < PROBE && !conflict; i++) {
            uint64_t o = slot_at(self, start, i);
            if (o == s || LOAD_SC(slot_word(self, o, SLOT_KEY)) != h) continue;
            uint64_t ow = LOAD_SC(slot_word(self, o, SLOT_STATE));
            if (W_PHASE(ow) == PH_LEASED && W_TIME(ow) > now) conflict = 1;
        }
        if (conflict) {
            if (cas_word(slot_word(self, s, SLOT_STATE), nw, w)) live_add(self, LS_LEASED, -1);
            bump(self, LS_CONFLICTS, 1);
            continue;
        }
        bump(self, LS_GRANTS, 1);
        return granted_as(GRANTED, (s << 16) | tok, expires, token, until);
    }
    /* Only a storm of concurrent changes to this one window gets here. */
    bump(self, LS_REFUSED_TAKEN, 1);
    return granted_as(REFUSED_TAKEN, 0, now, token, until);
}


static PyObject *
Leases_grant(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("grant", nargs, 6) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, now, lease_ms, cadence_ms, site;
    int with_permit = PyObject_IsTrue(args[5]);
    if (with_permit < 0 || parse_hash(args[0], &h) < 0 || parse_time(args[1], &now, "now") < 0 ||
        parse_time(args[2], &lease_ms, "lease") < 0 ||
        parse_time(args[3], &cadence_ms, "cadence") < 0 || parse_u64(args[4], &site) < 0) {
        return NULL;
    }
    if (lease_ms == 0 || now + lease_ms > TIME_MAX) {
        PyErr_SetString(PyExc_ValueError, "lease_ms must be positive and now + lease in range");
        return NULL;
    }
    uint64_t token, until;
    int code = grant_one(self, h, now, lease_ms, cadence_ms, site, with_permit, &token, &until);
    return Py_BuildValue("(iKK)", code, (unsigned long long)token, (unsigned long long)until);
}

/* A contiguous, aligned array of n 8-byte items from a buffer, writable if asked. */
static int
u64_array(PyObject *o, Py_buffer *view, Py_ssize_t n, int writable, const char *what)
{
    if (PyObject_GetBuffer(o, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        return -1;
    }
    if (view->len != n * 8 || ((uintptr_t)view->buf & 7u)) {
        PyErr_Format(PyExc_ValueError, "grant_batch: %s must be %zd aligned 8-byte items", what, n);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* grant_batch(hashes, site_hashes, cadence_ms, now, lease_ms, sites, tokens, expires)
 *   -> keys granted
 *
 * grant() over a batch, in order, as the claim path made it one key at a time: for each
 * key with a non-zero hash (0: skip it), first its site's permit and spacing when `sites`
 * (a Sites, or None) is given and the key names a site, then the lease with the key's
 * cadence as the hold cap, the site's take given back if the lease is refused.
 * tokens[i] gets the lease's token, 0 when none was granted; expires[i] the lease's
 * expiry, or the refusal's `until` (the lease's or the site's; 0 when there is none).
 * hashes, site_hashes, cadence_ms: uint64[n]; tokens, expires: writable uint64[n]. */
static PyObject *
Leases_grant_batch(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("grant_batch", nargs, 8) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t now, lease_ms;
    if (parse_time(args[3], &now, "now") < 0 || parse_time(args[4], &lease_ms, "lease") < 0) {
        return NULL;
    }
    if (lease_ms == 0 || now + lease_ms > TIME_MAX) {
        PyErr_SetString(PyExc_ValueError, "lease_ms must be positive and now + lease in range");
        return NULL;
    }
    int with_sites = shm_sites_usable(args[5]);
    if (with_sites < 0) return NULL;
    Py_buffer in[3], out[2];
    int taken = 0;
    Py_ssize_t n = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &in[0], PyBUF_C_CONTIGUOUS) < 0) return NULL;
    taken = 1;
    n = in[0].len / 8;
    if ((in[0].len & 7) || ((uintptr_t)in[0].buf & 7u)) {
        PyErr_SetString(PyExc_ValueError, "grant_batch: hashes must be aligned 8-byte items");
        goto done;
    }
    if (u64_array(args[1], &in[1], n, 0, "site_hashes") < 0) goto done;
    taken = 2;
    if (u64_array(args[2], &in[2], n, 0, "cadence_ms") < 0) goto done;
    taken = 3;
    if (u64_array(args[6], &out[0], n, 1, "tokens") < 0) goto done;
    taken = 4;
    if (u64_array(args[7], &out[1], n, 1, "expires") < 0) goto done;
    taken = 5;
    const uint64_t *hashes = in[0].buf, *sites = in[1].buf, *cadences = in[2].buf;
    uint64_t *tokens = out[0].buf, *expires = out[1].buf;
    Py_ssize_t granted = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = hashes[i], site = sites[i], token = 0, until = 0;
        tokens[i] = 0;
        expires[i] = 0;
        if (h == 0) continue;
        uint64_t site_until = 0;
        int64_t previous = -1;
        int site_code = SHM_SITE_GRANTED;
        if (site && with_sites) {
            site_code = shm_sites_acquire(args[5], site, now, lease_ms, &site_until, &previous);
            if (site_code != SHM_SITE_GRANTED && site_code != SHM_SITE_PERMIT) {
                expires[i] = site_until;
                continue;
            }
        }
        int code = grant_one(self, h, now, lease_ms, cadences[i], site,
                             site_code == SHM_SITE_PERMIT, &token, &until);
        if (code != GRANTED) {
            if (site && with_sites) shm_sites_undo(args[5], site, site_until, now, previous);
            expires[i] = until;
            continue;
        }
        tokens[i] = token;
        expires[i] = until;
        granted++;
    }
    result = PyLong_FromSsize_t(granted);
done:
    if (taken >= 1) PyBuffer_Release(&in[0]);
    if (taken >= 2) PyBuffer_Release(&in[1]);
    if (taken >= 3) PyBuffer_Release(&in[2]);
    if (taken >= 4) PyBuffer_Release(&out[0]);
    if (taken >= 5) PyBuffer_Release(&out[1]);
    return result;
}

/* The slot and 16-bit counter a token names; 0 if it names no slot. */
static int
token_slot(LeasesObject *self, PyObject *const *args, uint64_t *h, uint64_t *s, uint64_t *tok,
           uint64_t *now)
{
    uint64_t token;
    if (parse_hash(args[0], h) < 0 || parse_u64(args[1], &token) < 0 ||
        parse_time(args[2], now, "now") < 0) {
        return -1;
    }
    *s = token >> 16;
    *tok = token & 0xffffu;
    return *s < self->capacity && *tok != 0;
}

/* The slot's state word if the token's lease on this key is live, else 0. State
 * before key, as in probe(): a CAS on the returned word then acts on this key. */
static uint64_t
live_lease(LeasesObject *self, uint64_t h, uint64_t s, uint64_t tok, uint64_t now)
{
    uint64_t w = LOAD_SC(slot_word(self, s, SLOT_STATE));
    if (W_PHASE(w) != PH_LEASED || W_TOKEN(w) != tok || W_TIME(w) <= now) return 0;
    return LOAD_SC(slot_word(self, s, SLOT_KEY)) == h ? w : 0;
}

static PyObject *
Leases_holds(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("holds", nargs, 3) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, s, tok, now;
    int r = token_slot(self, args, &h, &s, &tok, &now);
    if (r < 0) return NULL;
    return PyBool_FromLong(r == 1 && live_lease(self, h, s, tok, now) != 0);
}

/* renew(h, token, now, lease_ms, expected) -> new expiry or -1. expected: the lease's
 * expiry the caller moved its permit from (0: any); another expiry refuses, so a renewal
 * never moves a lease its permit did not follow. */
static PyObject *
Leases_renew(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("renew", nargs, 5) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, s, tok, now, lease_ms, expected;
    int r = token_slot(self, args, &h, &s, &tok, &now);
    if (r < 0 || parse_time(args[3], &lease_ms, "lease") < 0 ||
        parse_time(args[4], &expected, "expected") < 0) {
        return NULL;
    }
    if (lease_ms == 0 || now + lease_ms > TIME_MAX) {
        PyErr_SetString(PyExc_ValueError, "lease_ms must be positive and now + lease in range");
        return NULL;
    }
    for (int attempt = 0; r == 1 && attempt < LEASE_MAX_ATTEMPTS; attempt++) {
        uint64_t w = live_lease(self, h, s, tok, now);
        if (w == 0 || (expected != 0 && W_TIME(w) != expected)) break;
        uint64_t nw = W_MAKE(PH_LEASED, W_MISSES(w), tok, now + lease_ms);
        if (cas_word(slot_word(self, s, SLOT_STATE), w, nw)) {
            bump(self, LS_RENEWALS, 1);
            return PyLong_FromUnsignedLongLong(now + lease_ms);
        }
    }
    bump(self, LS_STALE_TOKENS, 1);
    return PyLong_FromLong(-1);
}

/* What a lease holds of its site: the site word and the hold word's permit bit, read
 * with the state word they go with (the winner wrote them before its token was out). */
static void
lease_site(LeasesObject *self, uint64_t s, uint64_t tok, uint64_t *site, int *with_permit)
{
    uint64_t hold = LOAD_SC(slot_word(self, s, SLOT_HOLD));
    *site = LOAD_SC(&self->sites[s]);
    *with_permit = (hold >> 48) == tok && (hold & HOLD_PERMIT) != 0;
}

/* complete(key_hash, token, now) -> (expires, site_hash, permit): the ended lease's
 * expiry (0 if the token's lease was not live: nothing changed), its site, and whether it
 * held a permit there, for the caller to free (shm/sites.py). */
static PyObject *
Leases_complete(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("complete", nargs, 3) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, s, tok, now;
    int r = token_slot(self, args, &h, &s, &tok, &now);
    if (r < 0) return NULL;
    for (int attempt = 0; r == 1 && attempt < LEASE_MAX_ATTEMPTS; attempt++) {
        uint64_t w = live_lease(self, h, s, tok, now);
        if (w == 0) break;
        uint64_t site;
        int with_permit;
        lease_site(self, s, tok, &site, &with_permit);
        /* A result ends the lease and forgives the misses. */
        if (cas_word(slot_word(self, s, SLOT_STATE), w, W_MAKE(PH_FREE, 0, tok, 0))) {
            live_add(self, LS_LEASED, -1);
            bump(self, LS_COMPLETIONS, 1);
            return Py_BuildValue("(KKO)", (unsigned long long)W_TIME(w), (unsigned long long)site,
                                 with_permit ? Py_True : Py_False);
        }
    }
    bump(self, LS_STALE_TOKENS, 1);
    return Py_BuildValue("(KKO)", 0ull, 0ull, Py_False);
}

/* lease_of(key_hash, token, now) -> (expires, site_hash, permit), or None if the token's
 * lease is not live. */
static PyObject *
Leases_lease_of(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("lease_of", nargs, 3) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, s, tok, now;
    int r = token_slot(self, args, &h, &s, &tok, &now);
    if (r < 0) return NULL;
    uint64_t w = r == 1 ? live_lease(self, h, s, tok, now) : 0;
    if (w == 0) Py_RETURN_NONE;
    uint64_t site;
    int with_permit;
    lease_site(self, s, tok, &site, &with_permit);
    if (LOAD_SC(slot_word(self, s, SLOT_STATE)) != w) Py_RETURN_NONE;
    return Py_BuildValue("(KKO)", (unsigned long long)W_TIME(w), (unsigned long long)site,
                         with_permit ? Py_True : Py_False);
}

/* drop_permit(key_hash, token) -> bool: the lease no longer holds a permit (a renewal
 * found its site full), so its result frees none. */
static PyObject *
Leases_drop_permit(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("drop_permit", nargs, 2) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, token;
    if (parse_hash(args[0], &h) < 0 || parse_u64(args[1], &token) < 0) return NULL;
    uint64_t s = token >> 16, tok = token & 0xffffu;
    if (s >= self->capacity || tok == 0) Py_RETURN_FALSE;
    aword *hw = slot_word(self, s, SLOT_HOLD);
    uint64_t hold = LOAD_SC(hw);
    if ((hold >> 48) != tok || !(hold & HOLD_PERMIT)) Py_RETURN_FALSE;
    return PyBool_FromLong(cas_word(hw, hold, hold & ~HOLD_PERMIT));
}

/* fail(key_hash, token, now) -> (hold end, expires, site_hash, permit); hold end -1 if
 * the token's lease is not live (then nothing changed). The rest as complete's.
 *
 * A failed render is a result, but not one that should be retried at once: the lease
 * ends and the key is held back from now exactly as if the lease had expired
 * unanswered (the hold word: 2 lease lengths, then 4, 8, ... capped at the cadence),
 * with the misses raised. Only complete() (rendered, gone) forgives the misses, so a
 * key that keeps failing spaces its retries out the same way a key whose renders keep
 * vanishing does. */
static PyObject *
Leases_fail(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("fail", nargs, 3) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, s, tok, now;
    int r = token_slot(self, args, &h, &s, &tok, &now);
    if (r < 0) return NULL;
    for (int attempt = 0; r == 1 && attempt < LEASE_MAX_ATTEMPTS; attempt++) {
        uint64_t w = live_lease(self, h, s, tok, now);
        if (w == 0) break;
        uint64_t m = W_MISSES(w) + 1 > MISSES_MAX ? MISSES_MAX : W_MISSES(w) + 1;
        uint64_t until = now + settled_hold(self, s, w);
        if (until > TIME_MAX) until = TIME_MAX;
        uint64_t nw = W_MAKE(PH_HELD, m, tok, until);
        uint64_t site;
        int with_permit;
        lease_site(self, s, tok, &site, &with_permit);
        if (cas_word(slot_word(self, s, SLOT_STATE), w, nw)) {
            live_add(self, LS_LEASED, -1);
            bump(self, LS_COMPLETIONS, 1);
            atomic_fetch_add_explicit(&self->ctrl[LEASE_FAILURES], 1, memory_order_relaxed);
            if (until > now) count_hold(self, s, nw);
            return Py_BuildValue("(LKKO)", (long long)until, (unsigned long long)W_TIME(w),
                                 (unsigned long long)site, with_permit ? Py_True : Py_False);
        }
    }
    bump(self, LS_STALE_TOKENS, 1);
    return Py_BuildValue("(LKKO)", -1ll, 0ull, 0ull, Py_False);
}

/* forgive(key_hash, now) -> slots released: an operator's "render now". Every hold of
 * the key ends (an expired, unanswered lease too) and its misses are forgotten; a live
 * lease is never touched. */
static PyObject *
Leases_forgive(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("forgive", nargs, 2) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, now;
    if (parse_hash(args[0], &h) < 0 || parse_time(args[1], &now, "now") < 0) return NULL;
    long released = 0;
    for (int attempt = 0; attempt < LEASE_MAX_ATTEMPTS; attempt++) {
        probe_t p;
        probe(self, h, now, &p);
        int retry = 0;
        for (int i = 0; i < p.n; i++) {
            uint64_t w = p.word[i];
            int expired = W_PHASE(w) == PH_LEASED && W_TIME(w) <= now;
            if (W_PHASE(w) != PH_HELD && !expired) continue;
            if (!cas_word(slot_word(self, p.slot[i], SLOT_STATE), w,
                          W_MAKE(PH_FREE, 0, W_TOKEN(w), 0))) {
                retry = 1;
                continue;
            }
            if (expired) {
                live_add(self, LS_LEASED, -1);
                bump(self, LS_EXPIRIES, 1);
            } else {
                uncount_hold(self, p.slot[i], w);
            }
            released++;
        }
        if (!retry) break;
    }
    if (released) {
        atomic_fetch_add_explicit(&self->ctrl[LEASE_FORGIVEN], (uint64_t)released,
                                  memory_order_relaxed);
    }
    return PyLong_FromLong(released);
}

typedef struct {
    int leased, held;
    uint64_t lease_expires_at, held_until, misses;
} keystate_t;

/* Read-only view of a key: an expired lease with no result reads as the hold it
 * will become once a grant or sweep settles it. */
static void
key_state(LeasesObject *self, uint64_t h, uint64_t now, keystate_t *ks)
{
    probe_t p;
    probe(self, h, now, &p);
    memset(ks, 0, sizeof(*ks));
    for (int i = 0; i < p.n; i++) {
        uint64_t w = p.word[i];
        if (W_PHASE(w) == PH_LEASED && W_TIME(w) <= now) w = settled_word(self, p.slot[i], w);
        uint64_t t = W_TIME(w);
        if (W_MISSES(w) > ks->misses) ks->misses = W_MISSES(w);
        if (W_PHASE(w) == PH_LEASED) {
            ks->leased = 1;
            if (t > ks->lease_expires_at) ks->lease_expires_at = t;
        } else if (W_PHASE(w) == PH_HELD) {
            if (t > now) ks->held = 1;
            if (t > ks->held_until) ks->held_until = t;
        }
    }
}

static PyObject *
Leases_state(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("state", nargs, 2) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, now;
    if (parse_hash(args[0], &h) < 0 || parse_time(args[1], &now, "now") < 0) return NULL;
    keystate_t ks;
    key_state(self, h, now, &ks);
    return Py_BuildValue("(OKOKK)", ks.leased ? Py_True : Py_False,
                         (unsigned long long)ks.lease_expires_at, ks.held ? Py_True : Py_False,
                         (unsigned long long)ks.held_until, (unsigned long long)ks.misses);
}

/* A batch's probe windows are scattered over the table: fetching the windows a few
 * hashes ahead overlaps their cache misses instead of paying them one by one. */
#define BLOCKED_AHEAD 8

static inline void
prefetch_window(LeasesObject *self, uint64_t h)
{
    uint64_t start = window_start(self, h);
    for (int i = 0; i < PROBE; i += 2) {
        __builtin_prefetch(slot_word(self, slot_at(self, start, i), SLOT_KEY), 0, 1);
    }
}

/* blocked_mask(hashes, out_u8, now): out[i] = 1 if hashes[i] is leased or held now.
 * blocked_until(hashes, out_i64, now): out[i] = until when: a lease's end (the hold it
 * may earn is read once it has ended) or a hold's, 0 for a key neither.
 * First the tag lanes (a compact array, mostly cached) rule out the keys no slot
 * can hold; only the rest are probed, their windows fetched a few keys ahead. */
static PyObject *
blocked_common(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs, const char *name,
               Py_ssize_t out_size)
{
    if (check_nargs(name, nargs, 3) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t now;
    if (parse_time(args[2], &now, "now") < 0) return NULL;
    Py_buffer in, out;
    if (PyObject_GetBuffer(args[0], &in, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    Py_ssize_t n = in.len / 8;
    if ((in.len & 7) || out.len != n * out_size || ((uintptr_t)in.buf & 7u) ||
        ((uintptr_t)out.buf % (uintptr_t)out_size)) {
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        PyErr_Format(PyExc_ValueError, "%s wants aligned uint64 hashes and one %zd-byte output "
                     "per hash", name, out_size);
        return NULL;
    }
    const uint64_t *hs = in.buf;
    unsigned char *mask = out_size == 1 ? out.buf : NULL;
    int64_t *until = out_size == 8 ? out.buf : NULL;
    Py_ssize_t *probe_at = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t));
    if (probe_at == NULL) {
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        return PyErr_NoMemory();
    }
    Py_ssize_t candidates = 0, blocked = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (mask) mask[i] = 0;
        if (until) until[i] = 0;
        if (hs[i] != 0 && window_may_hold(self, hs[i])) probe_at[candidates++] = i;
    }
    for (Py_ssize_t c = 0; c < candidates; c++) {
        keystate_t ks;
        if (c + BLOCKED_AHEAD < candidates) prefetch_window(self, hs[probe_at[c + BLOCKED_AHEAD]]);
        Py_ssize_t i = probe_at[c];
        key_state(self, hs[i], now, &ks);
        int leased = ks.leased && ks.lease_expires_at > now;
        if (leased || ks.held) {
            if (mask) mask[i] = 1;
            if (until) {
                uint64_t end = leased ? ks.lease_expires_at : 0;
                if (ks.held && ks.held_until > end) end = ks.held_until;
                until[i] = (int64_t)end;
            }
            blocked++;
        }
    }
    PyMem_Free(probe_at);
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    return PyLong_FromSsize_t(blocked);
}

static PyObject *
Leases_blocked_mask(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return blocked_common(self, args, nargs, "blocked_mask", 1);
}

static PyObject *
Leases_blocked_until(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    return blocked_common(self, args, nargs, "blocked_until", 8);
}

/* sweep(now, keep_misses_ms) -> reclaimed slots, or -1 if another live process is
 * sweeping. Settles expired leases; reclaims FREE slots and holds that ended
 * keep_misses_ms ago; finishes removals a dead sweeper left half done. */
static PyObject *
Leases_sweep(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("sweep", nargs, 2) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t now, keep;
    if (parse_time(args[0], &now, "now") < 0 || parse_time(args[1], &keep, "keep") < 0) {
        return NULL;
    }
    uint64_t me = (uint64_t)getpid();
    aword *sweeper = &self->ctrl[LEASE_SWEEPER];
    uint64_t owner = LOAD_SC(sweeper);
    if (owner != me) {
        if (owner != 0 && process_alive(owner)) return PyLong_FromLong(-1);
        if (!cas_word(sweeper, owner, me)) return PyLong_FromLong(-1);
    }
    bump(self, LS_SWEEPS, 1);
    uint64_t parked = removing_word();
    long reclaimed = 0;
    for (uint64_t s = 0; s < self->capacity; s++) {
        aword *kw = slot_word(self, s, SLOT_KEY);
        aword *sw = slot_word(self, s, SLOT_STATE);
        uint64_t w = LOAD_SC(sw); /* state before key, as in probe() */
        uint64_t k = LOAD_SC(kw);
        if (W_PHASE(w) == PH_REMOVING) {
            /* A remover killed between its steps: finish for it. A live one (another
             * process: within this one the GIL keeps removals whole) finishes itself. */
            uint64_t remover = W_TIME(w);
            if (remover != me && process_alive(remover)) continue;
            remove_slot(self, s, k, w);
            reclaimed++;
            continue;
        }
        if (k == 0) continue;
        if (W_PHASE(w) == PH_LEASED && W_TIME(w) <= now) {
            settle(self, s, w, now);
            w = LOAD_SC(sw);
        }
        if (W_PHASE(w) == PH_HELD && W_TIME(w) <= now) uncount_hold(self, s, w);
        int dead = W_PHASE(w) == PH_FREE ||
                   (W_PHASE(w) == PH_HELD && W_TIME(w) + keep <= now);
        if (dead && cas_word(sw, w, parked)) {
            remove_slot(self, s, k, parked);
            reclaimed++;
        }
    }
    cas_word(sweeper, me, 0);
    bump(self, LS_RECLAIMED, (uint64_t)reclaimed);
    return PyLong_FromLong(reclaimed);
}

/* census(now) -> (occupied, live, held, expired_unsettled, removing) */
static PyObject *
Leases_census(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("census", nargs, 1) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t now;
    if (parse_time(args[0], &now, "now") < 0) return NULL;
    uint64_t occupied = 0, live = 0, held = 0, expired = 0, removing = 0;
    for (uint64_t s = 0; s < self->capacity; s++) {
        uint64_t k = LOAD(slot_word(self, s, SLOT_KEY));
        uint64_t w = LOAD(slot_word(self, s, SLOT_STATE));
        if (W_PHASE(w) == PH_REMOVING) {
            removing++;
            continue;
        }
        if (k == 0) continue;
        occupied++;
        if (W_PHASE(w) == PH_LEASED) {
            if (W_TIME(w) > now) {
                live++;
            } else {
                expired++;
                if (W_TIME(settled_word(self, s, w)) > now) held++;
            }
        } else if (W_PHASE(w) == PH_HELD && W_TIME(w) > now) {
            held++;
        }
    }
    return Py_BuildValue("(KKKKK)", (unsigned long long)occupied, (unsigned long long)live,
                         (unsigned long long)held, (unsigned long long)expired,
                         (unsigned long long)removing);
}

/* live() -> (occupied, leased, held): the counters the ops keep, read as signed (a
 * process killed between a CAS and its count can leave one off until recount). */
static PyObject *
Leases_live(LeasesObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->held) return shm_released_error();
    return Py_BuildValue("(LLL)", (long long)(int64_t)stripes_sum(self, LS_OCCUPIED),
                         (long long)(int64_t)stripes_sum(self, LS_LEASED),
                         (long long)(int64_t)stripes_sum(self, LS_HELD));
}

/* totals() -> each statistics counter summed over the process stripes (STRIPE_WORDS
 * values), in one call rather than STRIPES x STRIPE_WORDS loads from Python. */
static PyObject *
Leases_totals(LeasesObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->held) return shm_released_error();
    PyObject *out = PyTuple_New(STRIPE_WORDS);
    if (out == NULL) return NULL;
    for (int i = 0; i < STRIPE_WORDS; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(stripes_sum(self, i));
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

/* recount(now) -> (occupied, leased, held): rebuild the counters, the held names
 * and the tag lanes from the slots, for a table whose slots were written whole
 * (an import). Only while no other process uses the table: it stores, not CASes. */
static PyObject *
Leases_recount(LeasesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("recount", nargs, 1) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t now;
    if (parse_time(args[0], &now, "now") < 0) return NULL;
    for (uint64_t t = 0; t < LEASE_TAG_WORDS(self->capacity); t++) STORE(&self->tags[t], 0);
    uint64_t occupied = 0, leased = 0, held = 0;
    for (uint64_t s = 0; s < self->capacity; s++) {
        uint64_t k = LOAD_SC(slot_word(self, s, SLOT_KEY));
        uint64_t w = LOAD_SC(slot_word(self, s, SLOT_STATE));
        uint64_t named = 0;
        if (k != 0) occupied++; /* a removal's key too, until the key is cleared */
        if (k != 0 && W_PHASE(w) != PH_REMOVING) {
            mark_tag(self, s, k);
            if (W_PHASE(w) == PH_LEASED) {
                leased++;
            } else if (W_PHASE(w) == PH_HELD && W_TIME(w) > now) {
                held++;
                named = w;
            }
        }
        atomic_store_explicit(slot_word(self, s, SLOT_COUNTED), named, memory_order_seq_cst);
    }
    const int live[3] = {LS_OCCUPIED, LS_LEASED, LS_HELD};
    const uint64_t counted[3] = {occupied, leased, held};
    for (int j = 0; j < 3; j++) {
        for (int stripe = 0; stripe < STRIPES; stripe++) {
            atomic_store_explicit(&self->ctrl[LEASE_STRIPES + stripe * STRIPE_WORDS + live[j]],
                                  stripe == 0 ? counted[j] : 0, memory_order_seq_cst);
        }
    }
    return Py_BuildValue("(KKK)", (unsigned long long)occupied, (unsigned long long)leased,
                         (unsigned long long)held);
}

static PyObject *
Leases_release(LeasesObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        self->ctrl = self->slots = self->tags = self->sites = NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Leases_methods[] = {
    {"grant", (PyCFunction)(void (*)(void))Leases_grant, METH_FASTCALL,
     "grant($self, key_hash, now, lease_ms, cadence_ms, site_hash, permit, /)\n--\n\ngrant(key_hash, now, lease_ms, cadence_ms, site_hash, permit) -> (code, token, until)."},
    {"grant_batch", (PyCFunction)(void (*)(void))Leases_grant_batch, METH_FASTCALL,
     "grant_batch($self, hashes, site_hashes, cadence_ms, now, lease_ms, sites, tokens, expires, /)\n--\n\ngrant_batch(...) -> keys granted: grant() over arrays, site permits taken inside."},
    {"holds", (PyCFunction)(void (*)(void))Leases_holds, METH_FASTCALL,
     "holds($self, key_hash, token, now, /)\n--\n\nholds(key_hash, token, now) -> bool."},
    {"renew", (PyCFunction)(void (*)(void))Leases_renew, METH_FASTCALL,
     "renew($self, key_hash, token, now, lease_ms, expected, /)\n--\n\nrenew(key_hash, token, now, lease_ms, expected) -> new expiry, or -1."},
    {"complete", (PyCFunction)(void (*)(void))Leases_complete, METH_FASTCALL,
     "complete($self, key_hash, token, now, /)\n--\n\ncomplete(key_hash, token, now) -> (expires, site_hash, permit); expires 0 if not held."},
    {"lease_of", (PyCFunction)(void (*)(void))Leases_lease_of, METH_FASTCALL,
     "lease_of($self, key_hash, token, now, /)\n--\n\nlease_of(key_hash, token, now) -> (expires, site_hash, permit) or None."},
    {"drop_permit", (PyCFunction)(void (*)(void))Leases_drop_permit, METH_FASTCALL,
     "drop_permit($self, key_hash, token, /)\n--\n\ndrop_permit(key_hash, token) -> bool."},
    {"fail", (PyCFunction)(void (*)(void))Leases_fail, METH_FASTCALL,
     "fail($self, key_hash, token, now, /)\n--\n\nfail(key_hash, token, now) -> (hold end or -1, expires, site_hash, permit)."},
    {"forgive", (PyCFunction)(void (*)(void))Leases_forgive, METH_FASTCALL,
     "forgive($self, key_hash, now, /)\n--\n\nforgive(key_hash, now) -> slots whose hold (or expired lease) was released."},
    {"state", (PyCFunction)(void (*)(void))Leases_state, METH_FASTCALL,
     "state($self, key_hash, now, /)\n--\n\nstate(key_hash, now) -> (leased, lease_expires_at, held, held_until, misses)."},
    {"blocked_mask", (PyCFunction)(void (*)(void))Leases_blocked_mask, METH_FASTCALL,
     "blocked_mask($self, hashes, out, now, /)\n--\n\nblocked_mask(hashes_u64, out_u8, now) -> number blocked."},
    {"blocked_until", (PyCFunction)(void (*)(void))Leases_blocked_until, METH_FASTCALL,
     "blocked_until($self, hashes, out, now, /)\n--\n\nblocked_until(hashes_u64, out_i64, now) -> number blocked; each blocked key's end."},
    {"sweep", (PyCFunction)(void (*)(void))Leases_sweep, METH_FASTCALL,
     "sweep($self, now, keep_misses_ms, /)\n--\n\nsweep(now, keep_misses_ms) -> reclaimed, or -1 if another process is sweeping."},
    {"census", (PyCFunction)(void (*)(void))Leases_census, METH_FASTCALL,
     "census($self, now, /)\n--\n\ncensus(now) -> (occupied, live, held, expired_unsettled, removing)."},
    {"live", (PyCFunction)Leases_live, METH_NOARGS,
     "live($self)\n--\n\nlive() -> (occupied, leased, held), the counters the ops keep."},
    {"totals", (PyCFunction)Leases_totals, METH_NOARGS,
     "totals($self)\n--\n\ntotals() -> the statistics counters, each summed over the process stripes."},
    {"recount", (PyCFunction)(void (*)(void))Leases_recount, METH_FASTCALL,
     "recount($self, now, /)\n--\n\nrecount(now) -> (occupied, leased, held): rebuild counters and tags from the slots."},
    {"release", (PyCFunction)Leases_release, METH_NOARGS, "release($self)\n--\n\nGive the buffer back (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LeasesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shm._atomics.Leases",
    .tp_basicsize = sizeof(LeasesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Leases(buffer, ctrl_offset, slots_offset, tags_offset, sites_offset, capacity)\n--\n\n"
              "The lease table's hot paths.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Leases_init,
    .tp_dealloc = (destructor)Leases_dealloc,
    .tp_methods = Leases_methods,
};

int
shm_leases_add(PyObject *m)
{
    if (PyType_Ready(&LeasesType) < 0) return -1;
    Py_INCREF(&LeasesType);
    if (PyModule_AddObject(m, "Leases", (PyObject *)&LeasesType) < 0) {
        Py_DECREF(&LeasesType);
        return -1;
    }
    static const char *const lease_keys[] = {
        "sweeper", "stripes", "ctrl_words", "slot_words", "probe", "s_grants", "s_renewals",
        "s_completions", "s_expiries", "s_hold_events", "s_refused_taken", "s_refused_held",
        "s_refused_probe_full", "s_inserts", "s_reclaimed", "s_conflicts", "s_stale_tokens",
        "s_sweeps", "granted", "refused_taken", "refused_held", "refused_probe_full",
        "misses_max", "keep_misses_ms", "s_occupied", "s_leased", "s_held", "incarnation",
        "phase_mask", "phase_removing", "token_shift", "token_mask", "time_shift",
        "failures", "forgiven", "secret_print", "hold_permit_bit",
    };
    static const long lease_values[] = {
        LEASE_SWEEPER, LEASE_STRIPES, LEASE_CTRL_WORDS, SLOT_WORDS, PROBE, LS_GRANTS,
        LS_RENEWALS, LS_COMPLETIONS, LS_EXPIRIES, LS_HOLD_EVENTS, LS_REFUSED_TAKEN,
        LS_REFUSED_HELD, LS_REFUSED_PROBE_FULL, LS_INSERTS, LS_RECLAIMED, LS_CONFLICTS,
        LS_STALE_TOKENS, LS_SWEEPS, GRANTED, REFUSED_TAKEN, REFUSED_HELD, REFUSED_PROBE_FULL,
        MISSES_MAX, (long)KEEP_MISSES_MS, LS_OCCUPIED, LS_LEASED, LS_HELD, LEASE_INCARNATION,
        3, PH_REMOVING, 6, 0xffff, 22, /* the state word's fields: see W_MAKE */
        LEASE_FAILURES, LEASE_FORGIVEN, LEASE_SECRET_PRINT, 47,
    };
    _Static_assert(sizeof(lease_keys) / sizeof(lease_keys[0]) ==
                       sizeof(lease_values) / sizeof(lease_values[0]),
                   "lease layout table");
    return shm_add_layout(m, "LEASE_LAYOUT", lease_keys, lease_values,
                          (int)(sizeof(lease_values) / sizeof(lease_values[0])));
}
