"""convoctl against the real daemon: every command, the exit statuses (0 ok, 1 error answer,
2 usage, 3 unreachable), --raw, the stdin raw mode with pipelining, and the admin commands
(metrics, spool, dead letters, create-table against dynalite, follow)."""
import json
import os
import re
import select
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid

import pytest

import ddb
from conftest import CONVOCTL, ROOT, TIMEOUT_SCALE

MAN_PAGE = os.path.join(ROOT, "clients", "convoctl.1")
COMMANDS = ["add-user", "add-assistant", "add-message", "get-messages", "summary-info",
            "add-summary", "last-summary", "messages-map", "set-metadata", "describe", "flush",
            "close", "list", "stats", "ping", "metrics", "spool", "store", "dead-letters",
            "retry-dead-letters", "create-table", "follow", "raw"]


def run(args, socket_path=None, stdin=b"", env=None, timeout=60):
    """Runs convoctl; returns the CompletedProcess (stdout/stderr as text). A sanitizer
    report on stderr fails the test."""
    assert os.path.exists(CONVOCTL), "convoctl not built: " + CONVOCTL
    cmd = [CONVOCTL]
    if socket_path is not None:
        cmd += ["--socket", socket_path]
    cmd += list(args)
    full_env = dict(os.environ)
    full_env.pop("CONVOD_SOCKET", None)
    if env:
        full_env.update(env)
    p = subprocess.run(cmd, input=stdin, capture_output=True, env=full_env, timeout=timeout)
    out = p.stdout.decode()
    err = p.stderr.decode()
    assert "Sanitizer" not in err and "runtime error:" not in err, err
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@pytest.fixture
def ctl(daemon):
    """ctl(*args, expect=0, stdin=b"") -> CompletedProcess, asserting the exit status."""

    def call(*args, expect=0, stdin=b"", env=None):
        p = run(args, daemon.socket, stdin=stdin, env=env)
        assert p.returncode == expect, (args, p.returncode, p.stdout, p.stderr)
        return p

    return call


@pytest.fixture
def ctl_json(ctl):
    """ctl_json(*args) -> the printed result, parsed; asserts exit 0."""

    def call(*args):
        return json.loads(ctl(*args).stdout)

    return call


def error_code(p):
    m = re.search(r"^convoctl: ([a-z_]+): ", p.stderr, re.M)
    assert m, p.stderr
    return m.group(1)


# -- help, version, usage errors (exit 2) ---------------------------------------------------

def test_help_lists_every_command_and_the_man_page_documents_them():
    p = run(["--help"])
    assert p.returncode == 0
    with open(MAN_PAGE) as f:
        man = f.read().replace("\\-", "-")
    for name in COMMANDS:
        assert re.search(r"^  %s\b" % re.escape(name), p.stdout, re.M), name
        assert re.search(r"\\fB%s\\fR|^\.BR? %s\b" % (re.escape(name), re.escape(name)), man,
                         re.M), "man page lacks " + name
    for opt in ["--socket", "--raw", "--timeout", "--format", "--preamble",
                "--include-previous-summary", "--ids", "--versions", "--full",
                "--include-last", "--timing", "--aux", "--user-tag", "--summary-closure",
                "--limit", "--interval", "--count"]:
        assert opt in p.stdout, opt
        assert opt in man, "man page lacks " + opt
    assert "Usage:" in p.stdout
    assert run(["ping", "--help"]).stdout == p.stdout


def test_version_matches_daemon(ctl_json):
    p = run(["--version"])
    assert p.returncode == 0
    assert ctl_json("ping")["version"] in p.stdout


@pytest.mark.parametrize("args", [
    [],
    ["bogus"],
    ["--bogus", "ping"],
    ["--timeout"],
    ["--timeout", "soon", "ping"],
    ["--timeout", "-1", "ping"],
    ["--socket"],
    ["ping", "extra"],
    ["list", "--full"],
    ["add-user", "c1"],
    ["add-assistant"],
    ["add-message", "c1", "user"],
    ["get-messages"],
    ["get-messages", "c1", "c2"],
    ["get-messages", "c1", "--format"],
    ["summary-info", "c1", "--ids", "a"],
    ["add-summary", "c1", "text"],
    ["add-summary", "c1", "text", "--ids", "a,,b"],
    ["add-summary", "c1", "text", "--ids", "a", "--versions", "1,x"],
    ["last-summary"],
    ["messages-map", "c1", "--incremental"],
    ["set-metadata", "c1"],
    ["set-metadata", "c1", "m1", "--timing", "playStart"],
    ["set-metadata", "c1", "m1", "--timing", "playStart=soon"],
    ["set-metadata", "c1", "m1", "--aux", "note=not json"],
    ["set-metadata", "c1", "m1", "--aux", "=1"],
    ["describe", "c1", "c2"],
    ["flush", "c1", "c2"],
    ["close"],
    ["raw", "extra"],
    ["metrics", "extra"],
    ["metrics", "--format", "json"],
    ["spool", "x"],
    ["store", "x"],
    ["dead-letters", "--limit"],
    ["dead-letters", "--limit", "ten"],
    ["dead-letters", "--limit", "1", "x"],
    ["dead-letters", "--count", "1"],
    ["retry-dead-letters", "x"],
    ["create-table", "t"],
    ["follow"],
    ["follow", "c1", "c2"],
    ["follow", "c1", "--interval", "0"],
    ["follow", "c1", "--interval", "soon"],
    ["follow", "c1", "--interval", "86400001"],
    ["follow", "c1", "--count", "0"],
    ["follow", "c1", "--count"],
    ["follow", "c1", "--limit", "1"],
    ["add-user", "c1", b"\xff invalid UTF-8"],
])
def test_usage_errors_exit_2_and_send_nothing(daemon, args):
    c = daemon.connect()
    accepted = c.ok({"op": "stats"})["connections"]["accepted"]
    p = run(args, daemon.socket)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.startswith("convoctl: ")
    assert "Usage:" in p.stderr
    assert p.stdout == ""
    assert c.ok({"op": "stats"})["connections"]["accepted"] == accepted  # never connected
    assert c.ok({"op": "list"})["conversations"] == []


# -- unreachable or silent daemon (exit 3) -------------------------------------------------

def test_missing_socket_exits_3():
    with tempfile.TemporaryDirectory() as d:
        p = run(["ping"], os.path.join(d, "nothing.sock"))
    assert p.returncode == 3
    assert "cannot connect" in p.stderr and "nothing.sock" in p.stderr
    assert p.stdout == ""


def test_socket_without_listener_exits_3():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "dead.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(path)  # bound, never listening: connect is refused
        try:
            p = run(["ping"], path)
        finally:
            s.close()
    assert p.returncode == 3
    assert "cannot connect" in p.stderr


class FakeServer:
    """A socket that accepts one client and runs handler(conn) in a thread."""

    def __init__(self, handler):
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "fake.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(4)
        self.handler = handler
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conn, _ = self.sock.accept()
        with conn:
            self.handler(conn)

    def close(self):
        self.sock.close()
        self.thread.join(10)
        self.dir.cleanup()


def read_lines(conn, n):
    buf = b""
    while buf.count(b"\n") < n:
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n")[:n]


def test_silent_daemon_times_out_with_exit_3():
    release = threading.Event()
    srv = FakeServer(lambda conn: release.wait(30))
    try:
        t0 = time.monotonic()
        p = run(["--timeout", "0.5", "ping"], srv.path)
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        srv.close()
    assert p.returncode == 3
    assert "no answer" in p.stderr
    assert 0.4 < elapsed < 10


def test_connection_closed_before_answer_exits_3():
    srv = FakeServer(lambda conn: read_lines(conn, 1))
    try:
        p = run(["ping"], srv.path)
    finally:
        srv.close()
    assert p.returncode == 3
    assert "closed the connection" in p.stderr


@pytest.mark.parametrize("later", [b"", b"\n  \n", b'{"op":"ping"}\n'])
def test_stdin_after_the_daemon_closed(later):
    """A daemon that closes after answering everything sent so far is fine if stdin has
    nothing more (its end, blank lines: exit 0, as when both arrive at once); a request
    that comes later cannot be sent (exit 3)."""
    srv = FakeServer(lambda conn: (read_lines(conn, 1), conn.sendall(b'{"ok":true}\n')))
    try:
        proc = subprocess.Popen([CONVOCTL, "--socket", srv.path, "--timeout", "5", "-"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        proc.stdin.write(b'{"op":"ping"}\n')
        proc.stdin.flush()
        srv.thread.join(10 * TIMEOUT_SCALE)  # answered and closed
        assert not srv.thread.is_alive()
        time.sleep(0.2 * TIMEOUT_SCALE)  # convoctl sees the end of the connection first
        out, err = proc.communicate(later, timeout=10 * TIMEOUT_SCALE)
    finally:
        srv.close()
    assert b"Sanitizer" not in err and b"runtime error:" not in err, err
    assert out == b'{"ok":true}\n'
    if b"op" in later:
        assert proc.returncode == 3, err
        assert b"closed the connection" in err
    else:
        assert proc.returncode == 0, err


def test_client_pipelines_before_reading_answers():
    """The server answers only after it has read all five requests: a client that waited
    for each answer before sending the next request would time out."""
    seen = []

    def handler(conn):
        lines = read_lines(conn, 5)
        seen.extend(lines)
        conn.sendall(b"".join(b'{"ok":true,"result":{"n":%d}}\n' % i for i in range(5)))

    srv = FakeServer(handler)
    try:
        reqs = b"".join(b'{"op":"ping","id":%d}\n' % i for i in range(5))
        p = run(["--timeout", "5", "-"], srv.path, stdin=reqs)
    finally:
        srv.close()
    assert p.returncode == 0, p.stderr
    assert [json.loads(x)["id"] for x in seen] == list(range(5))
    assert [json.loads(x)["result"]["n"] for x in p.stdout.splitlines()] == list(range(5))


def test_malformed_response_exits_1():
    srv = FakeServer(lambda conn: (read_lines(conn, 1), conn.sendall(b"not json\n")))
    try:
        p = run(["ping"], srv.path)
    finally:
        srv.close()
    assert p.returncode == 1
    assert "malformed response" in p.stderr


# -- adding messages ------------------------------------------------------------------------

def test_add_user_string_then_array_merges(ctl_json):
    r = ctl_json("add-user", "c1", "Hi")
    assert r["merged"] is False
    assert r["message"]["message"] == {"role": "user", "contents": ["Hi"]}
    assert isinstance(r["message"]["metadata"]["timing"]["creation"], int)
    r2 = ctl_json("add-user", "c1", "how", "are you")
    assert r2["merged"] is True
    assert r2["message"]["id"] == r["message"]["id"]
    assert r2["message"]["message"]["contents"] == ["Hi", "how", "are you"]
    assert r2["message"]["metadata"]["attribute"] == ["merged"]


def test_add_assistant_on_new_conversation_inserts_fake_user(ctl_json):
    r = ctl_json("add-assistant", "c2", "Hello!")
    assert r["message"]["message"] == {"role": "assistant", "contents": ["Hello!"]}
    log = ctl_json("messages-map", "c2", "--full")["messages"]
    assert [m["message"]["role"] for m in log] == ["user", "assistant"]
    assert log[0]["message"]["contents"] == ["..."]
    assert log[0]["metadata"]["attribute"] == ["fake"]


def test_add_message_roles_and_errors(ctl, ctl_json):
    r = ctl_json("add-message", "c3", "user", "Good, ", "thank you!")
    assert r["message"]["message"] == {"role": "user", "contents": ["Good, ", "thank you!"]}
    r = ctl_json("add-message", "c3", "assistant", "Fine")
    assert r["message"]["message"]["role"] == "assistant"
    p = ctl("add-message", "c3", "summary", "nope", expect=1)
    assert error_code(p) == "bad_request"
    assert p.stdout == ""
    p = ctl("add-user", "c3", "   ", expect=1)
    assert error_code(p) == "bad_request"
    assert len(ctl_json("messages-map", "c3", "--full")["messages"]) == 2


def test_text_after_double_dash_may_start_with_dashes(ctl_json):
    r = ctl_json("add-user", "c4", "--", "--full", "-x")
    assert r["message"]["message"]["contents"] == ["--full", "-x"]


def test_add_with_metadata_options(ctl_json):
    r = ctl_json("add-user", "c5", "Hi", "--timing", "listenStart=1000", "--timing=listenEnd=2000",
                 "--aux", "lang=\"en\"", "--aux", "conf={\"p\": 0.5}")
    md = r["message"]["metadata"]
    assert md["timing"]["listenStart"] == 1000 and md["timing"]["listenEnd"] == 2000
    assert md["aux"] == {"lang": "en", "conf": {"p": 0.5}}


def test_socket_from_environment(daemon):
    p = run(["ping"], None, env={"CONVOD_SOCKET": daemon.socket})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["pong"] is True


# -- reading --------------------------------------------------------------------------------

def make_dialogue(ctl_json, conv):
    ctl_json("add-user", conv, "Hi")
    ctl_json("add-assistant", conv, "Hello!")
    ctl_json("add-user", conv, "How are you")


@pytest.mark.parametrize("fmt", ["meta", "bedrock", "anthropic", "openai", None])
def test_get_messages_formats(ctl_json, fmt):
    make_dialogue(ctl_json, "g1")
    args = ["get-messages", "g1"] + (["--format", fmt] if fmt else [])
    r = ctl_json(*args)
    assert r["summary"] is None
    msgs = r["messages"]
    assert len(msgs) == 3
    if fmt in ("meta", None):
        assert [m["message"]["contents"] for m in msgs] == [["Hi"], ["Hello!"], ["How are you"]]
    elif fmt == "bedrock":
        assert msgs[1] == {"role": "assistant", "content": [{"text": "Hello!"}]}
    else:
        assert msgs[0] == {"role": "user", "content": [{"type": "text", "text": "Hi"}]}


def test_get_messages_bad_format_and_unknown_conversation(ctl, ctl_json):
    make_dialogue(ctl_json, "g2")
    p = ctl("get-messages", "g2", "--format", "yaml", expect=1)
    assert error_code(p) == "bad_request"
    p = ctl("get-messages", "nobody", expect=1)
    assert error_code(p) == "not_found"
    assert p.stderr.startswith("convoctl: not_found: ")


def test_summary_info_text_and_format_options(ctl_json):
    make_dialogue(ctl_json, "s1")
    info = ctl_json("summary-info", "s1")
    assert [m["contents"] for m in info["messages"]] == [["Hi"], ["Hello!"]]
    assert info["ids"] == [m["id"] for m in info["messages"]]
    assert info["versions"] == [1, 1]
    assert info["previous_summary"] is None
    assert info["text"] == "[User]: Hi.\n[Assistant]: Hello!"
    info = ctl_json("summary-info", "s1", "--preamble", "Sum up:\n", "--prefix", "<",
                    "--postfix", "> ", "--user-tag", "U", "--assistant-tag", "A",
                    "--closure", " | ")
    assert info["text"] == "Sum up:\n<U> Hi. | <A> Hello!"


def test_add_summary_and_last_summary(ctl, ctl_json):
    make_dialogue(ctl_json, "s2")
    assert ctl_json("last-summary", "s2") == {"message": None}
    info = ctl_json("summary-info", "s2")
    r = ctl_json("add-summary", "s2", "They said hello.", "--ids", ",".join(info["ids"]),
                 "--versions", ",".join(str(v) for v in info["versions"]))
    summary = r["message"]
    assert summary["message"] == {"role": "summary", "contents": ["They said hello."]}
    assert summary["metadata"]["summaryIds"] == info["ids"]
    assert ctl_json("last-summary", "s2") == {"message": summary}
    view = ctl_json("get-messages", "s2")
    assert view["summary"] == ["They said hello."]
    assert [m["message"]["contents"] for m in view["messages"]] == [["How are you"]]
    # Next round: the previous summary comes first, and can be included in the text.
    ctl_json("add-assistant", "s2", "Fine.")
    info2 = ctl_json("summary-info", "s2", "--include-previous-summary", "--summary-tag", "P",
                     "--summary-closure", " // ")
    assert info2["ids"][0] == summary["id"]
    assert info2["text"] == "[P]: They said hello. // [User]: How are you.\n[Assistant]: Fine."
    # Stale ids: the first summary is no longer the last one after a second summary.
    ctl_json("add-summary", "s2", "Two", "--ids", ",".join(info2["ids"]))
    p = ctl("add-summary", "s2", "Again", "--ids", ",".join(info2["ids"]), expect=1)
    assert error_code(p) == "conflict"


def test_add_summary_versions_detect_a_merge(ctl, ctl_json):
    ctl_json("add-user", "s4", "Hi")
    ctl_json("add-assistant", "s4", "Hello!")
    info = ctl_json("summary-info", "s4")
    ids = ",".join(info["ids"])
    versions = ",".join(str(v) for v in info["versions"])
    # A reply merged into the summarized assistant message after summary-info.
    merged = ctl_json("add-assistant", "s4", "Anything else?")
    assert merged["merged"] is True and merged["message"]["id"] == info["ids"][-1]
    p = ctl("add-summary", "s4", "Greetings.", "--ids", ids, "--versions", versions, expect=1)
    assert error_code(p) == "conflict"
    assert ctl_json("last-summary", "s4") == {"message": None}
    # Without versions the same ids are still a valid start of the view.
    r = ctl_json("add-summary", "s4", "Greetings.", "--ids", ids)
    assert r["message"]["metadata"]["summaryIds"] == info["ids"]


def test_add_summary_empty_ids_is_bad_request(ctl, ctl_json):
    make_dialogue(ctl_json, "s5")
    p = ctl("add-summary", "s5", "x", "--ids", "", expect=1)
    assert error_code(p) == "bad_request"


def test_messages_map_incremental_full_include_last(ctl_json):
    make_dialogue(ctl_json, "m1")
    first = ctl_json("messages-map", "m1")["messages"]
    assert [m["message"]["contents"] for m in first] == [["Hi"], ["Hello!"]]
    assert ctl_json("messages-map", "m1")["messages"] == []
    last = ctl_json("messages-map", "m1", "--include-last")["messages"]
    assert [m["message"]["contents"] for m in last] == [["How are you"]]
    full = ctl_json("messages-map", "m1", "--full")["messages"]
    assert [m["id"] for m in full] == [m["id"] for m in first + last]
    assert ctl_json("messages-map", "m1", "--full", "--include-last")["messages"] == full


def test_set_metadata(ctl, ctl_json):
    r = ctl_json("add-user", "md1", "Hi")
    mid = r["message"]["id"]
    r = ctl_json("set-metadata", "md1", mid, "--timing", "playStart=1744815823080",
                 "--aux", "stopped=true", "--aux", "note=\"late\"")
    md = r["message"]["metadata"]
    assert md["timing"]["playStart"] == 1744815823080
    assert md["aux"] == {"stopped": True, "note": "late"}
    r = ctl_json("set-metadata", "md1", mid, "--aux", "note=null")
    assert r["message"]["metadata"]["aux"] == {"stopped": True}
    p = ctl("set-metadata", "md1", mid, "--timing", "creation=5", expect=1)
    assert error_code(p) == "bad_request"
    p = ctl("set-metadata", "md1", mid, "--timing", "bogusKey=5", expect=1)
    assert error_code(p) == "bad_request"
    p = ctl("set-metadata", "md1", "01ARZ3NDEKTSV4RRFFQ69G5FAV", "--aux", "a=1", expect=1)
    assert error_code(p) == "not_found"


def test_describe_prints_the_text_verbatim(daemon, ctl, ctl_json):
    ctl_json("add-assistant", "d1", "Hello!")
    ctl_json("add-user", "d1", "Hi, there")
    text = daemon.connect().ok({"op": "describe", "conversation": "d1"})["text"]
    out = ctl("describe", "d1").stdout
    assert out == (text if text.endswith("\n") else text + "\n")
    assert "Hello!" in out and "Hi, there" in out and "*" in out
    raw = ctl("--raw", "describe", "d1").stdout
    assert json.loads(raw)["result"]["text"] == text
    assert error_code(ctl("describe", "nobody", expect=1)) == "not_found"


# -- daemon commands ------------------------------------------------------------------------

def test_flush_close_list(ctl, ctl_json):
    make_dialogue(ctl_json, "b")
    ctl_json("add-user", "a", "Hi")
    lst = ctl_json("list")["conversations"]
    assert [c["conversation"] for c in lst] == ["a", "b"]
    assert [c["messages"] for c in lst] == [1, 3]
    assert all(isinstance(c["updated"], int) for c in lst)
    assert isinstance(ctl_json("flush", "b")["flushed"], int)
    assert isinstance(ctl_json("flush")["flushed"], int)
    assert isinstance(ctl_json("close", "a")["flushed"], int)
    assert [c["conversation"] for c in ctl_json("list")["conversations"]] == ["b"]
    # Closed means persisted and out of memory: naming it again restores it from the
    # local store, with nothing left to flush.
    assert ctl_json("close", "a")["flushed"] == 0
    assert error_code(ctl("flush", "nobody", expect=1)) == "not_found"


def test_stats_and_ping(ctl_json):
    ping = ctl_json("ping")
    assert ping["pong"] is True and ping["protocol"] == 1
    before = ctl_json("stats")
    ctl_json("add-user", "st", "Hi")
    ctl_json("ping")
    after = ctl_json("stats")
    for key in ("version", "uptime_ms", "connections", "conversations", "messages",
                "requests", "errors", "spool", "sink", "store"):
        assert key in after, key
    assert after["requests"]["by_op"]["add_user"] == before["requests"]["by_op"].get(
        "add_user", 0) + 1
    assert after["requests"]["by_op"]["ping"] == before["requests"]["by_op"].get("ping", 0) + 1
    assert after["conversations"] == before["conversations"] + 1


def test_raw_output_is_the_response_line(ctl):
    p = ctl("--raw", "add-user", "r1", "Hi")
    assert p.stdout.count("\n") == 1
    resp = json.loads(p.stdout)
    assert resp["ok"] is True and resp["result"]["merged"] is False
    assert ": " not in p.stdout.replace('": "', "")  # compact, as sent by the daemon
    p = ctl("--raw", "get-messages", "nobody", expect=1)
    resp = json.loads(p.stdout)
    assert resp["ok"] is False and resp["error"]["code"] == "not_found"
    assert "convoctl: not_found: " in p.stderr


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


def test_refused_connection_over_the_limit_exits_1(daemon_factory):
    d = daemon_factory(args=["--max-connections", "1"])
    held = hold_connection(d)
    p = run(["ping"], d.socket)
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert "convoctl: unavailable: " in p.stderr
    held.ok({"op": "ping"})  # the held connection is not disturbed


# -- stdin raw mode -------------------------------------------------------------------------

def test_stdin_mode_pipelines_and_prints_every_line(ctl):
    n = 500
    lines = [json.dumps({"id": i, "op": "add_user", "conversation": "p%d" % (i % 7),
                         "contents": "m%d" % i}) for i in range(n)]
    body = "\n".join(lines[:100]) + "\n\n   \n" + "\n".join(lines[100:])  # no final newline
    p = ctl("-", stdin=body.encode())
    out = p.stdout.splitlines()
    assert len(out) == n
    resps = [json.loads(x) for x in out]
    assert [r["id"] for r in resps] == list(range(n))
    assert all(r["ok"] for r in resps)
    merged = [r["result"]["merged"] for r in resps]
    assert merged[:7] == [False] * 7 and all(merged[7:])
    lst = json.loads(ctl("list").stdout)["conversations"]
    assert sorted(c["conversation"] for c in lst) == ["p%d" % i for i in range(7)]


def test_stdin_mode_errors_exit_1_and_go_on(ctl):
    body = b'{"id":1,"op":"ping"}\nnot json\n{"id":2,"op":"nope"}\r\n{"id":3,"op":"ping"}\n'
    p = ctl("raw", stdin=body, expect=1)
    resps = [json.loads(x) for x in p.stdout.splitlines()]
    assert [r.get("id") for r in resps] == [1, None, 2, 3]
    assert [r["ok"] for r in resps] == [True, False, False, True]
    assert resps[1]["error"]["code"] == "parse_error"
    assert resps[2]["error"]["code"] == "unknown_op"
    assert "convoctl: parse_error: " in p.stderr and "convoctl: unknown_op: " in p.stderr


def test_stdin_mode_empty_input(ctl):
    p = ctl("-", stdin=b"\n \n")
    assert p.stdout == ""


def test_stdin_mode_survives_the_daemons_output_limit(daemon_factory):
    """More answers than the daemon may queue: the client must read while it writes."""
    d = daemon_factory(args=["--max-output-bytes", "65536"])
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "big", "contents": "x" * 20000})
    n = 400  # about 8 MB of answers
    body = b"".join(b'{"id":%d,"op":"get_messages","conversation":"big"}\n' % i
                    for i in range(n))
    p = run(["--timeout", "10", "-"], d.socket, stdin=body, timeout=120)
    assert p.returncode == 0, p.stderr
    resps = [json.loads(x) for x in p.stdout.splitlines()]
    assert [r["id"] for r in resps] == list(range(n))
    assert all(len(r["result"]["messages"][0]["message"]["contents"][0]) == 20000 for r in resps)


# -- admin commands -------------------------------------------------------------------------

PROM_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)'
                         r'(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"\n]*"(?:,[a-zA-Z_][a-zA-Z0-9_]*="[^"\n]*")*\})?'
                         r' (-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)$')
PROM_TYPE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge)$")


def parse_prometheus(text):
    """Parses Prometheus text exposition: returns ({name: type}, {(name, labels): value}).
    Fails on any line that is neither a comment nor a sample, on a sample whose metric has
    no # TYPE line before it, and on a repeated sample."""
    assert text.endswith("\n"), repr(text[-50:])
    types, samples = {}, {}
    for line in text[:-1].split("\n"):
        if line.startswith("#"):
            m = PROM_TYPE.match(line)
            if m:
                assert m.group(1) not in types, "TYPE twice: " + line
                types[m.group(1)] = m.group(2)
            continue
        m = PROM_SAMPLE.match(line)
        assert m, "not a Prometheus sample: %r" % line
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        assert name in types, "sample before its # TYPE line: " + line
        assert (name, labels) not in samples, "sample twice: " + line
        samples[(name, labels)] = float(value)
    return types, samples


def test_metrics_is_prometheus_text_of_the_stats(ctl, ctl_json):
    ctl_json("add-user", "pm1", "Hi")
    before = ctl_json("stats")
    for _ in range(3):
        ctl_json("ping")
    ctl("get-messages", "nobody", expect=1)
    out = ctl("metrics").stdout
    assert re.search(r"^# TYPE convod_requests_total counter$", out, re.M), out
    assert re.search(r"^convod_requests_total [0-9]+$", out, re.M), out
    types, samples = parse_prometheus(out)
    assert types["convod_requests_total"] == "counter"
    assert types["convod_conversations"] == "gauge"
    assert samples[("convod_requests_by_op_total", '{op="ping"}')] == \
        before["requests"]["by_op"]["ping"] + 3
    assert samples[("convod_requests_by_op_total", '{op="get_messages"}')] == \
        before["requests"]["by_op"]["get_messages"] + 1
    assert samples[("convod_errors_by_code_total", '{code="not_found"}')] == \
        before["errors"]["by_code"]["not_found"] + 1
    assert types["convod_errors_by_op_total"] == "counter"
    assert samples[("convod_errors_by_op_total", '{op="get_messages"}')] == \
        before["errors"]["by_op"]["get_messages"] + 1
    assert samples[("convod_errors_by_op_total", '{op="ping"}')] == 0
    assert samples[("convod_conversations", "")] == before["conversations"] == 1
    assert samples[("convod_messages", "")] == 1
    # metrics, ping x3, get-messages and stats itself: at least as many as before + 5.
    assert samples[("convod_requests_total", "")] >= before["requests"]["total"] + 5
    assert samples[("convod_info", '{version="%s",sink="local"}' % before["version"])] == 1
    assert samples[("convod_spool_items", "")] == 0
    # The same request through --raw: the text is in the JSON answer, unchanged in form.
    raw = json.loads(ctl("--raw", "metrics").stdout)
    assert raw["result"]["format"] == "prometheus"
    parse_prometheus(raw["result"]["text"])


def test_parse_prometheus_rejects_what_it_should():
    """The parser above must really fail on bad text: a check that always passes proves
    nothing."""
    good = "# TYPE a counter\na 1\na_b 2\n"
    with pytest.raises(AssertionError):
        parse_prometheus(good)  # a_b has no TYPE line
    for bad in ["# TYPE a counter\na one\n", "# TYPE a counter\na{x=1} 1\n",
                "# TYPE a counter\na 1", "# TYPE a counter\na 1\na 2\n",
                "# TYPE a counter\n a 1\n"]:
        with pytest.raises(AssertionError):
            parse_prometheus(bad)
    assert parse_prometheus('# TYPE a gauge\na{q="0.5",k="v"} 1.5e3\n')[1] == \
        {("a", '{q="0.5",k="v"}'): 1500.0}


def test_spool_prints_the_spool_and_sink_of_stats(ctl_json):
    ctl_json("add-user", "sp1", "Hi")
    ctl_json("flush")
    out = ctl_json("spool")
    assert set(out) == {"spool", "sink"}
    stats = ctl_json("stats")
    assert set(out["spool"]) == set(stats["spool"]) >= {"items", "bytes", "oldest_pending_ms"}
    assert set(out["sink"]) == set(stats["sink"])
    assert out["sink"]["kind"] == "local"
    assert out["spool"]["items"] == 0 and out["sink"]["dead_lettered"] == 0


def test_store_prints_the_store_of_stats(ctl_json):
    before = ctl_json("store")
    assert set(before) == {"store"}
    ctl_json("add-user", "so1", "Hi")
    after = ctl_json("store")["store"]
    assert set(after) == set(ctl_json("stats")["store"]) >= {"commits", "fold", "db_bytes"}
    assert after["durability"] == "process"
    assert after["commits"] > before["store"]["commits"]
    assert after["records"] >= before["store"]["records"] + 1


def test_dead_letters_empty_and_retry_nothing(ctl, ctl_json):
    assert ctl_json("dead-letters") == {"dead_letters": []}
    assert ctl_json("dead-letters", "--limit", "5") == {"dead_letters": []}
    assert ctl_json("dead-letters", "--limit=100000") == {"dead_letters": []}
    assert ctl_json("retry-dead-letters") == {"retried": 0}
    # The range is the daemon's to check: exit 1 with its bad_request.
    for limit in ("0", "100001", "-3"):
        p = ctl("dead-letters", "--limit", limit, expect=1)
        assert error_code(p) == "bad_request" and "limit" in p.stderr
        assert p.stdout == ""


def test_create_table_without_dynamodb_is_bad_request(ctl):
    p = ctl("create-table", expect=1)
    assert error_code(p) == "bad_request"
    assert "DynamoDB" in p.stderr
    assert p.stdout == ""


# -- follow ---------------------------------------------------------------------------------

DESCRIBE_HEADER = "META MESSAGES ("


class Follower:
    """convoctl follow running in the background; reads its output with a deadline."""

    def __init__(self, socket_path, args):
        env = dict(os.environ)
        env.pop("CONVOD_SOCKET", None)
        self.proc = subprocess.Popen([CONVOCTL, "--socket", socket_path] + list(args),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, env=env)
        self.out = b""

    def read_until(self, pred, timeout=20.0):
        """Reads stdout until pred(text so far) holds; returns the text."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while not pred(self.out.decode()):
            left = deadline - time.monotonic()
            assert left > 0, "follow printed only %r" % self.out
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                assert chunk, "follow ended early (%s): %r %r" % (
                    self.proc.poll(), self.out, self.proc.stderr.read())
                self.out += chunk
        return self.out.decode()

    def finish(self, timeout=20.0):
        """Waits for the exit; returns (status, all stdout, stderr)."""
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise AssertionError("follow did not exit within %ss" % timeout)
        self.out += out
        err = err.decode()
        assert "Sanitizer" not in err and "runtime error:" not in err, err
        return self.proc.returncode, self.out.decode(), err


def dumps(text):
    """Splits follow's output into describe dumps (each starts with the header line)."""
    parts = text.split(DESCRIBE_HEADER)
    assert parts[0] == "", text
    return [DESCRIBE_HEADER + p for p in parts[1:]]


def complete_dumps(n):
    return lambda text: text.count(DESCRIBE_HEADER) >= n and text.endswith(".\n") and \
        len(re.findall(r"^\.  - -> index \d+\.$", text, re.M)) >= n


def test_follow_prints_when_the_log_changes(daemon, ctl, ctl_json):
    ctl_json("add-user", "f1", "Hi")
    first = ctl("describe", "f1").stdout
    f = Follower(daemon.socket, ["follow", "f1", "--interval", "50", "--count", "2"])
    try:
        f.read_until(complete_dumps(1))
        # About ten polls of an unchanged log print nothing (else --count 2 ends here).
        time.sleep(0.5)
        assert f.proc.poll() is None, f.out
        assert dumps(f.out.decode()) == [first]
        daemon.connect().ok({"op": "add_assistant", "conversation": "f1", "contents": "Hello"})
    finally:
        rc, out, err = f.finish()
    assert rc == 0, (out, err)
    second = ctl("describe", "f1").stdout
    assert dumps(out) == [first, second]
    assert "Hello" in second and "Hello" not in first


def test_follow_stops_with_0_on_sigint_and_sigterm(daemon, ctl_json):
    ctl_json("add-user", "f2", "Hi")
    for sig in (signal.SIGINT, signal.SIGTERM):
        f = Follower(daemon.socket, ["follow", "f2", "--interval", "10000"])
        try:
            f.read_until(complete_dumps(1))
            time.sleep(0.1)  # in the pause between polls: it must end that pause at once
            t0 = time.monotonic()
            f.proc.send_signal(sig)
        finally:
            rc, out, err = f.finish()
        assert time.monotonic() - t0 < 5, "the signal did not end the pause"
        assert rc == 0, (sig, out, err)
        assert len(dumps(out)) == 1 and "'Hi'" in out


def test_follow_raw_prints_response_lines(daemon, ctl, ctl_json):
    ctl_json("add-user", "f3", "Hi")
    p = ctl("--raw", "follow", "f3", "--count", "1")
    (line,) = p.stdout.splitlines()
    resp = json.loads(line)
    assert resp["ok"] is True and resp["result"]["text"] == ctl("describe", "f3").stdout


def test_follow_unknown_conversation_exits_1(ctl):
    p = ctl("follow", "nobody", "--count", "1", expect=1)
    assert error_code(p) == "not_found"
    assert p.stdout == ""


def test_follow_exits_3_when_the_daemon_goes_away(daemon_factory):
    d = daemon_factory()
    d.connect().ok({"op": "add_user", "conversation": "f4", "contents": "Hi"})
    f = Follower(d.socket, ["follow", "f4", "--interval", "50"])
    try:
        f.read_until(complete_dumps(1))
        assert d.stop() == 0
    finally:
        rc, out, err = f.finish()
    assert rc == 3, (out, err)
    assert "closed the connection" in err or "cannot connect" in err or \
        "connection to the daemon failed" in err, err


# -- with DynamoDB (dynalite) ---------------------------------------------------------------

def ddb_env(endpoint):
    return {"AWS_ENDPOINT_URL_DYNAMODB": endpoint, "AWS_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/convod-test-credentials",
            "AWS_CONFIG_FILE": "/nonexistent/convod-test-config",
            "NO_PROXY": "*", "no_proxy": "*"}


def wait_for(pred, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        assert time.monotonic() < deadline, "timed out waiting for " + what
        time.sleep(0.05)


def _drop_table(endpoint, table):
    try:
        ddb.delete_table(endpoint, table, wait=False)
    except (OSError, ddb.DdbError):
        pass


def test_create_table_with_dynalite(dynalite, daemon_factory):
    table = "convod-ctl-%s" % uuid.uuid4().hex[:12]
    assert table not in ddb.list_tables(dynalite)
    d = daemon_factory(args=["--dynamodb-table", table, "--flush-interval", "50"],
                       env=ddb_env(dynalite))
    try:
        p = run(["create-table"], d.socket)
        assert p.returncode == 0, (p.stdout, p.stderr)
        assert json.loads(p.stdout) == {"table": table, "ready": True}
        desc = ddb.describe_table(dynalite, table)
        assert desc["TableStatus"] == "ACTIVE"
        assert sorted((k["AttributeName"], k["KeyType"]) for k in desc["KeySchema"]) == \
            [("conversation", "HASH"), ("sk", "RANGE")]
        # An existing table is fine.
        p = run(["create-table"], d.socket)
        assert p.returncode == 0, (p.stdout, p.stderr)
        assert json.loads(p.stdout) == {"table": table, "ready": True}
        # The daemon writes to it.
        c = d.connect()
        mid = c.ok({"op": "add_user", "conversation": "ct", "contents": "Hi"})["message"]["id"]
        c.ok({"op": "flush"})
        items = wait_for(lambda: ddb.query_all(dynalite, table, "ct"), what="the item")
        assert [it["sk"]["S"] for it in items] == [mid]
        spool = json.loads(run(["spool"], d.socket).stdout)
        assert spool["sink"]["kind"] == "dynamodb"
        wait_for(lambda: json.loads(run(["spool"], d.socket).stdout)["spool"]["items"] == 0,
                 what="an empty spool")
    finally:
        _drop_table(dynalite, table)


def test_writes_to_a_missing_table_wait_for_create_table(dynalite, daemon_factory):
    """A daemon started before its table exists: what it sends is refused with
    ResourceNotFoundException, which is retried (the table may yet come), never dead-lettered;
    the spool keeps everything until create_table makes the table, then drains into it."""
    table = "convod-ctl-late-%s" % uuid.uuid4().hex[:12]
    d = daemon_factory(args=["--dynamodb-table", table, "--flush-interval", "50",
                             "--retry-base-ms", "20", "--retry-max-ms", "200"],
                       env=ddb_env(dynalite))
    try:
        c = d.connect()
        ids = [c.ok({"op": op, "conversation": "late", "contents": "m%d" % i})["message"]["id"]
               for i, op in enumerate(["add_user", "add_assistant"] * 3)]
        c.ok({"op": "flush"})
        sink = wait_for(lambda: (lambda s: s if s["sink"]["failures"] >= 3 else None)(
            c.ok({"op": "stats"})), what="refused writes")["sink"]
        assert "ResourceNotFoundException" in (sink["last_error"] or ""), sink
        st = c.ok({"op": "stats"})
        assert st["spool"]["items"] == 6 and st["sink"]["dead_lettered"] == 0, st
        assert c.ok({"op": "create_table"}) == {"table": table, "ready": True}
        items = wait_for(lambda: (lambda it: it if len(it) == 6 else None)(
            ddb.query_all(dynalite, table, "late")), what="the six items")
        assert [it["sk"]["S"] for it in items] == ids
        assert [ddb.from_item(it)["message"]["contents"] for it in items] == \
            [["m%d" % i] for i in range(6)]
        st = wait_for(lambda: (lambda s: s if s["spool"]["items"] == 0 else None)(
            c.ok({"op": "stats"})), what="an empty spool")
        assert st["sink"]["dead_lettered"] == 0
        assert c.ok({"op": "dead_letters"}) == {"dead_letters": []}
    finally:
        _drop_table(dynalite, table)


def test_create_table_while_describe_says_not_found(faultproxy, dynalite, daemon_factory):
    """Right after CreateTable, DynamoDB may answer DescribeTable with
    ResourceNotFoundException for a while (eventual consistency): that is polled again, not
    a failure. Two clients asking at once share one CreateTable, and both are answered."""
    table = "convod-ctl-nf-%s" % uuid.uuid4().hex[:12]
    d = daemon_factory(args=["--dynamodb-table", table, "--flush-interval", "50"],
                       env=ddb_env(faultproxy.url))
    try:
        faultproxy.push("slow", n=1, op="CreateTable", ms=300)
        faultproxy.push("not_found", n=6, op="DescribeTable")
        a, b = d.connect(), d.connect()
        a.send({"op": "create_table", "id": "a"})
        time.sleep(0.1)
        b.send({"op": "create_table", "id": "b"})
        for conn, rid in ((a, "a"), (b, "b")):
            assert conn.recv() == {"id": rid, "ok": True,
                                   "result": {"table": table, "ready": True}}
        assert faultproxy.count("op:CreateTable") == 1
        assert faultproxy.count("not_found") == 6
        assert faultproxy.count("op:DescribeTable") >= 7
        assert faultproxy.pending == 0
        assert ddb.describe_table(dynalite, table)["TableStatus"] == "ACTIVE"
        assert "cannot create table" not in d.log()
        mid = a.ok({"op": "add_user", "conversation": "nf", "contents": "Hi"})["message"]["id"]
        a.ok({"op": "flush"})
        items = wait_for(lambda: ddb.query_all(dynalite, table, "nf"), what="the item")
        assert [it["sk"]["S"] for it in items] == [mid]
    finally:
        _drop_table(dynalite, table)


def test_create_table_refused_is_unavailable(faultproxy, dynalite, daemon_factory):
    """A CreateTable that DynamoDB refuses for good (ValidationException) answers
    unavailable with the reason in the log, creates nothing, and a later create_table
    tries again."""
    table = "convod-ctl-ref-%s" % uuid.uuid4().hex[:12]
    d = daemon_factory(args=["--dynamodb-table", table], env=ddb_env(faultproxy.url))
    try:
        faultproxy.push("validation", n=1, op="CreateTable")
        c = d.connect()
        e = c.err({"op": "create_table", "id": 1}, "unavailable")
        assert table in e["message"] or "table" in e["message"], e
        wait_for(lambda: "cannot create table " + table in d.log(), what="the log line")
        assert "ValidationException" in d.log()
        assert table not in ddb.list_tables(dynalite)
        assert c.ok({"op": "create_table"}) == {"table": table, "ready": True}
        assert ddb.describe_table(dynalite, table)["TableStatus"] == "ACTIVE"
        assert faultproxy.count("op:CreateTable") == 2
    finally:
        _drop_table(dynalite, table)


def test_dead_letter_listed_retried_and_delivered(faultproxy, dynalite, ddb_table,
                                                  daemon_factory):
    d = daemon_factory(args=["--dynamodb-table", ddb_table, "--flush-interval", "50",
                             "--retry-base-ms", "20", "--retry-max-ms", "300"],
                       env=ddb_env(faultproxy.url))

    def ctl_json(*args):
        p = run(args, d.socket)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return json.loads(p.stdout)

    assert ctl_json("dead-letters") == {"dead_letters": []}
    # The only BatchWriteItem (one item) is refused for good: a dead letter.
    faultproxy.push("validation", n=1, op="BatchWriteItem")
    added = ctl_json("add-user", "dl1", "Hi")["message"]
    t0 = int(time.time() * 1000)
    assert ctl_json("flush", "dl1") == {"flushed": 1}
    sink = wait_for(lambda: (lambda s: s if s["sink"]["dead_lettered"] >= 1 else None)(
        ctl_json("spool")), what="a dead letter")["sink"]
    assert sink["dead_lettered"] == 1 and "ValidationException" in (sink["last_error"] or "")
    assert faultproxy.count("validation") == 1
    (dead,) = ctl_json("dead-letters")["dead_letters"]
    assert dead["conversation"] == "dl1" and dead["sk"] == added["id"]
    assert dead["version"] == 1 and "ValidationException" in dead["error"]
    assert t0 - 5000 <= dead["at"] <= int(time.time() * 1000) + 5000
    assert ctl_json("dead-letters", "--limit", "1") == {"dead_letters": [dead]}
    assert ddb.query_all(dynalite, ddb_table, "dl1") == []
    # Retried: back in the spool, sent again, and this time written.
    assert ctl_json("retry-dead-letters") == {"retried": 1}
    items = wait_for(lambda: ddb.query_all(dynalite, ddb_table, "dl1"), what="the item")
    assert [it["sk"]["S"] for it in items] == [added["id"]]
    assert ddb.from_item(items[0])["message"] == {"role": "user", "contents": ["Hi"]}
    assert ctl_json("dead-letters") == {"dead_letters": []}
    assert ctl_json("retry-dead-letters") == {"retried": 0}
    spool = wait_for(lambda: (lambda s: s if s["spool"]["items"] == 0 else None)(
        ctl_json("spool")), what="an empty spool")
    assert spool["sink"]["dead_lettered"] == 1  # a counter: the retry does not undo it
