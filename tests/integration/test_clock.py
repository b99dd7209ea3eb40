"""The daemon's wall clock, moved while it runs: the retention purge of closed conversations
(--closed-retention-days) and the flusher's idle rule for a conversation's last message.

- A conversation closed longer ago than the retention leaves the local store; one closed
  within it, and one never closed, stay, across a restart too.
- A wall clock set back (NTP, a resumed VM) does not hold a conversation's last message
  back from DynamoDB for as long as it went back: the idle period is also counted on the
  monotonic clock. Nor does it take `updated` back, in DynamoDB or in `list`: a change
  after the step keeps the time of the last change before it.
- A daemon restarted with its clock a day behind the ids it wrote (a host without a
  real-time clock) still gives new messages ids above the conversation's, so the log keeps
  its order when it is read back from the store.

Thirty days cannot pass in a test, so the daemon runs under libfaketime (Debian's
libfaketime, preloaded), whose offset the test moves by rewriting a file: the daemon's
wall clock (CLOCK_REALTIME: what `close` stamps, what the purge and the idle rule compare
with, what messages' ids and timing carry) jumps while it runs. The monotonic clock is left
alone, so its timers and `uptime_ms` go on as they were. Nothing of convod is replaced: the
same binary, socket, store, DynamoDB (dynalite) and schedules.

Under valgrind the preload cannot reach the daemon (valgrind is the process), so these
tests skip there; they run in the normal and the sanitizer stages.
"""
import glob
import json
import os
import sqlite3
import time

import pytest

import ddb
from conftest import TIMEOUT_SCALE, VALGRIND
from test_disk_full import fill, small_fs  # noqa: F401 (small_fs: a fixture)
from test_persistence import ddb_env, expected_item, full_log, wait_drained, wait_until

FAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))
DAY_MS = 86400000

pytestmark = [
    pytest.mark.skipif(not FAKETIME, reason="libfaketime is not installed (tests/deps.sh)"),
    pytest.mark.skipif(VALGRIND, reason="LD_PRELOAD does not reach a daemon under valgrind"),
]


def faked(tmp_path, offset="+0"):
    """The environment of a daemon under libfaketime, and the file that moves its clock."""
    control = tmp_path / "faketime"
    control.write_text(offset + "\n")
    env = {
        "LD_PRELOAD": FAKETIME[0],
        "FAKETIME_TIMESTAMP_FILE": str(control),
        "FAKETIME_NO_CACHE": "1",  # the file is read again at every call
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        # The sanitizer stage: ASan wants its runtime first, libfaketime comes before it.
        "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "") + ":verify_asan_link_order=0",
    }
    return env, control


def add(c, conv, text, op="add_user"):
    return c.ok({"op": op, "conversation": conv, "contents": text})


def creation_ms(answer):
    return answer["message"]["metadata"]["timing"]["creation"]


def retention_daemon(tmp_path, daemon_factory, dynalite, table, extra=()):
    """A daemon under libfaketime with DynamoDB as the sink (the purge removes from the local
    store only what the table holds) and a 30-day retention; and the clock's control file."""
    env, control = faked(tmp_path)
    env.update(ddb_env(dynalite))
    d = daemon_factory(["--dynamodb-table", table, "--closed-retention-days", "30",
                        "--flush-interval", "100", "--idle-ms", "200", "--retry-base-ms", "20",
                        "--retry-max-ms", "300"] + list(extra), env=env)
    return d, control


def in_store(state, conv):
    """Whether the local store has the conversation's row."""
    db = sqlite3.connect(os.path.join(state, "convod.db"))
    try:
        return db.execute("SELECT count(*) FROM conversations WHERE CAST(id AS TEXT) = ?",
                          (conv,)).fetchone()[0] == 1
    finally:
        db.close()


def contents(c, conv):
    return [m["message"]["contents"] for m in
            c.ok({"op": "get_messages", "conversation": conv})["messages"]]


def test_closed_past_retention_purged(tmp_path, daemon_factory, dynalite, ddb_table):
    """A conversation closed longer ago than the retention leaves the local store; DynamoDB
    still holds it, and a request brings it back from there (nothing is deleted)."""
    d, control = retention_daemon(tmp_path, daemon_factory, dynalite, ddb_table)
    c = d.connect()
    before = creation_ms(add(c, "old", "closed a month ago"))
    add(c, "old", "answer", op="add_assistant")
    c.ok({"op": "close", "conversation": "old"})
    add(c, "open", "never closed")
    add(c, "recent-close", "opened a month ago, closed now")
    wait_drained(c)  # what is not in the table yet is never purged: none of it here

    control.write_text("+31d\n")
    after = creation_ms(add(c, "new", "written after the jump"))
    # The jump reached the daemon's wall clock (message ids and timing carry it) ...
    assert after - before >= 31 * DAY_MS - 60000, (before, after)
    c.ok({"op": "close", "conversation": "recent-close"})
    c.ok({"op": "close", "conversation": "new"})
    # ... and not its monotonic clock.
    assert c.ok({"op": "stats"})["uptime_ms"] < DAY_MS

    wait_until(lambda: "removed 1 closed conversations past retention" in d.log(),
               20 * TIMEOUT_SCALE, "the retention purge in the log")
    assert not in_store(d.state_dir, "old")
    for conv in ("open", "recent-close", "new"):
        assert in_store(d.state_dir, conv), conv
    # Only once an hour: a second quiet tick removes nothing more.
    time.sleep(0.5)
    assert d.log().count("past retention") == 1, d.log()
    # DynamoDB holds it: asked for, it comes back from there, whole.
    c = d.connect()
    assert contents(c, "old") == [["closed a month ago"], ["answer"]]
    assert contents(c, "recent-close") == [["opened a month ago, closed now"]]
    assert d.stop() == 0, d.log()


def test_no_purge_with_the_local_store_as_the_sink(tmp_path, daemon_factory):
    """Without DynamoDB the local store holds the only copy: closed conversations are kept
    however old (semantics.md: close deletes nothing), closed-retention-days notwithstanding.
    They used to be removed after 30 days by default."""
    env, control = faked(tmp_path)
    d = daemon_factory(["--closed-retention-days", "30", "--flush-interval", "100"], env=env)
    c = d.connect()
    add(c, "kept", "closed a year ago")
    add(c, "kept", "answer", op="add_assistant")
    c.ok({"op": "close", "conversation": "kept"})
    control.write_text("+365d\n")
    add(c, "other", "after the jump")  # a commit, then quiet ticks
    time.sleep(1.0 * TIMEOUT_SCALE)
    assert "past retention" not in d.log(), d.log()
    assert in_store(d.state_dir, "kept")
    assert d.stop() == 0, d.log()
    d.start()
    c = d.connect()
    assert contents(c, "kept") == [["closed a year ago"], ["answer"]]
    assert d.stop() == 0, d.log()


def closed_and_sent(c, convs):
    """Each conversation of convs: a user and an assistant message, closed; then out of
    memory, and in the table (the purge leaves what DynamoDB does not hold yet)."""
    for conv in convs:
        add(c, conv, "hello " + conv)
        add(c, conv, "answer " + conv, op="add_assistant")
        c.ok({"op": "close", "conversation": conv})
    wait_until(lambda: c.ok({"op": "list"})["conversations"] == [], 10 * TIMEOUT_SCALE,
               "the closed conversations out of memory")
    wait_drained(c)


def test_a_read_keeps_a_closed_conversation_from_the_purge(tmp_path, daemon_factory, dynalite,
                                                            ddb_table):
    """A closed conversation named again by a read is open again for good: the retention
    purge, which runs right after the clock jumps a month, leaves it alone, and a message
    added after the purge joins the whole log, across a restart. (Its row used to stay
    closed: the purge removed it from the store while memory held it, and the restart
    brought back only the message added after.)"""
    d, control = retention_daemon(tmp_path, daemon_factory, dynalite, ddb_table)
    c = d.connect()
    closed_and_sent(c, ("read", "unread"))
    assert len(c.ok({"op": "get_messages", "conversation": "read"})["messages"]) == 2

    control.write_text("+31d\n")
    # The purge runs at the first quiet tick: it takes the unread one only.
    wait_until(lambda: "past retention" in d.log(), 20 * TIMEOUT_SCALE,
               "the retention purge in the log")
    assert "removed 1 closed conversations past retention" in d.log(), d.log()
    assert not in_store(d.state_dir, "unread") and in_store(d.state_dir, "read")
    add(c, "read", "after the purge")
    want = [["hello read"], ["answer read"], ["after the purge"]]
    assert contents(c, "read") == want
    assert d.stop() == 0, d.log()
    d.start()
    c = d.connect()
    assert [x["conversation"] for x in c.ok({"op": "list"})["conversations"]] == ["read"]
    assert contents(c, "read") == want
    assert d.stop() == 0, d.log()


def test_a_reopening_undone_by_a_failed_commit_is_made_again_before_the_purge(
        tmp_path, daemon_factory, small_fs, dynalite, ddb_table):
    """The read's reopening rides on the next commit. When that commit fails (a full disk),
    the conversation is read back as the store holds it, closed, while memory holds it:
    the purge, once due, first has its row reopened by a commit of its own and leaves it
    alone."""
    state = os.path.join(small_fs, "state")
    d, control = retention_daemon(tmp_path, daemon_factory, dynalite, ddb_table,
                                  ["--state-dir", state, "--flush-interval", "500"])
    c = d.connect()
    closed_and_sent(c, ("read", "unread"))
    filler = fill(small_fs)
    for i in range(50):
        r = c.request({"op": "add_message", "conversation": "big", "role": "user",
                       "contents": "x%d " % i + "y" * 20000})
        if not r["ok"]:
            break
    assert not r["ok"] and r["error"]["code"] == "unavailable", r
    # The read and a change that cannot be stored, in one turn: one commit, which fails.
    c.send_raw((json.dumps({"id": 1, "op": "get_messages", "conversation": "read"}) + "\n" +
                json.dumps({"id": 2, "op": "add_message", "conversation": "big", "role": "user",
                            "contents": "z" * 20000}) + "\n").encode())
    answers = [c.recv(), c.recv()]
    assert answers[1]["error"]["code"] == "unavailable", answers
    db = sqlite3.connect(os.path.join(state, "convod.db"))
    assert db.execute("SELECT closed FROM conversations WHERE CAST(id AS TEXT) = 'read'"
                      ).fetchone()[0] > 0
    db.close()
    assert "read" in [x["conversation"] for x in c.ok({"op": "list"})["conversations"]]

    os.unlink(filler)
    wait_drained(c, timeout=30)
    control.write_text("+31d\n")
    wait_until(lambda: "past retention" in d.log(), 20 * TIMEOUT_SCALE,
               "the retention purge in the log")
    assert "removed 1 closed conversations past retention" in d.log(), d.log()
    assert not in_store(state, "unread") and in_store(state, "read")
    add(c, "read", "after the purge")
    want = [["hello read"], ["answer read"], ["after the purge"]]
    assert d.stop() == 0, d.log()
    d.start()
    c = d.connect()
    assert contents(c, "read") == want
    assert d.stop() == 0, d.log()


def test_retention_zero_keeps_closed_conversations(tmp_path, daemon_factory, dynalite,
                                                   ddb_table):
    """closed-retention-days = 0: no purge, however old the close."""
    d, control = retention_daemon(tmp_path, daemon_factory, dynalite, ddb_table,
                                  ["--closed-retention-days", "0"])
    c = d.connect()
    add(c, "kept", "closed ten years ago")
    c.ok({"op": "close", "conversation": "kept"})
    wait_drained(c)
    control.write_text("+3650d\n")
    add(c, "other", "after the jump")  # a commit, then quiet ticks
    time.sleep(1.0 * TIMEOUT_SCALE)
    assert "past retention" not in d.log(), d.log()
    assert in_store(d.state_dir, "kept")
    assert d.stop() == 0, d.log()


def test_clock_set_back_does_not_hold_the_last_message(tmp_path, dynalite, ddb_table,
                                                        daemon_factory):
    """The last message waits --idle-ms, then goes to DynamoDB, though the wall clock went
    back a day right after it was written (by the wall clock alone it would wait a day)."""
    idle = 300
    env, control = faked(tmp_path)
    env.update(ddb_env(dynalite))
    d = daemon_factory(["--dynamodb-table", ddb_table, "--flush-interval", "50", "--idle-ms",
                        str(idle), "--expires-days", "1"], env=env)
    c = d.connect()
    conv = "clock-back"
    u1 = c.ok({"op": "add_user", "conversation": conv, "contents": "one"})["message"]["id"]
    t_a1 = time.monotonic()  # before the add: its answer may come late on a slow host
    a1 = c.ok({"op": "add_assistant", "conversation": conv, "contents": "two"})["message"]["id"]
    control.write_text("-1d\n")
    # u1 is not last: it goes on the next tick, whatever the clock says.
    wait_until(lambda: ddb.get_item(dynalite, ddb_table, conv, u1) is not None, 10,
               "the first message in the table", interval=0.01)
    wait_until(lambda: ddb.get_item(dynalite, ddb_table, conv, a1) is not None,
               idle / 1000 + 10 * TIMEOUT_SCALE, "the last message after the idle period",
               interval=0.01)
    assert time.monotonic() - t_a1 >= idle / 1000 - 0.01
    first = int(ddb.get_item(dynalite, ddb_table, conv, a1)["updated"]["N"])
    listed = [x["updated"] for x in c.ok({"op": "list"})["conversations"]
              if x["conversation"] == conv]
    # A merge after the step, a day before the message's first version by the clock:
    # written again after the idle period too.
    three = c.ok({"op": "add_assistant", "conversation": conv, "contents": "three"})
    assert three["merged"]
    # (the clock did go back: a new message elsewhere is created a day before)
    assert creation_ms(add(c, "clock-back-other", "elsewhere")) < first - DAY_MS + 60000
    wait_until(lambda: ddb.get_item(dynalite, ddb_table, conv, a1)["version"] == {"N": "2"},
               idle / 1000 + 10 * TIMEOUT_SCALE, "the merged last message")
    # `updated` (the time of the last change) does not go back with the clock: version 2
    # keeps version 1's time, and so does the conversation.
    assert int(ddb.get_item(dynalite, ddb_table, conv, a1)["updated"]["N"]) == first
    assert [x["updated"] for x in c.ok({"op": "list"})["conversations"]
            if x["conversation"] == conv] == listed == [first]
    # A new message after the step too: created by the clock (a day back), its updated is
    # the conversation's last change. Every item expires a day after that at the earliest:
    # not a day after the clock, which would have it expire as it is written.
    four = c.ok({"op": "add_user", "conversation": conv, "contents": "four"})["message"]
    assert four["metadata"]["timing"]["creation"] < first - DAY_MS + 60000
    c.ok({"op": "close", "conversation": conv})
    wait_until(lambda: ddb.get_item(dynalite, ddb_table, conv, four["id"]) is not None, 10,
               "the new message in the table")
    c = d.connect()
    for m, version in zip(full_log(c, conv), [1, 2, 1]):
        item = ddb.get_item(dynalite, ddb_table, conv, m["id"])
        updated = int(item.pop("updated")["N"])
        assert updated > 0 and (m["id"] == u1 or updated >= first), (m, updated, first)
        assert int(item.pop("expires")["N"]) >= updated // 1000 + 86400, item
        assert item == expected_item(conv, m, version), (item, m)


def test_clock_behind_after_a_restart_keeps_the_log_order(tmp_path, daemon_factory):
    """A host without a real-time clock boots with an old time: the daemon restarts a day
    behind the ids it already wrote. New messages still get ids above the conversation's
    (the store orders a conversation's records by id when it reads them back), so the log
    keeps its order across the next restart, merges and summaries included."""
    env, control = faked(tmp_path)
    d = daemon_factory(["--flush-interval", "100"], env=env)
    c = d.connect()
    add(c, "rtc", "u1")
    add(c, "rtc", "a1", op="add_assistant")
    before = [m["id"] for m in c.ok({"op": "get_messages", "conversation": "rtc"})["messages"]]
    assert d.stop() == 0, d.log()

    control.write_text("-1d\n")
    d.start()
    c = d.connect()
    add(c, "rtc", "u2")
    add(c, "rtc", "u2 more")  # a merge
    add(c, "rtc", "a2", op="add_assistant")
    info = c.ok({"op": "get_summary_info", "conversation": "rtc"})
    c.ok({"op": "add_summary", "conversation": "rtc", "contents": "so far",
          "ids": info["ids"], "versions": info["versions"]})
    add(c, "rtc", "u3")
    a3 = add(c, "rtc", "a3", op="add_assistant")
    # The clock really is a day behind the first ids ...
    assert creation_ms(a3) < int(time.time() * 1000) - DAY_MS + 60000
    log = c.ok({"op": "to_messages_map", "conversation": "rtc", "incremental": False})
    ids = [m["id"] for m in log["messages"]]
    # ... and every new id is above every old one.
    assert ids[:2] == before and all(i > before[-1] for i in ids[2:]), ids
    contents = [m["message"]["contents"] for m in log["messages"]]
    assert d.stop() == 0, d.log()

    d.start()
    c = d.connect()
    again = c.ok({"op": "to_messages_map", "conversation": "rtc", "incremental": False})
    assert [m["id"] for m in again["messages"]] == ids
    assert [m["message"]["contents"] for m in again["messages"]] == contents
    assert contents[2] == ["u2", "u2 more"], contents
    assert d.stop() == 0, d.log()
