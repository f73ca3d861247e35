"""A fault-injecting HTTP proxy on loopback, between an S3 client and the moto server.

    with FaultProxy(upstream=s3.endpoint_url, rules=[FaultRule("503", WRITES, first=2)]) as p:
        run a job with storage_options={**s3.storage_options, "endpoint_url": p.url}
        p.attempts("PUT", "/results/")  # how many requests the client really sent

Each request is matched against the rules in order; the first rule that matches and
fires decides its fate:

    reset   the connection is closed with an RST before any response (a dead server)
    500     an S3 `InternalError` XML body with status 500
    503     an S3 `SlowDown` XML body with status 503 (throttling)
    stall   nothing is answered for `stall_s` seconds (past the client's read timeout),
            then the connection is reset

A rule fires for the first `first` requests it matches, or with `probability` (drawn
from the proxy's seeded generator, so a run is reproducible). Requests that no rule
fires on are forwarded unchanged (SigV4 signs the Host header, so it is kept as is).
"""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

READS = frozenset({"GET", "HEAD"})
WRITES = frozenset({"PUT", "POST", "DELETE"})
ALL = READS | WRITES
KINDS = ("reset", "500", "503", "stall")

_ERROR_BODIES = {
    "500": ("InternalError", "We encountered an internal error. Please try again."),
    "503": ("SlowDown", "Please reduce your request rate."),
}
# Hop-by-hop headers are the proxy's own business; the body is re-sent with a length.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length"})


@dataclass
class FaultRule:
    """Which requests fail, and how.

    Args:
        kind: one of KINDS.
        methods: HTTP methods the rule applies to (READS, WRITES or ALL).
        first: fire on the first `first` matching requests (None: use `probability`).
        probability: fire on each matching request with this probability.
        path_contains: only requests whose path contains this text (e.g. "/results/").
        stall_s: how long a stall holds the request before resetting it.
    """

    kind: str
    methods: frozenset[str] = ALL
    first: int | None = None
    probability: float = 0.0
    path_contains: str = ""
    stall_s: float = 3.0
    num_matched: int = field(default=0, init=False)
    num_fired: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.first is None and not 0.0 < self.probability <= 1.0:
            raise ValueError("give first=K or a probability in (0, 1]")

    def matches(self, method: str, path: str) -> bool:
        return method in self.methods and self.path_contains in path

    def fires(self, rng: random.Random) -> bool:
        """Counts one matching request and says whether the fault hits it."""
        self.num_matched += 1
        if self.first is not None:
            hit = self.num_matched <= self.first
        else:
            hit = rng.random() < self.probability
        self.num_fired += hit
        return hit


@dataclass(frozen=True)
class Exchange:
    """One request the proxy saw: what it was and what it did with it."""

    method: str
    path: str
    outcome: str  # "forwarded:<status>" or a fault kind


class FaultProxy:
    """A threaded HTTP proxy that forwards to `upstream` and injects `rules`' faults."""

    def __init__(self, upstream: str, rules: Iterable[FaultRule] = (), *, seed: int = 0):
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.rules = list(rules)
        self.exchanges: list[Exchange] = []
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True  # stalled handlers must not hold up stop()
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._server.shutdown()
        self._server.server_close()

    def set_rules(self, rules: Iterable[FaultRule]) -> None:
        with self._lock:
            self.rules = list(rules)

    def decide(self, method: str, path: str) -> FaultRule | None:
        """The rule that fires on this request, if any (thread-safe, in arrival order)."""
        with self._lock:
            for rule in self.rules:
                if rule.matches(method, path) and rule.fires(self._rng):
                    return rule
        return None

    def record(self, method: str, path: str, outcome: str) -> None:
        with self._lock:
            self.exchanges.append(Exchange(method, path, outcome))

    def attempts(self, method: str | None = None, path_contains: str = "") -> int:
        """Requests seen (faulted or forwarded) with this method and path text."""
        with self._lock:
            return sum(
                1
                for e in self.exchanges
                if (method is None or e.method == method) and path_contains in e.path
            )

    def faults(self) -> int:
        with self._lock:
            return sum(1 for e in self.exchanges if not e.outcome.startswith("forwarded"))


def _handler_for(proxy: FaultProxy) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(_ProxyHandler):
        owner = proxy

    return Handler


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect
    owner: FaultProxy

    def setup(self) -> None:
        super().setup()
        # Headers and body go out in separate writes: without NODELAY, Nagle's algorithm
        # and the client's delayed ACK hold each response back by ~40 ms.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base's name
        pass  # the exchanges list is the log

    def do_GET(self) -> None:
        self._handle()

    do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

    def _handle(self) -> None:
        body = self._read_body()
        rule = self.owner.decide(self.command, self.path)
        if rule is None:
            status = self._forward(body)
            self.owner.record(self.command, self.path, f"forwarded:{status}")
            return
        self.owner.record(self.command, self.path, rule.kind)
        if rule.kind == "stall":
            time.sleep(rule.stall_s)
            self._reset()
        elif rule.kind == "reset":
            self._reset()
        else:
            self._send_error(rule.kind)

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _forward(self, body: bytes) -> int:
        conn = http.client.HTTPConnection(*self.owner.upstream, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            if body or self.command in ("PUT", "POST"):
                headers["Content-Length"] = str(len(body))
            conn.request(self.command, self.path, body=body, headers=headers)
            response = conn.getresponse()
            payload = response.read()
            self.send_response(response.status, response.reason)
            for key, value in response.getheaders():
                if key.lower() not in _HOP_HEADERS:
                    self.send_header(key, value)
            # A HEAD answer announces the object's length but carries no body.
            length = response.getheader("Content-Length") if self.command == "HEAD" else None
            self.send_header("Content-Length", length or str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            return response.status
        finally:
            conn.close()

    def _send_error(self, kind: str) -> None:
        code, message = _ERROR_BODIES[kind]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            f"<RequestId>{uuid.uuid4().hex[:16]}</RequestId></Error>"
        ).encode()
        self.send_response(int(kind))
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _reset(self) -> None:
        # SO_LINGER with a zero timeout makes close() send RST instead of FIN.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close_connection = True
        self.connection.close()
