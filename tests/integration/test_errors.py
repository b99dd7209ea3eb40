"""Every error code of protocol.md produced through the socket, the precedence between
them, and the promises around errors: the connection goes on (a ping after each one) and a
refused request changes nothing.

`internal` is not produced here: it only answers a bug (a broken invariant or an allocation
failure inside the daemon) and no request from outside can reach it by design; the unit
and fuzz tests cover those paths."""
import json
import os
import re
import resource
import time

import pytest

from conftest import TIMEOUT_SCALE, VALGRIND, Conn

ULID_A = "01JRZJ166HZFPP405DV1QQB2X9"
ULID_B = "01JRZJ166J2WRMF990535EVSQS"


def ping(c):
    r = c.request({"op": "ping"})
    assert r.get("ok") is True and r["result"]["pong"] is True, r


def expect(c, req, code, field=None):
    """Sends req, expects code (naming field in the message), then a ping on the same connection."""
    rid = req.get("id", None) if isinstance(req, dict) else None
    r = c.request(req)
    assert r.get("ok") is False, (req, r)
    assert r["error"]["code"] == code, (req, r)
    assert isinstance(r["error"]["message"], str) and r["error"]["message"], r
    if field is not None:
        assert field in r["error"]["message"], (req, r)
    if isinstance(req, dict) and "id" in req:
        assert r["id"] == rid, r
    ping(c)
    return r["error"]


def expect_raw(c, raw, code):
    """Sends raw bytes (one or more lines) that must produce one error without an id."""
    c.send_raw(raw)
    r = c.recv()
    assert r.get("ok") is False, (raw[:200], r)
    assert r["error"]["code"] == code, (raw[:200], r)
    assert "id" not in r, r
    assert r["error"]["message"], r
    ping(c)


def snapshot(c, cid):
    """Everything a client can observe about a conversation without moving anything."""
    return (
        c.ok({"op": "describe", "conversation": cid})["text"],
        c.ok({"op": "to_messages_map", "conversation": cid, "incremental": False}),
        c.ok({"op": "get_messages", "conversation": cid}),
        c.ok({"op": "get_summary_info", "conversation": cid}),
        c.ok({"op": "get_last_summary", "conversation": cid}),
        c.ok({"op": "list"}),
    )


def build_base(c, cid="base"):
    """user, assistant, summary, user, assistant, user (unanswered); some pending for maps."""
    c.ok({"op": "add_user", "conversation": cid, "contents": "u1"})
    c.ok({"op": "add_assistant", "conversation": cid, "contents": "a1"})
    info = c.ok({"op": "get_summary_info", "conversation": cid})
    c.ok({"op": "add_summary", "conversation": cid, "contents": "S1", "ids": info["ids"]})
    c.ok({"op": "add_user", "conversation": cid, "contents": "u2",
          "metadata": {"aux": {"k": 1}, "timing": {"listenStart": 3}}})
    c.ok({"op": "add_assistant", "conversation": cid, "contents": "a2"})
    c.ok({"op": "to_messages_map", "conversation": cid})
    c.ok({"op": "add_user", "conversation": cid, "contents": "u3"})
    return c.ok({"op": "get_summary_info", "conversation": cid})


def not_found(c, cid):
    r = c.request({"op": "describe", "conversation": cid})
    assert r["ok"] is False and r["error"]["code"] == "not_found", (cid, r)


# ---- parse_error -------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    b"{",
    b"{nope}",
    b"{'op': 'ping'}",
    b'{"op":"ping",}',
    b'{"op":"ping"} trailing',
    b'{"op":"ping"}{"op":"ping"}',
    b'{"op":"ping"',
    b'{"op":"ping","x":01}',
    b'{"op":"ping","x":NaN}',
    b'\x00',
    b'{"op":"ping","conversation":"a\x01b"}',
    # A raw NUL right after a number or a literal (jansson's reader dropped it: ran them).
    b'{"op":"ping","id":1\x00}',
    b'{"op":"ping","x":true\x00,"id":3}',
    b'{"op":null\x00,"id":7}',
    b'{"op":"add_user","conversation":"nul-after","contents":"x",'
    b'"metadata":{"timing":{"playStart":7\x00}}}',
])
def test_parse_error_bad_json(conn, raw):
    expect_raw(conn, raw + b"\n", "parse_error")


@pytest.mark.parametrize("raw", [b"[]", b'[{"op":"ping"}]', b'"ping"', b"42", b"null", b"true", b"1.5"])
def test_parse_error_not_an_object(conn, raw):
    expect_raw(conn, raw + b"\n", "parse_error")


@pytest.mark.parametrize("raw", [
    b'{"op":"ping","x":"\xff"}',
    b'{"op":"ping","x":"\xc0\xaf"}',          # overlong encoding of '/'
    b'{"op":"ping","x":"\xed\xa0\x80"}',      # a UTF-16 surrogate encoded as UTF-8
    b'{"op":"ping","x":"\xe2\x82"}',          # truncated sequence
    b'{"op":"ping","x":"\xf8\x88\x80\x80\x80"}',  # 5-byte form
    b'{"op":"ping","x":"\xf4\x90\x80\x80"}',  # above U+10FFFF
    b'{"op":"ping"}\xff',
    b'\xef\xbb\xbf\xff{"op":"ping"}',
])
def test_parse_error_invalid_utf8(conn, raw):
    expect_raw(conn, raw + b"\n", "parse_error")


def test_parse_error_invalid_utf8_changes_nothing(conn):
    c = conn
    c.ok({"op": "add_user", "conversation": "u8", "contents": "x"})
    before = snapshot(c, "u8")
    expect_raw(c, b'{"op":"add_assistant","conversation":"u8","contents":"\xff\xfe"}\n', "parse_error")
    expect_raw(c, b'{"op":"add_assistant","conversation":"u8\xff","contents":"x"}\n', "parse_error")
    assert snapshot(c, "u8") == before
    not_found(c, "u8\ufffd")


# ---- too_large ---------------------------------------------------------------------------

def test_too_large_line_rest_discarded(daemon_factory):
    d = daemon_factory(["--max-line-bytes", "4096"])
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "t", "contents": "x"})
    before = snapshot(c, "t")
    # The tail of the over-long line looks like a request; it must not run.
    tail = b'{"op":"add_assistant","conversation":"t","contents":"tail"}'
    expect_raw(c, b" " * 5000 + tail + b"\n", "too_large")
    line = json.dumps({"id": 9, "op": "add_assistant", "conversation": "t", "contents": "y" * 6000}).encode()
    expect_raw(c, line + b"\n", "too_large")
    # Several megabytes in many writes: one answer, and the connection goes on.
    c.send_raw(b'{"id":1,"op":"add_assistant","conversation":"t","contents":"')
    for _ in range(48):
        c.send_raw(b"z" * 65536)
    c.send_raw(b'"}\n{"id":2,"op":"ping"}\n')
    r = c.recv()
    assert r["ok"] is False and r["error"]["code"] == "too_large" and "id" not in r, r
    r = c.recv()
    assert r == {"id": 2, "ok": True, "result": r["result"]} and r["result"]["pong"] is True
    assert snapshot(c, "t") == before
    # Over-long and not JSON: the length is what is reported.
    expect_raw(c, b"{" * 5000 + b"\n", "too_large")
    expect_raw(c, b"\xff" * 5000 + b"\n", "too_large")


def test_too_large_conversation_id(daemon_factory):
    d = daemon_factory(["--max-conversation-id-bytes", "16"])
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "a" * 16, "contents": "x"})
    expect(c, {"id": 3, "op": "add_user", "conversation": "a" * 17, "contents": "x"}, "too_large")
    # Bytes of UTF-8, not characters.
    c.ok({"op": "add_user", "conversation": "\u00e9" * 8, "contents": "x"})
    expect(c, {"op": "add_user", "conversation": "\u00e9" * 8 + "a", "contents": "x"}, "too_large")
    expect(c, {"op": "add_user", "conversation": "\U0001F600" * 5, "contents": "x"}, "too_large")
    expect(c, {"op": "describe", "conversation": "b" * 17}, "too_large")
    expect(c, {"op": "describe", "conversation": "b" * 10000}, "too_large")
    names = [x["conversation"] for x in c.ok({"op": "list"})["conversations"]]
    assert names == ["a" * 16, "\u00e9" * 8]


def test_too_large_conversation_id_default_limit(conn):
    c = conn
    c.ok({"op": "add_user", "conversation": "k" * 256, "contents": "x"})
    expect(c, {"op": "add_user", "conversation": "k" * 257, "contents": "x"}, "too_large")
    assert [x["conversation"] for x in c.ok({"op": "list"})["conversations"]] == ["k" * 256]


def test_too_large_messages(daemon_factory):
    d = daemon_factory(["--max-messages", "4"])
    c = d.connect()
    # A fake message counts: assistant first needs two entries.
    ok1 = c.ok({"op": "add_user", "conversation": "m", "contents": "u1"})
    c.ok({"op": "add_assistant", "conversation": "m", "contents": "a1"})
    c.ok({"op": "add_user", "conversation": "m", "contents": "u2"})
    c.ok({"op": "add_assistant", "conversation": "m", "contents": "a2"})
    before = snapshot(c, "m")
    expect(c, {"op": "add_user", "conversation": "m", "contents": "u3"}, "too_large")
    expect(c, {"op": "add_message", "role": "user", "conversation": "m", "contents": "u3"}, "too_large")
    assert snapshot(c, "m") == before
    # A merge adds no message.
    r = c.ok({"op": "add_assistant", "conversation": "m", "contents": "a2b"})
    assert r["merged"] is True
    # A summary counts.
    before = snapshot(c, "m")
    info = c.ok({"op": "get_summary_info", "conversation": "m"})
    assert len(info["ids"]) == 4
    expect(c, {"op": "add_summary", "conversation": "m", "contents": "S", "ids": info["ids"]}, "too_large")
    assert snapshot(c, "m") == before
    assert ok1["message"]["message"]["contents"] == ["u1"]

    # A fake message counts: after a summary, an assistant turn needs two entries.
    d2 = daemon_factory(["--max-messages", "4"])
    c2 = d2.connect()
    c2.ok({"op": "add_user", "conversation": "f", "contents": "u"})
    c2.ok({"op": "add_assistant", "conversation": "f", "contents": "a"})
    info = c2.ok({"op": "get_summary_info", "conversation": "f"})
    c2.ok({"op": "add_summary", "conversation": "f", "contents": "S", "ids": info["ids"]})
    before = snapshot(c2, "f")
    expect(c2, {"op": "add_assistant", "conversation": "f", "contents": "a2"}, "too_large")
    assert snapshot(c2, "f") == before
    c2.ok({"op": "add_user", "conversation": "f", "contents": "u2"})
    # On a new conversation: a refused first add creates nothing.
    d3 = daemon_factory(["--max-messages", "2", "--max-conversation-bytes", "10"])
    c3 = d3.connect()
    expect(c3, {"op": "add_assistant", "conversation": "n", "contents": "y" * 11}, "too_large")
    not_found(c3, "n")
    assert c3.ok({"op": "list"}) == {"conversations": []}
    # The fake's three bytes count as content too: 3 + 8 > 10.
    expect(c3, {"op": "add_assistant", "conversation": "n", "contents": "y" * 8}, "too_large")
    not_found(c3, "n")
    c3.ok({"op": "add_assistant", "conversation": "n", "contents": "y" * 7})
    assert [m["message"]["contents"] for m in c3.ok({"op": "to_messages_map", "conversation": "n",
                                                         "incremental": False})["messages"]] == [["..."], ["y" * 7]]


def test_merge_into_a_conversation_over_a_lowered_max_messages(daemon_factory):
    """Restarted under a lower --max-messages, a conversation already over it is restored
    whole; a merge, which adds no message, is taken, a new message is refused."""
    d = daemon_factory([])
    c = d.connect()
    for op, text in (("add_user", "u1"), ("add_assistant", "a1"), ("add_user", "u2")):
        c.ok({"op": op, "conversation": "over", "contents": text})
    assert d.stop() == 0
    d.args = ["--max-messages", "2"]
    d.start()
    c = d.connect()
    r = c.ok({"op": "add_user", "conversation": "over", "contents": "u2b"})
    assert r["merged"] is True and r["message"]["message"]["contents"] == ["u2", "u2b"]
    before = snapshot(c, "over")
    expect(c, {"op": "add_assistant", "conversation": "over", "contents": "a2"}, "too_large")
    assert snapshot(c, "over") == before and len(before[1]["messages"]) == 3


def test_too_large_conversation_bytes(daemon_factory):
    d = daemon_factory(["--max-conversation-bytes", "100"])
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "b", "contents": "u" * 60})
    before = snapshot(c, "b")
    expect(c, {"op": "add_assistant", "conversation": "b", "contents": ["a" * 20, "a" * 21]}, "too_large")
    # A merge that would cross the limit.
    expect(c, {"op": "add_user", "conversation": "b", "contents": "u" * 41}, "too_large")
    assert snapshot(c, "b") == before
    # Exactly the limit is fine (blank strings are dropped before counting).
    c.ok({"op": "add_assistant", "conversation": "b", "contents": ["a" * 20, "  ", "a" * 20]})
    before = snapshot(c, "b")
    expect(c, {"op": "add_user", "conversation": "b", "contents": "x"}, "too_large")
    expect(c, {"op": "add_assistant", "conversation": "b", "contents": "\u00e9"}, "too_large")
    assert snapshot(c, "b") == before
    # Bytes, not characters: 2-byte characters count twice.
    expect(c, {"op": "add_user", "conversation": "b2", "contents": "\u00e9" * 51}, "too_large")
    not_found(c, "b2")
    c.ok({"op": "add_user", "conversation": "b2", "contents": "\u00e9" * 50})


def test_too_large_item_over_dynamodb_limit(conn):
    """persistence.md: a message whose item would exceed DynamoDB's 400 KB is refused when it
    is added or merged, before it is acknowledged."""
    c = conn
    expect(c, {"op": "add_user", "conversation": "big", "contents": "x" * 450000}, "too_large")
    not_found(c, "big")
    c.ok({"op": "add_user", "conversation": "big", "contents": "x" * 300000})
    before = snapshot(c, "big")
    expect(c, {"op": "add_user", "conversation": "big", "contents": "y" * 200000}, "too_large")
    assert snapshot(c, "big") == before
    c.ok({"op": "add_assistant", "conversation": "big", "contents": "y" * 200000})


# ---- unknown_op --------------------------------------------------------------------------

def test_unknown_op(conn):
    c = conn
    c.ok({"op": "add_user", "conversation": "x", "contents": "u"})
    before = snapshot(c, "x")
    for op in ("frobnicate", "", "PING", "Add_User", "add_user ", "delete"):
        expect(c, {"id": op, "op": op, "conversation": "x", "contents": "u"}, "unknown_op")
    assert snapshot(c, "x") == before


def test_an_op_with_a_nul_names_no_operation(conn):
    """An op name followed by a NUL (and more, or nothing) names no operation: unknown_op, and
    nothing changes (it used to run the op its first bytes named: an add, a close). So for
    stats' format: bad_request."""
    c = conn
    c.ok({"op": "add_user", "conversation": "x", "contents": "u"})
    before = snapshot(c, "x")
    for op in ("add_user\\u0000junk", "add_user\\u0000", "close\\u0000", "ping\\u0000x",
               "add_summary\\u0000", "stats\\u0000"):
        raw = ('{"id":7,"op":"%s","conversation":"x","contents":"v"}\n' % op).encode()
        c.send_raw(raw)
        r = c.recv()
        assert r.get("id") == 7 and r["ok"] is False and r["error"]["code"] == "unknown_op", (op, r)
        assert "NUL" in r["error"]["message"], r
    for conv in ("y", "x"):
        c.send_raw(('{"op":"add_user\\u0000","conversation":"%s","contents":"v"}\n'
                    % conv).encode())
        assert c.recv()["error"]["code"] == "unknown_op"
    assert snapshot(c, "x") == before
    not_found(c, "y")
    for fmt in ("json\\u0000xml", "prometheus\\u0000", "json\\u0000"):
        c.send_raw(('{"op":"stats","format":"%s"}\n' % fmt).encode())
        r = c.recv()
        assert r["ok"] is False and r["error"]["code"] == "bad_request", (fmt, r)
        assert "format" in r["error"]["message"], r


def test_conversation_is_an_unknown_field_of_ops_without_one(conn):
    """protocol.md: unknown fields are ignored. list, stats, ping and the extensions without
    a conversation answer as if "conversation" were absent, whatever it holds; flush, where
    it is optional, still checks it, and an unknown op still puts too_large first."""
    c = conn
    c.ok({"op": "add_user", "conversation": "kept", "contents": "u"})
    before = snapshot(c, "kept")
    bad = [5, None, "", "a\x01b", "\x7f", "x" * 300, ["kept"], {"c": 1}]
    for op in ("list", "ping", "dead_letters", "retry_dead_letters", "create_table"):
        plain = c.request({"id": 1, "op": op})
        for v in bad:
            r = c.request({"id": 1, "op": op, "conversation": v})
            # create_table answers bad_request here (no DynamoDB): the same one.
            assert r == plain, (op, v, r, plain)
    for v in bad:
        r = c.request({"op": "stats", "conversation": v})
        assert r["ok"] is True and r["result"]["conversations"] == 1, (v, r)
    assert snapshot(c, "kept") == before
    expect(c, {"op": "flush", "conversation": 5}, "bad_request", "conversation")
    expect(c, {"op": "flush", "conversation": "a\x01b"}, "bad_request", "conversation")
    expect(c, {"op": "flush", "conversation": "x" * 300}, "too_large", "conversation")
    expect(c, {"op": "nosuch", "conversation": "x" * 300}, "too_large", "conversation")
    expect(c, {"op": "nosuch", "conversation": 5}, "unknown_op", "op")


# ---- bad_request -------------------------------------------------------------------------

B = "base"
ALL_WS = "\t\n\r \x85\xa0\u1680\u2000\u2003\u200a\u2028\u2029\u202f\u205f\u3000"

# (request, a word the error message must contain)
BAD = [
    ({"conversation": B}, "op"),
    ({"op": 5, "conversation": B}, "op"),
    ({"op": None, "conversation": B}, "op"),
    ({"op": ["ping"]}, "op"),
    ({"op": {"name": "ping"}}, "op"),
    ({"op": "add_user", "contents": "x"}, "conversation"),
    ({"op": "add_user", "conversation": 5, "contents": "x"}, "conversation"),
    ({"op": "add_user", "conversation": None, "contents": "x"}, "conversation"),
    ({"op": "add_user", "conversation": ["base"], "contents": "x"}, "conversation"),
    ({"op": "add_user", "conversation": "", "contents": "x"}, "conversation"),
    ({"op": "add_user", "conversation": "a\tb", "contents": "x"}, "conversation"),
    ({"op": "add_user", "conversation": "a\nb", "contents": "x"}, "conversation"),
    ({"op": "add_user", "conversation": "\x1f", "contents": "x"}, "conversation"),
    ({"op": "add_user", "conversation": "a\x7fb", "contents": "x"}, "conversation"),
    ({"op": "describe", "conversation": 1.5}, "conversation"),
    ({"op": "describe"}, "conversation"),
    ({"op": "close"}, "conversation"),
    ({"op": "get_messages"}, "conversation"),
    ({"op": "flush", "conversation": 5}, "conversation"),
    ({"op": "add_user", "conversation": B}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": 5}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": None}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": True}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": {"text": "x"}}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": []}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": [1]}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": ["ok", 2]}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": ["ok", None]}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": ["ok", ["nested"]]}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": ""}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": "   "}, "contents"),
    ({"op": "add_assistant", "conversation": B, "contents": ["", " ", ALL_WS]}, "contents"),
    ({"op": "add_assistant", "conversation": B, "contents": ALL_WS}, "contents"),
    ({"op": "add_message", "conversation": B, "contents": "x"}, "role"),
    ({"op": "add_message", "conversation": B, "contents": "x", "role": "summary"}, "role"),
    ({"op": "add_message", "conversation": B, "contents": "x", "role": "system"}, "role"),
    ({"op": "add_message", "conversation": B, "contents": "x", "role": "User"}, "role"),
    ({"op": "add_message", "conversation": B, "contents": "x", "role": 0}, "role"),
    ({"op": "add_message", "conversation": B, "contents": "x", "role": None}, "role"),
    ({"op": "add_message", "conversation": B, "contents": " ", "role": "user"}, "contents"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": "m"}, "metadata"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": []}, "metadata"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"foo": {}}}, "foo"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"attribute": ["fake"]}}, "attribute"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"summaryIds": []}}, "summaryIds"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": []}}, "timing"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": 5}}, "timing"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": {"foo": 1}}}, "foo"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": {"creation": 1}}}, "creation"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": {"playStart": -1}}}, "playStart"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": {"playStart": 1.5}}}, "playStart"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": {"playStart": "5"}}}, "playStart"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": {"playStart": None}}}, "playStart"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": {"playStart": True}}}, "playStart"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"timing": {"playstart": 1}}}, "playstart"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"aux": []}}, "aux"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"aux": "s"}}, "aux"),
    ({"op": "add_user", "conversation": B, "contents": "x", "metadata": {"aux": 5}}, "aux"),
    # A bad field in one part of metadata must not let the other part through.
    ({"op": "add_user", "conversation": B, "contents": "x",
      "metadata": {"aux": {"ok": 1}, "timing": {"llmEnd": -3}}}, "llmEnd"),
    ({"op": "get_messages", "conversation": B, "format": "xml"}, "format"),
    ({"op": "get_messages", "conversation": B, "format": 5}, "format"),
    ({"op": "get_messages", "conversation": B, "format": {}}, "format"),
    ({"op": "get_messages", "conversation": B, "format": None}, "format"),
    ({"op": "get_summary_info", "conversation": B, "format": "x"}, "format"),
    ({"op": "get_summary_info", "conversation": B, "format": []}, "format"),
    ({"op": "get_summary_info", "conversation": B, "format": {"foo": "x"}}, "foo"),
    ({"op": "get_summary_info", "conversation": B, "format": {"preamble": "x"}}, "preamble"),
    ({"op": "get_summary_info", "conversation": B, "format": {"prefix": 5}}, "prefix"),
    ({"op": "get_summary_info", "conversation": B, "format": {"closure": None}}, "closure"),
    ({"op": "get_summary_info", "conversation": B, "format": {"summary_tag": ["x"]}}, "summary_tag"),
    ({"op": "get_summary_info", "conversation": B, "preamble": 5}, "preamble"),
    ({"op": "get_summary_info", "conversation": B, "include_previous_summary": "yes"}, "include_previous_summary"),
    ({"op": "get_summary_info", "conversation": B, "include_previous_summary": 1}, "include_previous_summary"),
    ({"op": "add_summary", "conversation": B, "ids": [ULID_A]}, "contents"),
    ({"op": "add_summary", "conversation": B, "contents": " ", "ids": [ULID_A]}, "contents"),
    ({"op": "add_summary", "conversation": B, "contents": 5, "ids": [ULID_A]}, "contents"),
    ({"op": "add_summary", "conversation": B, "contents": "S"}, "ids"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": ULID_A}, "ids"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": [5]}, "ids"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": [None]}, "ids"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": []}, "ids"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": [ULID_A], "versions": "1"}, "versions"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": [ULID_A], "versions": ["1"]}, "versions"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": [ULID_A], "versions": [1.5]}, "versions"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": [ULID_A], "versions": [-1]}, "versions"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": [ULID_A], "versions": []}, "versions"),
    ({"op": "add_summary", "conversation": B, "contents": "S", "ids": [ULID_A], "versions": [1, 1]}, "versions"),
    ({"op": "get_last_summary"}, "conversation"),
    ({"op": "to_messages_map", "conversation": B, "incremental": "yes"}, "incremental"),
    ({"op": "to_messages_map", "conversation": B, "incremental": 1}, "incremental"),
    ({"op": "to_messages_map", "conversation": B, "incremental": None}, "incremental"),
    ({"op": "to_messages_map", "conversation": B, "exclude_last": "no"}, "exclude_last"),
    ({"op": "to_messages_map", "conversation": B, "exclude_last": 0}, "exclude_last"),
    ({"op": "set_metadata", "conversation": B, "aux": {"a": 1}}, "message_id"),
    ({"op": "set_metadata", "conversation": B, "message_id": 5, "aux": {"a": 1}}, "message_id"),
    ({"op": "set_metadata", "conversation": B, "message_id": None, "aux": {"a": 1}}, "message_id"),
]


def base_ids(c):
    return [m["id"] for m in c.ok({"op": "to_messages_map", "conversation": B, "incremental": False})["messages"]]


def set_metadata_bad(c):
    """set_metadata forms that need a real message id."""
    mid = base_ids(c)[3]
    return [
        ({"op": "set_metadata", "conversation": B, "message_id": mid, "timing": {"foo": 1}}, "foo"),
        ({"op": "set_metadata", "conversation": B, "message_id": mid, "timing": {"creation": 1}}, "creation"),
        ({"op": "set_metadata", "conversation": B, "message_id": mid, "timing": {"playEnd": -5}}, "playEnd"),
        ({"op": "set_metadata", "conversation": B, "message_id": mid, "timing": {"playEnd": 2.5}}, "playEnd"),
        ({"op": "set_metadata", "conversation": B, "message_id": mid, "timing": []}, "timing"),
        ({"op": "set_metadata", "conversation": B, "message_id": mid, "timing": "x"}, "timing"),
        ({"op": "set_metadata", "conversation": B, "message_id": mid, "aux": [1]}, "aux"),
        ({"op": "set_metadata", "conversation": B, "message_id": mid, "aux": "x"}, "aux"),
        ({"op": "set_metadata", "conversation": B, "message_id": mid, "aux": {"z": 1},
          "timing": {"listenEnd": "soon"}}, "listenEnd"),
    ]


def test_bad_request_forms_change_nothing(conn):
    c = conn
    build_base(c)
    cases = BAD + set_metadata_bad(c)
    before = snapshot(c, B)
    for i, (req, field) in enumerate(cases):
        req = dict(req, id=i)
        expect(c, req, "bad_request", field)
        assert snapshot(c, B) == before, req


def test_bad_request_on_new_conversation_creates_nothing(conn):
    c = conn
    for i, (req, field) in enumerate(BAD):
        if req.get("conversation") != B:
            continue
        cid = "fresh-%d" % i
        req = dict(req, conversation=cid)
        expect(c, req, "bad_request", field)
        not_found(c, cid)
    assert c.ok({"op": "list"}) == {"conversations": []}


# ---- not_found ---------------------------------------------------------------------------

def test_not_found(conn):
    c = conn
    reqs = [
        {"op": "get_messages", "conversation": "ghost"},
        {"op": "get_messages", "conversation": "ghost", "format": "bedrock"},
        {"op": "get_summary_info", "conversation": "ghost"},
        {"op": "add_summary", "conversation": "ghost", "contents": "S", "ids": [ULID_A, ULID_B]},
        {"op": "get_last_summary", "conversation": "ghost"},
        {"op": "to_messages_map", "conversation": "ghost"},
        {"op": "to_messages_map", "conversation": "ghost", "incremental": False},
        {"op": "set_metadata", "conversation": "ghost", "message_id": ULID_A, "aux": {"a": 1}},
        {"op": "describe", "conversation": "ghost"},
        {"op": "flush", "conversation": "ghost"},
        {"op": "close", "conversation": "ghost"},
    ]
    for i, req in enumerate(reqs):
        expect(c, dict(req, id=i), "not_found")
    assert c.ok({"op": "list"}) == {"conversations": []}
    # A message that does not exist in a conversation that does.
    info = build_base(c)
    before = snapshot(c, B)
    expect(c, {"op": "set_metadata", "conversation": B, "message_id": ULID_A, "aux": {"a": 1}}, "not_found")
    # An id of another conversation is not a message of this one.
    other = c.ok({"op": "add_user", "conversation": "other", "contents": "x"})["message"]["id"]
    before = snapshot(c, B)
    expect(c, {"op": "set_metadata", "conversation": B, "message_id": other, "aux": {"a": 1}}, "not_found")
    assert snapshot(c, B) == before
    assert info["ids"]


# ---- conflict ----------------------------------------------------------------------------

def test_conflict_stale_ids(conn):
    c = conn
    info = build_base(c)
    old = c.ok({"op": "get_summary_info", "conversation": B})
    c.ok({"op": "add_summary", "conversation": B, "contents": "S2", "ids": info["ids"], "versions": info["versions"]})
    before = snapshot(c, B)
    # The same ids again: their summary is no longer the last one.
    expect(c, {"op": "add_summary", "conversation": B, "contents": "S3", "ids": old["ids"]}, "conflict")
    expect(c, {"op": "add_summary", "conversation": B, "contents": "S3", "ids": old["ids"],
               "versions": old["versions"]}, "conflict")
    # Without the previous summary: they no longer start the LLM view.
    expect(c, {"op": "add_summary", "conversation": B, "contents": "S3", "ids": old["ids"][1:]}, "conflict")
    assert snapshot(c, B) == before


def test_conflict_versions(conn):
    c, cid = conn, "v"
    c.ok({"op": "add_user", "conversation": cid, "contents": "u1"})
    c.ok({"op": "add_assistant", "conversation": cid, "contents": "a1"})
    info = c.ok({"op": "get_summary_info", "conversation": cid})
    c.ok({"op": "add_assistant", "conversation": cid, "contents": "a1b"})
    before = snapshot(c, cid)
    expect(c, {"op": "add_summary", "conversation": cid, "contents": "S", "ids": info["ids"],
               "versions": info["versions"]}, "conflict")
    assert snapshot(c, cid) == before
    info = c.ok({"op": "get_summary_info", "conversation": cid})
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": info["ids"][0], "aux": {"x": 1}})
    before = snapshot(c, cid)
    expect(c, {"op": "add_summary", "conversation": cid, "contents": "S", "ids": info["ids"],
               "versions": info["versions"]}, "conflict")
    assert snapshot(c, cid) == before
    # A set_metadata that changes nothing does not make the versions stale.
    info = c.ok({"op": "get_summary_info", "conversation": cid})
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": info["ids"][0], "aux": {"x": 1}})
    c.ok({"op": "add_summary", "conversation": cid, "contents": "S", "ids": info["ids"], "versions": info["versions"]})


def test_ids_that_do_not_describe_the_view(conn):
    """Refused with conflict or bad_request (protocol.md leaves the choice to whether the ids
    could ever have been valid); either way nothing changes and the connection goes on."""
    c = conn
    info = build_base(c)
    log = base_ids(c)
    s1, u2, a2, u3 = log[2], log[3], log[4], log[5]
    assert info["ids"] == [s1, u2, a2]
    before = snapshot(c, B)
    for ids in ([s1, a2, u2], [s1, a2], [s1, u2], [s1, u2, a2, u3], [u2, u2, a2], [s1, s1, u2, a2],
                [s1, u2, a2, ULID_A], [ULID_A], ["not-a-ulid"], [s1], [log[0], log[1]], [a2]):
        r = c.request({"op": "add_summary", "conversation": B, "contents": "S", "ids": ids})
        assert r["ok"] is False and r["error"]["code"] in ("conflict", "bad_request"), (ids, r)
        ping(c)
        assert snapshot(c, B) == before, ids


# ---- unavailable -------------------------------------------------------------------------

def test_unavailable_max_conversations(daemon_factory):
    d = daemon_factory(["--max-conversations", "3"])
    c = d.connect()
    for cid in ("a", "b", "c"):
        c.ok({"op": "add_user", "conversation": cid, "contents": "x"})
    before = c.ok({"op": "list"})
    expect(c, {"id": 1, "op": "add_user", "conversation": "d", "contents": "x"}, "unavailable")
    expect(c, {"op": "add_assistant", "conversation": "d", "contents": "x"}, "unavailable")
    expect(c, {"op": "add_message", "role": "user", "conversation": "e", "contents": "x"}, "unavailable")
    not_found(c, "d")
    assert c.ok({"op": "list"}) == before
    # Precedence: a malformed request is bad_request, an over-long id too_large.
    expect(c, {"op": "add_user", "conversation": "d", "contents": 5}, "bad_request")
    expect(c, {"op": "add_user", "conversation": "d" * 300, "contents": "x"}, "too_large")
    # Existing conversations go on.
    assert c.ok({"op": "add_user", "conversation": "a", "contents": "y"})["merged"] is True
    c.ok({"op": "add_assistant", "conversation": "b", "contents": "y"})
    # Closing one makes room.
    c.ok({"op": "close", "conversation": "c"})
    deadline = time.time() + 10 * TIMEOUT_SCALE
    while c.ok({"op": "stats"})["conversations"] != 2:  # dropped once persisted
        assert time.time() < deadline
        time.sleep(0.02)
    c.ok({"op": "add_user", "conversation": "d", "contents": "x"})
    expect(c, {"op": "add_user", "conversation": "e", "contents": "x"}, "unavailable")


def test_restart_under_a_lower_max_conversations(daemon_factory):
    """A start restores every open conversation of the store, more than a lowered
    --max-conversations included, and says so; the limit then holds back new ones (and
    closed ones brought back) until close brings the count under it."""
    d = daemon_factory(["--max-conversations", "10"])
    c = d.connect()
    for cid in ("a", "b", "c", "d", "e"):
        c.ok({"op": "add_user", "conversation": cid, "contents": "x"})
    c.ok({"op": "close", "conversation": "e"})
    assert d.stop() == 0
    d.args = ["--max-conversations", "2"]
    d.start()
    assert "4 open conversations restored, more than max-conversations 2" in d.log(), d.log()
    c = d.connect()
    assert c.ok({"op": "stats"})["conversations"] == 4
    c.ok({"op": "add_assistant", "conversation": "a", "contents": "y"})
    expect(c, {"op": "add_user", "conversation": "new", "contents": "x"}, "unavailable")
    expect(c, {"op": "get_messages", "conversation": "e"}, "unavailable")


def test_unavailable_max_connections(daemon_factory):
    d = daemon_factory(["--max-connections", "2"])
    c1 = d.connect()
    ping(c1)
    deadline = time.time() + 10
    while c1.ok({"op": "stats"})["connections"]["current"] != 1:
        assert time.time() < deadline
        time.sleep(0.02)
    refused0 = c1.ok({"op": "stats"})["connections"]["refused"]
    c2 = d.connect()
    ping(c2)
    c3 = d.connect()
    r = json.loads(c3.recv_line())
    assert r["ok"] is False and r["error"]["code"] == "unavailable" and "id" not in r, r
    with pytest.raises(EOFError):
        c3.recv_line()
    ping(c1)
    ping(c2)
    s = c1.ok({"op": "stats"})["connections"]
    assert s["refused"] == refused0 + 1 and s["current"] == 2
    c2.close()
    deadline = time.time() + 10
    while c1.ok({"op": "stats"})["connections"]["current"] != 1:
        assert time.time() < deadline
        time.sleep(0.02)
    c4 = d.connect()
    ping(c4)


def connect_many(d, n, refusal):
    """n clients, one after the other, each sending a ping: (the served connections, left
    open; the refusals, whose message must hold `refusal`). A refused client's line is there
    before its request, then the end (a reset when the daemon closed with it unread)."""
    served, refused = [], []
    for i in range(n):
        c = Conn(d.socket, timeout=10)
        try:
            r = c.request({"op": "ping", "id": i})
        except BrokenPipeError:  # refused before the request went out: the line is there
            r = json.loads(c.recv_line())
        if r.get("ok"):
            served.append(c)
            continue
        assert r["error"]["code"] == "unavailable" and "id" not in r, r
        assert refusal in r["error"]["message"], r
        with pytest.raises((EOFError, ConnectionResetError)):
            c.recv_line()
        refused.append(r)
        c.close()
    return served, refused


def test_open_file_limit_lowers_the_connection_limit(daemon_factory):
    """A client that opens connections without end, against a daemon whose open-file limit
    is below what max-connections needs: past the room the limit leaves, accept() would fail
    (EMFILE) and libuv would accept and close the waiting connections without a word. The
    daemon instead lowers its connection limit to that room (the limit less 64 kept for its
    own files), says so at the start, and refuses the clients past it with an answer; it
    keeps serving the others, does not spin, and serves new ones once some leave."""
    nofile = 128
    room = nofile - 64
    d = daemon_factory(["--max-connections", "1000"], nofile=nofile)
    assert re.search(r"warn server: the open-file limit \(\d+, hard \d+\) leaves room for "
                     r"\d+ connections: max-connections 1000 cannot be reached", d.log()), d.log()
    limit = int(re.search(r"leaves room for (\d+) connections", d.log()).group(1))
    assert limit <= room  # under valgrind, which keeps a few files of the limit, fewer
    # past the open-file limit itself
    served, refused = connect_many(d, limit + 80, "too many connections (limit %d)" % limit)
    # Every client got an answer; the served ones fill the limit (less any the daemon has
    # not finished closing, such as its readiness check's).
    assert len(served) + len(refused) == limit + 80
    assert limit - 2 <= len(served) <= limit and len(refused) >= 80, (len(served), len(refused))
    st = served[0].ok({"op": "stats"})["connections"]
    assert st["refused"] == len(refused) and st["current"] == len(served), st
    # At rest with every slot taken, the daemon does not spin.
    pid = d.proc.pid
    def cpu_ticks():
        f = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])
    t0 = cpu_ticks()
    time.sleep(1.0)
    assert cpu_ticks() - t0 <= 20 * TIMEOUT_SCALE  # ticks of 10 ms: at most a fifth of a CPU
    for c in served:
        ping(c)
    for c in served[:10]:
        c.close()
    deadline = time.time() + 10 * TIMEOUT_SCALE
    while served[-1].ok({"op": "stats"})["connections"]["current"] != len(served) - 10:
        assert time.time() < deadline
        time.sleep(0.02)
    again = [d.connect() for _ in range(10)]
    for c in again:
        ping(c)
    for c in served[10:]:
        c.close()


def test_open_file_limit_with_room_for_max_connections_says_nothing(daemon_factory):
    """An open-file limit short of max-connections + 64, yet with room for every connection
    (64: room for 32): no warning (it said "max-connections 8 cannot be reached"), and the
    limit is max-connections itself."""
    d = daemon_factory(["--max-connections", "8"], nofile=64)
    assert "open-file limit" not in d.log(), d.log()
    served, refused = connect_many(d, 10, "too many connections (limit 8)")
    assert 7 <= len(served) <= 8 and len(served) + len(refused) == 10, (len(served), len(refused))
    for c in served:
        c.close()


@pytest.mark.skipif(VALGRIND, reason="valgrind keeps descriptors of its own at the top of the limit")
def test_open_file_limit_lowered_while_running(daemon_factory):
    """The open-file limit lowered under a running daemon (prlimit): the connection limit it
    worked out at the start no longer holds, and accept() would fail with EMFILE, where libuv
    accepts and closes the waiting connections without a word and without calling back (they
    were neither answered nor counted). Near the end of the limit the daemon refuses new
    clients with an answer instead, keeps serving the ones it has, and serves new ones once
    the limit is raised again."""
    d = daemon_factory([])
    pid = d.proc.pid
    kept = [d.connect() for _ in range(3)]
    for c in kept:
        ping(c)
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    nfds = len(os.listdir("/proc/%d/fd" % pid))
    low = nfds + 20
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (low, hard))
    try:
        served, refused = connect_many(d, 40, "out of file descriptors (open-file limit %d)" % low)
        # Every client got an answer: 20 descriptors of room, 16 kept for the daemon's own.
        assert len(served) + len(refused) == 40
        assert 1 <= len(served) <= 8 and len(refused) >= 32, (len(served), len(refused))
        st = kept[0].ok({"op": "stats"})["connections"]
        assert st["refused"] == len(refused), st
        assert "refusing a connection: out of file descriptors" in d.log()
        for c in kept + served:
            ping(c)
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    more = [d.connect() for _ in range(40)]
    for c in more:
        ping(c)
    for c in kept + served + more:
        c.close()


# ---- precedence --------------------------------------------------------------------------

def test_precedence(daemon_factory):
    d = daemon_factory(["--max-line-bytes", "2000"])
    c = d.connect()
    long_id = "x" * 300
    # parse_error before everything else.
    expect_raw(c, b'{"op":"nope","conversation":"' + long_id.encode() + b'",}\n', "parse_error")
    # An over-long line is too_large even when it is not JSON.
    expect_raw(c, b"[" * 3000 + b"\n", "too_large")
    # too_large before unknown_op and bad_request.
    expect(c, {"op": "nope", "conversation": long_id}, "too_large")
    expect(c, {"op": "add_user", "conversation": long_id}, "too_large")
    expect(c, {"op": "add_user", "conversation": long_id, "contents": 5, "metadata": "x"}, "too_large")
    # unknown_op before bad_request.
    expect(c, {"op": "nope", "conversation": 5, "contents": []}, "unknown_op")
    expect(c, {"op": "nope"}, "unknown_op")
    # bad_request before not_found.
    expect(c, {"op": "get_messages", "conversation": "ghost", "format": "xml"}, "bad_request")
    expect(c, {"op": "set_metadata", "conversation": "ghost"}, "bad_request")
    expect(c, {"op": "set_metadata", "conversation": "ghost", "message_id": ULID_A, "timing": {"x": 1}}, "bad_request")
    expect(c, {"op": "add_summary", "conversation": "ghost", "contents": "S", "ids": "x"}, "bad_request")
    expect(c, {"op": "to_messages_map", "conversation": "ghost", "incremental": "x"}, "bad_request")
    expect(c, {"op": "get_summary_info", "conversation": "ghost", "format": {"bogus": 1}}, "bad_request")
    # not_found before conflict.
    expect(c, {"op": "add_summary", "conversation": "ghost", "contents": "S", "ids": [ULID_A, ULID_B],
               "versions": [1, 1]}, "not_found")
    assert c.ok({"op": "list"}) == {"conversations": []}
