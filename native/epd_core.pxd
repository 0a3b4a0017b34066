# C declarations of native/epd_core.h, and nothing else.
from libc.stdint cimport int32_t, uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "epd_core.h" nogil:
    enum:
        EPD_ERRLEN
        EPD_OK
        EPD_EINVAL
        EPD_EREFUSED
        EPD_ETIMEDOUT
        EPD_ECONN
        EPD_EPROTO
        EPD_ESYS
        EPD_EBUSY
        EPD_EAUTH
        EPD_WIRE_MAGIC
        EPD_WIRE_VERSION
        EPD_OP_WRITE
        EPD_OP_HELLO
        EPD_OP_CONTROL
        EPD_OP_AUTH
        EPD_ST_OK
        EPD_ST_REFUSED
        EPD_ST_BADREQ
        EPD_ST_CONTROL_ERR
        EPD_ST_NOAUTH
        EPD_ST_AUTH_REQUIRED
        EPD_SECRET_MAX
        EPD_COPY_MEMCPY
        EPD_COPY_STREAM
        EPD_STREAM_MIN
        EPD_STREAM_BATCH_MIN
        EPD_COPY_VERSION

    ctypedef struct epd_wire_req:
        uint32_t magic
        uint16_t version
        uint16_t op
        uint64_t seq, addr, length, key

    ctypedef struct epd_wire_rep:
        uint32_t magic
        int32_t status
        uint64_t seq, length

    ctypedef struct epd_hello:
        int32_t pid
        int32_t table_fd
        uint64_t nonce

    ctypedef struct epd_strided:
        uint64_t src, dst, len, key, count, src_stride, dst_stride

    uint64_t epd_strided_extent(uint64_t length, uint64_t count, uint64_t stride)

    ctypedef struct epd_region:
        uint64_t addr
        uint64_t length
        uint32_t kind

    ctypedef struct epd_owner_stats:
        uint64_t regions, registered_bytes
        uint64_t writes_in, bytes_in, writes_refused, writes_in_flight
        uint64_t managed_arenas, managed_bytes
        uint64_t deregister_timeouts
        uint64_t pins_reaped

    ctypedef struct epd_owner:
        pass
    ctypedef struct epd_server:
        pass
    ctypedef struct epd_conn:
        pass
    ctypedef struct epd_shm_peer:
        pass

    ctypedef int (*epd_control_fn)(void *ctx, const uint8_t *req, uint32_t length, uint8_t **resp,
                                   uint32_t *resp_len) noexcept nogil

    int epd_owner_create(epd_owner **out, int timeout_ms, char *err)
    void epd_owner_destroy(epd_owner *o)
    int epd_owner_register(epd_owner *o, uint64_t addr, uint64_t length, uint64_t *key_out, char *err)
    int epd_owner_deregister(epd_owner *o, uint64_t addr, char *err)
    int epd_owner_covers(epd_owner *o, uint64_t addr, uint64_t length)
    int epd_owner_alloc_managed(epd_owner *o, uint64_t length, uint64_t *addr_out, char *err)
    int epd_owner_free_managed(epd_owner *o, uint64_t addr, char *err)
    int epd_owner_regions(epd_owner *o, epd_region *out, int cap)
    void epd_owner_stats_get(epd_owner *o, epd_owner_stats *s)
    epd_hello epd_owner_hello(epd_owner *o)

    ctypedef struct epd_server_opts:
        int timeout_ms
        int max_conns
        int idle_ms
        const uint8_t *secret
        uint32_t secret_len
        epd_control_fn control
        void *control_ctx

    ctypedef struct epd_server_stats:
        uint64_t conns_active, conns_accepted, conns_refused, conns_idle_closed, auth_failures

    int epd_server_start(epd_server **out, epd_owner *o, const char *host, int port, const epd_server_opts *opts,
                         char *err)
    int epd_server_port(epd_server *s)
    void epd_server_stats_get(epd_server *s, epd_server_stats *st)
    void epd_server_stop(epd_server *s)

    int epd_conn_open(epd_conn **out, const char *host, int port, int timeout_ms, const uint8_t *secret,
                      uint32_t secret_len, char *err)
    void epd_conn_close(epd_conn *c)
    int epd_conn_broken(epd_conn *c)
    int epd_conn_alive(epd_conn *c)
    void epd_hmac_sha256(const uint8_t *key, size_t key_len, const uint8_t *msg, size_t msg_len, uint8_t *out)
    int epd_conn_write(epd_conn *c, const uint64_t *srcs, const uint64_t *dsts, const uint64_t *lens,
                       const uint64_t *keys, int n,
                       char *err)
    int epd_conn_write_strided(epd_conn *c, const epd_strided *w, int n, char *err)
    int epd_conn_hello(epd_conn *c, epd_hello *h, char *err)
    int epd_conn_control(epd_conn *c, const uint8_t *req, uint32_t length, uint8_t **resp, uint32_t *resp_len,
                         char *err)

    void epd_copy_policy_set(int large_copy, uint64_t large_min)
    void epd_copy_policy_get(int *large_copy, uint64_t *large_min)
    const char *epd_copy_stream_isa()
    void epd_copy(int kind, void *dst, const void *src, uint64_t length)

    int epd_shm_attach(epd_shm_peer **out, const epd_hello *h, int timeout_ms, char *err)
    void epd_shm_detach(epd_shm_peer *p)
    int epd_shm_write(epd_shm_peer *p, const uint64_t *srcs, const uint64_t *dsts, const uint64_t *lens,
                      const uint64_t *keys, int n,
                      char *err)
    int epd_shm_write_strided(epd_shm_peer *p, const epd_strided *w, int n, char *err)
