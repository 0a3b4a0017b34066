/* epd_core: the native data paths of epd_lab's transfer engine.
 *
 * Owner side: a registration table that lives in a memfd (so same-host peers can map and check it),
 * managed arenas (memfd memory peers map directly), and a TCP server whose connection threads place
 * incoming writes straight into registered memory after checking them against the table.
 * Writer side: a TCP connection (header + bytes, one reply per write) and a same-host shm peer
 * (memcpy into a mapped arena, process_vm_writev elsewhere), both checking the owner's table.
 *
 * Every function returns 0 or a negative EPD_E* code and writes a sentence into `err` (EPD_ERRLEN).
 * No function here touches Python; all of them may run without the GIL.
 */
#ifndef EPD_CORE_H
#define EPD_CORE_H

#include <stddef.h>
#include <stdint.h>

#define EPD_ERRLEN 320

enum {
    EPD_OK = 0,
    EPD_EINVAL = -1,    /* misuse: zero length, overlap, unknown pointer */
    EPD_EREFUSED = -2,  /* the owner refused a write outside its registrations */
    EPD_ETIMEDOUT = -3, /* no progress within the timeout */
    EPD_ECONN = -4,     /* could not connect, or the peer closed/died */
    EPD_EPROTO = -5,    /* bytes that are not the protocol */
    EPD_ESYS = -6,      /* a system call failed; errno is kept */
    EPD_EBUSY = -7,     /* deregister waited out the timeout for in-flight writes */
    EPD_EAUTH = -8,     /* the shared-secret handshake failed (a wrong or missing secret on either side) */
};

/* wire protocol (little-endian hosts only; checked at build time in epd_core.c) */
#define EPD_WIRE_MAGIC 0x57445045u /* "EPDW" */
#define EPD_WIRE_VERSION 2
enum { EPD_OP_WRITE = 1, EPD_OP_HELLO = 2, EPD_OP_CONTROL = 3, EPD_OP_AUTH = 4, EPD_OP_WRITE_STRIDED = 5 };
enum { EPD_ST_OK = 0, EPD_ST_REFUSED = 1, EPD_ST_BADREQ = 2, EPD_ST_CONTROL_ERR = 3, EPD_ST_NOAUTH = 4,
       EPD_ST_AUTH_REQUIRED = 5 };
#define EPD_CONTROL_MAX (1u << 20)

/* The shared-secret handshake (only when the server has a secret; epd_lab.security says where it comes from).
 * Before any other request the client sends AUTH with its nonce (EPD_NONCE_BYTES); the server answers its own
 * nonce and proof HMAC-SHA256(secret, "EPD-S" | cnonce | snonce); the client checks that proof and sends AUTH
 * with HMAC-SHA256(secret, "EPD-C" | snonce | cnonce); the server checks it and answers OK. Any other request
 * first is answered EPD_ST_AUTH_REQUIRED (its payload unread), so that a writer without the secret learns why,
 * and closes the connection, as a wrong proof does (both counted in auth_failures). A server without a secret
 * answers AUTH with EPD_ST_NOAUTH. Both sides prove the secret, so a writer never sends bytes to an impostor. */
#define EPD_NONCE_BYTES 32
#define EPD_MAC_BYTES 32
#define EPD_SECRET_MAX 256

typedef struct {
    uint32_t magic;
    uint16_t version;
    uint16_t op;
    uint64_t seq;
    uint64_t addr;
    uint64_t length; /* payload bytes that follow */
    uint64_t key;    /* WRITE: the registration's key (the rkey's role); 0 checks bounds only */
} epd_wire_req;

/* WRITE_STRIDED: the header is followed by a uint64 entry count n (1..EPD_STRIDED_MAX), n entries, then the
 * request's `length` payload bytes: entry by entry, piece by piece. Entry i places `count` pieces of `piece_len`
 * bytes at addr + k * stride; the owner checks and pins each entry's extent
 * [addr, addr + (count - 1) * stride + piece_len) (under `key`), and refuses the request as a whole when one
 * lies outside its registrations. One request, one reply, however many pieces. */
#define EPD_STRIDED_MAX 65536
typedef struct {
    uint64_t addr;
    uint64_t piece_len;
    uint64_t count;
    uint64_t stride;
    uint64_t key;
} epd_wire_strided;

typedef struct {
    uint32_t magic;
    int32_t status;
    uint64_t seq;
    uint64_t length; /* payload bytes that follow (HELLO, CONTROL) */
} epd_wire_rep;

typedef struct {
    int32_t pid;
    int32_t table_fd;
    uint64_t nonce;
} epd_hello;

/* ---- owner: table + managed arenas ---- */
typedef struct epd_owner epd_owner;

typedef struct {
    uint64_t addr, length;
    uint32_t kind; /* 0 external (process_vm_writev), 1 inside a managed arena */
} epd_region;

typedef struct {
    uint64_t regions, registered_bytes;
    uint64_t writes_in, bytes_in, writes_refused, writes_in_flight;
    uint64_t managed_arenas, managed_bytes;
    uint64_t deregister_timeouts;
    uint64_t pins_reaped; /* pins dropped because the same-host writer holding them died mid-write */
} epd_owner_stats;

int epd_owner_create(epd_owner **out, int timeout_ms, char *err);
void epd_owner_destroy(epd_owner *o);
int epd_owner_register(epd_owner *o, uint64_t addr, uint64_t length, uint64_t *key_out, char *err);
int epd_owner_deregister(epd_owner *o, uint64_t addr, char *err);
int epd_owner_covers(epd_owner *o, uint64_t addr, uint64_t length);
int epd_owner_alloc_managed(epd_owner *o, uint64_t length, uint64_t *addr_out, char *err);
int epd_owner_free_managed(epd_owner *o, uint64_t addr, char *err);
int epd_owner_regions(epd_owner *o, epd_region *out, int cap);
void epd_owner_stats_get(epd_owner *o, epd_owner_stats *s);
epd_hello epd_owner_hello(epd_owner *o);

/* ---- owner: TCP server ---- */
typedef struct epd_server epd_server;
/* CONTROL requests go to this callback (it may take the GIL); *resp is malloc'ed by the callback. */
typedef int (*epd_control_fn)(void *ctx, const uint8_t *req, uint32_t len, uint8_t **resp, uint32_t *resp_len);

typedef struct {
    int timeout_ms;           /* a started request that makes no progress for this long closes the connection */
    int max_conns;            /* connections served at once (one thread each); more are closed at once. 0: no cap */
    int idle_ms;              /* a connection that sends no request for this long is closed. 0: never */
    const uint8_t *secret;    /* the handshake's shared secret (copied); NULL or secret_len 0: no handshake */
    uint32_t secret_len;      /* at most EPD_SECRET_MAX */
    epd_control_fn control;
    void *control_ctx;
} epd_server_opts;

typedef struct {
    uint64_t conns_active, conns_accepted, conns_refused, conns_idle_closed, auth_failures;
} epd_server_stats;

int epd_server_start(epd_server **out, epd_owner *o, const char *host, int port, const epd_server_opts *opts,
                     char *err);
int epd_server_port(epd_server *s);
void epd_server_stats_get(epd_server *s, epd_server_stats *st);
void epd_server_stop(epd_server *s);

/* ---- writer: TCP connection ---- */
typedef struct epd_conn epd_conn;
/* With a secret (secret_len > 0), the handshake runs before this returns: EPD_EAUTH when it fails. */
int epd_conn_open(epd_conn **out, const char *host, int port, int timeout_ms, const uint8_t *secret,
                  uint32_t secret_len, char *err);
void epd_conn_close(epd_conn *c);
int epd_conn_broken(epd_conn *c);
/* 0 when the peer closed an idle connection (its idle timeout) or it is broken: do not reuse it. */
int epd_conn_alive(epd_conn *c);
int epd_conn_write(epd_conn *c, const uint64_t *srcs, const uint64_t *dsts, const uint64_t *lens,
                   const uint64_t *keys, int n,
                   char *err);
int epd_conn_hello(epd_conn *c, epd_hello *h, char *err);
int epd_conn_control(epd_conn *c, const uint8_t *req, uint32_t len, uint8_t **resp, uint32_t *resp_len,
                     char *err);

/* HMAC-SHA256 (RFC 2104 over FIPS 180-4), for the handshake; exposed for its test against Python's hmac. */
void epd_hmac_sha256(const uint8_t *key, size_t key_len, const uint8_t *msg, size_t msg_len, uint8_t out[32]);

/* ---- the copy into a peer's managed buffer (shm) ----
 * Two copies: glibc's memcpy and a streaming-store (non-temporal) copy. A write whose blocks total at
 * least EPD_STREAM_BATCH_MIN bytes copies each block of at least EPD_STREAM_MIN bytes with streaming
 * stores, except blocks of at least `large_min` bytes, which take `large_copy`. Everything else uses
 * memcpy, which leaves the bytes in the cache for the receiver. The policy is per process; the default
 * streams every such block, and epd_lab.transfer.shm_copy sets it from a measurement. */
enum { EPD_COPY_MEMCPY = 0, EPD_COPY_STREAM = 1 };
#define EPD_STREAM_MIN (4u << 10)
#define EPD_STREAM_BATCH_MIN (4u << 20)
#define EPD_COPY_VERSION 2 /* bump when a copy changes: calibrations cached for the old one are redone */

void epd_copy_policy_set(int large_copy, uint64_t large_min);
void epd_copy_policy_get(int *large_copy, uint64_t *large_min);
/* The instructions the streaming copy uses on this CPU: "avx2", "sse2", or "" (none: it is memcpy). */
const char *epd_copy_stream_isa(void);
/* One copy of `len` bytes (no overlap) by `kind`; its stores are complete (fenced) on return. */
void epd_copy(int kind, void *dst, const void *src, uint64_t len);

/* ---- strided writes ----
 * One entry: `count` pieces of `len` bytes, piece k read at src + k * src_stride and written at
 * dst + k * dst_stride (a head slice of every token of a run of KV blocks). Strides are at least `len` when
 * count > 1, so pieces never overlap; the destination extent is checked against the owner's registrations
 * (and `key`) as one write. */
typedef struct {
    uint64_t src, dst, len, key, count, src_stride, dst_stride;
} epd_strided;

/* The bytes [dst, dst + extent) an entry spans, or 0 when it is malformed (zero length or count, a stride
 * shorter than a piece, an overflow). */
uint64_t epd_strided_extent(uint64_t len, uint64_t count, uint64_t stride);
int epd_conn_write_strided(epd_conn *c, const epd_strided *w, int n, char *err);

/* ---- writer: same-host peer ---- */
typedef struct epd_shm_peer epd_shm_peer;
int epd_shm_attach(epd_shm_peer **out, const epd_hello *h, int timeout_ms, char *err);
void epd_shm_detach(epd_shm_peer *p);
int epd_shm_write(epd_shm_peer *p, const uint64_t *srcs, const uint64_t *dsts, const uint64_t *lens,
                  const uint64_t *keys, int n,
                  char *err);
int epd_shm_write_strided(epd_shm_peer *p, const epd_strided *w, int n, char *err);

#endif
