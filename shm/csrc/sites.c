/* Sites: the site table (shm/sites.py). Per site: its settings, its block, the time of
 * its last grant, its failure streak, and its permits: one word per permit, holding the
 * expiry of the lease it covers. No mutex: every change is a CAS on one word. */
#include "atomics.h"

#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/types.h>

/* A slot's state word: bits 0-1 phase, bits 2-63 a stamp. FREE carries the incarnation
 * the slot was last emptied with; LIVE keeps that same stamp, so a state word once read
 * matches again only if the slot was not emptied since (no ABA); REMOVING carries the
 * remover's pid. The key (site hash) and state live in arrays of their own, so a probe
 * window's keys are one or two cache lines. */
enum { SPH_FREE = 0, SPH_LIVE = 1, SPH_REMOVING = 3 };
#define S_PHASE(w) ((w) & 3u)
#define S_STAMP(w) ((w) >> 2)
#define S_MAKE(ph, stamp) ((uint64_t)(ph) | ((uint64_t)(stamp) << 2))
#define STAMP_MAX ((((uint64_t)1) << 62) - 1)
#define SPROBE 8
#define SITE_ATTEMPTS 64
#define SITE_TIME_MAX ((((uint64_t)1) << 42) - 1)

/* Control block, in words. */
enum {
    SC_SWEEPER = 0,       /* pid of the process sweeping, 0 when none */
    SC_INCARNATION = 1,   /* stamps each emptied slot */
    SC_VERSION = 2,       /* settings versions, see CFG_* */
    SC_DEFAULT_CAP = 3,   /* the default max in flight + 1; 0: none */
    SC_DEFAULT_INTERVAL = 4,
    SC_FAIL_STREAK = 5,   /* failed outcomes in a row that block a site; 0: never */
    SC_FAIL_WINDOW = 6,   /* ... within this many ms of the first */
    SC_FAIL_BLOCK = 7,    /* the first block's length, ms */
    SC_FAIL_BLOCK_MAX = 8,
    SC_STRIPES = 16,
    SC_CTRL_WORDS = SC_STRIPES + STRIPES * STRIPE_WORDS,
};
enum {
    SS_GRANTS = 0,        /* grants that passed a site's cap or spacing */
    SS_PERMITS = 1,       /* permits taken (grants and renewals) */
    SS_CAPPED = 2,        /* refusals: the site's permits were all live */
    SS_SPACING = 3,       /* refusals: inside the site's spacing */
    SS_BLOCKED = 4,       /* refusals: the site was blocked */
    SS_FULL = 5,          /* refusals: the site needed an entry and no window had room */
    SS_RELEASES = 6,
    SS_EXTENDS = 7,
    SS_CONFLICTS = 8,     /* takes reverted: racing claimants would have passed the cap */
    SS_BLOCKS_RETRY = 9,  /* blocks for an origin's Retry-After */
    SS_BLOCKS_FAILED = 10, /* blocks for a failure streak */
    SS_INSERTS = 11,
    SS_RECLAIMED = 12,
    SS_SWEEPS = 13,
    SS_LIVE = 14,         /* live entries (+1 insert, -1 removal), summed over stripes */
    SS_UNDONE = 15,       /* acquisitions given back: the lease grant after them failed */
};
_Static_assert(SS_UNDONE < STRIPE_WORDS, "site counters inside a stripe");

/* A site entry's body: these words, then its permit words. */
enum {
    B_CONFIG = 0,
    B_BLOCK = 1,   /* until << 2 | reason */
    B_LAST = 2,    /* the time of the last grant that passed the spacing */
    B_STREAK = 3,  /* failed outcomes in a row: count | window start << 16 */
    B_PENALTY = 4, /* the failure block's length (ms, low 32 bits) | its end (s, high 32) */
    B_HIGH = 5,    /* permit words in use are below this index */
    B_GRANTS = 6,
    B_SKIPS = 7,
    B_HEAD = 8,
};
/* The settings word: bits 0-26 min interval ms, bit 27 interval set, bits 28-40 max in
 * flight, bit 41 max set, bits 42-63 a version (the newest of a site's duplicate entries
 * is the one in force). 0: nothing set. */
#define CFG_IVAL(w) ((w) & ((1ull << 27) - 1))
#define CFG_IVAL_SET(w) (((w) >> 27) & 1u)
#define CFG_CAP(w) (((w) >> 28) & ((1ull << 13) - 1))
#define CFG_CAP_SET(w) (((w) >> 41) & 1u)
#define CFG_VERSION(w) ((w) >> 42)
#define CFG_VERSION_MASK ((1ull << 22) - 1)
#define SITE_CAP_MAX 4096
#define SITE_INTERVAL_MAX 86400000ull
enum { REASON_NONE = 0, REASON_RETRY_AFTER = 1, REASON_FAILURES = 2 };
#define STREAK_COUNT(w) ((w) & 0xffffu)
#define STREAK_START(w) ((w) >> 16)
#define PENALTY_MS(w) ((w) & 0xffffffffu)
#define PENALTY_END_S(w) ((w) >> 32)
/* A failure block's length is forgotten this long after it ended with no new streak. */
#define PENALTY_KEEP_MS 3600000ull

enum {
    ACQ_GRANTED = 0,        /* nothing to give back: the site has no cap */
    ACQ_PERMIT = 1,         /* a permit until now + lease_ms is held */
    ACQ_CAPPED = 2,
    ACQ_SPACING = 3,
    ACQ_BLOCKED = 4,
    ACQ_FULL = 5,
};
/* acquire flags: a renewal that lost its permit takes one under the cap alone. */
enum { ACQ_PERMIT_ONLY = 1 };

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int held;
    aword *ctrl;
    aword *keys;
    aword *states;
    aword *bodies;
    uint64_t capacity;
    uint64_t permits; /* permit words per entry */
    uint64_t body_words;
    aword *stripe;
} SitesObject;

#define SITES_LAYOUT_BYTES(capacity, permits)                                                 \
    ((uint64_t)(capacity) * 8 * (2 + B_HEAD + (uint64_t)(permits)))

static int
Sites_init(SitesObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "ctrl_offset", "slots_offset", "capacity", "permits",
                             NULL};
    PyObject *obj;
    Py_ssize_t ctrl_off, slots_off, capacity, permits;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnnn", kwlist, &obj, &ctrl_off, &slots_off,
                                     &capacity, &permits)) {
        return -1;
    }
    if (self->held) {
        PyErr_SetString(PyExc_RuntimeError, "Sites is already initialised");
        return -1;
    }
    if (capacity < SPROBE || capacity > ((Py_ssize_t)1 << 26) || permits < 1 ||
        permits > SITE_CAP_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "site table capacity must be in %d..2**26 and permits in 1..%d", SPROBE,
                     SITE_CAP_MAX);
        return -1;
    }
    char *base;
    Py_ssize_t length;
    if (shm_acquire_region(obj, 0, -1, &self->view, &base, &length) < 0) return -1;
    self->held = 1;
    if (ctrl_off < 0 || slots_off < 0 || (ctrl_off & 63) || (slots_off & 63) ||
        ctrl_off + SC_CTRL_WORDS * 8 > length ||
        (uint64_t)slots_off + SITES_LAYOUT_BYTES(capacity, permits) > (uint64_t)length) {
        PyErr_Format(PyExc_ValueError,
                     "site layout (ctrl %zd, slots %zd, capacity %zd, permits %zd) does not "
                     "fit a buffer of %zd bytes with aligned words",
                     ctrl_off, slots_off, capacity, permits, length);
        PyBuffer_Release(&self->view);
        self->held = 0;
        return -1;
    }
    self->ctrl = (aword *)(base + ctrl_off);
    self->keys = (aword *)(base + slots_off);
    self->states = self->keys + capacity;
    self->bodies = self->states + capacity;
    self->capacity = (uint64_t)capacity;
    self->permits = (uint64_t)permits;
    self->body_words = B_HEAD + (uint64_t)permits;
    self->stripe = self->ctrl + SC_STRIPES + stripe_of_process() * STRIPE_WORDS;
    return 0;
}

static void
Sites_dealloc(SitesObject *self)
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static inline void
sbump(SitesObject *self, int which, uint64_t n)
{
    atomic_fetch_add_explicit(&self->stripe[which], n, memory_order_relaxed);
}

static inline aword *
body(SitesObject *self, uint64_t s, uint64_t word)
{
    return &self->bodies[s * self->body_words + word];
}

static inline aword *
permit(SitesObject *self, uint64_t s, uint64_t i)
{
    return body(self, s, B_HEAD + i);
}

/* ------------------------------------------------------------------ probe */

/* A site's live entries in its window. A site normally has one; two inserts of a site
 * racing a removal in its window can leave two, and every decision reads all of them:
 * the permits are counted over every entry, the newest settings win, the latest block
 * and the latest grant count. */
typedef struct {
    int n;
    uint64_t slot[SPROBE];
    uint64_t state[SPROBE];
    int64_t empty; /* first slot with no key, -1 if none */
    uint64_t empty_state;
} sprobe_t;

static inline uint64_t
swindow_start(SitesObject *self, uint64_t h)
{
    return (uint64_t)(((unsigned __int128)h * self->capacity) >> 64);
}

static void
sprobe(SitesObject *self, uint64_t h, sprobe_t *p, int help)
{
    uint64_t start = swindow_start(self, h);
    p->n = 0;
    p->empty = -1;
    p->empty_state = 0;
    for (int i = 0; i < SPROBE; i++) {
        uint64_t s = start + (uint64_t)i;
        if (s >= self->capacity) s -= self->capacity;
        /* State before key: a FREE state that still holds when a CAS succeeds proves
         * the key read after it is the slot's (a key is set only while FREE, and
         * cleared only while REMOVING). */
        uint64_t w = LOAD_SC(&self->states[s]);
        uint64_t k = LOAD_SC(&self->keys[s]);
        if (S_PHASE(w) == SPH_REMOVING) continue;
        if (k == h) {
            if (S_PHASE(w) == SPH_FREE) {
                /* An insert under way, or one whose inserter died between its two
                 * steps: finish it. */
                if (!help) continue;
                uint64_t live = S_MAKE(SPH_LIVE, S_STAMP(w));
                if (cas_word(&self->states[s], w, live)) {
                    sbump(self, SS_LIVE, 1);
                    sbump(self, SS_INSERTS, 1);
                } else if (LOAD_SC(&self->states[s]) != live) {
                    continue;
                }
                w = live;
            }
            p->slot[p->n] = s;
            p->state[p->n] = w;
            p->n++;
        } else if (k == 0 && S_PHASE(w) == SPH_FREE && p->empty < 0) {
            p->empty = (int64_t)s;
            p->empty_state = w;
        }
    }
}

/* The site's entries, inserting one if it has none; 0 if its window has no room. */
static int
ensure(SitesObject *self, uint64_t h, sprobe_t *p)
{
    for (int attempt = 0; attempt < SITE_ATTEMPTS && p->n == 0; attempt++) {
        if (p->empty < 0) return 0;
        uint64_t s = (uint64_t)p->empty;
        if (cas_word(&self->keys[s], 0, h)) {
            uint64_t live = S_MAKE(SPH_LIVE, S_STAMP(p->empty_state));
            if (cas_word(&self->states[s], p->empty_state, live)) {
                sbump(self, SS_LIVE, 1);
                sbump(self, SS_INSERTS, 1);
            }
        }
        sprobe(self, h, p, 1);
    }
    return p->n > 0;
}

static inline int
still_live(SitesObject *self, uint64_t s, uint64_t state)
{
    return LOAD_SC(&self->states[s]) == state;
}

/* ------------------------------------------------------------- settings */

static inline int
version_newer(uint64_t a, uint64_t b)
{
    uint64_t d = (a - b) & CFG_VERSION_MASK;
    return d != 0 && d < (CFG_VERSION_MASK >> 1);
}

typedef struct {
    int64_t cap; /* -1: none */
    uint64_t interval;
    int cap_set, interval_set;
} config_t;

static void
effective(SitesObject *self, const sprobe_t *p, config_t *c)
{
    uint64_t best = 0;
    for (int i = 0; i < p->n; i++) {
        uint64_t w = LOAD_SC(body(self, p->slot[i], B_CONFIG));
        if (w != 0 && (best == 0 || version_newer(CFG_VERSION(w), CFG_VERSION(best)))) best = w;
    }
    uint64_t dcap = LOAD(&self->ctrl[SC_DEFAULT_CAP]);
    c->cap_set = (int)CFG_CAP_SET(best);
    c->interval_set = (int)CFG_IVAL_SET(best);
    c->cap = c->cap_set ? (int64_t)CFG_CAP(best) : (dcap ? (int64_t)dcap - 1 : -1);
    c->interval = c->interval_set ? CFG_IVAL(best) : LOAD(&self->ctrl[SC_DEFAULT_INTERVAL]);
}

/* ------------------------------------------------------------ reading */

static uint64_t
block_of(SitesObject *self, const sprobe_t *p, uint64_t *reason)
{
    uint64_t until = 0;
    *reason = REASON_NONE;
    for (int i = 0; i < p->n; i++) {
        uint64_t w = LOAD_SC(body(self, p->slot[i], B_BLOCK));
        if ((w >> 2) > until) {
            until = w >> 2;
            *reason = w & 3u;
        }
    }
    return until;
}

static uint64_t
last_of(SitesObject *self, const sprobe_t *p)
{
    uint64_t last = 0;
    for (int i = 0; i < p->n; i++) {
        uint64_t w = LOAD_SC(body(self, p->slot[i], B_LAST));
        if (w > last) last = w;
    }
    return last;
}

/* Permits live at `now` over every entry of the site, and the earliest of their ends. */
static uint64_t
live_permits(SitesObject *self, const sprobe_t *p, uint64_t now, uint64_t *soonest)
{
    uint64_t live = 0, first = 0;
    for (int i = 0; i < p->n; i++) {
        uint64_t s = p->slot[i];
        uint64_t high = LOAD_SC(body(self, s, B_HIGH));
        if (high > self->permits) high = self->permits;
        for (uint64_t j = 0; j < high; j++) {
            uint64_t e = LOAD_SC(permit(self, s, j));
            if (e > now) {
                live++;
                if (first == 0 || e < first) first = e;
            }
        }
    }
    if (soonest) *soonest = first;
    return live;
}

/* ------------------------------------------------------------ permits */

static inline void
raise_high(SitesObject *self, uint64_t s, uint64_t to)
{
    aword *hw = body(self, s, B_HIGH);
    uint64_t cur = LOAD_SC(hw);
    while (cur < to && !atomic_compare_exchange_weak_explicit(hw, &cur, to, memory_order_seq_cst,
                                                              memory_order_seq_cst)) {
    }
}

/* Take a permit until `expires` under the cap, by CAS on a free word of the site's
 * first entry, then count again over every entry: of two claimants racing for the last
 * permit, the later CAS sees the earlier one's word and gives its own back, so the
 * count never passes the cap (sequential consistency). 1: taken (*slot, *index say
 * where); 0: capped; -1: the entry changed under it, retry. */
static int
take_permit(SitesObject *self, uint64_t h, sprobe_t *p, int64_t cap, uint64_t now,
            uint64_t expires, uint64_t *soonest, uint64_t *slot_out, uint64_t *index_out)
{
    if (live_permits(self, p, now, soonest) >= (uint64_t)cap) return 0;
    uint64_t s = p->slot[0], state = p->state[0];
    for (uint64_t i = 0; i < self->permits; i++) {
        aword *pw = permit(self, s, i);
        uint64_t old = LOAD_SC(pw);
        if (old > now) continue;
        raise_high(self, s, i + 1); /* before the CAS, so every count after it reads i */
        if (!cas_word(pw, old, expires)) return -1;
        sprobe_t again;
        sprobe(self, h, &again, 1);
        if (!still_live(self, s, state)) {
            cas_word(pw, expires, 0);
            return -1;
        }
        if (live_permits(self, &again, now, NULL) > (uint64_t)cap) {
            cas_word(pw, expires, 0);
            sbump(self, SS_CONFLICTS, 1);
            return -1;
        }
        *slot_out = s;
        *index_out = i;
        return 1;
    }
    return 0;
}

/* Move a permit word from `from` to `to` (0 frees it) on any entry of the site. */
static int
move_permit(SitesObject *self, uint64_t h, uint64_t from, uint64_t to)
{
    if (from == 0) return 0;
    sprobe_t p;
    sprobe(self, h, &p, 0);
    for (int i = 0; i < p.n; i++) {
        uint64_t s = p.slot[i];
        uint64_t high = LOAD_SC(body(self, s, B_HIGH));
        if (high > self->permits) high = self->permits;
        for (uint64_t j = 0; j < high; j++) {
            aword *pw = permit(self, s, j);
            if (LOAD_SC(pw) == from && cas_word(pw, from, to)) return 1;
        }
    }
    return 0;
}

/* --------------------------------------------------------------- args */

static int
parse_stime(PyObject *o, uint64_t *out, const char *what)
{
    int64_t v;
    if (parse_i64(o, &v) < 0) return -1;
    if (v < 0 || (uint64_t)v > SITE_TIME_MAX) {
        PyErr_Format(PyExc_ValueError, "%s %lld ms is outside 0..2**42", what, (long long)v);
        return -1;
    }
    *out = (uint64_t)v;
    return 0;
}

/* ------------------------------------------------------------ acquire */

/* acquire(site_hash, now, lease_ms, flags) -> (code, until, previous_last)
 *
 * Before a lease is granted on a key of the site: refused while the site is blocked
 * (until: the block's end) or inside its spacing (until: when it may grant again), or
 * when its permits are all live (until: the earliest of their ends); else ACQ_PERMIT
 * with a permit until now + lease_ms (the lease's own expiry) when the site has a cap,
 * or ACQ_GRANTED when it has none. A site with a spacing has its last-grant time moved
 * to now; previous_last is what it was (-1 if untouched), for undo. A site with no
 * entry, no default cap and no default spacing needs nothing: ACQ_GRANTED at once. */
static inline int
acquired(int code, uint64_t at, int64_t previous, uint64_t *until, int64_t *previous_last)
{
    *until = at;
    *previous_last = previous;
    return code;
}

/* acquire's decision, for one site: the code, and through `until` and `previous_last`
 * what acquire() returns beside it. `now + lease_ms` is checked by the caller. */
static int
acquire_one(SitesObject *self, uint64_t h, uint64_t now, uint64_t lease_ms, int64_t flags,
            uint64_t *until, int64_t *previous_last)
{
    if (h == 0) return acquired(ACQ_GRANTED, 0, -1, until, previous_last);
    uint64_t expires = now + lease_ms;
    int permit_only = (flags & ACQ_PERMIT_ONLY) != 0;
    sprobe_t p;
    for (int attempt = 0; attempt < SITE_ATTEMPTS; attempt++) {
        sprobe(self, h, &p, 1);
        config_t c;
        effective(self, &p, &c);
        uint64_t interval = permit_only ? 0 : c.interval;
        if (p.n == 0 && c.cap < 0 && interval == 0) {
            return acquired(ACQ_GRANTED, 0, -1, until, previous_last);
        }
        if (!permit_only && p.n > 0) {
            uint64_t reason, blocked_until = block_of(self, &p, &reason);
            if (blocked_until > now) {
                sbump(self, SS_BLOCKED, 1);
                atomic_fetch_add_explicit(body(self, p.slot[0], B_SKIPS), 1, memory_order_relaxed);
                return acquired(ACQ_BLOCKED, blocked_until, -1, until, previous_last);
            }
        }
        if (interval > 0 && p.n > 0) {
            uint64_t last = last_of(self, &p);
            if (now < last + interval) {
                sbump(self, SS_SPACING, 1);
                atomic_fetch_add_explicit(body(self, p.slot[0], B_SKIPS), 1, memory_order_relaxed);
                return acquired(ACQ_SPACING, last + interval, -1, until, previous_last);
            }
        }
        if (c.cap < 0 && interval == 0) {
            atomic_fetch_add_explicit(body(self, p.slot[0], B_GRANTS), 1, memory_order_relaxed);
            return acquired(ACQ_GRANTED, 0, -1, until, previous_last);
        }
        if (p.n == 0) {
            if (!ensure(self, h, &p)) {
                sbump(self, SS_FULL, 1);
                return acquired(ACQ_FULL, 0, -1, until, previous_last);
            }
            continue; /* decide again with the entry's own state */
        }
        uint64_t slot = 0, index = 0;
        int have = 0;
        if (c.cap >= 0) {
            uint64_t soonest = 0;
            int r = take_permit(self, h, &p, c.cap, now, expires, &soonest, &slot, &index);
            if (r < 0) continue;
            if (r == 0) {
                sbump(self, SS_CAPPED, 1);
                atomic_fetch_add_explicit(body(self, p.slot[0], B_SKIPS), 1, memory_order_relaxed);
                return acquired(ACQ_CAPPED, soonest, -1, until, previous_last);
            }
            have = 1;
        }
        int64_t previous = -1;
        if (interval > 0) {
            uint64_t s = p.slot[0];
            aword *lw = body(self, s, B_LAST);
            uint64_t mine = LOAD_SC(lw);
            sprobe_t again;
            sprobe(self, h, &again, 1);
            uint64_t last = last_of(self, &again);
            int moved = now >= last + interval && cas_word(lw, mine, now);
            if (moved) {
                /* Another entry of the site may have granted meanwhile: the later of two
                 * such CASes sees the earlier, and gives its own back. */
                sprobe(self, h, &again, 1);
                for (int i = 0; i < again.n && moved; i++) {
                    if (again.slot[i] == s) continue;
                    if (LOAD_SC(body(self, again.slot[i], B_LAST)) + interval > now) moved = 0;
                }
                if (!still_live(self, s, p.state[0])) moved = 0;
                if (!moved) cas_word(lw, now, mine);
            }
            if (!moved) {
                if (have) cas_word(permit(self, slot, index), expires, 0);
                continue; /* the next round refuses it, or finds the entry anew */
            }
            previous = (int64_t)mine;
        }
        sbump(self, SS_GRANTS, 1);
        if (have) sbump(self, SS_PERMITS, 1);
        atomic_fetch_add_explicit(body(self, p.slot[0], B_GRANTS), 1, memory_order_relaxed);
        return acquired(have ? ACQ_PERMIT : ACQ_GRANTED, have ? expires : 0, previous, until,
                        previous_last);
    }
    sbump(self, SS_CAPPED, 1);
    return acquired(ACQ_CAPPED, now, -1, until, previous_last);
}


static PyObject *
Sites_acquire(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("acquire", nargs, 4) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, now, lease_ms;
    int64_t flags;
    if (parse_u64(args[0], &h) < 0 || parse_stime(args[1], &now, "now") < 0 ||
        parse_stime(args[2], &lease_ms, "lease") < 0 || parse_i64(args[3], &flags) < 0) {
        return NULL;
    }
    if (lease_ms == 0 || now + lease_ms > SITE_TIME_MAX) {
        PyErr_SetString(PyExc_ValueError, "lease_ms must be positive and now + lease in range");
        return NULL;
    }
    uint64_t until;
    int64_t previous;
    int code = acquire_one(self, h, now, lease_ms, flags, &until, &previous);
    return Py_BuildValue("(iKL)", code, (unsigned long long)until, (long long)previous);
}

/* undo(site_hash, expires, now, previous_last) -> None: give back what acquire took when
 * the lease grant after it failed: the permit until `expires` (0: none) and the
 * last-grant time, back to previous_last if it is still `now` (-1: untouched). */
static void
undo_one(SitesObject *self, uint64_t h, uint64_t expires, uint64_t now, int64_t previous)
{
    if (h == 0) return;
    move_permit(self, h, expires, 0);
    if (previous >= 0) {
        sprobe_t p;
        sprobe(self, h, &p, 0);
        for (int i = 0; i < p.n; i++) {
            if (cas_word(body(self, p.slot[i], B_LAST), now, (uint64_t)previous)) break;
        }
    }
    sbump(self, SS_UNDONE, 1);
}

static PyObject *
Sites_undo(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("undo", nargs, 4) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, expires, now;
    int64_t previous;
    if (parse_u64(args[0], &h) < 0 || parse_stime(args[1], &expires, "expires") < 0 ||
        parse_stime(args[2], &now, "now") < 0 || parse_i64(args[3], &previous) < 0) {
        return NULL;
    }
    undo_one(self, h, expires, now, previous);
    Py_RETURN_NONE;
}

/* release_permit(site_hash, expires) -> bool: free the permit of a lease that ended (its word
 * is the lease's expiry). Permits with one word are interchangeable: whichever is freed,
 * the ones left cover the leases left. */
static PyObject *
Sites_release_permit(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("release_permit", nargs, 2) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, expires;
    if (parse_u64(args[0], &h) < 0 || parse_stime(args[1], &expires, "expires") < 0) return NULL;
    int done = h != 0 && move_permit(self, h, expires, 0);
    if (done) sbump(self, SS_RELEASES, 1);
    return PyBool_FromLong(done);
}

/* extend(site_hash, expires, new_expires) -> bool: a renewal moves its permit's word
 * before its lease's (later) or after it (earlier), so a permit never ends before its
 * lease. False if no permit of the site has that word. */
static PyObject *
Sites_extend(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("extend", nargs, 3) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, from, to;
    if (parse_u64(args[0], &h) < 0 || parse_stime(args[1], &from, "expires") < 0 ||
        parse_stime(args[2], &to, "new expires") < 0) {
        return NULL;
    }
    if (to == 0) {
        PyErr_SetString(PyExc_ValueError, "extend: new_expires 0 would free the permit");
        return NULL;
    }
    int done = h != 0 && move_permit(self, h, from, to);
    if (done) sbump(self, SS_EXTENDS, 1);
    return PyBool_FromLong(done);
}

/* ----------------------------------------------------------- settings */

static uint64_t
take_version(SitesObject *self)
{
    uint64_t v = (atomic_fetch_add_explicit(&self->ctrl[SC_VERSION], 1, memory_order_seq_cst) +
                  1) & CFG_VERSION_MASK;
    return v ? v : take_version(self); /* 0 means "take one" to configure */
}

/* reserve_version() -> int: the latest settings version; any configure() made after
 * this call takes a newer one. A caller that reads settings from the store after
 * reserving, and writes them with this version, cannot overwrite a configure made since
 * with newer ones. It moves nothing (once the first version is taken): the keeper
 * reserves one at every feed drain, and versions compare within half their range. */
static PyObject *
Sites_reserve_version(SitesObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->held) return shm_released_error();
    uint64_t v =
        atomic_load_explicit(&self->ctrl[SC_VERSION], memory_order_seq_cst) & CFG_VERSION_MASK;
    return PyLong_FromUnsignedLongLong(v ? v : take_version(self));
}

/* configure(site_hash, max_in_flight, min_interval_ms, version) -> int: a site's own
 * settings; -1 for either: none (the node's default applies); version 0: a new one.
 * Written to every entry of the site unless the entry holds a newer version, so the
 * newest wins however entries race. A site with no entry gets one only to hold a
 * setting. 1: in force; -1: a newer version is in force; 0: its window has no room. */
static PyObject *
Sites_configure(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("configure", nargs, 4) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, asked;
    int64_t cap, interval;
    if (parse_u64(args[0], &h) < 0 || parse_i64(args[1], &cap) < 0 ||
        parse_i64(args[2], &interval) < 0 || parse_u64(args[3], &asked) < 0) {
        return NULL;
    }
    if (asked > CFG_VERSION_MASK) {
        PyErr_Format(PyExc_ValueError, "version %llu is not one reserve_version() gives",
                     (unsigned long long)asked);
        return NULL;
    }
    if (h == 0) {
        PyErr_SetString(PyExc_ValueError, "site hash 0 names no site");
        return NULL;
    }
    if (cap < -1 || cap > (int64_t)self->permits) {
        PyErr_Format(PyExc_ValueError, "max_in_flight %lld is outside 0..%llu (this table's "
                     "permits a site)", (long long)cap, (unsigned long long)self->permits);
        return NULL;
    }
    if (interval < -1 || interval > (int64_t)SITE_INTERVAL_MAX) {
        PyErr_Format(PyExc_ValueError, "min_interval_ms %lld is outside 0..%llu",
                     (long long)interval, (unsigned long long)SITE_INTERVAL_MAX);
        return NULL;
    }
    uint64_t version = asked ? asked : take_version(self);
    uint64_t w = version << 42;
    if (cap >= 0) w |= (1ull << 41) | ((uint64_t)cap << 28);
    if (interval >= 0) w |= (1ull << 27) | (uint64_t)interval;
    sprobe_t p;
    for (int attempt = 0; attempt < SITE_ATTEMPTS; attempt++) {
        sprobe(self, h, &p, 1);
        if (p.n == 0) {
            if (cap < 0 && interval < 0) return PyLong_FromLong(1); /* nothing to hold */
            if (!ensure(self, h, &p)) return PyLong_FromLong(0);
        }
        int lost = 0, superseded = 0;
        for (int i = 0; i < p.n; i++) {
            aword *cw = body(self, p.slot[i], B_CONFIG);
            uint64_t cur = LOAD_SC(cw);
            int wrote = 0;
            while ((cur == 0 || !version_newer(CFG_VERSION(cur), version)) &&
                   !(wrote = atomic_compare_exchange_weak_explicit(
                         cw, &cur, w, memory_order_seq_cst, memory_order_seq_cst))) {
            }
            if (!wrote) superseded = 1; /* the loop ends unwritten only on a newer version */
            if (!still_live(self, p.slot[i], p.state[i])) {
                /* The entry was emptied under the write: take it back from the slot,
                 * which may hold another site by now. */
                if (wrote) cas_word(cw, w, cur);
                lost = 1;
            }
        }
        if (!lost) return PyLong_FromLong(superseded ? -1 : 1);
    }
    return PyLong_FromLong(0);
}

/* ------------------------------------------------------------- blocks */

static uint64_t
block_until(SitesObject *self, uint64_t h, uint64_t until, uint64_t reason)
{
    sprobe_t p;
    for (int attempt = 0; attempt < SITE_ATTEMPTS; attempt++) {
        sprobe(self, h, &p, 1);
        if (!ensure(self, h, &p)) return 0;
        uint64_t s = p.slot[0];
        aword *bw = body(self, s, B_BLOCK);
        uint64_t cur = LOAD_SC(bw);
        uint64_t want = (until << 2) | reason;
        int wrote = 0;
        while ((cur >> 2) < until && !(wrote = atomic_compare_exchange_weak_explicit(
                                           bw, &cur, want, memory_order_seq_cst,
                                           memory_order_seq_cst))) {
        }
        if (still_live(self, s, p.state[0])) {
            uint64_t r;
            return block_of(self, &p, &r);
        }
        if (wrote) cas_word(bw, want, cur); /* emptied under the write: take it back */
    }
    return 0;
}

/* block(site_hash, until, reason) -> the site's block end (0: no room for its entry).
 * Blocks only grow: a shorter one leaves a longer one in place. */
static PyObject *
Sites_block(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("block", nargs, 3) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, until, reason;
    if (parse_u64(args[0], &h) < 0 || parse_stime(args[1], &until, "until") < 0 ||
        parse_u64(args[2], &reason) < 0) {
        return NULL;
    }
    if (h == 0 || reason < REASON_RETRY_AFTER || reason > REASON_FAILURES) {
        PyErr_SetString(PyExc_ValueError, "block: a site hash and a reason (1 or 2)");
        return NULL;
    }
    uint64_t got = block_until(self, h, until, reason);
    if (got && got == until) sbump(self, reason == REASON_RETRY_AFTER ? SS_BLOCKS_RETRY : SS_BLOCKS_FAILED, 1);
    return PyLong_FromUnsignedLongLong(got);
}

/* outcome(site_hash, now, failed) -> the end of a block this outcome started, or 0.
 *
 * A success ends the site's streak of failures and forgets its failure block's length.
 * A failure extends the streak (a new one if the last started over a window ago); the
 * streak's limit'th failure blocks the site, first for the configured block, then twice
 * the last one each time (up to the maximum) until a success or an hour passes. */
static PyObject *
Sites_outcome(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("outcome", nargs, 3) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, now;
    int failed = PyObject_IsTrue(args[2]);
    if (failed < 0 || parse_u64(args[0], &h) < 0 || parse_stime(args[1], &now, "now") < 0) {
        return NULL;
    }
    if (h == 0) return PyLong_FromLong(0);
    sprobe_t p;
    if (!failed) {
        sprobe(self, h, &p, 0);
        for (int i = 0; i < p.n; i++) {
            for (int w = B_STREAK; w <= B_PENALTY; w++) {
                aword *x = body(self, p.slot[i], (uint64_t)w);
                uint64_t cur = LOAD_SC(x);
                if (cur != 0) cas_word(x, cur, 0);
            }
        }
        return PyLong_FromLong(0);
    }
    uint64_t limit = LOAD(&self->ctrl[SC_FAIL_STREAK]);
    if (limit == 0) return PyLong_FromLong(0);
    uint64_t window = LOAD(&self->ctrl[SC_FAIL_WINDOW]);
    for (int attempt = 0; attempt < SITE_ATTEMPTS; attempt++) {
        sprobe(self, h, &p, 1);
        if (!ensure(self, h, &p)) return PyLong_FromLong(0);
        uint64_t s = p.slot[0];
        aword *sw = body(self, s, B_STREAK);
        uint64_t cur = LOAD_SC(sw);
        uint64_t count = STREAK_COUNT(cur), start = STREAK_START(cur);
        if (count == 0 || now > start + window || now < start) {
            count = 0;
            start = now;
        }
        count++;
        if (count < limit) {
            uint64_t next = (start << 16) | (count > 0xffff ? 0xffff : count);
            if (!cas_word(sw, cur, next)) continue;
            if (!still_live(self, s, p.state[0])) {
                cas_word(sw, next, cur);
                continue;
            }
            return PyLong_FromLong(0);
        }
        /* The streak's winner (one CAS back to 0) blocks the site. */
        if (!cas_word(sw, cur, 0)) continue;
        aword *pw = body(self, s, B_PENALTY);
        uint64_t base = LOAD(&self->ctrl[SC_FAIL_BLOCK]);
        uint64_t most = LOAD(&self->ctrl[SC_FAIL_BLOCK_MAX]);
        uint64_t length = base, pen = LOAD_SC(pw);
        for (int tries = 0; tries < SITE_ATTEMPTS; tries++) {
            uint64_t before = PENALTY_MS(pen);
            int fresh = before == 0 || now > PENALTY_END_S(pen) * 1000 + PENALTY_KEEP_MS;
            length = fresh ? base : (before > most / 2 ? most : before * 2);
            if (length > most) length = most;
            if (length > 0xffffffffu) length = 0xffffffffu;
            uint64_t end_s = (now + length) / 1000;
            if (cas_word(pw, pen, (end_s << 32) | length)) break;
            pen = LOAD_SC(pw);
        }
        if (length == 0) return PyLong_FromLong(0);
        uint64_t until = now + length > SITE_TIME_MAX ? SITE_TIME_MAX : now + length;
        uint64_t got = block_until(self, h, until, REASON_FAILURES);
        if (got) sbump(self, SS_BLOCKS_FAILED, 1);
        return PyLong_FromUnsignedLongLong(got);
    }
    return PyLong_FromLong(0);
}

/* ------------------------------------------------------------- reads */

/* info(site_hash, now) -> (entries, cap_set, cap, interval_set, interval, in_flight,
 * soonest_end, blocked_until, reason, last_grant, streak, penalty_ms, grants, skips)
 * cap: -1 none (after the default); interval after the default. */
static PyObject *
Sites_info(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("info", nargs, 2) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t h, now;
    if (parse_u64(args[0], &h) < 0 || parse_stime(args[1], &now, "now") < 0) return NULL;
    sprobe_t p;
    p.n = 0;
    if (h != 0) sprobe(self, h, &p, 0);
    config_t c;
    effective(self, &p, &c);
    if (h == 0) c.cap = -1, c.interval = 0;
    uint64_t soonest = 0, reason = 0;
    uint64_t live = live_permits(self, &p, now, &soonest);
    uint64_t until = block_of(self, &p, &reason);
    uint64_t streak = 0, penalty = 0, grants = 0, skips = 0;
    for (int i = 0; i < p.n; i++) {
        uint64_t st = LOAD_SC(body(self, p.slot[i], B_STREAK));
        if (STREAK_COUNT(st) > streak && now <= STREAK_START(st) + LOAD(&self->ctrl[SC_FAIL_WINDOW]))
            streak = STREAK_COUNT(st);
        uint64_t pen = PENALTY_MS(LOAD_SC(body(self, p.slot[i], B_PENALTY)));
        if (pen > penalty) penalty = pen;
        grants += LOAD(body(self, p.slot[i], B_GRANTS));
        skips += LOAD(body(self, p.slot[i], B_SKIPS));
    }
    return Py_BuildValue("(iiLiKKKKKKKKKK)", p.n, c.cap_set, (long long)c.cap, c.interval_set,
                         (unsigned long long)c.interval, (unsigned long long)live,
                         (unsigned long long)soonest, (unsigned long long)until,
                         (unsigned long long)reason, (unsigned long long)last_of(self, &p),
                         (unsigned long long)streak, (unsigned long long)penalty,
                         (unsigned long long)grants, (unsigned long long)skips);
}

/* allowances(hashes_u64, out_i64, now) -> None: for each site, how many more grants it
 * can take now: -1 unlimited, 0 while blocked, inside its spacing or with every permit
 * live, else its free permits (at most 1 with a spacing). Hash 0 (no site): -1. */
static PyObject *
Sites_allowances(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("allowances", nargs, 3) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t now;
    if (parse_stime(args[2], &now, "now") < 0) return NULL;
    Py_buffer in, out;
    if (PyObject_GetBuffer(args[0], &in, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    Py_ssize_t n = in.len / 8;
    if ((in.len & 7) || out.len != in.len || ((uintptr_t)in.buf & 7u) ||
        ((uintptr_t)out.buf & 7u)) {
        PyBuffer_Release(&in);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "allowances wants aligned uint64 hashes and as many "
                                          "int64 outputs");
        return NULL;
    }
    const uint64_t *hs = in.buf;
    int64_t *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h = hs[i];
        if (h == 0) {
            o[i] = -1;
            continue;
        }
        sprobe_t p;
        sprobe(self, h, &p, 0);
        config_t c;
        effective(self, &p, &c);
        uint64_t reason;
        int64_t room = -1;
        if (p.n > 0 && block_of(self, &p, &reason) > now) {
            room = 0;
        } else if (c.interval > 0 && p.n > 0 && now < last_of(self, &p) + c.interval) {
            room = 0;
        } else {
            if (c.cap >= 0) {
                uint64_t live = live_permits(self, &p, now, NULL);
                room = live >= (uint64_t)c.cap ? 0 : c.cap - (int64_t)live;
            }
            if (c.interval > 0 && room != 0) room = 1;
        }
        o[i] = room;
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------- sweep */

static int
site_process_alive(uint64_t pid)
{
    if (pid == 0 || pid > (uint64_t)INT32_MAX) return 0;
    if (kill((pid_t)pid, 0) == 0) return 1;
    return errno != ESRCH;
}

/* Nothing in the entry matters any more at `now`: no settings, block, live permit,
 * spacing or failure memory, and no grant within `keep`. */
static int
idle(SitesObject *self, uint64_t s, uint64_t now, uint64_t keep)
{
    uint64_t cfg = LOAD_SC(body(self, s, B_CONFIG));
    if (CFG_CAP_SET(cfg) || CFG_IVAL_SET(cfg)) return 0;
    if ((LOAD_SC(body(self, s, B_BLOCK)) >> 2) > now) return 0;
    uint64_t last = LOAD_SC(body(self, s, B_LAST));
    uint64_t spacing = LOAD(&self->ctrl[SC_DEFAULT_INTERVAL]);
    if (last + (spacing > keep ? spacing : keep) > now) return 0;
    uint64_t st = LOAD_SC(body(self, s, B_STREAK));
    if (STREAK_COUNT(st) && STREAK_START(st) + LOAD(&self->ctrl[SC_FAIL_WINDOW]) >= now) return 0;
    uint64_t pen = LOAD_SC(body(self, s, B_PENALTY));
    if (PENALTY_MS(pen) && PENALTY_END_S(pen) * 1000 + PENALTY_KEEP_MS > now) return 0;
    for (uint64_t j = 0; j < self->permits; j++) {
        if (LOAD_SC(permit(self, s, j)) > now) return 0;
    }
    return 1;
}

/* Empty a slot parked REMOVING: body first, then the key, then a new stamp. */
static void
empty_slot(SitesObject *self, uint64_t s, uint64_t k, uint64_t parked)
{
    for (uint64_t j = 0; j < self->body_words; j++) STORE(body(self, s, j), 0);
    if (k != 0) cas_word(&self->keys[s], k, 0);
    uint64_t incarnation =
        atomic_fetch_add_explicit(&self->ctrl[SC_INCARNATION], 1, memory_order_relaxed) + 1;
    if (cas_word(&self->states[s], parked, S_MAKE(SPH_FREE, incarnation & STAMP_MAX))) {
        sbump(self, SS_LIVE, (uint64_t)-1);
    }
}

/* sweep(now, keep_ms) -> entries reclaimed, or -1 if another live process is sweeping.
 * Parks an idle entry (LIVE -> REMOVING), checks it again (a claimant that took a permit
 * before the park verified before it, and its permit is seen now; one after the park
 * sees the state moved and gives its permit back), then empties it or restores it. */
static PyObject *
Sites_sweep(SitesObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_nargs("sweep", nargs, 2) < 0) return NULL;
    if (!self->held) return shm_released_error();
    uint64_t now, keep;
    if (parse_stime(args[0], &now, "now") < 0 || parse_stime(args[1], &keep, "keep") < 0) {
        return NULL;
    }
    uint64_t me = (uint64_t)getpid();
    aword *sweeper = &self->ctrl[SC_SWEEPER];
    uint64_t owner = LOAD_SC(sweeper);
    if (owner != me) {
        if (owner != 0 && site_process_alive(owner)) return PyLong_FromLong(-1);
        if (!cas_word(sweeper, owner, me)) return PyLong_FromLong(-1);
    }
    sbump(self, SS_SWEEPS, 1);
    uint64_t parked = S_MAKE(SPH_REMOVING, me);
    long reclaimed = 0;
    for (uint64_t s = 0; s < self->capacity; s++) {
        uint64_t w = LOAD_SC(&self->states[s]);
        uint64_t k = LOAD_SC(&self->keys[s]);
        if (S_PHASE(w) == SPH_REMOVING) {
            /* A remover killed between its steps: judge the entry again for it. */
            uint64_t remover = S_STAMP(w);
            if (remover == me || site_process_alive(remover)) continue;
            if (idle(self, s, now, keep)) {
                empty_slot(self, s, k, w);
                reclaimed++;
            } else {
                uint64_t incarnation =
                    atomic_fetch_add_explicit(&self->ctrl[SC_INCARNATION], 1,
                                              memory_order_relaxed) + 1;
                cas_word(&self->states[s], w, S_MAKE(SPH_LIVE, incarnation & STAMP_MAX));
            }
            continue;
        }
        if (k == 0) continue;
        if (S_PHASE(w) == SPH_FREE) {
            /* A half-done insert: finish it, then judge it like any entry. */
            uint64_t live = S_MAKE(SPH_LIVE, S_STAMP(w));
            if (cas_word(&self->states[s], w, live)) {
                sbump(self, SS_LIVE, 1);
                sbump(self, SS_INSERTS, 1);
            }
            w = LOAD_SC(&self->states[s]);
            if (S_PHASE(w) != SPH_LIVE) continue;
        }
        if (!idle(self, s, now, keep)) continue;
        if (!cas_word(&self->states[s], w, parked)) continue;
        if (idle(self, s, now, keep)) {
            empty_slot(self, s, k, parked);
            reclaimed++;
        } else {
            cas_word(&self->states[s], parked, w);
        }
    }
    cas_word(sweeper, me, 0);
    sbump(self, SS_RECLAIMED, (uint64_t)reclaimed);
    return PyLong_FromLong(reclaimed);
}

/* totals() -> each counter summed over the process stripes. */
static PyObject *
Sites_totals(SitesObject *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->held) return shm_released_error();
    PyObject *out = PyTuple_New(STRIPE_WORDS);
    if (out == NULL) return NULL;
    for (int i = 0; i < STRIPE_WORDS; i++) {
        uint64_t sum = 0;
        for (int stripe = 0; stripe < STRIPES; stripe++) {
            sum += LOAD(&self->ctrl[SC_STRIPES + stripe * STRIPE_WORDS + i]);
        }
        PyObject *v = PyLong_FromLongLong((long long)(int64_t)sum);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, v);
    }
    return out;
}

static PyObject *
Sites_release(SitesObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->held) {
        PyBuffer_Release(&self->view);
        self->held = 0;
        self->ctrl = self->keys = self->states = self->bodies = NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef Sites_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))Sites_acquire, METH_FASTCALL,
     "acquire($self, site_hash, now, lease_ms, flags, /)\n--\n\nacquire(site_hash, now, lease_ms, flags) -> (code, until, previous_last)."},
    {"undo", (PyCFunction)(void (*)(void))Sites_undo, METH_FASTCALL,
     "undo($self, site_hash, expires, now, previous_last, /)\n--\n\nGive back what acquire took."},
    {"release_permit", (PyCFunction)(void (*)(void))Sites_release_permit, METH_FASTCALL,
     "release_permit($self, site_hash, expires, /)\n--\n\nrelease_permit(site_hash, expires) -> bool: free the permit with that word."},
    {"extend", (PyCFunction)(void (*)(void))Sites_extend, METH_FASTCALL,
     "extend($self, site_hash, expires, new_expires, /)\n--\n\nextend(site_hash, expires, new_expires) -> bool."},
    {"configure", (PyCFunction)(void (*)(void))Sites_configure, METH_FASTCALL,
     "configure($self, site_hash, max_in_flight, min_interval_ms, version, /)\n--\n\nconfigure(site_hash, max_in_flight | -1, min_interval_ms | -1, version | 0) -> 1 in force, -1 superseded, 0 no room."},
    {"reserve_version", (PyCFunction)Sites_reserve_version, METH_NOARGS,
     "reserve_version($self, /)\n--\n\nreserve_version() -> the latest settings version; configure() takes newer ones after it."},
    {"block", (PyCFunction)(void (*)(void))Sites_block, METH_FASTCALL,
     "block($self, site_hash, until, reason, /)\n--\n\nblock(site_hash, until, reason) -> the block's end, 0 if no room."},
    {"outcome", (PyCFunction)(void (*)(void))Sites_outcome, METH_FASTCALL,
     "outcome($self, site_hash, now, failed, /)\n--\n\noutcome(site_hash, now, failed) -> the end of a block it started, or 0."},
    {"info", (PyCFunction)(void (*)(void))Sites_info, METH_FASTCALL,
     "info($self, site_hash, now, /)\n--\n\ninfo(site_hash, now) -> a tuple of the site's state."},
    {"allowances", (PyCFunction)(void (*)(void))Sites_allowances, METH_FASTCALL,
     "allowances($self, hashes, out, now, /)\n--\n\nallowances(hashes_u64, out_i64, now): grants each site can take now."},
    {"sweep", (PyCFunction)(void (*)(void))Sites_sweep, METH_FASTCALL,
     "sweep($self, now, keep_ms, /)\n--\n\nsweep(now, keep_ms) -> reclaimed, or -1 if another process is sweeping."},
    {"totals", (PyCFunction)Sites_totals, METH_NOARGS,
     "totals($self)\n--\n\ntotals() -> the counters, each summed over the process stripes."},
    {"release", (PyCFunction)Sites_release, METH_NOARGS,
     "release($self)\n--\n\nGive the buffer back (idempotent)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SitesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "shm._atomics.Sites",
    .tp_basicsize = sizeof(SitesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Sites(buffer, ctrl_offset, slots_offset, capacity, permits)\n--\n\n"
              "The site table's operations.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Sites_init,
    .tp_dealloc = (destructor)Sites_dealloc,
    .tp_methods = Sites_methods,
};

_Static_assert((int)SHM_SITE_GRANTED == (int)ACQ_GRANTED && (int)SHM_SITE_PERMIT == (int)ACQ_PERMIT,
               "the site codes a batch grant reads");

int
shm_sites_usable(PyObject *sites)
{
    if (sites == Py_None) return 0;
    if (!PyObject_TypeCheck(sites, &SitesType)) {
        PyErr_SetString(PyExc_TypeError, "sites must be a Sites or None");
        return -1;
    }
    if (!((SitesObject *)sites)->held) {
        shm_released_error();
        return -1;
    }
    return 1;
}

int
shm_sites_acquire(PyObject *sites, uint64_t h, uint64_t now, uint64_t lease_ms, uint64_t *until,
                  int64_t *previous_last)
{
    if (lease_ms == 0 || now + lease_ms > SITE_TIME_MAX) {
        return acquired(ACQ_FULL, 0, -1, until, previous_last); /* fails closed */
    }
    return acquire_one((SitesObject *)sites, h, now, lease_ms, 0, until, previous_last);
}

void
shm_sites_undo(PyObject *sites, uint64_t h, uint64_t expires, uint64_t now, int64_t previous)
{
    undo_one((SitesObject *)sites, h, expires, now, previous);
}

int
shm_sites_add(PyObject *m)
{
    if (PyType_Ready(&SitesType) < 0) return -1;
    Py_INCREF(&SitesType);
    if (PyModule_AddObject(m, "Sites", (PyObject *)&SitesType) < 0) {
        Py_DECREF(&SitesType);
        return -1;
    }
    static const char *const site_keys[] = {
        "sweeper", "incarnation", "version", "default_cap", "default_interval", "fail_streak",
        "fail_window", "fail_block", "fail_block_max", "stripes", "ctrl_words", "probe",
        "body_head", "cap_max", "interval_max", "s_grants", "s_permits", "s_capped",
        "s_spacing", "s_blocked", "s_full", "s_releases", "s_extends", "s_conflicts",
        "s_blocks_retry_after", "s_blocks_failed", "s_inserts", "s_reclaimed", "s_sweeps",
        "s_live", "s_undone", "granted", "permit", "capped", "spacing", "blocked", "full",
        "permit_only", "reason_retry_after", "reason_failures", "penalty_keep_ms",
    };
    static const long site_values[] = {
        SC_SWEEPER, SC_INCARNATION, SC_VERSION, SC_DEFAULT_CAP, SC_DEFAULT_INTERVAL,
        SC_FAIL_STREAK, SC_FAIL_WINDOW, SC_FAIL_BLOCK, SC_FAIL_BLOCK_MAX, SC_STRIPES,
        SC_CTRL_WORDS, SPROBE, B_HEAD, SITE_CAP_MAX, (long)SITE_INTERVAL_MAX, SS_GRANTS,
        SS_PERMITS, SS_CAPPED, SS_SPACING, SS_BLOCKED, SS_FULL, SS_RELEASES, SS_EXTENDS,
        SS_CONFLICTS, SS_BLOCKS_RETRY, SS_BLOCKS_FAILED, SS_INSERTS, SS_RECLAIMED, SS_SWEEPS,
        SS_LIVE, SS_UNDONE, ACQ_GRANTED, ACQ_PERMIT, ACQ_CAPPED, ACQ_SPACING, ACQ_BLOCKED,
        ACQ_FULL, ACQ_PERMIT_ONLY, REASON_RETRY_AFTER, REASON_FAILURES, (long)PENALTY_KEEP_MS,
    };
    _Static_assert(sizeof(site_keys) / sizeof(site_keys[0]) ==
                       sizeof(site_values) / sizeof(site_values[0]),
                   "site layout table");
    return shm_add_layout(m, "SITE_LAYOUT", site_keys, site_values,
                          (int)(sizeof(site_values) / sizeof(site_values[0])));
}
