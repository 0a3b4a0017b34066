/* epd_core.c: see epd_core.h for the map. */
#define _GNU_SOURCE
#include "epd_core.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the wire format is little-endian");
_Static_assert(sizeof(epd_wire_req) == 40 && sizeof(epd_wire_rep) == 24, "wire structs are packed by layout");

/* Socket buffers, measured here with 16 MiB writes on loopback: 1 MiB 4.5-5.6 GB/s, kernel
 * autotuning 3.9-5.1, 4 MiB 2.1-2.3. */
#define SOCK_BUF (1 << 20)
#define DRAIN_MAX (1ULL << 40)   /* a refused write longer than this is garbage: close instead of draining */
#define RECV_CHUNK (256 << 10) /* see recv_all */
#define SPIN_NS 50000           /* see spin_until_readable */
#define WINDOW 512               /* pipelined writes per batch window (replies are 24 bytes each) */
#define MAX_ARENAS 256
#define TABLE_CAP 8192
#define MAX_WRITERS 64           /* same-host writer processes attached to one owner at once */
#define REAP_EVERY_NS 1000000ULL /* how often a deregister waiting for pins looks for dead writers */
#define TABLE_MAGIC 0x32304C4254445045ULL /* "EPDTBL02" */

#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)
#define ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_SEQ_CST)

static int fail(char *err, int code, const char *fmt, ...) {
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, EPD_ERRLEN, fmt, ap);
        va_end(ap);
    }
    return code;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* ===================== HMAC-SHA256 (the handshake's only use; no library dependency) ===================== */

typedef struct {
    uint32_t h[8];
    uint64_t bytes;
    uint8_t buf[64];
    uint32_t used;
} sha256_t;

static const uint32_t SHA_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98,
    0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786,
    0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8,
    0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13,
    0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819,
    0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a,
    0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(sha256_t *c, const uint8_t *p) {
    uint32_t w[64], a, b, d, e, f, g, h, cc;
    for (int i = 0; i < 16; i++) w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR(w[i - 15], 7) ^ ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR(w[i - 2], 17) ^ ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    a = c->h[0], b = c->h[1], cc = c->h[2], d = c->h[3], e = c->h[4], f = c->h[5], g = c->h[6], h = c->h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ROR(e, 6) ^ ROR(e, 11) ^ ROR(e, 25)) + ((e & f) ^ (~e & g)) + SHA_K[i] + w[i];
        uint32_t t2 = (ROR(a, 2) ^ ROR(a, 13) ^ ROR(a, 22)) + ((a & b) ^ (a & cc) ^ (b & cc));
        h = g, g = f, f = e, e = d + t1, d = cc, cc = b, b = a, a = t1 + t2;
    }
    c->h[0] += a, c->h[1] += b, c->h[2] += cc, c->h[3] += d, c->h[4] += e, c->h[5] += f, c->h[6] += g, c->h[7] += h;
}

static void sha256_init(sha256_t *c) {
    static const uint32_t H0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, H0, sizeof(H0));
    c->bytes = 0;
    c->used = 0;
}

static void sha256_update(sha256_t *c, const uint8_t *p, size_t n) {
    c->bytes += n;
    while (n) {
        size_t take = 64 - c->used < n ? 64 - c->used : n;
        memcpy(c->buf + c->used, p, take);
        c->used += (uint32_t)take, p += take, n -= take;
        if (c->used == 64) {
            sha256_block(c, c->buf);
            c->used = 0;
        }
    }
}

static void sha256_final(sha256_t *c, uint8_t out[32]) {
    uint64_t bits = c->bytes * 8;
    uint8_t pad = 0x80, zero = 0, len[8];
    sha256_update(c, &pad, 1);
    while (c->used != 56) sha256_update(c, &zero, 1);
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)(bits >> (56 - 8 * i));
    sha256_update(c, len, 8);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(c->h[i] >> 24), out[4 * i + 1] = (uint8_t)(c->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(c->h[i] >> 8), out[4 * i + 3] = (uint8_t)c->h[i];
    }
}

void epd_hmac_sha256(const uint8_t *key, size_t key_len, const uint8_t *msg, size_t msg_len, uint8_t out[32]) {
    uint8_t k[64] = {0}, pad[64], inner[32];
    sha256_t c;
    if (key_len > 64) {
        sha256_init(&c);
        sha256_update(&c, key, key_len);
        sha256_final(&c, k);
    } else {
        memcpy(k, key, key_len);
    }
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x36;
    sha256_init(&c);
    sha256_update(&c, pad, 64);
    sha256_update(&c, msg, msg_len);
    sha256_final(&c, inner);
    for (int i = 0; i < 64; i++) pad[i] = k[i] ^ 0x5c;
    sha256_init(&c);
    sha256_update(&c, pad, 64);
    sha256_update(&c, inner, 32);
    sha256_final(&c, out);
}

/* The handshake's proofs: HMAC(secret, label | first nonce | second nonce). */
static void auth_proof(const uint8_t *secret, uint32_t secret_len, const char *label, const uint8_t *n1,
                       const uint8_t *n2, uint8_t out[EPD_MAC_BYTES]) {
    uint8_t msg[5 + 2 * EPD_NONCE_BYTES];
    memcpy(msg, label, 5);
    memcpy(msg + 5, n1, EPD_NONCE_BYTES);
    memcpy(msg + 5 + EPD_NONCE_BYTES, n2, EPD_NONCE_BYTES);
    epd_hmac_sha256(secret, secret_len, msg, sizeof(msg), out);
}

static int same_mac(const uint8_t *a, const uint8_t *b) { /* constant time */
    uint8_t d = 0;
    for (int i = 0; i < EPD_MAC_BYTES; i++) d |= a[i] ^ b[i];
    return d == 0;
}

static int random_bytes(uint8_t *buf, size_t n) {
    size_t done = 0;
    while (done < n) {
        ssize_t r = getrandom(buf + done, n - done, 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        done += (size_t)r;
    }
    return 0;
}

/* ===================== registration table (shared with same-host peers) ===================== */

enum { SLOT_FREE = 0, SLOT_ACTIVE = 1, SLOT_REVOKING = 2 };

typedef struct {
    uint64_t addr, length;
    uint32_t state, kind;
    uint32_t arena_idx, arena_id;
    int32_t inflight;
    uint32_t pad;
    uint64_t key; /* unique per registration: a write naming an older registration is refused */
    uint64_t pad2[2];
} slot_t; /* 64 bytes */

typedef struct {
    uint64_t base, length;
    uint32_t id, live;
    int32_t fd, pad;
} arena_rec_t;

/* A same-host writer process attached to the table (epd_shm_attach). Its pins are counted here, per slot,
 * and not in the slot: a writer killed mid-copy never releases them, and the owner, seeing the process gone,
 * drops them all at once (reap_writer). A slot's pins are its own `inflight` (the owner's server threads, the
 * cuda transport) plus every writer's count for it. */
enum { WRITER_FREE = 0, WRITER_CLAIMING = 1, WRITER_LIVE = 2, WRITER_REAPING = 3 };

typedef struct {
    uint32_t state;
    int32_t pid;
    uint64_t start; /* the process's start time (/proc/<pid>/stat), which tells a reused pid apart; 0: unknown */
    uint64_t pad[6];
    int32_t pins[TABLE_CAP];
} writer_rec_t;

typedef struct {
    uint64_t magic, nonce;
    int32_t pid;
    uint32_t used; /* slots ever used: the scan bound */
    uint64_t writes_in, bytes_in, writes_refused; /* placed by whoever wrote: server thread or shm peer */
    uint64_t arena_epoch;                         /* bumped when an arena is freed, so peers unmap it */
    uint64_t pins_reaped;                         /* pins dropped with the writer that held them (it died) */
    uint64_t pad[8];
    arena_rec_t arenas[MAX_ARENAS];
    slot_t slots[TABLE_CAP];
    writer_rec_t writers[MAX_WRITERS]; /* after the slots: the layout before them is cuda_table.py's too */
} table_t;

static int covers(uint64_t a, uint64_t l, uint64_t addr, uint64_t len) {
    return addr >= a && len <= l && addr - a <= l - len;
}

/* Find the live registration covering [addr, addr+len) and pin it (inflight) so that a deregister
 * waits for this write. Pin first, then re-check: the owner sets REVOKING first, then waits, so one
 * of the two always sees the other. */
static int slot_matches(slot_t *s, uint64_t addr, uint64_t len, uint64_t key) {
    return LOAD(&s->state) == SLOT_ACTIVE && covers(LOAD(&s->addr), LOAD(&s->length), addr, len) &&
           (key == 0 || LOAD(&s->key) == key);
}

/* `w`: the writer record to count the pin in (a same-host writer), NULL for the slot's own count. Returns
 * the pinned counter (give it to table_release) and sets *slot, or NULL when nothing covers the write. */
static int32_t *table_acquire(table_t *t, writer_rec_t *w, uint64_t addr, uint64_t len, uint64_t key,
                              slot_t **slot) {
    uint32_t used = LOAD(&t->used);
    for (uint32_t i = 0; i < used; i++) {
        slot_t *s = &t->slots[i];
        if (!slot_matches(s, addr, len, key)) continue;
        int32_t *pin = w ? &w->pins[i] : &s->inflight;
        ADD(pin, 1);
        if (slot_matches(s, addr, len, key)) {
            if (slot) *slot = s;
            return pin;
        }
        ADD(pin, -1);
    }
    return NULL;
}

static void table_release(int32_t *pin) { ADD(pin, -1); }

/* ---- writer records ---- */

/* Field 22 of /proc/<pid>/stat (start time, in clock ticks since boot) and field 3 (state). Returns 1, 0 when
 * the process does not exist, -1 when it cannot tell. */
static int proc_stat(int pid, uint64_t *start, char *state) {
    char path[64], buf[1024];
    snprintf(path, sizeof(path), "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT || errno == ESRCH ? 0 : -1;
    ssize_t n = read(fd, buf, sizeof(buf) - 1);
    int e = errno;
    close(fd);
    if (n <= 0) return n < 0 && e == ESRCH ? 0 : -1;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* the command name may hold spaces and parentheses */
    if (!p || sscanf(p + 2, "%c", state) != 1) return -1;
    for (int field = 3; field <= 22 && p; field++) p = strchr(p + 1, ' '); /* from ')' to the space before 22 */
    if (!p || sscanf(p + 1, "%lu", start) != 1) return -1;
    return 1;
}

/* Whether the writer (pid, start) is certainly gone: exited (a zombie too: it copies nothing any more), or
 * its pid now names another process. In doubt it counts as alive, so a live writer never loses its pins. */
static int writer_gone(int32_t pid, uint64_t start) {
    int pidfd = (int)syscall(SYS_pidfd_open, pid, 0); /* first, so that the start time checked is its process's */
    if (pidfd < 0 && errno == ESRCH) return 1;
    uint64_t now_start = 0;
    char state = 0;
    int known = proc_stat(pid, &now_start, &state);
    int gone = known == 0 || (known == 1 && start && now_start != start);
    if (!gone && known == 1) {
        if (pidfd >= 0) {
            struct pollfd pf = {pidfd, POLLIN, 0};
            gone = poll(&pf, 1, 0) == 1; /* a pidfd becomes readable once the whole process has exited */
        } else {
            gone = state == 'Z' || state == 'X';
        }
    }
    if (pidfd >= 0) close(pidfd);
    return gone;
}

/* Drop every pin of a writer whose process is gone and free its record; the pins it held return to 0. */
static void reap_writer(table_t *t, writer_rec_t *w) {
    uint32_t live = WRITER_LIVE;
    if (!__atomic_compare_exchange_n(&w->state, &live, WRITER_REAPING, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
        return; /* another reaper took it */
    uint64_t dropped = 0;
    for (uint32_t i = 0; i < TABLE_CAP; i++) {
        int32_t p = __atomic_exchange_n(&w->pins[i], 0, __ATOMIC_SEQ_CST);
        if (p > 0) dropped += (uint64_t)p;
    }
    ADD(&t->pins_reaped, dropped);
    STORE(&w->state, WRITER_FREE);
}

/* Reap the records of writers that are gone; with `pinned_only`, only of those that still pin something. */
static void reap_gone_writers(table_t *t, int pinned_only) {
    uint32_t used = LOAD(&t->used);
    for (int k = 0; k < MAX_WRITERS; k++) {
        writer_rec_t *w = &t->writers[k];
        if (LOAD(&w->state) != WRITER_LIVE) continue;
        int pinned = !pinned_only;
        for (uint32_t i = 0; i < used && !pinned; i++) pinned = LOAD(&w->pins[i]) != 0;
        if (pinned && writer_gone(LOAD(&w->pid), LOAD(&w->start))) reap_writer(t, w);
    }
}

/* Every pin on slot i: its own and each writer's. */
static int64_t slot_pins(table_t *t, uint32_t i) {
    int64_t n = LOAD(&t->slots[i].inflight);
    for (int k = 0; k < MAX_WRITERS; k++)
        if (LOAD(&t->writers[k].state) != WRITER_FREE) n += LOAD(&t->writers[k].pins[i]);
    return n;
}

static writer_rec_t *writer_claim(table_t *t) {
    uint64_t start = 0;
    char state;
    if (proc_stat(getpid(), &start, &state) != 1) start = 0;
    for (int pass = 0; pass < 2; pass++) {
        for (int k = 0; k < MAX_WRITERS; k++) {
            writer_rec_t *w = &t->writers[k];
            uint32_t free_ = WRITER_FREE;
            if (!__atomic_compare_exchange_n(&w->state, &free_, WRITER_CLAIMING, 0, __ATOMIC_SEQ_CST,
                                             __ATOMIC_SEQ_CST))
                continue;
            memset(w->pins, 0, sizeof(w->pins)); /* a writer that detached left none; one reaped, none either */
            STORE(&w->pid, (int32_t)getpid());
            STORE(&w->start, start);
            STORE(&w->state, WRITER_LIVE);
            return w;
        }
        reap_gone_writers(t, 0); /* full: records of writers that died without detaching come back */
    }
    return NULL;
}

/* ===================== owner ===================== */

typedef struct {
    void *base;
    uint64_t length;
    int fd;
    uint32_t id;
} arena_t;

struct epd_owner {
    pthread_mutex_t mu;
    int table_fd;
    table_t *t;
    int timeout_ms;
    arena_t arenas[MAX_ARENAS];
    uint32_t next_arena_id;
    uint64_t next_key;
    uint64_t deregister_timeouts;
};

int epd_owner_create(epd_owner **out, int timeout_ms, char *err) {
    epd_owner *o = calloc(1, sizeof(*o));
    if (!o) return fail(err, EPD_ESYS, "out of memory");
    pthread_mutex_init(&o->mu, NULL);
    o->timeout_ms = timeout_ms;
    o->table_fd = memfd_create("epd-registrations", MFD_CLOEXEC);
    if (o->table_fd < 0) goto sys;
    if (ftruncate(o->table_fd, sizeof(table_t)) < 0) goto sys;
    o->t = mmap(NULL, sizeof(table_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, o->table_fd, 0);
    if (o->t == MAP_FAILED) goto sys;
    o->t->magic = TABLE_MAGIC;
    o->t->pid = getpid();
    if (getrandom(&o->t->nonce, sizeof(o->t->nonce), 0) != sizeof(o->t->nonce)) o->t->nonce = now_ns();
    for (int i = 0; i < MAX_ARENAS; i++) o->arenas[i].fd = -1;
    /* Under Yama ptrace_scope=1 only descendants may process_vm_writev into us; peers are not. */
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0);
    *out = o;
    return EPD_OK;
sys : {
    int e = errno;
    if (o->table_fd >= 0) close(o->table_fd);
    free(o);
    errno = e;
    return fail(err, EPD_ESYS, "cannot create the registration table: %s", strerror(e));
}
}

void epd_owner_destroy(epd_owner *o) {
    if (!o) return;
    for (int i = 0; i < MAX_ARENAS; i++)
        if (o->arenas[i].base) {
            munmap(o->arenas[i].base, o->arenas[i].length);
            close(o->arenas[i].fd);
        }
    munmap(o->t, sizeof(table_t));
    close(o->table_fd);
    pthread_mutex_destroy(&o->mu);
    free(o);
}

static int arena_of(epd_owner *o, uint64_t addr, uint64_t len) {
    for (int i = 0; i < MAX_ARENAS; i++)
        if (o->arenas[i].base && covers((uint64_t)o->arenas[i].base, o->arenas[i].length, addr, len)) return i;
    return -1;
}

int epd_owner_register(epd_owner *o, uint64_t addr, uint64_t length, uint64_t *key_out, char *err) {
    if (length == 0) return fail(err, EPD_EINVAL, "cannot register 0 bytes at 0x%lx", addr);
    if (addr == 0) return fail(err, EPD_EINVAL, "cannot register a null pointer");
    if (addr + length < addr) return fail(err, EPD_EINVAL, "region 0x%lx + %lu wraps the address space", addr, length);
    table_t *t = o->t;
    pthread_mutex_lock(&o->mu);
    int free_slot = -1;
    for (uint32_t i = 0; i < t->used; i++) {
        slot_t *s = &t->slots[i];
        if (s->state == SLOT_FREE) {
            /* a slot a deregister gave up on may still be pinned by a frozen writer: not reused while it is */
            if (free_slot < 0 && slot_pins(t, i) == 0) free_slot = (int)i;
            continue;
        }
        if (s->addr == addr && s->length == length) {
            pthread_mutex_unlock(&o->mu);
            return fail(err, EPD_EINVAL, "0x%lx (%lu bytes) is already registered", addr, length);
        }
        if (addr < s->addr + s->length && s->addr < addr + length) {
            pthread_mutex_unlock(&o->mu);
            return fail(err, EPD_EINVAL, "0x%lx (%lu bytes) overlaps the registered region 0x%lx (%lu bytes)", addr,
                        length, s->addr, s->length);
        }
    }
    if (free_slot < 0) {
        if (t->used == TABLE_CAP) {
            pthread_mutex_unlock(&o->mu);
            return fail(err, EPD_EINVAL, "registration table full (%d regions)", TABLE_CAP);
        }
        free_slot = (int)t->used;
    }
    slot_t *s = &t->slots[free_slot];
    STORE(&s->addr, addr);
    STORE(&s->length, length);
    int a = arena_of(o, addr, length);
    s->kind = a >= 0;
    s->arena_idx = a >= 0 ? (uint32_t)a : 0;
    s->arena_id = a >= 0 ? o->arenas[a].id : 0;
    STORE(&s->key, ++o->next_key);
    *key_out = s->key;
    STORE(&s->state, SLOT_ACTIVE); /* publish after the fields */
    if ((uint32_t)free_slot == t->used) STORE(&t->used, t->used + 1);
    pthread_mutex_unlock(&o->mu);
    return EPD_OK;
}

int epd_owner_deregister(epd_owner *o, uint64_t addr, char *err) {
    table_t *t = o->t;
    pthread_mutex_lock(&o->mu);
    slot_t *s = NULL;
    uint32_t idx = 0;
    for (uint32_t i = 0; i < t->used; i++)
        if (t->slots[i].state == SLOT_ACTIVE && t->slots[i].addr == addr) s = &t->slots[i], idx = i;
    if (!s) {
        pthread_mutex_unlock(&o->mu);
        return fail(err, EPD_EINVAL, "0x%lx is not the start of a registered region", addr);
    }
    STORE(&s->state, SLOT_REVOKING);
    pthread_mutex_unlock(&o->mu);
    /* No write may land after deregister returns: wait for pinned writers. A stalled TCP writer is cut
     * off by its connection's idle timeout, so wait twice that; an shm writer that died mid-copy has its
     * pins dropped here; only a frozen shm writer outlasts the wait. */
    uint64_t t0 = now_ns(), deadline = t0 + 2 * (uint64_t)o->timeout_ms * 1000000ULL, reap_at = t0 + REAP_EVERY_NS;
    int expired = 0;
    while (slot_pins(t, idx) > 0) {
        uint64_t now = now_ns();
        if (now > deadline) {
            expired = 1;
            break;
        }
        if (now >= reap_at) {
            reap_gone_writers(t, 1);
            reap_at = now + REAP_EVERY_NS;
        }
        struct timespec ts = {0, 20000};
        nanosleep(&ts, NULL);
    }
    pthread_mutex_lock(&o->mu);
    STORE(&s->state, SLOT_FREE);
    if (expired) o->deregister_timeouts++;
    pthread_mutex_unlock(&o->mu);
    if (expired)
        return fail(err, EPD_EBUSY,
                    "0x%lx was deregistered, but a writer stalled mid-write for over %d ms; its late bytes may "
                    "still land there",
                    addr, 2 * o->timeout_ms);
    return EPD_OK;
}

int epd_owner_covers(epd_owner *o, uint64_t addr, uint64_t length) {
    int32_t *pin = table_acquire(o->t, NULL, addr, length, 0, NULL);
    if (pin) table_release(pin);
    return pin != NULL;
}

int epd_owner_alloc_managed(epd_owner *o, uint64_t length, uint64_t *addr_out, char *err) {
    if (length == 0) return fail(err, EPD_EINVAL, "cannot allocate a managed buffer of 0 bytes");
    pthread_mutex_lock(&o->mu);
    int idx = -1;
    for (int i = 0; i < MAX_ARENAS && idx < 0; i++)
        if (!o->arenas[i].base) idx = i;
    if (idx < 0) {
        pthread_mutex_unlock(&o->mu);
        return fail(err, EPD_EINVAL, "too many managed buffers (at most %d)", MAX_ARENAS);
    }
    int fd = memfd_create("epd-managed", MFD_CLOEXEC);
    void *base = MAP_FAILED;
    if (fd >= 0 && ftruncate(fd, (off_t)length) == 0)
        base = mmap(NULL, length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (base == MAP_FAILED) {
        int e = errno;
        if (fd >= 0) close(fd);
        pthread_mutex_unlock(&o->mu);
        errno = e;
        return fail(err, EPD_ESYS, "cannot allocate a managed buffer of %lu bytes: %s", length, strerror(e));
    }
    arena_t *a = &o->arenas[idx];
    *a = (arena_t){base, length, fd, ++o->next_arena_id};
    arena_rec_t *r = &o->t->arenas[idx];
    r->base = (uint64_t)base;
    r->length = length;
    r->fd = fd;
    r->id = a->id;
    STORE(&r->live, 1);
    pthread_mutex_unlock(&o->mu);
    *addr_out = (uint64_t)base;
    return EPD_OK;
}

int epd_owner_free_managed(epd_owner *o, uint64_t addr, char *err) {
    pthread_mutex_lock(&o->mu);
    int idx = -1;
    for (int i = 0; i < MAX_ARENAS; i++)
        if (o->arenas[i].base && (uint64_t)o->arenas[i].base == addr) idx = i;
    if (idx < 0) {
        pthread_mutex_unlock(&o->mu);
        return fail(err, EPD_EINVAL, "0x%lx is not a managed buffer of this engine", addr);
    }
    arena_t *a = &o->arenas[idx];
    for (uint32_t i = 0; i < o->t->used; i++) {
        slot_t *s = &o->t->slots[i];
        if (s->state != SLOT_FREE && covers((uint64_t)a->base, a->length, s->addr, s->length)) {
            pthread_mutex_unlock(&o->mu);
            return fail(err, EPD_EINVAL, "managed buffer 0x%lx still holds the registered region 0x%lx; deregister it first",
                        addr, s->addr);
        }
    }
    STORE(&o->t->arenas[idx].live, 0);
    ADD(&o->t->arena_epoch, 1);
    munmap(a->base, a->length);
    close(a->fd);
    *a = (arena_t){NULL, 0, -1, 0};
    pthread_mutex_unlock(&o->mu);
    return EPD_OK;
}

int epd_owner_regions(epd_owner *o, epd_region *out, int cap) {
    int n = 0;
    pthread_mutex_lock(&o->mu);
    for (uint32_t i = 0; i < o->t->used; i++) {
        slot_t *s = &o->t->slots[i];
        if (s->state != SLOT_ACTIVE) continue;
        if (n < cap) out[n] = (epd_region){s->addr, s->length, s->kind};
        n++;
    }
    pthread_mutex_unlock(&o->mu);
    return n;
}

void epd_owner_stats_get(epd_owner *o, epd_owner_stats *st) {
    memset(st, 0, sizeof(*st));
    pthread_mutex_lock(&o->mu);
    for (int pass = 0; pass < 2; pass++) {
        uint64_t pinned = 0;
        for (uint32_t i = 0; i < o->t->used; i++)
            if (o->t->slots[i].state == SLOT_ACTIVE) {
                int64_t pins = slot_pins(o->t, i);
                pinned += pins > 0 ? (uint64_t)pins : 0;
            }
        if (pinned == 0 || pass == 1) {
            st->writes_in_flight = pinned;
            break;
        }
        reap_gone_writers(o->t, 1); /* pins seen: those of writers that died mid-copy go before they are counted */
    }
    for (uint32_t i = 0; i < o->t->used; i++)
        if (o->t->slots[i].state == SLOT_ACTIVE) {
            st->regions++;
            st->registered_bytes += o->t->slots[i].length;
        }
    for (int i = 0; i < MAX_ARENAS; i++)
        if (o->arenas[i].base) {
            st->managed_arenas++;
            st->managed_bytes += o->arenas[i].length;
        }
    st->deregister_timeouts = o->deregister_timeouts;
    pthread_mutex_unlock(&o->mu);
    st->writes_in = LOAD(&o->t->writes_in);
    st->bytes_in = LOAD(&o->t->bytes_in);
    st->writes_refused = LOAD(&o->t->writes_refused);
    st->pins_reaped = LOAD(&o->t->pins_reaped);
}

epd_hello epd_owner_hello(epd_owner *o) { return (epd_hello){o->t->pid, o->table_fd, o->t->nonce}; }

/* ===================== socket helpers ===================== */

/* Idle timeout: a blocking call that makes no progress for timeout_ms fails with EAGAIN. */
static void sock_setup(int fd, int timeout_ms) {
    int one = 1, buf = SOCK_BUF;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof(buf));
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof(buf));
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
}

static int io_fail(char *err, const char *what, int e, int timeout_ms) {
    if (e == EAGAIN || e == EWOULDBLOCK)
        return fail(err, EPD_ETIMEDOUT, "%s: the peer made no progress for %d ms (frozen or overloaded)", what,
                    timeout_ms);
    if (e == 0) return fail(err, EPD_ECONN, "%s: the peer closed the connection (it died or was closed)", what);
    if (e == EPIPE || e == ECONNRESET)
        return fail(err, EPD_ECONN, "%s: the connection was reset (the peer died or was closed)", what);
    errno = e;
    return fail(err, EPD_ESYS, "%s: %s", what, strerror(e));
}

/* Receive exactly len bytes. *got tells the caller whether anything arrived (idle vs mid-message). */
static int recv_all(int fd, void *buf, uint64_t len, uint64_t *got, int timeout_ms) {
    uint64_t done = 0;
    while (done < len) {
        /* Chunks keep each call short, so that the idle timeout below is measured per chunk. */
        uint64_t want = len - done < RECV_CHUNK ? len - done : RECV_CHUNK;
        uint64_t t0 = now_ns();
        ssize_t r = recv(fd, (char *)buf + done, want, MSG_WAITALL);
        if (r > 0) {
            done += (uint64_t)r;
            /* SO_RCVTIMEO ends a MSG_WAITALL call short: the sender stalled for the whole timeout */
            if ((uint64_t)r < want && now_ns() - t0 >= (uint64_t)timeout_ms * 1000000ULL) {
                if (got) *got = done;
                return EAGAIN;
            }
            continue;
        }
        if (r < 0 && errno == EINTR) continue;
        if (got) *got = done;
        return r == 0 ? 0 : errno;
    }
    if (got) *got = done;
    return -1; /* complete */
}
#define RECV_DONE (-1)

/* Wait for the next small message by polling for up to SPIN_NS before sleeping in recv: a thread
 * that sleeps between a request and its reply pays a wake-up, which on these VMs costs 20-80 us. */
static int spin_until_readable(int fd) { /* 1: readable (bytes, end of stream or an error) */
    uint64_t end = now_ns() + SPIN_NS;
    char c;
    while (now_ns() < end) {
        ssize_t r = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (r > 0 || r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return 1;
        /* Sockets wake their peer thread onto the waker's CPU: yield, or we would spin in its way. */
        sched_yield();
    }
    return 0;
}

static int send_all(int fd, struct iovec *iov, int cnt, int flags) {
    while (cnt > 0) {
        struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)(cnt > IOV_MAX ? IOV_MAX : cnt)};
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL | flags);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        while (cnt > 0 && (size_t)w >= iov->iov_len) {
            w -= (ssize_t)iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + w;
            iov->iov_len -= (size_t)w;
        }
    }
    return -1;
}

static int send_buf(int fd, const void *buf, size_t len) {
    struct iovec iov = {(void *)buf, len};
    return send_all(fd, &iov, 1, 0);
}

/* ===================== owner: TCP server ===================== */

typedef struct srv_conn {
    int fd;
    pthread_t th;
    int done;
    struct epd_server *s;
    struct srv_conn *next;
} srv_conn;

struct epd_server {
    epd_owner *o;
    int lfd, wake[2], port, timeout_ms, max_conns, idle_ms;
    pthread_t th;
    epd_control_fn control;
    void *control_ctx;
    pthread_mutex_t mu;
    srv_conn *conns;
    uint8_t secret[EPD_SECRET_MAX];
    uint32_t secret_len;
    uint64_t active, accepted, refused, idle_closed, auth_failures, auth_logged_ns; /* atomics */
};

/* While the next request of a pipelined batch is already waiting, hold the reply back (MSG_MORE) so
 * that a batch's replies leave in a few segments instead of one per block; the reply sent when
 * nothing is waiting flushes them all. */
static int reply(int fd, uint64_t seq, int32_t status, const void *payload, uint64_t len) {
    epd_wire_rep rep = {EPD_WIRE_MAGIC, status, seq, len};
    struct iovec iov[2] = {{&rep, sizeof(rep)}, {(void *)payload, len}};
    char c;
    int more = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0 ? MSG_MORE : 0;
    return send_all(fd, iov, len ? 2 : 1, more) == RECV_DONE;
}

/* Discard the payload of a refused write: it never goes anywhere. */
static int drain(int fd, uint64_t len, int timeout_ms) {
    static __thread char sink[1 << 16];
    while (len) {
        uint64_t n = len < sizeof(sink) ? len : sizeof(sink);
        if (recv_all(fd, sink, n, NULL, timeout_ms) != RECV_DONE) return 0;
        len -= n;
    }
    return 1;
}

static int serve_write(epd_server *s, int fd, const epd_wire_req *q) {
    table_t *t = s->o->t;
    int32_t *sl = q->length ? table_acquire(t, NULL, q->addr, q->length, q->key, NULL) : NULL;
    if (!sl) {
        ADD(&t->writes_refused, 1);
        if (q->length > DRAIN_MAX || !drain(fd, q->length, s->timeout_ms)) return 0;
        return reply(fd, q->seq, q->length ? EPD_ST_REFUSED : EPD_ST_BADREQ, NULL, 0);
    }
    int rc = recv_all(fd, (void *)q->addr, q->length, NULL, s->timeout_ms);
    table_release(sl);
    if (rc != RECV_DONE) return 0;
    ADD(&t->writes_in, 1);
    ADD(&t->bytes_in, q->length);
    return reply(fd, q->seq, EPD_ST_OK, NULL, 0);
}

uint64_t epd_strided_extent(uint64_t len, uint64_t count, uint64_t stride) {
    uint64_t span;
    if (len == 0 || count == 0 || (count > 1 && stride < len)) return 0;
    if (__builtin_mul_overflow(count - 1, stride, &span) || __builtin_add_overflow(span, len, &span)) return 0;
    return span;
}

#define BOUNCE_BYTES (1u << 20) /* a strided request's payload is received this many bytes at a time */
#define STRIDED_IOV_MAX (1u << 20) /* source pieces per strided request: bounds the writer's iovec array */

/* Receive a strided request's payload and scatter it, entry by entry and piece by piece, through a bounce
 * buffer: a few large receives, not one per piece. */
static int recv_strided(int fd, const epd_wire_strided *tab, uint64_t length, int timeout_ms) {
    char *bounce = malloc(length < BOUNCE_BYTES ? length : BOUNCE_BYTES);
    if (!bounce) return 0;
    uint64_t entry = 0, piece = 0, off = 0; /* where the next payload byte goes */
    int ok = 1;
    for (uint64_t left = length; ok && left;) {
        uint64_t got = left < BOUNCE_BYTES ? left : BOUNCE_BYTES;
        ok = recv_all(fd, bounce, got, NULL, timeout_ms) == RECV_DONE;
        for (uint64_t p = 0; ok && p < got;) {
            const epd_wire_strided *e = &tab[entry];
            uint64_t take = e->piece_len - off < got - p ? e->piece_len - off : got - p;
            memcpy((char *)(e->addr + piece * e->stride + off), bounce + p, take);
            p += take;
            if ((off += take) == e->piece_len && (off = 0, ++piece == e->count)) piece = 0, entry++;
        }
        left -= got;
    }
    free(bounce);
    return ok;
}

static int serve_write_strided(epd_server *s, int fd, const epd_wire_req *q) {
    table_t *t = s->o->t;
    uint64_t n, payload = 0;
    if (recv_all(fd, &n, sizeof(n), NULL, s->timeout_ms) != RECV_DONE || n == 0 || n > EPD_STRIDED_MAX) return 0;
    epd_wire_strided *tab = malloc(n * sizeof(*tab));
    int32_t **pins = calloc(n, sizeof(*pins));
    int ok = tab && pins && recv_all(fd, tab, n * sizeof(*tab), NULL, s->timeout_ms) == RECV_DONE;
    for (uint64_t i = 0; ok && i < n; i++) { /* framing that does not add up cannot be drained safely: close */
        uint64_t bytes;
        ok = epd_strided_extent(tab[i].piece_len, tab[i].count, tab[i].stride) &&
             !__builtin_mul_overflow(tab[i].piece_len, tab[i].count, &bytes) &&
             !__builtin_add_overflow(payload, bytes, &payload);
    }
    ok = ok && payload == q->length;
    uint64_t npin = 0;
    for (; ok && npin < n; npin++) {
        uint64_t extent = epd_strided_extent(tab[npin].piece_len, tab[npin].count, tab[npin].stride);
        if (!(pins[npin] = table_acquire(t, NULL, tab[npin].addr, extent, tab[npin].key, NULL))) break;
    }
    if (ok && npin < n) { /* an entry outside the registrations: the request is refused as a whole */
        for (uint64_t i = 0; i < npin; i++) table_release(pins[i]);
        ADD(&t->writes_refused, 1);
        free(tab), free(pins);
        if (q->length > DRAIN_MAX || !drain(fd, q->length, s->timeout_ms)) return 0;
        return reply(fd, q->seq, EPD_ST_REFUSED, NULL, 0);
    }
    ok = ok && recv_strided(fd, tab, q->length, s->timeout_ms);
    for (uint64_t i = 0; i < npin; i++) table_release(pins[i]);
    free(tab), free(pins);
    if (!ok) return 0;
    ADD(&t->writes_in, n);
    ADD(&t->bytes_in, q->length);
    return reply(fd, q->seq, EPD_ST_OK, NULL, 0);
}

static int serve_control(epd_server *s, int fd, const epd_wire_req *q) {
    if (q->length > EPD_CONTROL_MAX) return 0;
    uint8_t *req = malloc(q->length ? q->length : 1);
    if (!req || recv_all(fd, req, q->length, NULL, s->timeout_ms) != RECV_DONE) {
        free(req);
        return 0;
    }
    uint8_t *resp = NULL;
    uint32_t resp_len = 0;
    int status = EPD_ST_CONTROL_ERR;
    if (s->control) status = s->control(s->control_ctx, req, (uint32_t)q->length, &resp, &resp_len) == 0 ? EPD_ST_OK : EPD_ST_CONTROL_ERR;
    free(req);
    int ok = reply(fd, q->seq, status, resp, resp ? resp_len : 0);
    free(resp);
    return ok;
}

/* One AUTH request of the handshake (epd_core.h). Returns 1 to go on serving, 0 to close the connection;
 * *authed becomes 1 once the client proved the secret. */
static int serve_auth(epd_server *s, int fd, const epd_wire_req *q, uint8_t *cnonce, uint8_t *snonce, int *stage,
                      int *authed) {
    uint8_t in[EPD_NONCE_BYTES];
    if (q->length != EPD_NONCE_BYTES || recv_all(fd, in, sizeof(in), NULL, s->timeout_ms) != RECV_DONE) return 0;
    if (!s->secret_len) return reply(fd, q->seq, EPD_ST_NOAUTH, NULL, 0);
    if (*stage == 0) { /* the client's nonce: answer ours and our proof */
        uint8_t out[EPD_NONCE_BYTES + EPD_MAC_BYTES];
        memcpy(cnonce, in, EPD_NONCE_BYTES);
        if (random_bytes(snonce, EPD_NONCE_BYTES) < 0) return 0;
        memcpy(out, snonce, EPD_NONCE_BYTES);
        auth_proof(s->secret, s->secret_len, "EPD-S", cnonce, snonce, out + EPD_NONCE_BYTES);
        *stage = 1;
        return reply(fd, q->seq, EPD_ST_OK, out, sizeof(out));
    }
    uint8_t want[EPD_MAC_BYTES];
    auth_proof(s->secret, s->secret_len, "EPD-C", snonce, cnonce, want);
    if (*stage != 1 || !same_mac(in, want)) return 0;
    *stage = 2;
    *authed = 1;
    return reply(fd, q->seq, EPD_ST_OK, NULL, 0);
}

/* One line on stderr (the role's log) per refused peer, at most one a second so that a flood cannot fill the
 * log; the count says how many there were. The secret itself is never printed. */
static void log_auth_failure(epd_server *s, int fd, uint64_t count) {
    uint64_t now = now_ns(), last = LOAD(&s->auth_logged_ns);
    if (last && now - last < 1000000000ull) return;
    if (!__atomic_compare_exchange_n(&s->auth_logged_ns, &last, now, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return;
    struct sockaddr_storage ss;
    socklen_t sl = sizeof(ss);
    char host[INET6_ADDRSTRLEN] = "?";
    int port = 0;
    if (getpeername(fd, (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET) {
            inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, host, sizeof(host));
            port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        } else if (ss.ss_family == AF_INET6) {
            inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, host, sizeof(host));
            port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
        }
    }
    fprintf(stderr, "epd_lab.transfer: a peer at %s:%d failed the shared-secret handshake on port %d "
                    "(auth_failures=%lu)\n", host, port, s->port, (unsigned long)count);
}

static void *conn_main(void *arg) {
    srv_conn *c = arg;
    epd_server *s = c->s;
    uint8_t cnonce[EPD_NONCE_BYTES], snonce[EPD_NONCE_BYTES];
    int stage = 0, authed = s->secret_len == 0, tried = 0;
    for (;;) {
        epd_wire_req q;
        int rc;
        /* Between requests a connection may idle for idle_ms (a writer's pooled connection); within one, each
         * step must progress within timeout_ms. */
        struct pollfd pf = {c->fd, POLLIN, 0};
        rc = spin_until_readable(c->fd); /* a pipelined batch's next header is usually there: no poll */
        while (!rc && (rc = poll(&pf, 1, s->idle_ms > 0 ? s->idle_ms : -1)) < 0 && errno == EINTR) {
            rc = 0;
        }
        if (rc == 0) {
            ADD(&s->idle_closed, 1);
            break;
        }
        if (recv_all(c->fd, &q, sizeof(q), NULL, s->timeout_ms) != RECV_DONE || q.magic != EPD_WIRE_MAGIC ||
            q.version != EPD_WIRE_VERSION)
            break;
        int ok = 0;
        tried = 1;
        if (q.op == EPD_OP_AUTH) {
            ok = serve_auth(s, c->fd, &q, cnonce, snonce, &stage, &authed);
        } else if (!authed) {
            /* nothing is read or written before the handshake; the answer tells a writer without the secret why */
            reply(c->fd, q.seq, EPD_ST_AUTH_REQUIRED, NULL, 0);
        } else if (q.op == EPD_OP_WRITE) {
            ok = serve_write(s, c->fd, &q);
        } else if (q.op == EPD_OP_WRITE_STRIDED) {
            ok = serve_write_strided(s, c->fd, &q);
        } else if (q.op == EPD_OP_HELLO && q.length == 0) {
            epd_hello h = epd_owner_hello(s->o);
            ok = reply(c->fd, q.seq, EPD_ST_OK, &h, sizeof(h));
        } else if (q.op == EPD_OP_CONTROL) {
            ok = serve_control(s, c->fd, &q);
        }
        if (!ok) break;
    }
    /* a connection that made requests and left without proving the secret: a wrong or missing one */
    if (tried && !authed) log_auth_failure(s, c->fd, ADD(&s->auth_failures, 1));
    shutdown(c->fd, SHUT_RDWR);
    ADD(&s->active, -1);
    STORE(&c->done, 1);
    return NULL;
}

static void reap(epd_server *s, int all) {
    pthread_mutex_lock(&s->mu);
    srv_conn **pp = &s->conns;
    while (*pp) {
        srv_conn *c = *pp;
        if (all) shutdown(c->fd, SHUT_RDWR);
        if (all || LOAD(&c->done)) {
            pthread_mutex_unlock(&s->mu);
            pthread_join(c->th, NULL);
            pthread_mutex_lock(&s->mu);
            close(c->fd);
            *pp = c->next;
            free(c);
        } else {
            pp = &c->next;
        }
    }
    pthread_mutex_unlock(&s->mu);
}

static void *accept_main(void *arg) {
    epd_server *s = arg;
    struct pollfd pf[2] = {{s->lfd, POLLIN, 0}, {s->wake[0], POLLIN, 0}};
    for (;;) {
        if (poll(pf, 2, 1000) < 0 && errno != EINTR) break;
        if (pf[1].revents) break;
        reap(s, 0);
        if (!(pf[0].revents & POLLIN)) continue;
        int fd = accept4(s->lfd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0) continue;
        /* past the cap: closed at once (the client sees the connection closed), no thread spent on it */
        if (s->max_conns > 0 && LOAD(&s->active) >= (uint64_t)s->max_conns) {
            close(fd);
            ADD(&s->refused, 1);
            continue;
        }
        sock_setup(fd, s->timeout_ms);
        srv_conn *c = calloc(1, sizeof(*c));
        if (!c) {
            close(fd);
            continue;
        }
        c->fd = fd;
        c->s = s;
        pthread_mutex_lock(&s->mu);
        ADD(&s->active, 1); /* before the thread starts: it decrements when it ends */
        if (pthread_create(&c->th, NULL, conn_main, c) != 0) {
            ADD(&s->active, -1);
            pthread_mutex_unlock(&s->mu);
            close(fd);
            free(c);
            continue;
        }
        ADD(&s->accepted, 1);
        c->next = s->conns;
        s->conns = c;
        pthread_mutex_unlock(&s->mu);
    }
    return NULL;
}

static int resolve(const char *host, int port, struct sockaddr_storage *ss, socklen_t *sl, char *err) {
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
    char ps[16];
    snprintf(ps, sizeof(ps), "%d", port);
    int rc = getaddrinfo(host, ps, &hints, &res);
    if (rc != 0 || !res) return fail(err, EPD_ECONN, "cannot resolve %s: %s", host, gai_strerror(rc));
    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *sl = res->ai_addrlen;
    freeaddrinfo(res);
    return EPD_OK;
}

int epd_server_start(epd_server **out, epd_owner *o, const char *host, int port, const epd_server_opts *opts,
                     char *err) {
    struct sockaddr_storage ss;
    socklen_t sl;
    if (opts->timeout_ms <= 0 || opts->max_conns < 0 || opts->idle_ms < 0 || opts->secret_len > EPD_SECRET_MAX)
        return fail(err, EPD_EINVAL, "bad server options (timeout %d ms, max_conns %d, idle %d ms, secret of %u bytes)",
                    opts->timeout_ms, opts->max_conns, opts->idle_ms, opts->secret_len);
    int rc = resolve(host, port, &ss, &sl, err);
    if (rc) return rc;
    epd_server *s = calloc(1, sizeof(*s));
    if (!s) return fail(err, EPD_ESYS, "out of memory");
    *s = (epd_server){.o = o, .lfd = -1, .wake = {-1, -1}, .timeout_ms = opts->timeout_ms,
                      .max_conns = opts->max_conns, .idle_ms = opts->idle_ms, .control = opts->control,
                      .control_ctx = opts->control_ctx};
    if (opts->secret && opts->secret_len) {
        memcpy(s->secret, opts->secret, opts->secret_len);
        s->secret_len = opts->secret_len;
    }
    pthread_mutex_init(&s->mu, NULL);
    int one = 1;
    s->lfd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (s->lfd < 0) goto sys;
    setsockopt(s->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(s->lfd, (struct sockaddr *)&ss, sl) < 0 || listen(s->lfd, 128) < 0) goto sys;
    if (getsockname(s->lfd, (struct sockaddr *)&ss, &sl) < 0) goto sys;
    s->port = ntohs(ss.ss_family == AF_INET ? ((struct sockaddr_in *)&ss)->sin_port
                                            : ((struct sockaddr_in6 *)&ss)->sin6_port);
    if (pipe2(s->wake, O_CLOEXEC) < 0) goto sys;
    if ((errno = pthread_create(&s->th, NULL, accept_main, s)) != 0) goto sys;
    *out = s;
    return EPD_OK;
sys : {
    int e = errno;
    if (s->lfd >= 0) close(s->lfd);
    if (s->wake[0] >= 0) close(s->wake[0]), close(s->wake[1]);
    free(s);
    errno = e;
    return fail(err, EPD_ESYS, "cannot listen on %s:%d: %s", host, port, strerror(e));
}
}

int epd_server_port(epd_server *s) { return s->port; }

void epd_server_stats_get(epd_server *s, epd_server_stats *st) {
    *st = (epd_server_stats){LOAD(&s->active), LOAD(&s->accepted), LOAD(&s->refused), LOAD(&s->idle_closed),
                             LOAD(&s->auth_failures)};
}

void epd_server_stop(epd_server *s) {
    if (!s) return;
    if (write(s->wake[1], "x", 1) < 0) { /* the accept thread also wakes within 1 s */
    }
    pthread_join(s->th, NULL);
    close(s->lfd);
    reap(s, 1);
    close(s->wake[0]);
    close(s->wake[1]);
    pthread_mutex_destroy(&s->mu);
    explicit_bzero(s->secret, sizeof(s->secret));
    free(s);
}

/* ===================== writer: TCP connection ===================== */

struct epd_conn {
    int fd, timeout_ms, broken;
    uint64_t seq;
    char peer[300];
};

static int conn_handshake(epd_conn *c, const uint8_t *secret, uint32_t secret_len, char *err);

int epd_conn_open(epd_conn **out, const char *host, int port, int timeout_ms, const uint8_t *secret,
                  uint32_t secret_len, char *err) {
    if (secret_len > EPD_SECRET_MAX) return fail(err, EPD_EINVAL, "a secret of %u bytes (at most %d)", secret_len, EPD_SECRET_MAX);
    struct sockaddr_storage ss;
    socklen_t sl;
    int rc = resolve(host, port, &ss, &sl, err);
    if (rc) return rc;
    int fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) return fail(err, EPD_ESYS, "socket: %s", strerror(errno));
    int e = 0;
    if (connect(fd, (struct sockaddr *)&ss, sl) < 0) {
        e = errno;
        if (e == EINPROGRESS) {
            struct pollfd pf = {fd, POLLOUT, 0};
            int pr = poll(&pf, 1, timeout_ms);
            socklen_t el = sizeof(e);
            if (pr == 0) e = ETIMEDOUT;
            else if (pr < 0) e = errno;
            else getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &el);
        }
    }
    if (e) {
        close(fd);
        errno = e;
        if (e == ETIMEDOUT)
            return fail(err, EPD_ETIMEDOUT, "connect to %s:%d: no answer within %d ms", host, port, timeout_ms);
        return fail(err, EPD_ECONN, "connect to %s:%d: %s", host, port, strerror(e));
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    sock_setup(fd, timeout_ms);
    epd_conn *c = calloc(1, sizeof(*c));
    if (!c) {
        close(fd);
        return fail(err, EPD_ESYS, "out of memory");
    }
    c->fd = fd;
    c->timeout_ms = timeout_ms;
    snprintf(c->peer, sizeof(c->peer), "%s:%d", host, port);
    if (secret && secret_len && (rc = conn_handshake(c, secret, secret_len, err)) != EPD_OK) {
        epd_conn_close(c);
        return rc;
    }
    *out = c;
    return EPD_OK;
}

void epd_conn_close(epd_conn *c) {
    if (!c) return;
    close(c->fd);
    free(c);
}

int epd_conn_broken(epd_conn *c) { return c->broken; }

int epd_conn_alive(epd_conn *c) {
    char b;
    if (c->broken) return 0;
    ssize_t r = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    return r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK); /* 0: closed; bytes: out of step */
}

static int auth_required(epd_conn *c, char *err) {
    c->broken = 1;
    return fail(err, EPD_EAUTH, "%s requires the shared secret and this engine has none: set the same EPD_SECRET "
                                "on both", c->peer);
}

/* Any failure but a refusal leaves the stream out of step: the connection is not reused. A server with a secret
 * answers a request without the handshake with EPD_ST_AUTH_REQUIRED and closes; a large write may fail while it
 * is still being sent, with that answer already waiting to be read. */
static int conn_fail(epd_conn *c, char *err, const char *what, int e) {
    epd_wire_rep rep;
    c->broken = 1;
    if (recv(c->fd, &rep, sizeof(rep), MSG_PEEK | MSG_DONTWAIT) == (ssize_t)sizeof(rep) &&
        rep.magic == EPD_WIRE_MAGIC && rep.status == EPD_ST_AUTH_REQUIRED)
        return auth_required(c, err);
    return io_fail(err, what, e, c->timeout_ms);
}

static int read_reply(epd_conn *c, epd_wire_rep *rep, uint64_t seq, char *err) {
    spin_until_readable(c->fd);
    int rc = recv_all(c->fd, rep, sizeof(*rep), NULL, c->timeout_ms);
    if (rc != RECV_DONE) return conn_fail(c, err, "waiting for the write's completion", rc);
    if (rep->magic != EPD_WIRE_MAGIC || rep->seq != seq) {
        c->broken = 1;
        return fail(err, EPD_EPROTO, "%s answered with bytes that are not the engine's protocol", c->peer);
    }
    if (rep->status == EPD_ST_AUTH_REQUIRED) return auth_required(c, err);
    return EPD_OK;
}

int epd_conn_write(epd_conn *c, const uint64_t *srcs, const uint64_t *dsts, const uint64_t *lens,
                   const uint64_t *keys, int n, char *err) {
    if (c->broken) return fail(err, EPD_ECONN, "connection to %s is broken", c->peer);
    epd_wire_req hdr[WINDOW];
    struct iovec iov[2 * WINDOW];
    int first_err = EPD_OK;
    for (int base = 0; base < n; base += WINDOW) {
        int m = n - base < WINDOW ? n - base : WINDOW;
        uint64_t seq0 = c->seq;
        for (int i = 0; i < m; i++) {
            hdr[i] = (epd_wire_req){EPD_WIRE_MAGIC, EPD_WIRE_VERSION, EPD_OP_WRITE, c->seq++, dsts[base + i],
                                    lens[base + i], keys ? keys[base + i] : 0};
            iov[2 * i] = (struct iovec){&hdr[i], sizeof(hdr[i])};
            iov[2 * i + 1] = (struct iovec){(void *)srcs[base + i], lens[base + i]};
        }
        int rc = send_all(c->fd, iov, 2 * m, 0);
        if (rc != RECV_DONE) return conn_fail(c, err, "sending the write", rc);
        for (int i = 0; i < m; i++) {
            epd_wire_rep rep;
            if ((rc = read_reply(c, &rep, seq0 + (uint64_t)i, err))) return rc;
            if (rep.status != EPD_ST_OK && first_err == EPD_OK)
                first_err = fail(err, EPD_EREFUSED,
                                 "%s refused the write of %lu bytes to 0x%lx: not inside memory it registered%s",
                                 c->peer, lens[base + i], dsts[base + i],
                                 keys && keys[base + i] ? " under that key" : "");
        }
    }
    return first_err;
}

int epd_conn_write_strided(epd_conn *c, const epd_strided *w, int n, char *err) {
    if (c->broken) return fail(err, EPD_ECONN, "connection to %s is broken", c->peer);
    int first_err = EPD_OK, sent = 0;
    uint64_t seq0 = c->seq, m_sent = 0;
    /* requests, all sent before their replies are read */
    for (int base = 0; base < n; base += (int)m_sent, sent++) {
        /* entries up to EPD_STRIDED_MAX and STRIDED_IOV_MAX source pieces (at least one entry) */
        uint64_t m = 0, pieces = 0, payload = 0;
        while (base + (int)m < n && m < EPD_STRIDED_MAX) {
            const epd_strided *e = &w[base + m];
            uint64_t p = e->src_stride == e->len ? 1 : e->count; /* pieces end to end in the source leave as one */
            if (m && pieces + p > STRIDED_IOV_MAX) break;
            pieces += p;
            payload += e->len * e->count;
            m++;
        }
        m_sent = m;
        epd_wire_strided *tab = malloc(m * sizeof(*tab));
        struct iovec *iov = malloc((3 + pieces) * sizeof(*iov));
        if (!tab || !iov) {
            free(tab), free(iov);
            return fail(err, EPD_ESYS, "no memory for a strided write of %lu entries", m);
        }
        epd_wire_req hdr = {EPD_WIRE_MAGIC, EPD_WIRE_VERSION, EPD_OP_WRITE_STRIDED, c->seq++, 0, payload, 0};
        iov[0] = (struct iovec){&hdr, sizeof(hdr)};
        iov[1] = (struct iovec){&m, sizeof(m)};
        iov[2] = (struct iovec){tab, m * sizeof(*tab)};
        uint64_t v = 3;
        for (uint64_t i = 0; i < m; i++) {
            const epd_strided *e = &w[base + i];
            tab[i] = (epd_wire_strided){e->dst, e->len, e->count, e->dst_stride, e->key};
            if (e->src_stride == e->len) {
                iov[v++] = (struct iovec){(void *)e->src, e->len * e->count};
            } else {
                for (uint64_t k = 0; k < e->count; k++)
                    iov[v++] = (struct iovec){(void *)(e->src + k * e->src_stride), e->len};
            }
        }
        int rc = send_all(c->fd, iov, (int)v, 0);
        free(tab), free(iov);
        if (rc != RECV_DONE) return conn_fail(c, err, "sending the strided write", rc);
    }
    for (int i = 0; i < sent; i++) {
        epd_wire_rep rep;
        int rc = read_reply(c, &rep, seq0 + (uint64_t)i, err);
        if (rc) return rc;
        if (rep.status != EPD_ST_OK && first_err == EPD_OK)
            first_err = fail(err, EPD_EREFUSED,
                             "%s refused the strided write of %d entries: one is not inside memory it registered%s",
                             c->peer, n, w[0].key ? " under that key" : "");
    }
    return first_err;
}

static int conn_request(epd_conn *c, uint16_t op, const void *payload, uint64_t len, epd_wire_rep *rep, char *err) {
    if (c->broken) return fail(err, EPD_ECONN, "connection to %s is broken", c->peer);
    epd_wire_req q = {EPD_WIRE_MAGIC, EPD_WIRE_VERSION, op, c->seq++, 0, len, 0};
    struct iovec iov[2] = {{&q, sizeof(q)}, {(void *)payload, len}};
    int rc = send_all(c->fd, iov, len ? 2 : 1, 0);
    if (rc != RECV_DONE) return conn_fail(c, err, "sending a request", rc);
    return read_reply(c, rep, q.seq, err);
}

/* The client's half of the handshake (epd_core.h). */
static int conn_handshake(epd_conn *c, const uint8_t *secret, uint32_t secret_len, char *err) {
    uint8_t cnonce[EPD_NONCE_BYTES], answer[EPD_NONCE_BYTES + EPD_MAC_BYTES], want[EPD_MAC_BYTES],
        proof[EPD_MAC_BYTES];
    epd_wire_rep rep;
    if (random_bytes(cnonce, sizeof(cnonce)) < 0) return fail(err, EPD_ESYS, "getrandom: %s", strerror(errno));
    int rc = conn_request(c, EPD_OP_AUTH, cnonce, sizeof(cnonce), &rep, err);
    if (rc) return rc == EPD_ECONN ? fail(err, EPD_EAUTH, "%s closed the connection during the secret handshake "
                                                          "(an older engine?)", c->peer) : rc;
    if (rep.status == EPD_ST_NOAUTH)
        return fail(err, EPD_EAUTH, "%s has no shared secret, this engine has one: set the same EPD_SECRET on both",
                    c->peer);
    if (rep.status != EPD_ST_OK || rep.length != sizeof(answer))
        return fail(err, EPD_EPROTO, "%s gave a malformed answer to the secret handshake", c->peer);
    rc = recv_all(c->fd, answer, sizeof(answer), NULL, c->timeout_ms);
    if (rc != RECV_DONE) return conn_fail(c, err, "reading the handshake", rc);
    auth_proof(secret, secret_len, "EPD-S", cnonce, answer, want);
    if (!same_mac(answer + EPD_NONCE_BYTES, want))
        return fail(err, EPD_EAUTH, "%s does not know this engine's shared secret (a different EPD_SECRET?)", c->peer);
    auth_proof(secret, secret_len, "EPD-C", answer, cnonce, proof);
    rc = conn_request(c, EPD_OP_AUTH, proof, sizeof(proof), &rep, err);
    if (rc || rep.status != EPD_ST_OK) /* the server closes on a proof it does not accept */
        return fail(err, EPD_EAUTH, "%s refused this engine's proof of the shared secret", c->peer);
    return EPD_OK;
}

int epd_conn_hello(epd_conn *c, epd_hello *h, char *err) {
    epd_wire_rep rep;
    int rc = conn_request(c, EPD_OP_HELLO, NULL, 0, &rep, err);
    if (rc) return rc;
    if (rep.status != EPD_ST_OK || rep.length != sizeof(*h)) {
        c->broken = 1;
        return fail(err, EPD_EPROTO, "%s gave a malformed HELLO answer", c->peer);
    }
    rc = recv_all(c->fd, h, sizeof(*h), NULL, c->timeout_ms);
    return rc == RECV_DONE ? EPD_OK : conn_fail(c, err, "reading HELLO", rc);
}

int epd_conn_control(epd_conn *c, const uint8_t *req, uint32_t len, uint8_t **resp, uint32_t *resp_len,
                     char *err) {
    if (len > EPD_CONTROL_MAX) return fail(err, EPD_EINVAL, "control message of %u bytes exceeds %u", len, EPD_CONTROL_MAX);
    epd_wire_rep rep;
    int rc = conn_request(c, EPD_OP_CONTROL, req, len, &rep, err);
    if (rc) return rc;
    if (rep.length > EPD_CONTROL_MAX) {
        c->broken = 1;
        return fail(err, EPD_EPROTO, "%s sent a control answer of %lu bytes", c->peer, rep.length);
    }
    uint8_t *buf = malloc(rep.length ? rep.length : 1);
    if (!buf) return fail(err, EPD_ESYS, "out of memory");
    rc = recv_all(c->fd, buf, rep.length, NULL, c->timeout_ms);
    if (rc != RECV_DONE) {
        free(buf);
        return conn_fail(c, err, "reading a control answer", rc);
    }
    if (rep.status != EPD_ST_OK) {
        int n = (int)(rep.length < 200 ? rep.length : 200);
        fail(err, EPD_EPROTO, "%s failed the control request: %.*s", c->peer, n, (const char *)buf);
        free(buf);
        return EPD_EPROTO;
    }
    *resp = buf;
    *resp_len = (uint32_t)rep.length;
    return EPD_OK;
}

/* ===================== writer: same-host shm peer ===================== */

typedef struct {
    uint32_t id;
    uint64_t length;
    char *local;
} arena_map_t;

struct epd_shm_peer {
    int pid, pidfd, timeout_ms;
    pthread_mutex_t mu; /* guards the arena mappings; copies run concurrently */
    table_t *t;
    writer_rec_t *w; /* this process's record in the owner's table: where its pins are counted */
    uint64_t epoch;
    arena_map_t maps[MAX_ARENAS];
};

static int open_peer_fd(int pid, int fd) {
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", pid, fd);
    return open(path, O_RDWR | O_CLOEXEC);
}

int epd_shm_attach(epd_shm_peer **out, const epd_hello *h, int timeout_ms, char *err) {
    int fd = open_peer_fd(h->pid, h->table_fd);
    if (fd < 0)
        return fail(err, EPD_ECONN, "cannot open pid %d's registration table: %s (another host, or no ptrace access)",
                    h->pid, strerror(errno));
    struct stat st;
    table_t *t = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size == sizeof(table_t))
        t = mmap(NULL, sizeof(table_t), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (t == MAP_FAILED) return fail(err, EPD_ECONN, "pid %d's fd %d is not a registration table", h->pid, h->table_fd);
    /* The nonce proves that the process behind the TCP port is the one whose table we mapped. */
    if (t->magic != TABLE_MAGIC || t->nonce != h->nonce || t->pid != h->pid) {
        munmap(t, sizeof(table_t));
        return fail(err, EPD_ECONN, "pid %d's table does not match the peer's HELLO (another host?)", h->pid);
    }
    writer_rec_t *w = writer_claim(t);
    if (!w) {
        munmap(t, sizeof(table_t));
        return fail(err, EPD_ECONN, "pid %d already has %d same-host writers attached", h->pid, MAX_WRITERS);
    }
    epd_shm_peer *p = calloc(1, sizeof(*p));
    if (!p) {
        STORE(&w->state, WRITER_FREE);
        munmap(t, sizeof(table_t));
        return fail(err, EPD_ESYS, "out of memory");
    }
    p->pid = h->pid;
    p->t = t;
    p->w = w;
    p->timeout_ms = timeout_ms;
    p->epoch = LOAD(&t->arena_epoch);
    p->pidfd = (int)syscall(SYS_pidfd_open, h->pid, 0);
    pthread_mutex_init(&p->mu, NULL);
    *out = p;
    return EPD_OK;
}

static void unmap_arena(arena_map_t *m) {
    if (m->local) munmap(m->local, m->length);
    *m = (arena_map_t){0, 0, NULL};
}

void epd_shm_detach(epd_shm_peer *p) {
    if (!p) return;
    for (int i = 0; i < MAX_ARENAS; i++) unmap_arena(&p->maps[i]);
    STORE(&p->w->state, WRITER_FREE); /* no write runs now, so it pins nothing */
    munmap(p->t, sizeof(table_t));
    if (p->pidfd >= 0) close(p->pidfd);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

static int peer_alive(epd_shm_peer *p) {
    if (p->pidfd >= 0) {
        struct pollfd pf = {p->pidfd, POLLIN, 0};
        return poll(&pf, 1, 0) == 0; /* a pidfd becomes readable when the process exits */
    }
    return kill(p->pid, 0) == 0 || errno == EPERM;
}

/* The peer's mapping of the arena that holds slot s; mapped once, dropped when the owner frees it. */
static char *arena_local(epd_shm_peer *p, const slot_t *s, char *err) {
    uint64_t epoch = LOAD(&p->t->arena_epoch);
    if (epoch != p->epoch) {
        for (int i = 0; i < MAX_ARENAS; i++)
            if (p->maps[i].local && (!LOAD(&p->t->arenas[i].live) || p->t->arenas[i].id != p->maps[i].id))
                unmap_arena(&p->maps[i]);
        p->epoch = epoch;
    }
    arena_map_t *m = &p->maps[s->arena_idx];
    if (m->local && m->id == s->arena_id) return m->local;
    unmap_arena(m);
    const arena_rec_t *r = &p->t->arenas[s->arena_idx];
    int fd = open_peer_fd(p->pid, r->fd);
    if (fd < 0) {
        fail(err, EPD_ECONN, "cannot open pid %d's managed buffer: %s", p->pid, strerror(errno));
        return NULL;
    }
    void *local = mmap(NULL, r->length, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    close(fd);
    if (local == MAP_FAILED) {
        fail(err, EPD_ESYS, "cannot map pid %d's managed buffer: %s", p->pid, strerror(errno));
        return NULL;
    }
    *m = (arena_map_t){s->arena_id, r->length, local};
    return local;
}

/* The copy policy (epd_core.h). Read once per write; a write that races a change may use either
 * policy for its blocks, and both place the same bytes. */
static int copy_large = EPD_COPY_STREAM;
static uint64_t copy_large_min = 0;

void epd_copy_policy_set(int large_copy, uint64_t large_min) {
    STORE(&copy_large, large_copy);
    STORE(&copy_large_min, large_min);
}

void epd_copy_policy_get(int *large_copy, uint64_t *large_min) {
    *large_copy = LOAD(&copy_large);
    *large_min = LOAD(&copy_large_min);
}

#if defined(__x86_64__)
/* Prefetching 1 KiB ahead carries the loads across 4 KiB page edges, where the hardware prefetchers
 * stop. Measured on AMD EPYC into a memfd mapping: +10% at 64-256 MiB; 512 B less, 2 KiB no better. */
#define PREFETCH_AHEAD 1024

/* Both loops copy `n` bytes (a multiple of 128) to a 64-byte aligned `dst` in whole cache lines, so
 * that each line's write-combining buffer leaves complete. Compiled for their instructions by
 * attribute and chosen at run time, so the build needs no -march. */
__attribute__((target("avx2"))) static void stream_lines_avx2(char *dst, const char *src, uint64_t n) {
    for (uint64_t i = 0; i < n; i += 128) {
        _mm_prefetch(src + i + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch(src + i + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
        _mm256_stream_si256((__m256i *)(dst + i + 64), c);
        _mm256_stream_si256((__m256i *)(dst + i + 96), d);
    }
}

static void stream_lines_sse2(char *dst, const char *src, uint64_t n) {
    for (uint64_t i = 0; i < n; i += 64) {
        _mm_prefetch(src + i + PREFETCH_AHEAD, _MM_HINT_T0);
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i + 48));
        _mm_stream_si128((__m128i *)(dst + i), a);
        _mm_stream_si128((__m128i *)(dst + i + 16), b);
        _mm_stream_si128((__m128i *)(dst + i + 32), c);
        _mm_stream_si128((__m128i *)(dst + i + 48), d);
    }
}

/* AVX-512 is left out: on AMD EPYC (Zen 4) its 64-byte stores measured no faster than AVX2's, and
 * on Intel parts 512-bit instructions can lower the clock, which is why glibc prefers 256-bit there. */
const char *epd_copy_stream_isa(void) { return __builtin_cpu_supports("avx2") ? "avx2" : "sse2"; }

static void stream_copy(char *dst, const char *src, uint64_t len) {
    uint64_t head = (64 - ((uintptr_t)dst & 63)) & 63;
    if (head > len) head = len;
    memcpy(dst, src, head);
    dst += head, src += head, len -= head;
    uint64_t n = len & ~(uint64_t)127;
    if (__builtin_cpu_supports("avx2")) stream_lines_avx2(dst, src, n);
    else stream_lines_sse2(dst, src, n);
    memcpy(dst + n, src + n, len - n);
}

/* streaming stores are weakly ordered: complete them before the write is reported done */
static void store_fence(void) { _mm_sfence(); }
#else
const char *epd_copy_stream_isa(void) { return ""; }
static void stream_copy(char *dst, const char *src, uint64_t len) { memcpy(dst, src, len); }
static void store_fence(void) {}
#endif

static void copy_raw(int kind, char *dst, const char *src, uint64_t len) {
    if (kind == EPD_COPY_STREAM) stream_copy(dst, src, len);
    else memcpy(dst, src, len);
}

void epd_copy(int kind, void *dst, const void *src, uint64_t len) {
    copy_raw(kind, dst, src, len);
    if (kind == EPD_COPY_STREAM) store_fence();
}

/* The copy for one block of a write of `total` bytes (the policy in epd_core.h). A batch of many
 * blocks (the scattered KV/embedding case) would use glibc's cached stores per block, which read
 * each destination line before writing it; streaming stores skip that read. */
static int block_copy(uint64_t len, uint64_t total, int large, uint64_t large_min) {
    if (total < EPD_STREAM_BATCH_MIN || len < EPD_STREAM_MIN) return EPD_COPY_MEMCPY;
    return len >= large_min ? large : EPD_COPY_STREAM;
}

static int vm_write(epd_shm_peer *p, struct iovec *liov, struct iovec *riov, int cnt, char *err) {
    while (cnt > 0) {
        int k = cnt > IOV_MAX ? IOV_MAX : cnt;
        ssize_t w = process_vm_writev(p->pid, liov, (unsigned long)k, riov, (unsigned long)k, 0);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == ESRCH) return fail(err, EPD_ECONN, "peer pid %d has exited", p->pid);
            return fail(err, EPD_ESYS, "process_vm_writev into pid %d: %s", p->pid, strerror(errno));
        }
        if (w == 0) return fail(err, EPD_ESYS, "process_vm_writev into pid %d made no progress", p->pid);
        /* advance both vectors by w bytes; a partial transfer may stop inside an element */
        while (w > 0) {
            size_t take = (size_t)w < liov->iov_len ? (size_t)w : liov->iov_len;
            liov->iov_base = (char *)liov->iov_base + take;
            liov->iov_len -= take;
            riov->iov_base = (char *)riov->iov_base + take;
            riov->iov_len -= take;
            w -= (ssize_t)take;
            if (liov->iov_len == 0) liov++, riov++, cnt--;
        }
    }
    return EPD_OK;
}

/* A window's end: its streamed stores complete, then its pins go (so no byte lands after a deregister returns). */
static void unpin_window(int32_t **pinned, int npin, int streamed) {
    if (streamed) store_fence();
    for (int i = 0; i < npin; i++) table_release(pinned[i]);
}

/* A same-host write's end: count it in the owner's table when it succeeded; its status. */
static int counted(table_t *t, int rc, int written, uint64_t bytes) {
    if (rc == EPD_OK) {
        ADD(&t->writes_in, (uint64_t)written);
        ADD(&t->bytes_in, bytes);
    }
    return rc;
}

int epd_shm_write(epd_shm_peer *p, const uint64_t *srcs, const uint64_t *dsts, const uint64_t *lens,
                  const uint64_t *keys, int n, char *err) {
    if (!peer_alive(p)) return fail(err, EPD_ECONN, "peer pid %d has exited", p->pid);
    table_t *t = p->t;
    uint64_t total = 0;
    for (int i = 0; i < n; i++) total += lens[i];
    int large, streamed = 0;
    uint64_t large_min;
    epd_copy_policy_get(&large, &large_min);
    int32_t *pinned[WINDOW];
    struct iovec liov[WINDOW], riov[WINDOW];
    int rc = EPD_OK;
    uint64_t bytes = 0;
    int written = 0;
    for (int base = 0; base < n && rc == EPD_OK; base += WINDOW) {
        int m = n - base < WINDOW ? n - base : WINDOW, npin = 0, nvm = 0;
        for (int i = 0; i < m; i++) {
            uint64_t src = srcs[base + i], dst = dsts[base + i], len = lens[base + i];
            slot_t *s = NULL;
            int32_t *pin = len ? table_acquire(t, p->w, dst, len, keys ? keys[base + i] : 0, &s) : NULL;
            if (!pin) {
                ADD(&t->writes_refused, 1);
                rc = fail(err, EPD_EREFUSED,
                          "pid %d refused the write of %lu bytes to 0x%lx: not inside memory it registered%s", p->pid,
                          len, dst, keys && keys[base + i] ? " under that key" : "");
                break;
            }
            pinned[npin++] = pin;
            if (s->kind) {
                pthread_mutex_lock(&p->mu);
                char *local = arena_local(p, s, err);
                pthread_mutex_unlock(&p->mu);
                if (!local) {
                    rc = EPD_ECONN;
                    break;
                }
                int kind = block_copy(len, total, large, large_min);
                streamed |= kind == EPD_COPY_STREAM;
                copy_raw(kind, local + (dst - t->arenas[s->arena_idx].base), (const char *)src, len);
            } else {
                liov[nvm] = (struct iovec){(void *)src, len};
                riov[nvm++] = (struct iovec){(void *)dst, len};
            }
            bytes += len;
            written++;
        }
        /* scattered blocks into memory registered from elsewhere go in one system call */
        if (rc == EPD_OK && nvm) rc = vm_write(p, liov, riov, nvm, err);
        unpin_window(pinned, npin, streamed);
    }
    return counted(t, rc, written, bytes);
}

int epd_shm_write_strided(epd_shm_peer *p, const epd_strided *w, int n, char *err) {
    if (!peer_alive(p)) return fail(err, EPD_ECONN, "peer pid %d has exited", p->pid);
    table_t *t = p->t;
    struct iovec liov[IOV_MAX > 1024 ? 1024 : IOV_MAX], riov[IOV_MAX > 1024 ? 1024 : IOV_MAX];
    const int cap = (int)(sizeof(liov) / sizeof(liov[0]));
    int32_t *pinned[WINDOW];
    uint64_t bytes = 0, total = 0;
    int rc = EPD_OK, written = 0;
    for (int i = 0; i < n; i++) total += w[i].len * w[i].count;
    /* entries pinned a window at a time, with one store fence per window (as epd_shm_write) */
    for (int base = 0; base < n && rc == EPD_OK; base += WINDOW) {
        int m = n - base < WINDOW ? n - base : WINDOW, npin = 0, streamed = 0;
        for (int i = base; i < base + m && rc == EPD_OK; i++) {
            const epd_strided *e = &w[i];
            uint64_t extent = epd_strided_extent(e->len, e->count, e->dst_stride);
            if (!extent) {
                rc = fail(err, EPD_EINVAL, "strided write %d is malformed (%lu x %lu bytes, stride %lu)", i,
                          e->count, e->len, e->dst_stride);
                break;
            }
            slot_t *s = NULL;
            int32_t *pin = table_acquire(t, p->w, e->dst, extent, e->key, &s);
            if (!pin) {
                ADD(&t->writes_refused, 1);
                rc = fail(err, EPD_EREFUSED,
                          "pid %d refused the strided write of %lu x %lu bytes to 0x%lx: not inside memory it "
                          "registered%s", p->pid, e->count, e->len, e->dst, e->key ? " under that key" : "");
                break;
            }
            pinned[npin++] = pin;
            if (s->kind) { /* the peer's managed buffer, mapped here */
                pthread_mutex_lock(&p->mu);
                char *local = arena_local(p, s, err);
                pthread_mutex_unlock(&p->mu);
                if (!local) {
                    rc = EPD_ECONN;
                    break;
                }
                /* a large write's pieces of whole cache-line pairs stream past the cache, as whole blocks do */
                int kind = total >= EPD_STREAM_BATCH_MIN && e->len >= 128 ? EPD_COPY_STREAM : EPD_COPY_MEMCPY;
                streamed |= kind == EPD_COPY_STREAM;
                char *at = local + (e->dst - t->arenas[s->arena_idx].base);
                for (uint64_t k = 0; k < e->count; k++)
                    copy_raw(kind, at + k * e->dst_stride, (const char *)(e->src + k * e->src_stride), e->len);
            } else { /* memory registered from elsewhere: the pieces in system calls of up to `cap` each */
                for (uint64_t k = 0; k < e->count && rc == EPD_OK;) {
                    int j = 0;
                    for (; j < cap && k < e->count; j++, k++) {
                        liov[j] = (struct iovec){(void *)(e->src + k * e->src_stride), e->len};
                        riov[j] = (struct iovec){(void *)(e->dst + k * e->dst_stride), e->len};
                    }
                    rc = vm_write(p, liov, riov, j, err);
                }
            }
            bytes += e->len * e->count;
            written++;
        }
        unpin_window(pinned, npin, streamed);
    }
    return counted(t, rc, written, bytes);
}
