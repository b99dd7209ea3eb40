"""Tests of the DynamoDB test harness itself: the SigV4 signer of ddb.py against AWS's
vectors, dynalite, ddb.py's table and paging helpers, and every fault of faultproxy.py
seen from a plain Python client, so the proxy is proven before convod is put behind it."""
import http.client
import json
import os
import socket
import time
import urllib.error
import zlib

import pytest

import ddb
from faultproxy import FaultProxy

VECTORS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                       "aws-sig-v4-test-suite")


def item(conv, i, text="hello", version=1):
    """An item shaped like convod's (persistence.md)."""
    mid = "01J0000000000000000000%04d" % i
    return {
        "conversation": {"S": conv},
        "sk": {"S": mid},
        "id": {"S": mid},
        "message": {"M": {"role": {"S": "user"}, "contents": {"L": [{"S": "%s %d" % (text, i)}]}}},
        "metadata": {"M": {"timing": {"M": {"creation": {"N": str(1700000000000 + i)}}}}},
        "version": {"N": str(version)},
        "updated": {"N": str(1700000000000 + i)},
    }


def sks(items):
    return [it["sk"]["S"] for it in items]


# --- ddb.py's signer against AWS's Signature Version 4 test suite --------------------

# The cases that fit DynamoDB's requests (path "/", no query string, single-line headers).
SIGV4_CASES = ["get-vanilla", "post-vanilla", "post-header-key-case", "post-header-key-sort",
               "post-header-value-case", "post-x-www-form-urlencoded",
               "post-x-www-form-urlencoded-parameters", "get-header-key-duplicate",
               "get-header-value-trim", "post-sts-token/post-sts-header-before"]


def _read_case(name):
    base = os.path.join(VECTORS, name, os.path.basename(name))
    with open(base + ".req", "rb") as f:
        raw = f.read().decode()
    head, _, body = raw.partition("\n\n")
    lines = head.split("\n")
    method, path, _ = lines[0].split(" ")
    headers = [tuple(x.split(":", 1)) for x in lines[1:]]
    expect = {}
    for ext in ("creq", "sts", "authz"):
        with open(base + "." + ext, "rb") as f:
            expect[ext] = f.read().decode()
    return method, path, headers, body.encode(), expect


@pytest.mark.parametrize("case", SIGV4_CASES)
def test_sigv4_vectors(case):
    method, path, headers, body, expect = _read_case(case)
    amz_date = dict((k.lower(), v) for k, v in headers)["x-amz-date"]
    authz, creq, sts = ddb.sign(method, path, "", headers, body, amz_date, "us-east-1",
                                "service", "AKIDEXAMPLE",
                                "wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY")
    assert creq == expect["creq"]
    assert sts == expect["sts"]
    assert authz == expect["authz"]


def test_sigv4_changes_with_body_and_secret():
    h = [("Host", "x"), ("X-Amz-Date", "20150830T123600Z")]
    a = ddb.sign("POST", "/", "", h, b"{}", "20150830T123600Z", "us-east-1", "dynamodb",
                 "AK", "S1")[0]
    b = ddb.sign("POST", "/", "", h, b"{ }", "20150830T123600Z", "us-east-1", "dynamodb",
                 "AK", "S1")[0]
    c = ddb.sign("POST", "/", "", h, b"{}", "20150830T123600Z", "us-east-1", "dynamodb",
                 "AK", "S2")[0]
    assert len({a, b, c}) == 3
    assert "Credential=AK/20150830/us-east-1/dynamodb/aws4_request" in a


def test_av_round_trip():
    v = {"a": None, "b": True, "c": 3, "d": 2.5, "e": "s", "f": [1, "x", {"g": False}]}
    av = ddb.to_av(v)
    assert av["M"]["a"] == {"NULL": True} and av["M"]["c"] == {"N": "3"}
    assert ddb.from_av(av) == v


# --- dynalite and ddb.py -------------------------------------------------------------


def test_dynalite_answers_and_table_lifecycle(dynalite):
    assert dynalite.startswith("http://127.0.0.1:")
    name = "convod-harness-lifecycle"
    ddb.create_table(dynalite, name)
    try:
        t = ddb.describe_table(dynalite, name)
        assert t["TableStatus"] == "ACTIVE"
        assert {k["AttributeName"]: k["KeyType"] for k in t["KeySchema"]} == {
            "conversation": "HASH", "sk": "RANGE"}
        assert t["BillingModeSummary"]["BillingMode"] == "PAY_PER_REQUEST"
        assert name in ddb.list_tables(dynalite)
        with pytest.raises(ddb.DdbError) as e:
            ddb.create_table(dynalite, name)
        assert e.value.status == 400 and e.value.type == "ResourceInUseException"
    finally:
        ddb.delete_table(dynalite, name)
    assert name not in ddb.list_tables(dynalite)


def test_ddb_table_is_fresh_and_empty(dynalite, ddb_table):
    assert ddb_table.startswith("convod-test-")
    assert ddb.scan_all(dynalite, ddb_table) == []


def test_batch_write_query_scan_direct(dynalite, ddb_table):
    a = [item("conv-a", i) for i in range(25)]
    b = [item("conv-b", i) for i in range(10)]
    assert not ddb.batch_write(dynalite, ddb_table, a[::-1]).get("UnprocessedItems")
    assert not ddb.batch_write(dynalite, ddb_table, b).get("UnprocessedItems")
    got = ddb.query_all(dynalite, ddb_table, "conv-a", limit=7)  # 4 pages
    assert got == a  # all attributes back, in sort-key order
    assert len(ddb.query_all(dynalite, ddb_table, "conv-b")) == 10
    assert ddb.query_all(dynalite, ddb_table, "conv-c") == []
    everything = ddb.scan_all(dynalite, ddb_table, limit=6)
    assert len(everything) == 35
    assert sorted(sks(everything)) == sorted(sks(a) + sks(b))
    # A newer version of an item replaces the old one (what convod's resends rely on).
    ddb.batch_write(dynalite, ddb_table, [item("conv-a", 3, text="merged", version=2)])
    it = ddb.get_item(dynalite, ddb_table, "conv-a", sks(a)[3])
    assert it["version"] == {"N": "2"}
    assert ddb.from_item(it)["message"]["contents"] == ["merged 3"]


def test_permanent_error_from_dynalite(dynalite, ddb_table):
    bad = item("conv-a", 1)
    del bad["sk"]
    with pytest.raises(ddb.DdbError) as e:
        ddb.batch_write(dynalite, ddb_table, [bad])
    assert e.value.status == 400 and e.value.type == "ValidationException"


# --- the proxy, no faults ------------------------------------------------------------


def test_proxy_forwards(faultproxy, dynalite, ddb_table):
    assert faultproxy.url != dynalite
    a = [item("conv-a", i) for i in range(25)]
    assert not ddb.batch_write(faultproxy.url, ddb_table, a).get("UnprocessedItems")
    assert ddb.query_all(faultproxy.url, ddb_table, "conv-a", limit=10) == a
    assert ddb.query_all(dynalite, ddb_table, "conv-a") == a
    c = faultproxy.counts
    assert c["op:BatchWriteItem"] == 1 and c["op:Query"] == 3
    assert c["requests"] == c["forwarded"] == 4
    assert faultproxy.log == [("BatchWriteItem", None)] + [("Query", None)] * 3


def test_proxy_keep_alive_and_chunked(faultproxy, ddb_table):
    u = faultproxy.url
    conn = http.client.HTTPConnection("127.0.0.1", faultproxy.port, timeout=10)

    def call(op, payload, **kw):
        body = json.dumps(payload).encode()
        headers = dict(ddb.signed_headers(u, op, body))
        headers.update(kw.pop("extra", {}))
        if kw.get("encode_chunked"):
            headers.pop("Content-Length", None)
            headers["Transfer-Encoding"] = "chunked"
            body = iter([body[:10], body[10:]])
        conn.request("POST", "/", body=body, headers=headers, **kw)
        r = conn.getresponse()
        return r.status, json.loads(r.read())

    faultproxy.push("throttle", op="PutItem")
    st, doc = call("PutItem", {"TableName": ddb_table, "Item": item("k", 1)})
    assert st == 400 and doc["__type"].endswith("#ProvisionedThroughputExceededException")
    st, _ = call("PutItem", {"TableName": ddb_table, "Item": item("k", 1)})
    assert st == 200
    st, _ = call("PutItem", {"TableName": ddb_table, "Item": item("k", 2)},
                 extra={"Expect": "100-continue"})
    assert st == 200
    st, _ = call("PutItem", {"TableName": ddb_table, "Item": item("k", 3)}, encode_chunked=True)
    assert st == 200
    st, doc = call("Query", {"TableName": ddb_table, "KeyConditionExpression": "conversation = :c",
                             "ExpressionAttributeValues": {":c": {"S": "k"}}})
    assert st == 200 and doc["Count"] == 3
    conn.close()
    assert faultproxy.counts["connections"] == 1  # five requests, one connection
    assert faultproxy.counts["requests"] == 5


# --- each fault, seen from a plain client ---------------------------------------------

ERROR_FAULTS = [("throttle", 400, "ProvisionedThroughputExceededException"),
                ("500", 500, "InternalServerError"),
                ("503", 503, "ServiceUnavailable"),
                ("credentials", 400, "UnrecognizedClientException"),
                ("expired_token", 400, "ExpiredTokenException"),
                ("validation", 400, "ValidationException"),
                ("not_found", 400, "ResourceNotFoundException")]


@pytest.mark.parametrize("fault,status,type_", ERROR_FAULTS)
def test_error_faults(faultproxy, dynalite, ddb_table, fault, status, type_):
    faultproxy.push(fault, n=2, op="BatchWriteItem")
    # Another operation is not affected.
    assert ddb.query_all(faultproxy.url, ddb_table, "conv-a") == []
    for _ in range(2):
        with pytest.raises(ddb.DdbError) as e:
            ddb.batch_write(faultproxy.url, ddb_table, [item("conv-a", 1)])
        assert (e.value.status, e.value.type) == (status, type_)
        assert e.value.message
        assert ddb.scan_all(dynalite, ddb_table) == []  # nothing reached dynalite
    ddb.batch_write(faultproxy.url, ddb_table, [item("conv-a", 1)])
    assert len(ddb.scan_all(dynalite, ddb_table)) == 1
    c = faultproxy.counts
    assert c[fault] == 2 and c["op:BatchWriteItem"] == 3 and c["forwarded"] == 2
    assert faultproxy.pending == 0


def test_error_answer_looks_like_dynamodb(faultproxy):
    faultproxy.push("throttle")
    conn = http.client.HTTPConnection("127.0.0.1", faultproxy.port, timeout=10)
    body = b"{}"
    conn.request("POST", "/", body=body,
                 headers=dict(ddb.signed_headers(faultproxy.url, "ListTables", body)))
    r = conn.getresponse()
    data = r.read()
    assert r.status == 400
    assert r.getheader("Content-Type") == "application/x-amz-json-1.0"
    assert r.getheader("x-amzn-RequestId")
    assert int(r.getheader("x-amz-crc32")) == zlib.crc32(data)
    conn.close()


def test_fault_queue_order_and_any_op(faultproxy, ddb_table):
    faultproxy.push("500").push("throttle", n=2)
    seen = []
    for _ in range(4):
        try:
            ddb.query_all(faultproxy.url, ddb_table, "x")
            seen.append("ok")
        except ddb.DdbError as e:
            seen.append(e.type)
    assert seen == ["InternalServerError", "ProvisionedThroughputExceededException",
                    "ProvisionedThroughputExceededException", "ok"]
    assert [f for _, f in faultproxy.log] == ["500", "throttle", "throttle", None]


def test_garbage(faultproxy, dynalite, ddb_table):
    """garbage: the write reaches dynalite, the answer is a 200 HTML page, not JSON."""
    faultproxy.push("garbage", op="BatchWriteItem")
    conn = http.client.HTTPConnection("127.0.0.1", faultproxy.port, timeout=10)
    body = json.dumps({"RequestItems": {ddb_table: [
        {"PutRequest": {"Item": item("conv-g", 1)}}]}}).encode()
    conn.request("POST", "/", body=body,
                 headers=dict(ddb.signed_headers(faultproxy.url, "BatchWriteItem", body)))
    r = conn.getresponse()
    data = r.read()
    conn.close()
    assert r.status == 200 and r.getheader("Content-Type") == "text/html"
    assert data.startswith(b"<html>")
    with pytest.raises(ValueError):
        json.loads(data)
    assert len(ddb.scan_all(dynalite, ddb_table)) == 1  # the write itself happened
    assert faultproxy.counts["garbage"] == 1 and faultproxy.pending == 0


def test_unprocessed(faultproxy, dynalite, ddb_table):
    a = [item("conv-a", i) for i in range(25)]
    faultproxy.push("unprocessed")
    # A Query does not use up an "unprocessed" fault.
    ddb.query_all(faultproxy.url, ddb_table, "conv-a")
    r = ddb.batch_write(faultproxy.url, ddb_table, a)
    back = r["UnprocessedItems"][ddb_table]
    assert [w["PutRequest"]["Item"] for w in back] == a[12:]
    assert ddb.query_all(dynalite, ddb_table, "conv-a") == a[:12]
    # The client retries what came back, as it must.
    r = ddb.request(faultproxy.url, "BatchWriteItem", {"RequestItems": r["UnprocessedItems"]})
    assert not r.get("UnprocessedItems")
    assert ddb.query_all(dynalite, ddb_table, "conv-a") == a
    assert faultproxy.counts["unprocessed"] == 1
    assert faultproxy.counts["unprocessed_items"] == 13
    # One item: nothing is written, the item comes back.
    faultproxy.push("unprocessed")
    one = item("conv-b", 1)
    r = ddb.batch_write(faultproxy.url, ddb_table, [one])
    assert r["UnprocessedItems"] == {ddb_table: [{"PutRequest": {"Item": one}}]}
    assert ddb.query_all(dynalite, ddb_table, "conv-b") == []


def test_slow(faultproxy, ddb_table):
    faultproxy.push("slow", ms=400)
    t = time.monotonic()
    ddb.batch_write(faultproxy.url, ddb_table, [item("c", 1)])
    assert time.monotonic() - t >= 0.4
    t = time.monotonic()
    ddb.batch_write(faultproxy.url, ddb_table, [item("c", 2)])
    assert time.monotonic() - t < 0.4
    assert len(ddb.query_all(faultproxy.url, ddb_table, "c")) == 2
    assert faultproxy.counts["slow"] == 1


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_hang_until_client_closes(faultproxy, dynalite, ddb_table):
    faultproxy.push("hang")
    t = time.monotonic()
    with pytest.raises((socket.timeout, urllib.error.URLError)) as e:
        ddb.request(faultproxy.url, "BatchWriteItem",
                    {"RequestItems": {ddb_table: [{"PutRequest": {"Item": item("c", 1)}}]}},
                    timeout=0.5)
    assert "timed out" in str(e.value)
    assert time.monotonic() - t >= 0.5
    # The client closed its socket: the proxy lets go of the connection too.
    assert _wait(lambda: faultproxy.open_connections == 0)
    assert ddb.scan_all(dynalite, ddb_table) == []
    ddb.batch_write(faultproxy.url, ddb_table, [item("c", 1)])
    assert faultproxy.counts["hang"] == 1


def test_refuse(faultproxy, dynalite, ddb_table):
    faultproxy.push("refuse", op="BatchWriteItem")
    with pytest.raises(OSError):  # http.client.RemoteDisconnected is a ConnectionResetError
        ddb.batch_write(faultproxy.url, ddb_table, [item("c", 1)])
    assert ddb.scan_all(dynalite, ddb_table) == []
    ddb.batch_write(faultproxy.url, ddb_table, [item("c", 1)])
    assert len(ddb.scan_all(dynalite, ddb_table)) == 1
    assert faultproxy.counts["refuse"] == 1


def test_drop_then_idempotent_retry(faultproxy, dynalite, ddb_table):
    a = [item("c", i) for i in range(5)]
    faultproxy.push("drop", op="BatchWriteItem")
    with pytest.raises(OSError):
        ddb.batch_write(faultproxy.url, ddb_table, a)
    # The write happened although the client never heard of it...
    assert ddb.query_all(dynalite, ddb_table, "c") == a
    # ...and sending it again changes nothing.
    assert not ddb.batch_write(faultproxy.url, ddb_table, a).get("UnprocessedItems")
    assert ddb.query_all(dynalite, ddb_table, "c") == a
    c = faultproxy.counts
    assert c["drop"] == 1 and c["forwarded"] == 2


def test_probability(dynalite, ddb_table):
    p = FaultProxy(dynalite, seed=7).start()
    try:
        p.set_probability("throttle", 0.5, op="Query")
        outcomes = []
        for _ in range(40):
            try:
                ddb.query_all(p.url, ddb_table, "c")
                outcomes.append(True)
            except ddb.DdbError as e:
                assert e.type == "ProvisionedThroughputExceededException"
                outcomes.append(False)
        fails = outcomes.count(False)
        assert 5 <= fails <= 35, outcomes
        assert p.counts["throttle"] == fails
        ddb.batch_write(p.url, ddb_table, [item("c", 1)])  # another op: never
        p.set_probability("throttle", 0, op="Query")
        for _ in range(10):
            ddb.query_all(p.url, ddb_table, "c")
        assert p.counts["throttle"] == fails
        assert not p.errors
    finally:
        p.stop()


def test_down_and_up_on_same_port(faultproxy, ddb_table):
    url = faultproxy.url
    conn = http.client.HTTPConnection("127.0.0.1", faultproxy.port, timeout=5)
    conn.connect()
    faultproxy.set_down(True)
    assert faultproxy.down
    with pytest.raises((ConnectionRefusedError, urllib.error.URLError)) as e:
        ddb.query_all(url, ddb_table, "c")
    assert "refused" in str(e.value).lower()
    # A connection that was open when it went down is closed too.
    assert _wait(lambda: faultproxy.open_connections == 0)
    with pytest.raises(OSError):
        conn.request("POST", "/", body=b"{}",
                     headers=dict(ddb.signed_headers(url, "ListTables", b"{}")))
        conn.getresponse()
    conn.close()
    faultproxy.set_down(False)
    assert faultproxy.url == url and not faultproxy.down
    assert ddb.query_all(url, ddb_table, "c") == []
    # Down for a period, then back by itself.
    faultproxy.set_down(True, seconds=0.5)
    with pytest.raises((ConnectionRefusedError, urllib.error.URLError)):
        ddb.query_all(url, ddb_table, "c")
    assert _wait(lambda: not faultproxy.down)
    assert ddb.query_all(url, ddb_table, "c") == []
    assert faultproxy.counts["down"] == 2


def test_down_blackhole(faultproxy, ddb_table):
    faultproxy.set_down(True, mode="blackhole")
    with pytest.raises((socket.timeout, urllib.error.URLError)) as e:
        ddb.request(faultproxy.url, "ListTables", {}, timeout=0.5)
    assert "timed out" in str(e.value)
    faultproxy.set_down(False)
    assert ddb.query_all(faultproxy.url, ddb_table, "c") == []
    assert faultproxy.counts["blackholed"] == 1


def test_stop_releases_hung_clients(dynalite):
    p = FaultProxy(dynalite).start()
    p.push("hang")
    s = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    body = b"{}"
    head = "".join("%s: %s\r\n" % kv for kv in ddb.signed_headers(p.url, "ListTables", body))
    s.sendall(("POST / HTTP/1.1\r\n%sContent-Length: 2\r\n\r\n" % head).encode() + body)
    assert _wait(lambda: p.counts.get("hang") == 1)
    t = time.monotonic()
    p.stop()
    assert s.recv(100) == b""  # closed, no answer
    assert time.monotonic() - t < 3
    s.close()


def test_unknown_fault_rejected(faultproxy):
    with pytest.raises(ValueError):
        faultproxy.push("explode")
    with pytest.raises(ValueError):
        faultproxy.set_down(True, mode="sideways")
