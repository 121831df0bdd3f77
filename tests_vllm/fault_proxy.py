"""A fault-injecting HTTP proxy in front of a real vLLM OpenAI-compatible server (stdlib only).

Every request goes to the proxy's rule (tests_vllm/vllm_faults.py: the same catalogue and the same
serving code as the main suite's vLLM stand-in); an honest one is forwarded to the real server and its
reply passed on byte for byte, a faulted one is dropped, refused, stalled, or forwarded and its reply
altered or cut. `proxy.seen` / `proxy.injected()` say what it did to each request, for comparing with a
client's ledger.
"""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

from tests_vllm.vllm_faults import FaultyHandler, FaultyServer, error_body


class FaultProxy(FaultyServer):
    """Listens on a free loopback port and forwards to `upstream` (http://host:port); `yes_ids` are the
    served model's yes labels (the faults that alter them)."""

    def __init__(self, upstream: str, yes_ids: list[int], upstream_timeout_s: float = 300.0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        # Longer than any client's bound in the tests: the proxy's own wait must not be a fault of its own.
        self.upstream_timeout_s = upstream_timeout_s
        super().__init__(_Forward, yes_ids)


class _Forward(FaultyHandler):
    server: FaultProxy

    def honest(self, path: str, body: dict | None) -> tuple[int, dict | bytes]:
        host, port = self.server.upstream
        # A connection per request: the handler's threads share nothing, and a stalled client's request
        # never holds a connection another request would wait for.
        conn = http.client.HTTPConnection(host, port, timeout=self.server.upstream_timeout_s)
        try:
            if body is None:
                conn.request(self.command, path)
            else:  # the client's bytes as they came, not a re-encoding of them
                conn.request(self.command, path, self.raw, {"Content-Type": "application/json"})
            reply = conn.getresponse()
            return reply.status, reply.read()
        except OSError as e:  # the server is gone: what a proxy says then
            return 502, error_body(502, f"the upstream server at {host}:{port}: {e}")
        finally:
            conn.close()
