"""P→D: the paged KV cache and its transfer from prefill to decode (seed 003, Mooncake's vLLM v1 connector).

- `block_manager`: `BlockManager`, the free list of a cache's blocks.
- `paged_cache`: `PagedKVCache`, per layer K and V as blocks, registered with the engine once
  (`register_kv_caches`).
- `transfer`: block ids → merged (src, dst, length) runs (`group_concurrent_contiguous`, `block_copies`).
- `messages`: `MooncakeAgentMetadata`, `TransDone`, `TransError` and their codec.
- `connector`: `KVProducer` (prefill, ZMQ ROUTER: `request_finished`, `_handle_handshake`, `send_kv_to_decode`,
  `_send_blocks`) and `KVConsumer` (decode, REQ: `receive_kv`), under the seed's names.
"""
from epd_lab.kv.block_manager import BlockManager, OutOfBlocks, blocks_needed
from epd_lab.kv.connector import KVAuthenticationError, KVConsumer, KVProducer, KVTransferError
from epd_lab.kv.messages import MooncakeAgentMetadata, TransDone, TransError
from epd_lab.kv.paged_cache import PagedKVCache
from epd_lab.kv.runs import BlockCopies, block_copies, group_concurrent_contiguous

__all__ = [
    "BlockCopies",
    "KVAuthenticationError",
    "BlockManager",
    "KVConsumer",
    "KVProducer",
    "KVTransferError",
    "MooncakeAgentMetadata",
    "OutOfBlocks",
    "PagedKVCache",
    "TransDone",
    "TransError",
    "block_copies",
    "blocks_needed",
    "group_concurrent_contiguous",
]
