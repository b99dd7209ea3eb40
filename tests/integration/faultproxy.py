"""A fault-injecting HTTP/1.1 proxy for DynamoDB tests, standard library only.

It listens on 127.0.0.1 (port chosen by the OS), forwards each request to an upstream
DynamoDB-compatible endpoint (dynalite) over a kept-alive connection, and on the way
applies faults that the test schedules at run time:

    p = FaultProxy("http://127.0.0.1:4567").start()
    p.push("throttle", n=3, op="BatchWriteItem")  # the next 3 BatchWriteItem calls
    p.push("slow", ms=800)                          # then one slow request of any kind
    p.set_probability("500", 0.2)                   # and 20% of the rest fail with 500
    p.set_down(True); ...; p.set_down(False)        # refuse connections, then come back
    p.counts["throttle"], p.counts["forwarded"], p.log

Fault kinds (FAULTS): throttle, 500, 503, unprocessed, slow, hang, refuse, drop, garbage,
damaged, credentials, expired_token, validation, not_found. garbage forwards the request, then
answers 200 with an HTML page instead of DynamoDB's JSON (a captive portal or a broken
middlebox): the write happened, its answer cannot be read. damaged forwards the request and
answers the upstream's answer with bytes of its body replaced (push's sub: every occurrence of
sub[0] becomes sub[1]) but the x-amz-crc32 of the body as the upstream sent it (a bad link or
middlebox that alters an answer and leaves it well-formed). The queue is looked at first (first entry whose
op matches), then the probabilities. Clients may keep connections alive; the proxy keeps
one upstream connection per client connection.
"""
import http.client
import http.server
import json
import random
import select
import socket
import socketserver
import sys
import threading
import time
import traceback
import urllib.parse
import uuid
import zlib

DDB = "com.amazonaws.dynamodb.v20120810#"
CORAL = "com.amazon.coral.service#"

# Synthesized error answers: fault -> (HTTP status, __type, message).
ERRORS = {
    "throttle": (400, DDB + "ProvisionedThroughputExceededException",
                 "The level of configured provisioned throughput for the table was exceeded. "
                 "Consider increasing your provisioning level with the UpdateTable API."),
    "500": (500, DDB + "InternalServerError", "Internal server error (injected)"),
    "503": (503, DDB + "ServiceUnavailable", "Service unavailable (injected)"),
    "credentials": (400, CORAL + "UnrecognizedClientException",
                    "The security token included in the request is invalid."),
    "expired_token": (400, CORAL + "ExpiredTokenException",
                      "The security token included in the request is expired"),
    "validation": (400, "com.amazon.coral.validate#ValidationException",
                   "One or more parameter values were invalid (injected)"),
    # What DynamoDB answers for a table it does not know, and for a few seconds for one it
    # has just created (DescribeTable is eventually consistent).
    "not_found": (400, DDB + "ResourceNotFoundException",
                  "Requested resource not found (injected)"),
}
FAULTS = tuple(ERRORS) + ("unprocessed", "slow", "hang", "refuse", "drop", "garbage", "damaged")
GARBAGE = b"<html><head><title>Sign in</title></head><body>Wi-Fi login</body></html>\n"

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate",
              "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade",
              "expect", "content-length"}


class _Rule:
    __slots__ = ("fault", "n", "op", "ms", "p", "sub")

    def __init__(self, fault, n, op, ms, p, sub=None):
        if fault not in FAULTS:
            raise ValueError("unknown fault %r (known: %s)" % (fault, ", ".join(FAULTS)))
        self.fault, self.n, self.op, self.ms, self.p, self.sub = fault, n, op, ms, p, sub

    def matches(self, op):
        if self.fault == "unprocessed" and op != "BatchWriteItem":
            return False  # only a BatchWriteItem can leave items unprocessed
        return self.op is None or self.op == op


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr, proxy):
        self.proxy = proxy
        super().__init__(addr, _Handler)

    def handle_error(self, request, client_address):
        # A client that went away mid-request is normal here; anything else is kept
        # in proxy.errors for the test to look at instead of being printed.
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, socket.timeout, BrokenPipeError)):
            return
        self.proxy._count("handler_errors")
        with self.proxy._lock:
            self.proxy.errors.append(traceback.format_exc())


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "faultproxy"
    sys_version = ""
    # Headers and body are two writes: with Nagle the body waited for the client's delayed
    # ACK of the headers, 40 ms an answer.
    disable_nagle_algorithm = True

    def log_message(self, fmt, *args):  # quiet: the counters and log say what happened
        pass

    def setup(self):
        super().setup()
        self.proxy = self.server.proxy
        self.upstream = None
        self.proxy._track(self.connection, True)

    def finish(self):
        try:
            super().finish()
        except OSError:
            pass
        if self.upstream is not None:
            self.upstream.close()
        self.proxy._track(self.connection, False)

    # One request. Anything not POST is forwarded untouched (dynalite answers it).
    def do_GET(self):
        self._one(b"")

    def do_POST(self):
        try:
            body = self._read_body()
        except (ValueError, OSError):
            self.close_connection = True
            return
        self._one(body)

    def _read_body(self):
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = b""
            while True:
                size = int(self.rfile.readline().split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return out
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(n) if n else b""
        if len(data) != n:
            raise ValueError("short body")
        return data

    def _one(self, body):
        p = self.proxy
        target = self.headers.get("X-Amz-Target", "")
        op = target.rsplit(".", 1)[-1] if target else ""
        p._count("requests")
        p._count("op:" + (op or "-"))
        if op == "BatchWriteItem":
            try:
                n = sum(len(v) for v in json.loads(body)["RequestItems"].values())
            except (ValueError, KeyError, TypeError, AttributeError):
                n = None
            with p._lock:
                p._batch_sizes.append(n)
        if p._blackhole:
            p._count("blackholed")
            p._record(op, "blackhole")
            self._hang()
            return
        rule = p._next_fault(op)
        fault = rule.fault if rule else None
        p._record(op, fault)
        if fault is None:
            self._forward(body)
            return
        p._count(fault)
        if fault in ERRORS:
            status, type_, msg = ERRORS[fault]
            self._answer(status, json.dumps({"__type": type_, "message": msg}).encode())
        elif fault == "slow":
            if not p._stopping.wait((rule.ms if rule.ms is not None else 1000) / 1000.0):
                self._forward(body)
            else:
                self.close_connection = True
        elif fault == "hang":
            self._hang()
        elif fault == "refuse":
            self._abort()
        elif fault == "drop":
            self._forward(body, send=False)
            self._abort()
        elif fault == "unprocessed":
            self._unprocessed(body)
        elif fault == "garbage":
            self._forward(body, send=False)
            self._answer(200, GARBAGE, [("Content-Type", "text/html")])
        elif fault == "damaged":
            r = self._forward(body, send=False)
            if r is not None:
                old, new = rule.sub or (b"e", b"E")
                self._answer(r[0], r[2].replace(old, new), r[1], crc32=zlib.crc32(r[2]))

    def _answer(self, status, body, headers=None, crc32=None):
        """Sends an answer the way DynamoDB does (JSON, request id, CRC32 of the body, or
        crc32 when given)."""
        self.send_response(status)
        sent = set()
        for name, value in headers or []:
            if name.lower() in HOP_BY_HOP or name.lower() in ("x-amz-crc32", "date", "server"):
                continue
            self.send_header(name, value)
            sent.add(name.lower())
        if "content-type" not in sent:
            self.send_header("Content-Type", "application/x-amz-json-1.0")
        if "x-amzn-requestid" not in sent:
            self.send_header("x-amzn-RequestId", uuid.uuid4().hex.upper())
        self.send_header("x-amz-crc32", str(zlib.crc32(body) if crc32 is None else crc32))
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:
            self.close_connection = True

    def _abort(self):
        """Closes the client connection without an answer."""
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _hang(self):
        """Never answers: waits until the client closes (or the proxy stops)."""
        self.close_connection = True
        while not self.proxy._stopping.is_set():
            try:
                r, _, _ = select.select([self.connection], [], [], 0.1)
                if r and not self.connection.recv(65536):
                    return
            except OSError:
                return

    def _upstream_call(self, body):
        """Forwards the request; returns (status, headers, body) or None when the
        upstream could not be reached."""
        p = self.proxy
        for attempt in (0, 1):  # a kept-alive upstream connection may have been closed
            if self.upstream is None:
                self.upstream = http.client.HTTPConnection(p._up_host, p._up_port,
                                                           timeout=p.upstream_timeout)
            try:
                self.upstream.putrequest(self.command, self.path, skip_host=True,
                                         skip_accept_encoding=True)
                for name, value in self.headers.items():
                    if name.lower() not in HOP_BY_HOP:
                        self.upstream.putheader(name, value)
                self.upstream.putheader("Content-Length", str(len(body)))
                self.upstream.endheaders(body)
                resp = self.upstream.getresponse()
                data = resp.read()
                if resp.will_close:
                    self.upstream.close()
                    self.upstream = None
                return resp.status, resp.getheaders(), data
            except (OSError, http.client.HTTPException):
                self.upstream.close()
                self.upstream = None
                if attempt:
                    return None
        return None

    def _forward(self, body, send=True):
        r = self._upstream_call(body)
        if r is None:
            self.proxy._count("upstream_errors")
            if send:
                self._answer(502, b'{"message":"faultproxy: upstream unreachable"}')
            return None
        self.proxy._count("forwarded")
        if send:
            self._answer(r[0], r[2], r[1])
        return r

    def _unprocessed(self, body):
        """Writes only the first half of a BatchWriteItem's requests and hands the rest
        back as UnprocessedItems. Other operations are forwarded untouched."""
        try:
            doc = json.loads(body)
            items = doc["RequestItems"]
            flat = [(t, w) for t, ws in items.items() for w in ws]
        except (ValueError, KeyError, TypeError, AttributeError):
            flat = []
        if not flat:  # malformed or empty: let the upstream judge it
            self._forward(body)
            return
        keep = len(flat) // 2  # at least one item is always handed back
        sent, back = {}, {}
        for i, (t, w) in enumerate(flat):
            (sent if i < keep else back).setdefault(t, []).append(w)
        unprocessed = {}
        headers = None
        if sent:
            doc["RequestItems"] = sent
            r = self._upstream_call(json.dumps(doc).encode())
            if r is None:
                self.proxy._count("upstream_errors")
                self._answer(502, b'{"message":"faultproxy: upstream unreachable"}')
                return
            status, headers, data = r
            self.proxy._count("forwarded")
            if status != 200:
                self._answer(status, data, headers)
                return
            unprocessed = json.loads(data).get("UnprocessedItems") or {}
        for t, ws in back.items():
            unprocessed.setdefault(t, []).extend(ws)
        self.proxy._count("unprocessed_items", len(flat) - keep)
        self._answer(200, json.dumps({"UnprocessedItems": unprocessed}).encode(), headers)


class FaultProxy:
    """See the module comment. url, push(), set_probability(), clear(), set_down(),
    counts (a copy), log (list of (op, fault or None)), stop()."""

    def __init__(self, upstream, seed=0, upstream_timeout=30.0):
        u = urllib.parse.urlsplit(upstream)
        if u.scheme != "http" or not u.hostname:
            raise ValueError("upstream must be http://host:port, not %r" % upstream)
        self._up_host, self._up_port = u.hostname, u.port or 80
        self.upstream_timeout = upstream_timeout
        self._lock = threading.Lock()
        self._queue = []
        self._probs = []
        self._rand = random.Random(seed)
        self._counts = {}
        self._log = []
        self._batch_sizes = []
        self._times = []  # time.monotonic() of each entry of _log
        self.errors = []  # tracebacks of unexpected handler failures
        self._conns = set()
        self._stopping = threading.Event()
        self._server = None
        self._thread = None
        self._blackhole = False
        self._up_timer = None
        self.port = 0

    # --- life ---

    def start(self):
        self._listen()
        return self

    def _listen(self):
        self._server = _Server(("127.0.0.1", self.port), self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def _unlisten(self):
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None

    def stop(self):
        """Stops listening and closes every client connection (hung ones too)."""
        if self._up_timer:
            self._up_timer.cancel()
        self._stopping.set()
        self._unlisten()
        self._close_all()

    @property
    def url(self):
        return "http://127.0.0.1:%d" % self.port

    # --- schedule ---

    def push(self, fault, n=1, op=None, ms=None, sub=None):
        """Queues fault for the next n requests of operation op (all when None).
        ms: the delay of "slow" (default 1000); sub: the (old, new) bytes of "damaged"
        (default (b"e", b"E"))."""
        with self._lock:
            self._queue.append(_Rule(fault, n, op, ms, None, sub))
        return self

    def set_probability(self, fault, p, op=None, ms=None):
        """From now on, fault hits each matching request with probability p (0 removes)."""
        with self._lock:
            self._probs = [r for r in self._probs if not (r.fault == fault and r.op == op)]
            if p > 0:
                self._probs.append(_Rule(fault, None, op, ms, p))
        return self

    def clear(self):
        """Forgets every queued fault and probability."""
        with self._lock:
            self._queue.clear()
            self._probs.clear()

    @property
    def pending(self):
        """How many queued faults are still to be applied."""
        with self._lock:
            return sum(r.n for r in self._queue)

    def _next_fault(self, op):
        with self._lock:
            for r in self._queue:
                if r.matches(op):
                    r.n -= 1
                    if r.n <= 0:
                        self._queue.remove(r)
                    return r
            for r in self._probs:
                if r.matches(op) and self._rand.random() < r.p:
                    return r
        return None

    # --- down / up ---

    def set_down(self, down, seconds=None, mode="refuse"):
        """down=True: mode "refuse" closes the listening socket and every open connection
        (clients get connection refused); mode "blackhole" keeps accepting but answers
        nothing. seconds: come back up by itself after that long. down=False: listen
        again on the same port."""
        if self._up_timer:
            self._up_timer.cancel()
            self._up_timer = None
        if down:
            self._count("down")
            if mode == "blackhole":
                self._blackhole = True
            elif mode == "refuse":
                self._unlisten()
                self._close_all()
            else:
                raise ValueError("mode must be refuse or blackhole")
            if seconds is not None:
                self._up_timer = threading.Timer(seconds, self.set_down, (False,))
                self._up_timer.daemon = True
                self._up_timer.start()
        else:
            if self._blackhole:
                self._blackhole = False
                self._close_all()  # the hung requests fail, as on a real outage
            if self._server is None and not self._stopping.is_set():
                for _ in range(100):  # the port can take a moment to be free again
                    try:
                        self._listen()
                        break
                    except OSError:
                        time.sleep(0.05)
                else:
                    raise RuntimeError("faultproxy could not listen on port %d again"
                                       % self.port)

    @property
    def down(self):
        return self._server is None or self._blackhole

    # --- bookkeeping ---

    def _track(self, conn, add):
        with self._lock:
            if add:
                self._conns.add(conn)
                self._counts["connections"] = self._counts.get("connections", 0) + 1
            else:
                self._conns.discard(conn)

    def _close_all(self):
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _count(self, key, n=1):
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + n

    def _record(self, op, fault):
        with self._lock:
            self._log.append((op, fault))
            self._times.append(time.monotonic())

    @property
    def counts(self):
        """A copy of the counters: requests, forwarded, connections, op:<Operation>,
        one per fault kind applied, unprocessed_items, upstream_errors, down."""
        with self._lock:
            return dict(self._counts)

    @property
    def open_connections(self):
        """How many client connections the proxy holds open right now."""
        with self._lock:
            return len(self._conns)

    def count(self, key):
        with self._lock:
            return self._counts.get(key, 0)

    @property
    def batch_sizes(self):
        """The items of every BatchWriteItem seen, in order (None: an unreadable body)."""
        with self._lock:
            return list(self._batch_sizes)

    @property
    def log(self):
        """(operation, fault or None) for every request seen, in order."""
        with self._lock:
            return list(self._log)

    @property
    def timed_log(self):
        """(time.monotonic() when the request was read, operation, fault or None) for every
        request seen, in order."""
        with self._lock:
            return [(t, op, f) for t, (op, f) in zip(self._times, self._log)]
