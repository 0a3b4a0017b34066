"""The package's own HTTP/1.1 clients, kept-alive, each request one send and its answer parsed by httptools.

- `client`: `KeepAliveClient`, for the synchronous hops (the prefill's receiver → encoders); the request bytes
  and header lines both clients write.
- `aio`: `AsyncHTTPClient`, the same on asyncio: the proxy's and the front's calls to their backends.
"""
