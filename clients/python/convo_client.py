"""Python client of convod, the conversation daemon (standard library only).

convod keeps LLM conversations for voice assistants and speaks newline-delimited JSON
over a Unix stream socket (wire protocol v1, ``proto/`` and ``protocol.md``). This module
wraps that protocol:

- :class:`ConvoClient` has one typed method per operation (``add_user``,
  ``get_messages``, ``get_summary_info``, ``add_summary``, ...). Each sends one request,
  waits for its answer and returns the ``result`` object, or raises :class:`ConvoError`
  with the daemon's error ``code`` and ``message``.
- :meth:`ConvoClient.batch` sends many requests at once (pipelining) and returns every
  response, errors included, in request order.
- :meth:`ConvoClient.summarize` runs the whole summary round trip safely: it passes the
  ``versions`` from ``get_summary_info`` back to ``add_summary``, so a message that was
  merged into while the summary was being written makes the daemon refuse the summary
  with ``conflict`` instead of summarizing it without its new contents.

Example::

    from convo_client import ConvoClient, ConvoError

    with ConvoClient("/run/convod/convod.sock") as client:
        client.add_user("call-42", "Hi")
        client.add_assistant("call-42", ["Hello!", "How can I help?"])
        view = client.get_messages("call-42", format="bedrock")["messages"]
        try:
            client.summarize("call-42", my_llm_summary, preamble="Summarize:\\n")
        except ConvoError as e:
            if e.code != "conflict":
                raise

A client object holds one connection and is not thread-safe; use one per thread. The
socket path defaults to ``$CONVOD_SOCKET``, else ``/run/convod/convod.sock``.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Union

__all__ = ["ConvoClient", "ConvoError", "DEFAULT_SOCKET", "PROTOCOL_VERSION"]

DEFAULT_SOCKET = "/run/convod/convod.sock"
PROTOCOL_VERSION = 1

Contents = Union[str, Sequence[str]]
JSONDict = Dict[str, Any]

# A response line longer than this is refused rather than buffered without bound.
_MAX_RESPONSE_BYTES = 1 << 30
_FORMAT_KEYS = ("prefix", "postfix", "user_tag", "assistant_tag", "summary_tag",
                "separator", "closure", "summary_closure")


class ConvoError(Exception):
    """An error response of the daemon.

    ``code`` is the protocol's error code (``bad_request``, ``not_found``, ``conflict``,
    ``too_large``, ``unavailable``, ...), ``message`` its human-readable explanation.
    A refused request changed nothing on the daemon.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__("%s: %s" % (code, message))
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return "ConvoError(%r, %r)" % (self.code, self.message)


class ConvoClient:
    """A connection to convod.

    :param path: the daemon's Unix socket; defaults to ``$CONVOD_SOCKET``, else
        ``/run/convod/convod.sock``.
    :param timeout: seconds to wait for the daemon (to connect, and without any progress
        while a request is outstanding) before raising :class:`TimeoutError`; ``None``
        waits forever.

    The connection is opened on the first request (or by :meth:`connect`). After an I/O
    error or a timeout it is closed and the error is raised; the next request opens a new
    one. A request that failed that way may or may not have been applied.
    """

    def __init__(self, path: Optional[str] = None, timeout: Optional[float] = 30.0) -> None:
        self.path = path or os.environ.get("CONVOD_SOCKET") or DEFAULT_SOCKET
        self.timeout = timeout
        self._sock: Optional[socket.socket] = None
        self._buf = b""

    # -- connection ---------------------------------------------------------------------

    def connect(self) -> None:
        """Opens the connection now (it is otherwise opened by the first request)."""
        if self._sock is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)
            sock.connect(self.path)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._buf = b""

    def close(self) -> None:
        """Closes the connection (not a conversation: see :meth:`close_conversation`)."""
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._buf = b""

    def __enter__(self) -> "ConvoClient":
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- raw exchange -------------------------------------------------------------------

    def _exchange(self, payload: bytes, count: int) -> List[bytes]:
        """Sends payload and returns the next count response lines, reading while writing
        so that a long pipeline never deadlocks against the daemon's output limit."""
        self.connect()
        sock = self._sock
        assert sock is not None
        lines: List[bytes] = []
        view = memoryview(payload)
        sel = selectors.DefaultSelector()
        try:
            sel.register(sock, selectors.EVENT_READ | (selectors.EVENT_WRITE if view else 0))
            self._take_lines(lines, count)
            while len(lines) < count or view:
                events = sel.select(self.timeout)
                if not events:
                    raise TimeoutError("convod did not answer within %ss" % self.timeout)
                for _, mask in events:
                    if mask & selectors.EVENT_WRITE and view:
                        try:
                            view = view[sock.send(view):]
                        except (BlockingIOError, InterruptedError):
                            pass
                        except (BrokenPipeError, ConnectionResetError):
                            # The daemon stopped reading (it may have said why, as in
                            # a refused connection): read what it sent, then fail.
                            view = view[:0]
                        if not view:
                            sel.modify(sock, selectors.EVENT_READ)
                    if mask & selectors.EVENT_READ:
                        try:
                            chunk = sock.recv(1 << 16)
                        except (BlockingIOError, InterruptedError):
                            continue
                        if not chunk:
                            raise ConnectionError("convod closed the connection")
                        self._buf += chunk
                        if len(self._buf) > _MAX_RESPONSE_BYTES and b"\n" not in self._buf:
                            raise ConnectionError("response line over %d bytes"
                                                  % _MAX_RESPONSE_BYTES)
                        self._take_lines(lines, count)
        except BaseException:
            # The stream position is unknown now: never reuse this connection.
            self.close()
            raise
        finally:
            sel.close()
        return lines

    def _take_lines(self, lines: List[bytes], count: int) -> None:
        while len(lines) < count:
            line, sep, rest = self._buf.partition(b"\n")
            if not sep:
                return
            lines.append(line)
            self._buf = rest

    @staticmethod
    def _encode(request: Mapping[str, Any]) -> bytes:
        return json.dumps(request, ensure_ascii=False, separators=(",", ":")).encode() + b"\n"

    @staticmethod
    def _decode(line: bytes) -> JSONDict:
        try:
            response = json.loads(line)
        except ValueError as e:
            raise ConnectionError("malformed response from convod: %r" % line[:200]) from e
        if not isinstance(response, dict) or not isinstance(response.get("ok"), bool):
            raise ConnectionError("malformed response from convod: %r" % line[:200])
        return response

    def request(self, op: str, **fields: Any) -> JSONDict:
        """Sends one request (``op`` plus fields whose value is not None) and returns its
        ``result``; raises :class:`ConvoError` on an error response."""
        req: JSONDict = {"op": op}
        req.update({k: v for k, v in fields.items() if v is not None})
        response = self._decode(self._exchange(self._encode(req), 1)[0])
        if not response["ok"]:
            error = response.get("error") or {}
            raise ConvoError(str(error.get("code", "internal")), str(error.get("message", "")))
        result = response.get("result")
        return result if isinstance(result, dict) else {}

    def batch(self, requests: Iterable[Mapping[str, Any]]) -> List[JSONDict]:
        """Sends every request without waiting (pipelining) and returns the responses in
        request order, as dicts with ``ok`` and ``result`` or ``error`` (and ``id`` when the
        request had one). Error responses are returned, not raised."""
        reqs = list(requests)
        if not reqs:
            return []
        payload = b"".join(self._encode(r) for r in reqs)
        return [self._decode(line) for line in self._exchange(payload, len(reqs))]

    # -- adding messages ----------------------------------------------------------------

    def add_user(self, conversation: str, contents: Contents,
                 metadata: Optional[Mapping[str, Any]] = None) -> JSONDict:
        """Appends a user message (merged into the last message if that is a user message;
        the conversation is created if new). ``contents`` is a string or a list of
        strings; ``metadata`` is ``{"timing": {KEY: ms}, "aux": {...}}``. Returns
        ``{"message": MAP, "merged": bool}``."""
        return self.request("add_user", conversation=conversation, contents=_contents(contents),
                            metadata=metadata)

    def add_assistant(self, conversation: str, contents: Contents,
                      metadata: Optional[Mapping[str, Any]] = None) -> JSONDict:
        """Appends an assistant message (a fake user message ``"..."`` comes first when the
        LLM view is empty). Returns ``{"message": MAP, "merged": bool}``."""
        return self.request("add_assistant", conversation=conversation,
                            contents=_contents(contents), metadata=metadata)

    def add_message(self, conversation: str, role: str, contents: Contents,
                    metadata: Optional[Mapping[str, Any]] = None) -> JSONDict:
        """Appends a message of ``role`` (``"user"`` or ``"assistant"``). Returns
        ``{"message": MAP, "merged": bool}``."""
        return self.request("add_message", conversation=conversation, role=role,
                            contents=_contents(contents), metadata=metadata)

    # -- reading ------------------------------------------------------------------------

    def get_messages(self, conversation: str, format: str = "meta") -> JSONDict:
        """The LLM view: ``{"messages": [...], "summary": [str] or None}``. ``format`` is
        ``meta`` (message maps), ``bedrock``, ``anthropic`` or ``openai``."""
        return self.request("get_messages", conversation=conversation, format=format)

    def get_summary_info(self, conversation: str, preamble: Optional[str] = None,
                         include_previous_summary: Optional[bool] = None,
                         format: Optional[Mapping[str, str]] = None) -> JSONDict:
        """What to summarize next: ``{"messages", "previous_summary", "ids", "versions",
        "text"}``. ``format`` may hold ``prefix``, ``postfix``, ``user_tag``,
        ``assistant_tag``, ``summary_tag``, ``separator``, ``closure``,
        ``summary_closure``."""
        return self.request("get_summary_info", conversation=conversation, preamble=preamble,
                            include_previous_summary=include_previous_summary,
                            format=dict(format) if format is not None else None)

    def add_summary(self, conversation: str, contents: Contents, ids: Sequence[str],
                    versions: Optional[Sequence[int]] = None) -> JSONDict:
        """Adds a summary of the messages named by ``ids`` (from :meth:`get_summary_info`).
        With ``versions`` (also from it), a message changed since then makes the daemon
        answer ``conflict``. Returns ``{"message": MAP}``."""
        return self.request("add_summary", conversation=conversation,
                            contents=_contents(contents), ids=list(ids),
                            versions=list(versions) if versions is not None else None)

    def get_last_summary(self, conversation: str) -> JSONDict:
        """``{"message": MAP or None}``: the last summary message."""
        return self.request("get_last_summary", conversation=conversation)

    def to_messages_map(self, conversation: str, incremental: bool = True,
                        exclude_last: bool = True) -> JSONDict:
        """``{"messages": [MAP, ...]}``: with ``incremental``, the messages new or changed
        since this conversation's previous incremental call (the last message left out
        while ``exclude_last``); without it, the whole log."""
        return self.request("to_messages_map", conversation=conversation,
                            incremental=incremental, exclude_last=exclude_last)

    def set_metadata(self, conversation: str, message_id: str,
                     timing: Optional[Mapping[str, int]] = None,
                     aux: Optional[Mapping[str, Any]] = None) -> JSONDict:
        """Sets timing keys (``playStart``, ``llmEnd``, ... in Unix milliseconds) and aux
        keys (a ``None`` value removes the key) of a message. Returns ``{"message": MAP}``.
        """
        return self.request("set_metadata", conversation=conversation, message_id=message_id,
                            timing=dict(timing) if timing is not None else None,
                            aux=dict(aux) if aux is not None else None)

    def describe(self, conversation: str) -> JSONDict:
        """``{"text": str}``: a human-readable dump of the log."""
        return self.request("describe", conversation=conversation)

    # -- daemon -------------------------------------------------------------------------

    def flush(self, conversation: Optional[str] = None) -> JSONDict:
        """Writes what is pending (of one conversation, or of all) to the spool now.
        Returns ``{"flushed": n}``."""
        return self.request("flush", conversation=conversation)

    def close_conversation(self, conversation: str) -> JSONDict:
        """Flushes a conversation, then drops it from memory. Returns ``{"flushed": n}``."""
        return self.request("close", conversation=conversation)

    def list(self) -> JSONDict:
        """``{"conversations": [{"conversation", "messages", "updated"}, ...]}``."""
        return self.request("list")

    def stats(self) -> JSONDict:
        """The daemon's counters (connections, requests, errors, spool, sink)."""
        return self.request("stats")

    def ping(self) -> JSONDict:
        """``{"pong": True, "version": str, "protocol": 1}``."""
        return self.request("ping")

    # -- helpers ------------------------------------------------------------------------

    def summarize(self, conversation: str, summarize_fn: Callable[[str], Contents],
                  **format: Any) -> Optional[JSONDict]:
        """Summarizes what :meth:`get_summary_info` offers and stores the summary.

        ``format`` takes ``preamble``, ``include_previous_summary`` and the keys of the
        request's ``format`` object (``prefix``, ``user_tag``, ...). Returns None when there
        is nothing to summarize; otherwise calls ``summarize_fn(text)`` (a string or a list
        of strings back) and returns the result of :meth:`add_summary`. The ids *and*
        versions of the info go back to the daemon, so when the conversation changed under
        the summary in between (a reply merged into a summarized message, another summary
        added) it raises :class:`ConvoError` with code ``conflict`` and nothing changes;
        call again to summarize the new state.
        """
        preamble = format.pop("preamble", None)
        include_previous = format.pop("include_previous_summary", None)
        unknown = [k for k in format if k not in _FORMAT_KEYS]
        if unknown:
            raise TypeError("summarize() got unexpected format keys: %s" % ", ".join(unknown))
        info = self.get_summary_info(conversation, preamble=preamble,
                                     include_previous_summary=include_previous,
                                     format=format or None)
        if not info.get("ids"):
            return None
        summary = summarize_fn(info["text"])
        return self.add_summary(conversation, summary, info["ids"], versions=info["versions"])


def _contents(contents: Contents) -> Union[str, List[str]]:
    """A string stays a string; any other sequence becomes a list (JSON array)."""
    if isinstance(contents, str):
        return contents
    if isinstance(contents, (bytes, bytearray)):
        raise TypeError("contents: expected str or a sequence of str, got bytes")
    return list(contents)
