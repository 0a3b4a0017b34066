# C declarations of libibverbs used by epd_lab._verbs, and nothing else (the pyverbs layout).
# Structs list only the fields this binding touches; Cython needs no more to access them.
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "<endian.h>" nogil:
    # GUIDs come in network byte order (__be64).
    uint64_t be64toh(uint64_t big_endian_64bits)


cdef extern from "infiniband/verbs.h" nogil:

    cdef enum ibv_mtu:
        IBV_MTU_256
        IBV_MTU_512
        IBV_MTU_1024
        IBV_MTU_2048
        IBV_MTU_4096

    cdef enum ibv_port_state:
        IBV_PORT_NOP
        IBV_PORT_DOWN
        IBV_PORT_INIT
        IBV_PORT_ARMED
        IBV_PORT_ACTIVE
        IBV_PORT_ACTIVE_DEFER

    enum:
        IBV_LINK_LAYER_UNSPECIFIED
        IBV_LINK_LAYER_INFINIBAND
        IBV_LINK_LAYER_ETHERNET

    cdef enum ibv_access_flags:
        IBV_ACCESS_LOCAL_WRITE
        IBV_ACCESS_REMOTE_WRITE
        IBV_ACCESS_REMOTE_READ
        IBV_ACCESS_REMOTE_ATOMIC

    cdef enum ibv_qp_type:
        IBV_QPT_RC

    cdef enum ibv_qp_state:
        IBV_QPS_RESET
        IBV_QPS_INIT
        IBV_QPS_RTR
        IBV_QPS_RTS
        IBV_QPS_SQD
        IBV_QPS_SQE
        IBV_QPS_ERR

    cdef enum ibv_qp_attr_mask:
        IBV_QP_STATE
        IBV_QP_ACCESS_FLAGS
        IBV_QP_PKEY_INDEX
        IBV_QP_PORT
        IBV_QP_AV
        IBV_QP_PATH_MTU
        IBV_QP_TIMEOUT
        IBV_QP_RETRY_CNT
        IBV_QP_RNR_RETRY
        IBV_QP_RQ_PSN
        IBV_QP_MAX_QP_RD_ATOMIC
        IBV_QP_MIN_RNR_TIMER
        IBV_QP_SQ_PSN
        IBV_QP_MAX_DEST_RD_ATOMIC
        IBV_QP_DEST_QPN

    cdef enum ibv_wr_opcode:
        IBV_WR_RDMA_WRITE

    cdef enum ibv_send_flags:
        IBV_SEND_SIGNALED

    cdef enum ibv_wc_status:
        IBV_WC_SUCCESS
        IBV_WC_WR_FLUSH_ERR
        IBV_WC_REM_ACCESS_ERR
        IBV_WC_RETRY_EXC_ERR

    cdef union ibv_gid:
        uint8_t raw[16]

    cdef struct ibv_device:
        pass

    cdef struct ibv_context:
        ibv_device *device

    cdef struct ibv_device_attr:
        char fw_ver[64]
        uint64_t max_mr_size
        int max_qp
        int max_qp_wr
        int max_cqe
        uint8_t phys_port_cnt

    cdef struct ibv_port_attr:
        ibv_port_state state
        ibv_mtu max_mtu
        ibv_mtu active_mtu
        int gid_tbl_len
        uint32_t max_msg_sz
        uint16_t lid
        uint8_t link_layer

    cdef struct ibv_pd:
        ibv_context *context

    cdef struct ibv_mr:
        void *addr
        size_t length
        uint32_t lkey
        uint32_t rkey

    cdef struct ibv_cq:
        int cqe

    cdef struct ibv_comp_channel:
        pass

    cdef struct ibv_srq:
        pass

    cdef struct ibv_qp:
        uint32_t qp_num
        ibv_qp_state state

    cdef struct ibv_qp_cap:
        uint32_t max_send_wr
        uint32_t max_recv_wr
        uint32_t max_send_sge
        uint32_t max_recv_sge
        uint32_t max_inline_data

    cdef struct ibv_qp_init_attr:
        void *qp_context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        ibv_srq *srq
        ibv_qp_cap cap
        ibv_qp_type qp_type
        int sq_sig_all

    cdef struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class

    cdef struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t src_path_bits
        uint8_t static_rate
        uint8_t is_global
        uint8_t port_num

    cdef struct ibv_qp_attr:
        ibv_qp_state qp_state
        ibv_mtu path_mtu
        uint32_t rq_psn
        uint32_t sq_psn
        uint32_t dest_qp_num
        unsigned int qp_access_flags
        ibv_ah_attr ah_attr
        uint16_t pkey_index
        uint8_t max_rd_atomic
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer
        uint8_t port_num
        uint8_t timeout
        uint8_t retry_cnt
        uint8_t rnr_retry

    cdef struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey

    # The anonymous `wr.rdma` member of ibv_send_wr; these two names exist only for Cython
    # (never declare a variable of these types: C has no such names).
    cdef struct _ibv_send_wr_rdma:
        uint64_t remote_addr
        uint32_t rkey

    cdef union _ibv_send_wr_wr:
        _ibv_send_wr_rdma rdma

    cdef struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr *next
        ibv_sge *sg_list
        int num_sge
        ibv_wr_opcode opcode
        unsigned int send_flags
        _ibv_send_wr_wr wr

    cdef struct ibv_wc:
        uint64_t wr_id
        ibv_wc_status status
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t qp_num

    ibv_device **ibv_get_device_list(int *num_devices)
    void ibv_free_device_list(ibv_device **list)
    const char *ibv_get_device_name(ibv_device *device)
    uint64_t ibv_get_device_guid(ibv_device *device)
    ibv_context *ibv_open_device(ibv_device *device)
    int ibv_close_device(ibv_context *context)
    int ibv_query_device(ibv_context *context, ibv_device_attr *device_attr)
    # A macro over ___ibv_query_port in rdma-core >= 17; the call compiles against either form.
    int ibv_query_port(ibv_context *context, uint8_t port_num, ibv_port_attr *port_attr)
    int ibv_query_gid(ibv_context *context, uint8_t port_num, int index, ibv_gid *gid)
    const char *ibv_wc_status_str(ibv_wc_status status)

    ibv_pd *ibv_alloc_pd(ibv_context *context)
    int ibv_dealloc_pd(ibv_pd *pd)
    # A macro over __ibv_reg_mr in newer headers; same call either way.
    ibv_mr *ibv_reg_mr(ibv_pd *pd, void *addr, size_t length, int access)
    int ibv_dereg_mr(ibv_mr *mr)

    ibv_cq *ibv_create_cq(ibv_context *context, int cqe, void *cq_context,
                          ibv_comp_channel *channel, int comp_vector)
    int ibv_destroy_cq(ibv_cq *cq)
    # static inline: a call through the provider's ops table, no system call.
    int ibv_poll_cq(ibv_cq *cq, int num_entries, ibv_wc *wc)

    ibv_qp *ibv_create_qp(ibv_pd *pd, ibv_qp_init_attr *qp_init_attr)
    int ibv_destroy_qp(ibv_qp *qp)
    int ibv_modify_qp(ibv_qp *qp, ibv_qp_attr *attr, int attr_mask)
    # static inline, like ibv_poll_cq.
    int ibv_post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad_wr)
