"""A full disk under the local store: the group commit fails, the turn's changes are
answered `unavailable` and undone in memory, reads go on, and writes succeed again once
space returns (persistence.md: acknowledged means stored; nothing half written).

Needs root to mount a small tmpfs for the state directory; skipped otherwise."""
import json
import os
import signal
import sqlite3
import subprocess
import tempfile
import threading
import time

import pytest

import ddb
from conftest import TIMEOUT_SCALE, VALGRIND, _probe_real, scaled
from test_persistence import (_all_dead_lettered, ddb_daemon, ddb_env, store_rows,
                              table_matches_daemon, wait_drained, wait_until)


def tmpfs(size):
    d = tempfile.mkdtemp(prefix="convod-full-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + size, "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip("cannot mount a tmpfs here: " + r.stderr.strip())
    yield d
    subprocess.run(["umount", "-l", d])
    os.rmdir(d)


@pytest.fixture
def small_fs():
    yield from tmpfs("2m")


@pytest.fixture
def fs_16m():
    yield from tmpfs("16m")


def fill(fs):
    """Fills the file system; returns the filler's path."""
    filler = os.path.join(fs, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\1" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


# process: the loop writes its commits itself; machine: the store's writer thread does, and
# the answers wait for it.
@pytest.mark.parametrize("durability", ["process", "machine"])
def test_disk_full_answers_unavailable_and_recovers(daemon_factory, small_fs, durability):
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", durability])
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "full", "contents": "before"})
    s0 = c.ok({"op": "stats"})
    # Fill the file system, leaving the daemon no room for its WAL.
    filler = fill(small_fs)
    # Big messages need new pages: their commit fails.
    refused = None
    for i in range(50):
        role = "assistant" if i % 2 == 0 else "user"
        r = c.request({"id": i, "op": "add_message", "conversation": "full", "role": role,
                       "contents": "x%d " % i + "y" * 20000})
        if not r["ok"]:
            refused = r
            break
    assert refused is not None, "a full disk must refuse some change"
    assert refused["error"]["code"] == "unavailable", refused
    assert refused["id"] == i, "the refused answer keeps the request's id"
    # It says why: the same text whether the answer was the commit's own or an ok answer
    # rewritten after the commit failed.
    assert refused["error"]["message"] == \
        "the local store is full (disk full); nothing was changed, retry later", refused
    # Counted once as a request of its op, and as an error of that op and code.
    s1 = c.ok({"op": "stats"})
    assert s1["requests"]["by_op"]["add_message"] - s0["requests"]["by_op"]["add_message"] \
        == i + 1
    assert s1["errors"]["by_op"]["add_message"] - s0["errors"]["by_op"]["add_message"] == 1
    assert s1["errors"]["by_code"]["unavailable"] - s0["errors"]["by_code"]["unavailable"] == 1
    assert s1["errors"]["total"] - s0["errors"]["total"] == 1
    assert sum(s1["errors"]["by_op"].values()) == s1["errors"]["total"]
    # Nothing half written: the refused text is nowhere, in memory or after a reload.
    log = c.ok({"op": "to_messages_map", "conversation": "full", "incremental": False})
    texts = [t for m in log["messages"] for t in m["message"]["contents"]]
    assert not any(t.startswith("x%d " % i) for t in texts), texts[:3]
    assert c.ok({"op": "ping"})["pong"] is True  # reads go on
    # Space returns: the same change now succeeds.
    os.unlink(filler)
    r = c.ok({"id": "again", "op": "add_message", "conversation": "full", "role": role,
              "contents": "after"})
    assert "after" in r["message"]["message"]["contents"]
    # And it is durable: a restart has it.
    assert d.stop() == 0, d.log()
    d.start()
    c = d.connect()
    log = c.ok({"op": "to_messages_map", "conversation": "full", "incremental": False})
    texts = [t for m in log["messages"] for t in m["message"]["contents"]]
    assert "before" in texts and "after" in texts
    assert not any(t.startswith("x%d " % i) for t in texts)


@pytest.mark.parametrize("durability", ["process", "machine"])
def test_disk_full_reads_of_a_refused_change_are_refused_too(daemon_factory, small_fs,
                                                             durability):
    """Reads in the turn of a change whose commit fails (on its connection and on another),
    and a list that would show a conversation it created, showed the change: ok answers of
    what memory held, while the change was answered unavailable and undone. A failed commit
    replaces the ok answers of its turn (protocol.md), reads of what it changed included;
    reads of what it did not change stand."""
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", durability])
    a, b = d.connect(), d.connect()
    a.ok({"op": "add_user", "conversation": "full", "contents": "before"})
    a.ok({"op": "add_user", "conversation": "other", "contents": "untouched"})
    filler = fill(small_fs)
    for i in range(40):
        role = "assistant" if i % 2 == 0 else "user"
        tag = "x%d " % i
        d.signal(signal.SIGSTOP)  # one loop turn for all of them
        a.send_raw((json.dumps({"id": "w", "op": "add_message", "conversation": "full",
                                "role": role, "contents": tag + "y" * 20000}) + "\n" +
                    json.dumps({"id": "r", "op": "get_messages", "conversation": "full"}) +
                    "\n" + json.dumps({"id": "n", "op": "add_user", "conversation": "new%d" % i,
                                       "contents": "z" * 20000}) + "\n" +
                    json.dumps({"id": "l", "op": "list"}) + "\n").encode())
        b.send_raw((json.dumps({"id": "rb", "op": "to_messages_map", "conversation": "full",
                                "incremental": False}) + "\n" +
                    json.dumps({"id": "o", "op": "get_messages", "conversation": "other"}) +
                    "\n").encode())
        d.signal(signal.SIGCONT)
        w, r, n, l = (a.recv() for _ in range(4))
        rb, o = b.recv(), b.recv()
        if w["ok"]:
            continue
        assert w["error"]["code"] == "unavailable" and not n["ok"], (w, n)
        for answer in (r, rb, l):
            assert not answer["ok"] and answer["error"]["code"] == "unavailable", answer
            assert tag not in json.dumps(answer)
        assert o["ok"] and "untouched" in json.dumps(o), o
        later = d.connect().ok({"op": "get_messages", "conversation": "full"})
        assert tag not in json.dumps(later), later
        break
    else:
        pytest.fail("a full disk must refuse some change")
    os.unlink(filler)
    r = a.request({"op": "get_messages", "conversation": "full"})
    assert r["ok"], r


def test_disk_full_new_conversation_is_not_created(daemon_factory, small_fs):
    """A conversation whose first message cannot be committed does not exist afterwards:
    not in memory (not_found, not in `list`), not after a restart; the conversations created
    before the disk filled are all there, and once space returns the same id is created."""
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", "process"])
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "old", "contents": "before"})
    filler = fill(small_fs)
    created, refused = ["old"], None
    for i in range(50):
        conv = "new-%d" % i
        r = c.request({"id": i, "op": "add_user", "conversation": conv,
                       "contents": "n%d " % i + "y" * 20000})
        if not r["ok"]:
            refused = conv
            break
        created.append(conv)
    assert refused is not None, "a full disk must refuse some change"
    assert r["error"]["code"] == "unavailable" and r["id"] == i, r

    def check(conn):
        for op in ("get_messages", "to_messages_map", "describe"):
            conn.err({"op": op, "conversation": refused}, "not_found")
        listed = [x["conversation"] for x in conn.ok({"op": "list"})["conversations"]]
        assert refused not in listed and sorted(listed) == sorted(created), listed

    check(c)
    os.unlink(filler)
    assert d.stop() == 0, d.log()
    d.start()
    c = d.connect()
    check(c)
    r = c.ok({"op": "add_user", "conversation": refused, "contents": "again"})
    assert not r["merged"]
    assert c.ok({"op": "get_messages", "conversation": refused,
                 "format": "bedrock"})["messages"][0]["content"][0]["text"] == "again"


def test_disk_full_with_commits_in_flight(daemon_factory, small_fs):
    """Several connections pipeline big adds while the disk fills, at durability machine
    (commits on the writer thread, several in flight): every change answered ok is there
    after a restart, every one answered unavailable is nowhere, and the conversations keep
    their invariants."""
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", "machine"])
    conns = [d.connect() for _ in range(3)]
    for k, c in enumerate(conns):
        c.ok({"op": "add_user", "conversation": "inflight-%d" % k, "contents": "start"})
    filler = fill(small_fs)
    os.unlink(filler)  # about 2 MB free again: the burst below fills it
    # Space comes back in steps: each time the disk fills, a spare goes, so that commits
    # fail and succeed again several times, with others in flight around each failure.
    spares = []
    for i in range(5):
        spares.append(os.path.join(small_fs, "spare-%d" % i))
        with open(spares[-1], "wb") as f:
            f.write(b"\2" * 150000)
    ok, refused = set(), set()
    for rnd in range(20):
        for k, c in enumerate(conns):
            for j in range(4):
                role = "assistant" if j % 2 == 0 else "user"
                c.send({"id": "%d-%d" % (rnd, j), "op": "add_message",
                        "conversation": "inflight-%d" % k, "role": role,
                        "contents": "t%d-%d-%d " % (k, rnd, j) + "y" * 30000})
        for k, c in enumerate(conns):
            for j in range(4):
                r = c.recv()
                text = "t%d-%d-%d " % (k, rnd, j)
                if r["ok"]:
                    ok.add(text)
                else:
                    assert r["error"]["code"] == "unavailable", r
                    assert "(disk full)" in r["error"]["message"], r
                    assert r["id"] == "%d-%d" % (rnd, j)
                    refused.add(text)
                    if spares:
                        os.unlink(spares.pop())
    assert refused, "the disk never filled"
    assert ok, "nothing was accepted"

    def contents(c):
        seen = set()
        for k in range(len(conns)):
            log = c.ok({"op": "to_messages_map", "conversation": "inflight-%d" % k,
                        "incremental": False})
            roles = [m["message"]["role"] for m in log["messages"]]
            assert all(a != b for a, b in zip(roles, roles[1:])), roles
            for m in log["messages"]:
                for t in m["message"]["contents"]:
                    seen.add(t.split(" ")[0] + " ")
        return seen

    seen = contents(conns[0])
    assert ok <= seen, sorted(ok - seen)[:5]
    assert not (refused & seen), sorted(refused & seen)[:5]
    assert d.stop() == 0, d.log()
    d.start()
    seen = contents(d.connect())
    assert ok <= seen, sorted(ok - seen)[:5]
    assert not (refused & seen), sorted(refused & seen)[:5]


def test_disk_full_mid_turn_answers_match_the_store(daemon_factory, small_fs):
    """A commit that fails undoes the change it held, and only that: here the big change's
    commit fails on a full disk while retry_dead_letters, behind it in the same read, waits
    for its move (parts committed between the turns), and the small change after it is
    committed on its own and answered as such: ok and kept, or unavailable and nowhere;
    never unavailable and kept (the server used to fail every answer of the turn)."""
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", "process"])
    c = d.connect()
    for conv in ("mid-a", "mid-b"):
        c.ok({"op": "add_user", "conversation": conv, "contents": "before"})
    # About 64 kB free: the big change's WAL frames fill it and fail; the small change after
    # it reuses the frames' room.
    spare = os.path.join(small_fs, "spare")
    with open(spare, "wb") as f:
        f.write(b"\2" * 65536)
    filler = fill(small_fs)
    os.unlink(spare)
    lines = [{"id": "big", "op": "add_message", "conversation": "mid-a", "role": "assistant",
              "contents": "big " + "y" * 150000},
             {"id": "retry", "op": "retry_dead_letters"},
             {"id": "small", "op": "add_message", "conversation": "mid-b",
              "role": "assistant", "contents": "small"}]
    c.send_raw(b"".join(json.dumps(x).encode() + b"\n" for x in lines))  # one turn
    big, retry, small = c.recv(), c.recv(), c.recv()
    assert [big["id"], retry["id"], small["id"]] == ["big", "retry", "small"]
    assert not big["ok"] and big["error"]["code"] == "unavailable", big
    # The retry finds the failure or comes after it (nothing to retry either way).
    assert retry["ok"] or retry["error"]["code"] == "unavailable", retry

    def texts(conn, conv):
        log = conn.ok({"op": "to_messages_map", "conversation": conv, "incremental": False})
        return [t for m in log["messages"] for t in m["message"]["contents"]]

    def check(conn):
        assert not any(t.startswith("big ") for t in texts(conn, "mid-a"))
        assert ("small" in texts(conn, "mid-b")) == small["ok"], small

    check(c)
    # The point of the test: the small change had room, was committed, and says so.
    assert small["ok"], small
    os.unlink(filler)
    assert d.stop() == 0, d.log()
    d.start()
    check(d.connect())


def spool_rows(state):
    """The spool rows of the local store (read-only): what DynamoDB has not confirmed, as
    far as the store knows (the `spool` of stats counts the sink's entries in memory)."""
    db = sqlite3.connect("file:%s?mode=ro" % os.path.join(state, "convod.db"), uri=True)
    try:
        return db.execute("SELECT count(*) FROM spool").fetchone()[0]
    finally:
        db.close()


def fill_for_commits(c, state, fs):
    """Makes every commit fail: a reader's snapshot keeps the WAL from starting over, so
    every commit must grow it; the disk is filled, and small adds to "slack" (through c)
    use up the WAL's unused tail until three in a row fail. Returns the reader (its
    transaction open) and the filler, for the caller to release."""
    reader = sqlite3.connect("file:%s?mode=ro" % os.path.join(state, "convod.db"), uri=True,
                             isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM spool").fetchone()
    filler = fill(fs)
    failed = 0
    for i in range(2000):
        r = c.request({"op": "add_user", "conversation": "slack", "contents": "s%d" % i})
        failed = 0 if r["ok"] else failed + 1
        if failed == 3:
            break
    assert failed == 3, "the disk never filled"
    return reader, filler


def test_disk_full_confirmations_lost_are_sent_again(daemon_factory, small_fs, faultproxy,
                                                     dynalite, ddb_table):
    """DynamoDB confirms writes while the disk is full: the commit that records the
    confirmations fails, so their spool rows stay, though the sink has let go of them. Once
    commits succeed again the sink reads the spool again and sends them again: the spool
    empties without a restart (it used to keep them until the next start), and the table
    holds each message once, at its version."""
    state = os.path.join(small_fs, "state")
    # No flusher ticks: only the flush request sends, so that the one call held is all.
    d = daemon_factory(["--state-dir", state, "--dynamodb-table", ddb_table,
                        "--flush-interval", "600000", "--retry-base-ms", "20",
                        "--retry-max-ms", "300"], env=ddb_env(faultproxy.url))
    c = d.connect()
    conv = "lost-confirmations"
    c.ok({"op": "add_user", "conversation": "slack", "contents": "known"})  # no Query later
    # The first write is held 4 s at the proxy, then done and answered.
    faultproxy.push("slow", n=1, op="BatchWriteItem", ms=4000)
    ids = [c.ok({"op": op, "conversation": conv, "contents": "m%d" % i})["message"]["id"]
           for i, op in enumerate(["add_user", "add_assistant", "add_user", "add_assistant"])]
    c.ok({"op": "flush", "conversation": conv})
    wait_until(lambda: faultproxy.count("slow") == 1, scaled(5), "the held call")
    forwarded = faultproxy.count("forwarded")
    assert spool_rows(state) == len(ids)
    # Commits fail from here on, the one recording the confirmations too.
    reader, filler = fill_for_commits(c, state, small_fs)
    assert faultproxy.count("forwarded") == forwarded, ("answered too soon", faultproxy.log)
    wait_until(lambda: faultproxy.count("forwarded") == forwarded + 1, scaled(10),
               "the held call's answer")
    wait_until(lambda: c.ok({"op": "stats"})["sink"]["confirmed"] == len(ids), scaled(5),
               "the confirmations")
    # Recorded in that turn's commit, which failed: DynamoDB has them, the store waits.
    assert spool_rows(state) == len(ids)
    reader.execute("COMMIT")
    reader.close()
    os.unlink(filler)
    # Commits succeed again (this one), and the sink reads the spool again.
    c.ok({"op": "add_user", "conversation": "after", "contents": "space again"})
    wait_until(lambda: spool_rows(state) == 0, scaled(10),
               "the spool rows to go, without a restart")
    resyncs = [line for line in d.log().splitlines()
               if "read the spool again after a lost recording" in line]
    assert any(" %d rows sent again" % len(ids) in line for line in resyncs), d.log()
    assert c.ok({"op": "stats"})["sink"]["resent"] == len(ids)
    items = ddb.query_all(dynalite, ddb_table, conv)
    assert [it["sk"]["S"] for it in items] == ids, items
    assert all(it["version"] == {"N": "1"} for it in items), items
    assert d.stop() == 0, d.log()


def lose_repair_rows(daemon_factory, small_fs, faultproxy, ddb_table):
    """A write left without an answer while the disk is full, so that the commit that was
    to record its two messages to look at again (the repairs rows) failed: returns the
    daemon, a connection, the state directory, the reader and filler that keep commits
    failing (for the caller to release), the request timeout (ms) and when the flush
    started."""
    # Scaled by 3 at most: under valgrind (10) each of these tests waited 30 s for the
    # timeout; only the one unanswered call meets it.
    timeout = int(3000 * min(3.0, TIMEOUT_SCALE))
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--dynamodb-table", ddb_table,
                        "--flush-interval", "600000", "--request-timeout-ms", str(timeout),
                        "--retry-base-ms", "20", "--retry-max-ms", "300"],
                       env=ddb_env(faultproxy.url))
    c = d.connect()
    conv = "repairs-lost"
    c.ok({"op": "add_user", "conversation": "slack", "contents": "known"})  # no Query later
    faultproxy.push("hang", n=1, op="BatchWriteItem")
    c.ok({"op": "add_user", "conversation": conv, "contents": "hello"})
    c.ok({"op": "add_assistant", "conversation": conv, "contents": "hi"})
    t0 = time.monotonic()
    c.ok({"op": "flush", "conversation": conv})
    wait_until(lambda: faultproxy.count("hang") == 1, scaled(5), "the unanswered call")
    reader, filler = fill_for_commits(c, state, small_fs)
    # The call times out while commits fail: its two messages wait to be looked at again,
    # in memory; the commit that was to write their rows failed.
    wait_until(lambda: c.ok({"op": "stats"})["sink"]["repairs_waiting"] == 2,
               5 + timeout / 1000.0, "the call's timeout")
    c.err({"op": "add_user", "conversation": "slack", "contents": "still full"}, "unavailable")
    assert store_rows(state, REPAIRS_COUNT) == [(0,)]
    return d, c, state, reader, filler, timeout, t0


REPAIRS_COUNT = "SELECT count(*) FROM repairs"


def skip_if_due(timeout, t0):
    """Skips the test on a host so slow that the repairs may have come due (and been looked
    at) by now: the rows are then gone for good reason."""
    if time.monotonic() - t0 > 3 * timeout / 1000.0:
        pytest.skip("too slow here: the repairs came due before the stop")


def restart_finds_the_repairs(d, timeout, t0):
    """After kill -9 or a stop, the next start finds the two messages to look at again."""
    skip_if_due(timeout, t0)
    d.start()
    d.connect().ok({"op": "ping"})
    assert "2 messages to look at again after a write without an answer before the last " \
        "stop" in d.log(), d.log()


def test_disk_full_repair_rows_lost_are_written_again(daemon_factory, small_fs, faultproxy,
                                                      ddb_table):
    """A write left without an answer while the disk is full: the commit that records its
    messages to look at again (the repairs rows) fails. Once commits succeed again the rows
    are written anew, so that a crash before the look does not forget it: after kill -9 the
    next start finds both. (They used to be kept in memory only, gone with a crash.) The
    rewrite waits for the next loop turn: a retry_dead_letters whose commit is the first to
    succeed is not failed by it."""
    d, c, state, reader, filler, timeout, t0 = lose_repair_rows(daemon_factory, small_fs,
                                                                faultproxy, ddb_table)
    reader.execute("COMMIT")
    reader.close()
    os.unlink(filler)
    # Commits succeed again with this add, which retry_dead_letters, read in the same turn,
    # commits before its move: the rows are written on the next turn, not inside that
    # commit (a transaction left open there made the move fail with "unavailable").
    c.send_raw((json.dumps({"id": "add", "op": "add_user", "conversation": "after",
                            "contents": "space again"}) + "\n" +
                json.dumps({"id": "retry", "op": "retry_dead_letters"}) + "\n").encode())
    added, retried = c.recv(), c.recv()
    assert added["ok"] and retried["ok"], (added, retried)
    wait_until(lambda: store_rows(state, REPAIRS_COUNT) == [(2,)], scaled(5),
               "the repairs rows written anew")
    assert "writing the rows of 2 messages to look at again anew" in d.log(), d.log()
    d.stop(signal.SIGKILL)
    restart_finds_the_repairs(d, timeout, t0)


def test_disk_full_repair_rows_lost_are_written_by_the_stop(daemon_factory, small_fs,
                                                            faultproxy, ddb_table):
    """The repairs rows lost to a failed commit, and the daemon stopped (SIGTERM) once space
    is back, before a loop turn wrote them anew: the stop writes them in its last commit
    (on_close_timer), so that the next start looks at those messages too."""
    d, c, state, reader, filler, timeout, t0 = lose_repair_rows(daemon_factory, small_fs,
                                                                faultproxy, ddb_table)
    reader.execute("COMMIT")
    reader.close()
    os.unlink(filler)
    assert store_rows(state, REPAIRS_COUNT) == [(0,)]
    skip_if_due(timeout, t0)
    assert d.stop() == 0, d.log()
    log = d.log()
    assert "writing the rows of 2 messages to look at again anew" in log, log
    assert "stopping with 2 messages to look at again after a write without an answer" in log
    assert store_rows(state, REPAIRS_COUNT) == [(2,)]
    restart_finds_the_repairs(d, timeout, t0)


def test_disk_full_repair_rows_lost_with_the_stop_say_so(daemon_factory, small_fs, faultproxy,
                                                         ddb_table):
    """The repairs rows lost to a failed commit, and the daemon stopped while the disk is
    still full: the stop's last commit, which was to write them anew, fails too. The stop
    says which rows are lost with it; the next start indeed finds none to look at."""
    d, c, state, reader, filler, timeout, t0 = lose_repair_rows(daemon_factory, small_fs,
                                                                faultproxy, ddb_table)
    skip_if_due(timeout, t0)
    assert d.stop() == 0, d.log()
    log = d.log()
    assert "last commit failed: confirmed writes will be sent again" in log, log
    assert ("error store: that commit held 2 rows of messages to look at again after a write "
            "without an answer: those no earlier commit wrote are lost") in log, log
    reader.execute("COMMIT")
    reader.close()
    os.unlink(filler)
    assert store_rows(state, REPAIRS_COUNT) == [(0,)]
    before = len(d.log())
    d.start()
    d.connect().ok({"op": "ping"})
    assert "to look at again after a write without an answer before the last stop" \
        not in d.log()[before:], d.log()[before:]


def test_disk_full_during_a_retry_move(daemon_factory, fs_16m, faultproxy, dynalite,
                                       ddb_table):
    """retry_dead_letters moves the dead letters back in parts, a transaction each; the
    disk fills in the middle of the move: the part that does not fit fails and the client
    is answered `unavailable`; the parts written stay moved and the rest stay dead letters,
    each message in exactly one of the two; once there is room, a retry moves the rest."""
    n = 5000
    state = os.path.join(fs_16m, "state")
    d = ddb_daemon(daemon_factory, faultproxy.url, ddb_table,
                   ["--state-dir", state, "--drain-ms", "0"], start=False)
    d.state_dir = state
    d.start()
    _all_dead_lettered(d, faultproxy, n, "full")
    d.start()
    c = d.connect()
    # A reader's snapshot keeps the WAL from starting over: every part grows it, by about
    # 250 kB here (5,000 dead letters of 100 conversations, 256 a part). Room for about
    # five parts, of twenty.
    reader = sqlite3.connect("file:%s?mode=ro" % os.path.join(state, "convod.db"), uri=True,
                             isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM spool").fetchone()
    spare = os.path.join(fs_16m, "spare")
    with open(spare, "wb") as f:
        f.write(b"\2" * (1280 * 1024))
    filler = fill(fs_16m)
    os.unlink(spare)
    r = c.request({"op": "retry_dead_letters"})
    assert not r["ok"] and r["error"]["code"] == "unavailable", r
    assert "retry_dead_letters: cannot move dead letters" in d.log(), d.log()[-3000:]
    assert c.ok({"op": "get_messages", "conversation": "full-7"})["messages"]  # reads go on
    reader.execute("COMMIT")
    reader.close()

    def counts():
        return (store_rows(state, "SELECT count(*) FROM spool")[0][0],
                store_rows(state, "SELECT count(*) FROM dead_letters")[0][0],
                store_rows(state, "SELECT count(*) FROM spool s JOIN dead_letters l"
                           " ON l.conversation = s.conversation AND l.sk = s.sk")[0][0])

    spool, dead, both = counts()
    # Whole parts moved (the failed one undone), then the rest left.
    assert 0 < spool < n and spool % 256 == 0, (spool, dead)
    assert spool + dead == n and both == 0, (spool, dead, both)
    assert [len(c.ok({"op": "dead_letters", "limit": 100000})["dead_letters"])] == [dead]
    retry = c.ok({"op": "stats"})["store"]["retry"]
    assert [retry["running"], retry["moves"], retry["moved"]] == [False, 1, spool], retry
    # The failed part was tried too.
    assert retry["parts"] == spool // 256 + 1, retry
    os.unlink(filler)
    assert c.ok({"op": "retry_dead_letters"})["retried"] == dead
    assert counts() == (n, 0, 0)
    retry = c.ok({"op": "stats"})["store"]["retry"]
    assert [retry["running"], retry["moves"], retry["moved"]] == [False, 2, n], retry
    # The flusher reads the spool again, in slices, and holds them all.
    wait_until(lambda: c.ok({"op": "stats"})["spool"]["items"] == n, scaled(10),
               "the re-read")
    c.close()
    assert d.stop() == 0, d.log()[-3000:]


def test_disk_full_flush_is_undone_and_sent_later(daemon_factory, small_fs, dynalite,
                                                  ddb_table):
    """A flush while the disk is full: its turn puts the conversation's messages in the
    spool, and that commit fails. The flush is answered `unavailable`, nothing of it reaches
    DynamoDB (the sink is told only of spool rows written), and the messages stay pending.
    Once there is room a flush sends them, and the table ends exactly as the daemon holds
    each conversation: the adds refused while the disk was full are in neither."""
    state = os.path.join(small_fs, "state")
    # No flusher ticks: only flush requests put messages in the spool.
    d = daemon_factory(["--state-dir", state, "--dynamodb-table", ddb_table,
                        "--flush-interval", "600000", "--retry-base-ms", "20",
                        "--retry-max-ms", "300"], env=ddb_env(dynalite))
    c = d.connect()
    conv = "flushed-when-full"
    for i, op in enumerate(["add_user", "add_assistant", "add_user", "add_assistant"]):
        c.ok({"op": op, "conversation": conv, "contents": "m%d" % i})
    c.ok({"op": "add_user", "conversation": "slack", "contents": "known"})
    reader, filler = fill_for_commits(c, state, small_fs)
    try:
        r = c.request({"op": "flush", "conversation": conv})
        assert not r["ok"] and r["error"]["code"] == "unavailable", r
        assert c.ok({"op": "stats"})["spool"]["items"] == 0
        time.sleep(0.3)  # what the sink would have sent by now
        assert ddb.query_all(dynalite, ddb_table, conv) == []
        assert spool_rows(state) == 0
    finally:
        reader.execute("COMMIT")
        reader.close()
        os.unlink(filler)
    c.ok({"op": "add_user", "conversation": "after", "contents": "space again"})
    for cv in (conv, "slack", "after"):
        assert c.ok({"op": "flush", "conversation": cv})["flushed"] >= 1, cv
    wait_drained(c)
    views = table_matches_daemon(dynalite, ddb_table, c, [conv, "slack", "after"])
    assert [m["message"]["contents"] for m in views[conv]] == [["m%d" % i] for i in range(4)]
    # The refused adds: in neither the daemon nor the table (the slack holds what was ok).
    texts = [t for m in views["slack"] for t in m["message"]["contents"]]
    assert texts[0] == "known" and len(texts) == len(set(texts)), texts
    assert spool_rows(state) == 0
    assert d.stop() == 0, d.log()


BIG = "y" * 300000


def texts_of(result):
    return [t for m in result["messages"] for t in m["message"]["contents"]]


@pytest.mark.parametrize("durability", ["process", "machine"])
def test_disk_full_keeps_to_messages_map_marks_of_ok_answers(daemon_factory, small_fs,
                                                             durability):
    """A failed commit read the conversation back from the store, whose client marks are
    only as recent as the last flush tick: the next incremental to_messages_map returned
    again what an ok answer had returned (protocol.md allows that only after a crash). The
    marks of the answers that stand are kept; those of a read the failure turns into
    `unavailable` are undone, so that the retry returns what it showed."""
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", durability,
                        "--flush-interval", "600000"])
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "x", "contents": "a"})
    c.ok({"op": "add_assistant", "conversation": "x", "contents": "b"})
    c.ok({"op": "add_user", "conversation": "x", "contents": "c"})
    assert texts_of(c.ok({"op": "to_messages_map", "conversation": "x"})) == ["a", "b"]
    assert c.ok({"op": "to_messages_map", "conversation": "x"})["messages"] == []
    filler = fill(small_fs)
    r = c.request({"op": "add_assistant", "conversation": "x", "contents": "big " + BIG})
    assert not r["ok"] and r["error"]["code"] == "unavailable", r
    os.unlink(filler)
    after = c.ok({"op": "to_messages_map", "conversation": "x"})
    assert after["messages"] == [], "returned again after a failed commit: %s" % after
    # The marks were saved by the stop (its checkpoint frees the WAL the big change grew).
    assert d.stop() == 0, d.log()
    d.start()
    c = d.connect()
    assert c.ok({"op": "to_messages_map", "conversation": "x"})["messages"] == []
    # A read in the turn of a failed change, answered unavailable: what it showed is
    # returned by the retry. The lines are sent while the daemon is stopped (one loop turn
    # for both), from a thread, as they may not all fit in the socket's buffer.
    c.ok({"op": "add_assistant", "conversation": "x", "contents": "d"})
    filler = fill(small_fs)
    d.signal(signal.SIGSTOP)
    sender = threading.Thread(target=c.send_raw, args=(
        (json.dumps({"id": "w", "op": "add_user", "conversation": "x",
                     "contents": "big " + BIG[:150000]}) + "\n" +
         json.dumps({"id": "r", "op": "to_messages_map", "conversation": "x"}) +
         "\n").encode(),))
    sender.start()
    time.sleep(0.2)
    d.signal(signal.SIGCONT)
    sender.join()
    w, r = c.recv(), c.recv()
    os.unlink(filler)
    assert not w["ok"] and not r["ok"] and r["error"]["code"] == "unavailable", (w, r)
    assert texts_of(c.ok({"op": "to_messages_map", "conversation": "x"})) == ["c"]
    assert d.stop() == 0, d.log()
    d.start()
    c = d.connect()
    assert texts_of(c.ok({"op": "to_messages_map", "conversation": "x",
                          "exclude_last": False})) == ["d"]


@pytest.mark.skipif(VALGRIND, reason="a preloaded library and a 40 ms window: the normal and "
                    "ASan stages run it")
def test_disk_full_read_of_a_change_in_flight(daemon_factory, small_fs):
    """At durability machine on a slow disk: A's add to x is being written (transaction 5)
    when B's turn reads x incrementally and adds a change to y too big for the disk (6). The
    read was bound to 6: 5 was written and 6 failed, the read was answered `unavailable`,
    yet x, written, was not read back, so the client marks it moved stayed, and the retry
    never returned m1. A read stands or falls with the transaction holding what it shows."""
    lib = _probe_real("SLOWSYNC_LIB", "libslowsync.so")  # in the build of $CONVOD_BIN
    assert os.path.exists(lib), "libslowsync.so not built at %s" % lib
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", "machine",
                        "--flush-interval", "600000"], start=False)
    d.env = dict(d.env or {})
    d.env.update({"LD_PRELOAD": " ".join(filter(None, [d.env.get("LD_PRELOAD"), lib])),
                  "SLOWSYNC_MS": "150",
                  # An ASan build wants its runtime first; the library only delays calls.
                  "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "") +
                  ":verify_asan_link_order=0"})
    d.start()
    a, b = d.connect(), d.connect()
    a.ok({"op": "add_user", "conversation": "y", "contents": "y0"})
    # Room for m1's transaction, not for the big one.
    spare = os.path.join(small_fs, "spare")
    with open(spare, "wb") as f:
        f.write(b"\2" * 65536)
    filler = fill(small_fs)
    os.unlink(spare)
    try:
        a.send({"id": "ax", "op": "add_user", "conversation": "x", "contents": "m1"})
        time.sleep(0.04)  # submitted: the writer is in its sync
        b.send_raw((json.dumps({"id": "by", "op": "add_assistant", "conversation": "y",
                                "contents": "big " + BIG}) + "\n" +
                    json.dumps({"id": "rx", "op": "to_messages_map", "conversation": "x",
                                "exclude_last": False}) + "\n").encode())
        ax = a.recv()
        by, rx = b.recv(), b.recv()
    finally:
        os.unlink(filler)
    assert ax["ok"], ax
    assert not by["ok"] and by["error"]["code"] == "unavailable", by
    assert rx["ok"] and texts_of(rx["result"]) == ["m1"], rx
    assert b.ok({"op": "to_messages_map", "conversation": "x",
                 "exclude_last": False})["messages"] == []


def test_durability_none_failed_flush_keeps_acknowledged(daemon_factory, small_fs):
    """At durability none the answers go out before anything is committed: the flush tick's
    commit failing on a full disk must not take back what was answered ok (it read the
    conversations back from the store, and the acknowledged add was gone from memory, and
    from the store for good, with no crash). Memory keeps it, the failure is logged once for
    the streak, and the next ticks try again: once there is room it is written (a kill -9
    then keeps it), a close made meanwhile included."""
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", "none",
                        "--flush-interval", "200"])
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "n", "contents": "before"})
    c.ok({"op": "add_user", "conversation": "shut", "contents": "closed while full"})
    time.sleep(0.6)  # committed by a tick
    filler = fill(small_fs)
    c.ok({"op": "add_assistant", "conversation": "n", "contents": "acked " + "y" * 300000})
    c.ok({"op": "close", "conversation": "shut"})
    # The failing commit may be the writer thread's (the loop hands it over when the writer
    # is busy with idle work), logged once the loop hears of it: wait for it, then a few
    # more ticks, whose commits fail too and must not log again.
    wait_until(lambda: "commit failed" in d.log(), scaled(10), "the first failed commit")
    time.sleep(1.0)

    def texts():
        log = c.ok({"op": "to_messages_map", "conversation": "n", "incremental": False})
        return [t[:6] for m in log["messages"] for t in m["message"]["contents"]]

    try:
        assert texts() == ["before", "acked "], (texts(), d.log()[-800:])
        log = d.log()
        assert log.count("commit failed") == 1, log[-800:]
        assert "answering unavailable" not in log, log[-800:]
    finally:
        os.unlink(filler)
    wait_until(lambda: "commits succeed again" in d.log(), scaled(5), "a commit")
    # The closed conversation leaves memory once its close is written.
    wait_until(lambda: c.ok({"op": "stats"})["conversations"] == 1, scaled(5),
               "the closed conversation to leave memory")
    d.stop(signal.SIGKILL)
    d.start()
    c = d.connect()
    assert texts() == ["before", "acked "]
    assert [x["conversation"] for x in c.ok({"op": "list"})["conversations"]] == ["n"]


def slow_syncs(ms, failfile):
    """The environment of a daemon whose syncs take ms longer, and fail while failfile
    exists (slowsync.c)."""
    lib = _probe_real("SLOWSYNC_LIB", "libslowsync.so")  # in the build of $CONVOD_BIN
    assert os.path.exists(lib), "libslowsync.so not built at %s" % lib
    return {"LD_PRELOAD": " ".join(filter(None, [os.environ.get("LD_PRELOAD"), lib])),
            "SLOWSYNC_MS": str(ms), "SLOWSYNC_FAILFILE": failfile,
            "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "") + ":verify_asan_link_order=0"}


@pytest.mark.skipif(VALGRIND, reason="a preloaded library and a 100 ms window: the normal and "
                    "ASan stages run it")
def test_close_written_just_before_a_failed_commit_leaves_memory(daemon_factory, tmp_path):
    """At durability machine on a slow disk: the close of x is being written (its sync
    takes 300 ms) when the next commit, an add to y, is handed over, and that one's sync
    fails. A retry_dead_letters in the add's turn has the loop wait for the writer (its
    move is a job queued after the add), so the loop learns of both at once: the failure
    reports the close as written. x is to leave memory then; it stayed (listed) until a
    later commit succeeded, on a quiet daemon for good."""
    failfile = str(tmp_path / "fail")
    d = daemon_factory(["--durability", "machine", "--flush-interval", "100"],
                       env=slow_syncs(300, failfile))
    a, b = d.connect(), d.connect()
    a.ok({"op": "add_user", "conversation": "x", "contents": "a"})
    a.ok({"op": "add_user", "conversation": "y", "contents": "a"})
    a.send({"id": "close", "op": "close", "conversation": "x"})
    time.sleep(0.1)  # the close is in its sync
    open(failfile, "w").close()
    try:
        b.send_raw((json.dumps({"id": "add", "op": "add_assistant", "conversation": "y",
                                "contents": "b"}) + "\n" +
                    json.dumps({"id": "retry", "op": "retry_dead_letters"}) + "\n").encode())
        closed, added, retried = a.recv(), b.recv(), b.recv()
    finally:
        os.unlink(failfile)
    assert closed["ok"], closed
    for r in (added, retried):
        assert not r["ok"] and r["error"]["code"] == "unavailable", r
    time.sleep(0.5)  # quiet: flush ticks, nothing to commit
    listed = [x["conversation"] for x in b.ok({"op": "list"})["conversations"]]
    assert listed == ["y"], listed


def test_durability_none_failed_flush_is_sent_later(daemon_factory, small_fs, dynalite,
                                                    ddb_table):
    """At durability none a flush is answered before its spool rows are committed; the
    tick's commit fails on a full disk. The messages it took must be taken again (their
    rows were void): once there is room they reach DynamoDB, and the table ends as the
    daemon holds the conversation, the add made while the disk was full included."""
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", "none", "--dynamodb-table",
                        ddb_table, "--flush-interval", "200", "--retry-base-ms", "20",
                        "--retry-max-ms", "300"], env=ddb_env(dynalite))
    c = d.connect()
    conv = "flushed-when-full"
    c.ok({"op": "add_user", "conversation": conv, "contents": "m0"})
    c.ok({"op": "flush", "conversation": conv})
    wait_until(lambda: ddb.query_all(dynalite, ddb_table, conv), scaled(5), "m0 sent")
    # A reader's snapshot keeps the WAL from starting over: every commit must grow it.
    reader = sqlite3.connect("file:%s?mode=ro" % os.path.join(state, "convod.db"), uri=True,
                             isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM spool").fetchone()
    filler = fill(small_fs)
    try:
        c.ok({"op": "add_assistant", "conversation": conv, "contents": "m1 " + "y" * 100000})
        c.ok({"op": "flush", "conversation": conv})
        time.sleep(1.0)  # ticks whose commits fail
        assert "commit failed" in d.log(), d.log()[-800:]
        assert len(ddb.query_all(dynalite, ddb_table, conv)) == 1
    finally:
        reader.execute("COMMIT")
        reader.close()
        os.unlink(filler)
    wait_until(lambda: "commits succeed again" in d.log(), scaled(5), "a commit")
    wait_drained(c)
    views = table_matches_daemon(dynalite, ddb_table, c, [conv])
    assert [m["message"]["contents"][0][:3] for m in views[conv]] == ["m0", "m1 "], views
    # The confirmations are committed by a tick too.
    wait_until(lambda: spool_rows(state) == 0, scaled(5), "an empty spool")
    assert d.stop() == 0, d.log()


@pytest.mark.skipif(VALGRIND, reason="a preloaded library: the normal and ASan stages run it")
def test_failed_sync_at_machine_is_not_brought_back_by_a_crash(daemon_factory, tmp_path):
    """At durability machine a commit whose WAL sync fails (EIO) is answered unavailable and
    undone in memory; but SQLite leaves its frames in the WAL file, whole and with valid
    checksums, and a kill -9 before the next commit brought the change back at the next
    start's recovery. The commit frame of a commit whose sync failed is spoiled (walvfs), so
    the refused change stays refused; what was answered ok before it stays, and the next
    commits go on."""
    failfile = str(tmp_path / "fail")
    d = daemon_factory(["--durability", "machine", "--flush-interval", "60000"],
                       env=slow_syncs(0, failfile))
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "x", "contents": "kept"})

    def texts(conn):
        log = conn.ok({"op": "to_messages_map", "conversation": "x", "incremental": False})
        return [t for m in log["messages"] for t in m["message"]["contents"]]

    open(failfile, "w").close()
    try:
        c.err({"op": "add_assistant", "conversation": "x", "contents": "refused"},
              "unavailable")
        assert texts(c) == ["kept"]
        store = c.ok({"op": "stats"})["store"]
        assert (store["commits_spoiled"], store["spoils_failed"]) == (1, 0), store
        d.stop(signal.SIGKILL)
    finally:
        os.unlink(failfile)
    d.start()
    c = d.connect()
    assert texts(c) == ["kept"], d.log()[-800:]
    c.ok({"op": "add_assistant", "conversation": "x", "contents": "after"})
    d.stop(signal.SIGKILL)
    d.start()
    assert texts(d.connect()) == ["kept", "after"], d.log()[-800:]
