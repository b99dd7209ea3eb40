"""clients/python/convo_client.py against the real daemon: every method, errors as
ConvoError, pipelined batches, and the summary helper's conflict detection."""
import os
import socket
import sys
import tempfile
import threading
import time

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

from convo_client import ConvoClient, ConvoError  # noqa: E402


@pytest.fixture
def client(daemon):
    c = ConvoClient(daemon.socket, timeout=10)
    yield c
    c.close()


def contents_of(maps):
    return [m["message"]["contents"] for m in maps]


def dialogue(client, conv):
    """user Hi, assistant Hello!, user How are you (unanswered)."""
    client.add_user(conv, "Hi")
    client.add_assistant(conv, "Hello!")
    client.add_user(conv, "How are you")


# -- adding messages ------------------------------------------------------------------------

def test_add_user_and_merge(client):
    r = client.add_user("c1", "Hi")
    assert r["merged"] is False
    assert r["message"]["message"] == {"role": "user", "contents": ["Hi"]}
    r2 = client.add_user("c1", ["how", "are you"])
    assert r2["merged"] is True and r2["message"]["id"] == r["message"]["id"]
    assert r2["message"]["message"]["contents"] == ["Hi", "how", "are you"]
    r3 = client.add_user("c1", ("tuple",))
    assert r3["message"]["message"]["contents"][-1] == "tuple"


def test_add_assistant_inserts_fake_user(client):
    r = client.add_assistant("c2", "Hello!", metadata={"timing": {"llmStart": 10, "llmEnd": 20}})
    assert r["message"]["message"]["role"] == "assistant"
    assert r["message"]["metadata"]["timing"]["llmEnd"] == 20
    log = client.to_messages_map("c2", incremental=False)["messages"]
    assert contents_of(log) == [["..."], ["Hello!"]]
    assert log[0]["metadata"]["attribute"] == ["fake"]


def test_add_message_and_errors(client):
    r = client.add_message("c3", "user", ["Good, ", "thank you!"], metadata={"aux": {"k": 1}})
    assert r["message"]["message"]["contents"] == ["Good, ", "thank you!"]
    assert r["message"]["metadata"]["aux"] == {"k": 1}
    with pytest.raises(ConvoError) as e:
        client.add_message("c3", "summary", "no")
    assert e.value.code == "bad_request"
    assert e.value.message and "bad_request" in str(e.value)
    with pytest.raises(ConvoError) as e:
        client.add_user("c3", ["", "  "])
    assert e.value.code == "bad_request"
    with pytest.raises(TypeError):
        client.add_user("c3", b"bytes")
    # Errors leave the connection usable and the conversation unchanged.
    assert len(client.to_messages_map("c3", incremental=False)["messages"]) == 1


# -- reading --------------------------------------------------------------------------------

def test_get_messages_formats(client):
    dialogue(client, "g")
    meta = client.get_messages("g")
    assert meta["summary"] is None
    assert contents_of(meta["messages"]) == [["Hi"], ["Hello!"], ["How are you"]]
    assert client.get_messages("g", format="bedrock")["messages"][0] == {
        "role": "user", "content": [{"text": "Hi"}]}
    for fmt in ("anthropic", "openai"):
        assert client.get_messages("g", format=fmt)["messages"][1] == {
            "role": "assistant", "content": [{"type": "text", "text": "Hello!"}]}
    with pytest.raises(ConvoError) as e:
        client.get_messages("g", format="yaml")
    assert e.value.code == "bad_request"
    with pytest.raises(ConvoError) as e:
        client.get_messages("nobody")
    assert e.value.code == "not_found"


def test_get_summary_info_and_formatting(client):
    assert client.add_user("s", "Hi")
    empty = client.get_summary_info("s", preamble="P")
    assert empty["ids"] == [] and empty["versions"] == [] and empty["text"] == "P"
    client.add_assistant("s", ["I am fine", "and you?"])
    client.add_user("s", "Good")
    info = client.get_summary_info("s")
    assert [m["role"] for m in info["messages"]] == ["user", "assistant"]
    assert [m["index"] for m in info["messages"]] == [0, 1]
    assert info["ids"] == [m["id"] for m in info["messages"]]
    assert info["versions"] == [1, 1]
    assert info["text"] == "[User]: Hi.\n[Assistant]: I am fine. and you?"
    info = client.get_summary_info("s", preamble="Summary:\n", format={
        "prefix": "", "postfix": ": ", "user_tag": "U", "assistant_tag": "A",
        "separator": "/", "closure": "; "})
    assert info["text"] == "Summary:\nU: Hi.; A: I am fine./and you?"
    with pytest.raises(ConvoError) as e:
        client.get_summary_info("s", format={"bogus": "x"})
    assert e.value.code == "bad_request"


def test_add_summary_get_last_summary(client):
    dialogue(client, "s2")
    assert client.get_last_summary("s2") == {"message": None}
    info = client.get_summary_info("s2")
    r = client.add_summary("s2", "They greeted.", info["ids"], versions=info["versions"])
    assert r["message"]["message"] == {"role": "summary", "contents": ["They greeted."]}
    assert r["message"]["metadata"]["summaryIds"] == info["ids"]
    assert client.get_last_summary("s2") == r
    view = client.get_messages("s2")
    assert view["summary"] == ["They greeted."]
    assert contents_of(view["messages"]) == [["How are you"]]
    client.add_assistant("s2", "Fine.")
    info2 = client.get_summary_info("s2", include_previous_summary=True)
    assert info2["previous_summary"] == r["message"]
    assert info2["ids"][0] == r["message"]["id"]
    assert info2["text"].startswith("[Previous Dialogue]: They greeted.\n\n[User]: How are you.")
    with pytest.raises(ConvoError) as e:
        client.add_summary("s2", "x", [])
    assert e.value.code == "bad_request"


def test_to_messages_map(client):
    dialogue(client, "m")
    assert contents_of(client.to_messages_map("m")["messages"]) == [["Hi"], ["Hello!"]]
    assert client.to_messages_map("m")["messages"] == []
    last = client.to_messages_map("m", exclude_last=False)["messages"]
    assert contents_of(last) == [["How are you"]]
    client.add_user("m", "again")  # a merge makes the message due again
    assert contents_of(client.to_messages_map("m", exclude_last=False)["messages"]) == [
        ["How are you", "again"]]
    assert len(client.to_messages_map("m", incremental=False)["messages"]) == 3


def test_set_metadata(client):
    mid = client.add_user("md", "Hi")["message"]["id"]
    r = client.set_metadata("md", mid, timing={"playStart": 5, "playEnd": 9},
                            aux={"stopped": True, "n": [1, 2]})
    md = r["message"]["metadata"]
    assert md["timing"]["playStart"] == 5 and md["timing"]["playEnd"] == 9
    assert md["aux"] == {"stopped": True, "n": [1, 2]}
    r = client.set_metadata("md", mid, aux={"n": None})
    assert r["message"]["metadata"]["aux"] == {"stopped": True}
    with pytest.raises(ConvoError) as e:
        client.set_metadata("md", mid, timing={"playStart": -1})
    assert e.value.code == "bad_request"
    with pytest.raises(ConvoError) as e:
        client.set_metadata("md", "01ARZ3NDEKTSV4RRFFQ69G5FAV", aux={"a": 1})
    assert e.value.code == "not_found"


def test_describe(client):
    client.add_assistant("d", "Hello!")
    client.add_user("d", "Hi, there")
    text = client.describe("d")["text"]
    assert isinstance(text, str)
    rows = [r for r in text.splitlines() if r.strip()]
    assert any("Hello!" in r for r in rows) and any("Hi, there" in r for r in rows)
    assert any("*" in r and "..." in r for r in rows)  # the fake user message is first


# -- daemon ops -----------------------------------------------------------------------------

def test_flush_close_list_stats_ping(client):
    dialogue(client, "b")
    client.add_user("a", "x")
    lst = client.list()["conversations"]
    assert [(c["conversation"], c["messages"]) for c in lst] == [("a", 1), ("b", 3)]
    assert isinstance(client.flush("b")["flushed"], int)
    assert isinstance(client.flush()["flushed"], int)
    assert isinstance(client.close_conversation("a")["flushed"], int)
    assert [c["conversation"] for c in client.list()["conversations"]] == ["b"]
    # Closed: persisted and out of memory; naming it again restores it from the store.
    assert client.close_conversation("a")["flushed"] == 0
    with pytest.raises(ConvoError) as e:
        client.close_conversation("never-created")
    assert e.value.code == "not_found"
    ping = client.ping()
    assert ping["pong"] is True and ping["protocol"] == 1 and isinstance(ping["version"], str)
    stats = client.stats()
    assert stats["conversations"] == 1
    assert stats["requests"]["by_op"]["add_user"] == 3
    assert stats["errors"]["by_code"]["not_found"] == 1


# -- batch ----------------------------------------------------------------------------------

def test_batch_pipelines_in_order_and_returns_errors(client):
    reqs = [{"id": i, "op": "add_user", "conversation": "p%d" % (i % 3), "contents": str(i)}
            for i in range(300)]
    reqs.insert(150, {"id": "bad", "op": "nope"})
    resps = client.batch(reqs)
    assert len(resps) == 301
    assert [r.get("id") for r in resps] == [r["id"] for r in reqs]
    assert resps[150]["ok"] is False and resps[150]["error"]["code"] == "unknown_op"
    assert all(r["ok"] for i, r in enumerate(resps) if i != 150)
    assert client.batch([]) == []
    # The connection is still in step afterwards.
    assert client.ping()["pong"] is True
    assert [c["messages"] for c in client.list()["conversations"]] == [1, 1, 1]


def test_batch_beyond_the_daemons_output_limit(daemon_factory):
    d = daemon_factory(args=["--max-output-bytes", "65536"])
    with ConvoClient(d.socket, timeout=10) as c:
        c.add_user("big", "y" * 30000)
        resps = c.batch([{"op": "get_messages", "conversation": "big"}] * 300)  # ~9 MB
        assert len(resps) == 300
        assert all(r["result"]["messages"][0]["message"]["contents"] == ["y" * 30000]
                   for r in resps)


# -- summarize ------------------------------------------------------------------------------

def test_summarize_nothing_to_do(client):
    client.add_user("z", "Hi")
    called = []
    assert client.summarize("z", called.append) is None
    assert called == []
    assert client.get_last_summary("z") == {"message": None}


def test_summarize_round_trip_with_format(client):
    dialogue(client, "sz")
    seen = []

    def fn(text):
        seen.append(text)
        return ["The user greeted;", "the assistant answered."]

    r = client.summarize("sz", fn, preamble="Summarize:\n", user_tag="Caller")
    assert seen == ["Summarize:\n[Caller]: Hi.\n[Assistant]: Hello!"]
    assert r["message"]["message"]["contents"] == ["The user greeted;", "the assistant answered."]
    assert client.get_last_summary("sz") == r
    assert contents_of(client.get_messages("sz")["messages"]) == [["How are you"]]
    with pytest.raises(TypeError):
        client.summarize("sz", fn, colour="red")


def test_summary_conflict_after_merge_into_summarized_message(client):
    """get_summary_info, then a reply merged into the summarized assistant message, then
    add_summary with the versions: conflict, and nothing changes."""
    client.add_user("cf", "Hi")
    client.add_assistant("cf", "Hello!")
    info = client.get_summary_info("cf")
    merged = client.add_assistant("cf", "Can I help?")
    assert merged["merged"] is True and merged["message"]["id"] == info["ids"][-1]
    before = client.to_messages_map("cf", incremental=False)
    with pytest.raises(ConvoError) as e:
        client.add_summary("cf", "Greetings.", info["ids"], versions=info["versions"])
    assert e.value.code == "conflict"
    assert client.to_messages_map("cf", incremental=False) == before
    assert client.get_last_summary("cf") == {"message": None}
    # A fresh info covers the merged contents and succeeds.
    info2 = client.get_summary_info("cf")
    assert info2["versions"][-1] == info["versions"][-1] + 1
    assert "Can I help?" in info2["text"]
    client.add_summary("cf", "Greetings.", info2["ids"], versions=info2["versions"])


def test_summarize_raises_conflict_when_a_reply_is_merged_meanwhile(daemon, client):
    client.add_user("cs", "Hi")
    client.add_assistant("cs", "Hello!")
    other = ConvoClient(daemon.socket, timeout=10)

    def slow_llm(text):
        # While "the LLM" writes the summary, the assistant's reply grows.
        assert other.add_assistant("cs", "One more thing.")["merged"] is True
        return "Greetings."

    try:
        with pytest.raises(ConvoError) as e:
            client.summarize("cs", slow_llm)
    finally:
        other.close()
    assert e.value.code == "conflict"
    assert client.get_last_summary("cs") == {"message": None}
    r = client.summarize("cs", lambda text: "Greetings, " + str("One more thing." in text))
    assert r["message"]["message"]["contents"] == ["Greetings, True"]


# -- connection handling --------------------------------------------------------------------

def test_context_manager_and_reconnect(daemon):
    with ConvoClient(daemon.socket, timeout=10) as c:
        assert c.ping()["pong"] is True
        sock = c._sock
        assert sock is not None
    assert c._sock is None and sock.fileno() == -1
    assert c.ping()["pong"] is True  # a new connection on demand
    c.close()


def test_default_path_from_environment(daemon, monkeypatch):
    monkeypatch.setenv("CONVOD_SOCKET", daemon.socket)
    c = ConvoClient()
    try:
        assert c.path == daemon.socket
        assert c.ping()["pong"] is True
    finally:
        c.close()
    monkeypatch.delenv("CONVOD_SOCKET")
    assert ConvoClient().path == "/run/convod/convod.sock"


def test_unreachable_socket_raises_oserror():
    with tempfile.TemporaryDirectory() as d:
        c = ConvoClient(os.path.join(d, "none.sock"), timeout=2)
        with pytest.raises(OSError):
            c.ping()


def test_silent_daemon_raises_timeout():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "silent.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        release = threading.Event()

        def serve():
            conn, _ = srv.accept()
            release.wait(30)
            conn.close()

        t = threading.Thread(target=serve, daemon=True)
        t.start()
        c = ConvoClient(path, timeout=0.5)
        try:
            with pytest.raises(TimeoutError):
                c.ping()
            assert c._sock is None  # never reused after a timeout
        finally:
            release.set()
            t.join(10)
            srv.close()


def hold_connection(d):
    """A working connection to d. The harness's readiness probe may not be closed yet on the
    daemon's side, so a refusal is retried for a while."""
    deadline = time.monotonic() + 10
    while True:
        c = d.connect()
        r = c.request({"op": "ping"})
        if r.get("ok"):
            return c
        assert r["error"]["code"] == "unavailable", r
        assert time.monotonic() < deadline, "the daemon never accepted a connection"
        time.sleep(0.02)


def test_refused_over_connection_limit_is_unavailable(daemon_factory):
    d = daemon_factory(args=["--max-connections", "1"])
    held = hold_connection(d)
    c = ConvoClient(d.socket, timeout=10)
    try:
        with pytest.raises(ConvoError) as e:
            c.ping()
        assert e.value.code == "unavailable"
    finally:
        c.close()
