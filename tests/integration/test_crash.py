"""kill -9 of convod at a random moment while clients add messages (shared/spec/persistence.md,
promises 1 and 5): after a restart on the same state directory every acknowledged message is
there at once, merges included, the conversations carry on, and with DynamoDB configured the
table ends up holding exactly what the daemon holds.

One writer thread per conversation adds user/assistant messages (a merge now and then, an
assistant-first start with its fake user message) and records every acknowledged answer.
The daemon is killed after a random delay, three rounds per test. The random seed is fixed
(CONVOD_CRASH_SEED overrides it) and printed, so a failure can be replayed.

Durability `process` and `machine` must keep everything acknowledged; `none` may lose up to a
flush interval, so there only a prefix of what was acknowledged is required.
"""
import os
import random
import re
import signal
import struct
import threading
import time

import pytest

from conftest import Conn
from test_disk_full import small_fs  # noqa: F401 (a fixture)
from test_persistence import (FAST, ddb_env, full_log, table_matches_daemon, wait_drained)

SEED = int(os.environ.get("CONVOD_CRASH_SEED", "424242"))
ROUNDS = 3
NCONVS = 3
MAX_ADDS = 300  # per writer and round: keeps the DynamoDB variant's table small


class Writer(threading.Thread):
    """Adds messages to one conversation until the connection dies or MAX_ADDS."""

    def __init__(self, sock, conv, rng, last_role, tag):
        super().__init__(daemon=True)
        self.sock, self.conv, self.rng, self.last_role, self.tag = sock, conv, rng, last_role, tag
        self.acked = []  # (role, text, message id, merged)
        self.inflight = None  # (role, text) sent but not answered when the connection died
        self.refused = []

    def run(self):
        try:
            c = Conn(self.sock, timeout=10)
        except OSError:
            return
        try:
            for i in range(MAX_ADDS):
                if self.last_role is None:
                    role = self.rng.choice(["user", "assistant"])
                elif self.rng.random() < 0.25:
                    role = self.last_role  # a merge
                else:
                    role = "user" if self.last_role == "assistant" else "assistant"
                text = "%s %s #%d %s \u00e9" % (self.conv, self.tag, i, role)
                self.inflight = (role, text)
                try:
                    r = c.request({"op": "add_message", "conversation": self.conv,
                                   "role": role, "contents": text})
                except (OSError, EOFError, ValueError):
                    return
                if not r.get("ok"):
                    self.refused.append(r)
                    return
                res = r["result"]
                if res["merged"] != (role == self.last_role):
                    self.refused.append(("merged should be %s" % (role == self.last_role), r))
                self.acked.append((role, text, res["message"]["id"], res["merged"]))
                self.inflight = None
                self.last_role = role
                time.sleep(0.002)
        finally:
            c.close()


def kill9(d):
    for c in d.conns:
        c.close()
    d.conns = []
    os.kill(d.proc.pid, signal.SIGKILL)
    d.proc.wait()
    d.stderr.close()
    assert d.proc.returncode == -signal.SIGKILL


def kill_while_writing(d, writers, delay):
    """Starts writers (those not started yet), kills d (kill -9) after delay seconds, and
    waits for the writers to end: none stuck, none refused."""
    for w in writers:
        if w.ident is None:
            w.start()
    time.sleep(delay)
    kill9(d)
    for w in writers:
        w.join(15)
        assert not w.is_alive(), "a writer is stuck"
        assert not w.refused, w.refused


def flat_log(maps):
    """(role, text) of every content string of the log, fake messages left out, and where
    each text is (text -> message id)."""
    seq, where = [], {}
    for m in maps:
        for s in m["message"]["contents"]:
            where[s] = m["id"]
            if "fake" not in m["metadata"].get("attribute", []):
                seq.append((m["message"]["role"], s))
    return seq, where


def check_log_shape(conv, maps):
    """No summaries here, so the whole log alternates and a fake only starts it."""
    roles = [m["message"]["role"] for m in maps]
    assert roles and roles[0] == "user", (conv, roles)
    assert all(a != b for a, b in zip(roles, roles[1:])), (conv, roles)
    for i, m in enumerate(maps):
        attrs = m["metadata"].get("attribute", [])
        if "fake" in attrs:
            assert i == 0 and m["message"]["contents"] == ["..."], (conv, i, m)
        assert attrs.count("merged") == len(m["message"]["contents"]) - 1, (conv, m)
    ids = [m["id"] for m in maps]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def carry_on(c, conv, maps):
    """A new add works after the restart and alternation holds: the same role as the last
    message merges into it, the other role makes a new message. Returns the (role, text)
    added."""
    last = maps[-1]
    role = last["message"]["role"]
    other = "user" if role == "assistant" else "assistant"
    r = c.ok({"op": "add_message", "conversation": conv, "role": role,
              "contents": "%s carry-on merge" % conv})
    assert r["merged"] and r["message"]["id"] == last["id"], r
    r2 = c.ok({"op": "add_message", "conversation": conv, "role": other,
               "contents": "%s carry-on new" % conv})
    assert not r2["merged"] and r2["message"]["id"] > last["id"], r2
    after = full_log(c, conv)
    assert after[:-2] == maps[:-1] and after[-1]["id"] == r2["message"]["id"]
    check_log_shape(conv, after)
    return [(role, "%s carry-on merge" % conv), (other, "%s carry-on new" % conv)]


def crash_rounds(d, durability, rng, after_restart=None):
    """Runs ROUNDS of write / kill -9 / restart / verify on daemon d (started)."""
    convs = ["crash-%s-%d" % (durability, k) for k in range(NCONVS)]
    history = {conv: [] for conv in convs}  # (role, text) the store must hold, in order
    last_role = {conv: None for conv in convs}
    for rnd in range(ROUNDS):
        writers = [Writer(d.socket, conv, random.Random(rng.random()), last_role[conv],
                          "r%d" % rnd) for conv in convs]
        delay = rng.uniform(0.05, 0.4) * float(os.environ.get("CONVOD_TIMEOUT_SCALE", "1"))
        print("round %d: kill -9 after %.3f s" % (rnd, delay))
        kill_while_writing(d, writers, delay)
        acked_total = sum(len(w.acked) for w in writers)
        print("round %d: %d adds acknowledged" % (rnd, acked_total))
        assert acked_total > 0, "nothing was acknowledged before the kill"

        d.start()
        c = d.connect()
        for w in writers:
            conv = w.conv
            maps = full_log(c, conv)
            seq, where = flat_log(maps)
            want = history[conv] + [(role, text) for role, text, _, _ in w.acked]
            if durability == "none":
                # Up to a flush interval may be lost: what is left is a prefix.
                assert seq == (want + [w.inflight] if w.inflight else want)[:len(seq)], (
                    conv, len(seq), len(want))
            else:
                # Everything acknowledged, plus possibly the request in flight at the kill
                # (committed, answer not read).
                assert seq in (want, want + [w.inflight] if w.inflight else want), (
                    "%s: %d strings in the log, %d acknowledged; first difference at %s" % (
                        conv, len(seq), len(want),
                        next((i for i, (a, b) in enumerate(zip(seq, want)) if a != b),
                             min(len(seq), len(want)))))
            print("  %s: %d acknowledged in all, %d in the log after restart%s" % (
                conv, len(want), len(seq),
                " (incl. the one in flight)" if w.inflight and len(seq) > len(want) else ""))
            kept = set(s for _, s in seq)
            for role, text, mid, merged in w.acked:
                if text in kept:
                    assert where[text] == mid, (conv, text, mid, where[text])
            if maps:
                check_log_shape(conv, maps)
            history[conv] = seq
            if maps:
                history[conv] = seq + carry_on(c, conv, maps)
                last_role[conv] = full_log(c, conv)[-1]["message"]["role"]
            else:
                last_role[conv] = None
        if after_restart:
            after_restart(c, [conv for conv in convs if history[conv]])
        d.conns.remove(c)
        c.close()
    return convs


@pytest.mark.parametrize("durability", ["process", "machine"])
def test_kill9_local_store(durability, daemon_factory):
    print("crash seed %d (CONVOD_CRASH_SEED)" % SEED)
    rng = random.Random(SEED)
    d = daemon_factory(["--durability", durability] + FAST)
    crash_rounds(d, durability, rng)
    assert d.stop() == 0, d.log()


def test_kill9_durability_none(daemon_factory):
    print("crash seed %d (CONVOD_CRASH_SEED)" % SEED)
    rng = random.Random(SEED + 1)
    d = daemon_factory(["--durability", "none"] + FAST)
    crash_rounds(d, "none", rng)
    assert d.stop() == 0, d.log()


def test_durability_none_loses_at_most_a_flush_interval(daemon_factory):
    """persistence.md: with durability none a crash loses at most one flush interval. What
    was acknowledged more than an interval before the kill -9 is all there; what came
    after may be lost, from the end only."""
    scale = float(os.environ.get("CONVOD_TIMEOUT_SCALE", "1"))
    d = daemon_factory(["--durability", "none", "--flush-interval", "100"])
    c = d.connect()
    texts = ["old %d" % i for i in range(20)]
    for i, t in enumerate(texts):
        c.ok({"op": "add_user" if i % 2 == 0 else "add_assistant", "conversation": "nd",
              "contents": t})
    time.sleep(0.5 * scale)  # several intervals
    late = ["late %d" % i for i in range(6)]
    for i, t in enumerate(late):
        c.ok({"op": "add_user" if i % 2 == 0 else "add_assistant", "conversation": "nd",
              "contents": t})
    kill9(d)
    d.start()
    c = d.connect()
    got = [m["message"]["contents"][0] for m in full_log(c, "nd")]
    assert got[:20] == texts, got
    assert got[20:] == late[:len(got) - 20], got


@pytest.mark.parametrize("durability", ["process", "machine"])
def test_commits_sync_as_the_durability_promises(durability, daemon_factory):
    """What `machine` promises beyond `process` (test_powercut.py stages the power loss
    itself), checked where it comes from: every acknowledged commit at `machine` synced
    the WAL before its answer (stats' wal_syncs, counted by the VFS once the real sync
    returned), and at `process` no commit syncs (only checkpoints do, which these few
    pages start none of)."""
    c = daemon_factory(["--durability", durability]).connect()
    c.ok({"op": "add_user", "conversation": "sync", "contents": "first"})
    s0 = c.ok({"op": "stats"})["store"]
    n = 40
    for i in range(n):
        # One at a time: each add is a commit of its own before its answer.
        c.ok({"op": "add_assistant" if i % 2 == 0 else "add_user", "conversation": "sync",
              "contents": "turn %d" % i})
    s1 = c.ok({"op": "stats"})["store"]
    commits = s1["commits"] - s0["commits"]
    wal_syncs = s1["wal_syncs"] - s0["wal_syncs"]
    checkpoints = s1["checkpoints"] - s0["checkpoints"]
    assert commits >= n, (s0, s1)
    if durability == "machine":
        assert wal_syncs >= commits, (s0, s1)
    else:
        # A checkpoint (an idle daemon's) syncs the WAL once; commits never.
        assert wal_syncs <= checkpoints + 1 and wal_syncs < n // 4, (s0, s1)
    print(durability, "commits", commits, "wal_syncs", wal_syncs, "checkpoints", checkpoints)
    assert s1["db_syncs"] >= s0["db_syncs"]


def test_kill9_dynamodb(dynalite, ddb_table, daemon_factory):
    print("crash seed %d (CONVOD_CRASH_SEED)" % SEED)
    rng = random.Random(SEED + 2)
    d = daemon_factory(["--dynamodb-table", ddb_table] + FAST, env=ddb_env(dynalite))

    def in_dynamodb(c, convs):
        c.ok({"op": "flush"})
        wait_drained(c, timeout=60)
        table_matches_daemon(dynalite, ddb_table, c, convs, timeout=30)

    crash_rounds(d, "process", rng, after_restart=in_dynamodb)
    assert d.stop() == 0, d.log()


def wal_frames(data):
    """The frames of a WAL file's bytes: (offset, page number, commit?, own?) each; own: its
    salts are the header's, not those of a frame left from before the WAL started over (as
    it does once a checkpoint copied everything, the idle daemon's too)."""
    page_size = struct.unpack(">I", data[8:12])[0]
    out, off = [], 32
    while off + 24 + page_size <= len(data):
        pgno, commit = struct.unpack(">II", data[off:off + 8])
        out.append((off, pgno, commit != 0, data[off + 8:off + 16] == data[16:24]))
        off += 24 + page_size
    return out


def add_turns(c, conv, lo, hi):
    """Turns lo..hi-1 to conv, one at a time: a commit each."""
    for i in range(lo, hi):
        c.ok({"op": "add_user" if i % 2 == 0 else "add_assistant", "conversation": conv,
              "contents": "turn %d" % i})


def damage_midway(wal, n):
    """Flips a bit in a page of the frame after the commit n // 2 + 1 commits before the
    WAL's last: returns the damaged bytes, the frames, this WAL's commit frames, the frame
    changed and the commit frames after it. (The WAL may have started over during the n
    adds, after an idle checkpoint: a slow host's, valgrind's.)"""
    with open(wal, "rb") as f:
        data = bytearray(f.read())
    frames = wal_frames(data)
    commits = [j for j, (_, _, commit, own) in enumerate(frames, 1) if commit and own]
    assert len(commits) >= n // 2 + 2, (len(frames), commits)
    bad = commits[len(commits) - n // 2 - 1] + 1
    later = [j for j in commits if j > bad]
    assert later
    data[frames[bad - 1][0] + 24 + 100] ^= 0x01
    with open(wal, "wb") as f:
        f.write(data)
    return data, frames, commits, bad, later


def copy_name(wal):
    """The name the start gives the copy of the damaged WAL wal: after its last change (UTC)
    and its size."""
    st = os.stat(wal)
    return "%s.damaged-%s-%d" % (wal, time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(st.st_mtime)),
                                 st.st_size)


def wal_left_as_it_is(d, log, wal, data, later, conv, n):
    """After a start that kept no copy of the damaged WAL (data, whose commits later were
    dropped): the WAL was not emptied (the start's own commits write over the frames after
    those kept), the commits dropped are counted, and conv holds a prefix of its n turns."""
    assert "after that recovery, the WAL was checkpointed" not in log, log
    c = d.connect()
    assert c.ok({"op": "stats"})["store"]["wal_commits_dropped"] == len(later)
    assert os.path.getsize(wal) >= len(data), (os.path.getsize(wal), len(data))
    texts = [m["message"]["contents"][0]
             for m in c.ok({"op": "get_messages", "conversation": conv})["messages"]]
    assert texts == ["turn %d" % i for i in range(len(texts))] and len(texts) < n, texts


def test_damaged_wal_is_reported_and_kept(daemon_factory):
    """A WAL whose frame was damaged after it was written (a bit flipped in a page, between
    a kill -9 and the restart): SQLite's recovery keeps the commits before that frame and
    drops the later ones without a word. convod says so as it starts, an error naming the
    frame and the commits dropped, and keeps a copy of the file as it was beside it. A
    restart on an intact WAL says nothing and copies nothing. A frame of the last commit
    alone not as written is what a power loss during that commit's write leaves: a warning,
    and no copy."""
    d = daemon_factory(["--durability", "machine"])
    n = 30
    add_turns(d.connect(), "w", 0, n)
    d.stop(signal.SIGKILL)
    wal = os.path.join(d.state_dir, "convod.db-wal")

    # The control: an intact WAL.
    d.start()
    assert len(d.connect().ok({"op": "get_messages", "conversation": "w"})["messages"]) == n
    assert d.connect().ok({"op": "stats"})["store"]["wal_commits_dropped"] == 0
    assert "SQLite's recovery" not in d.log()
    assert not [f for f in os.listdir(d.state_dir) if ".damaged-" in f]
    add_turns(d.connect(), "w", n, 2 * n)
    d.stop(signal.SIGKILL)
    # A frame halfway through the commits of the second run's adds: a byte of its page.
    data, frames, commits, bad, later = damage_midway(wal, n)

    d.start()
    log = d.log()
    m = re.search(r"convod\.db-wal: SQLite's recovery stops at frame (\d+) of (\d+),"
                  r" keeps the (\d+) commits before it and drops (\d+) later ones \(up to "
                  r"frame (\d+)\) whose frames are intact", log)
    assert m, log
    assert [int(x) for x in m.groups()] == [bad, len(frames), len([j for j in commits
                                                                    if j < bad]),
                                            len(later), later[-1]], (m.group(0), bad)
    assert "the file was damaged after it was written, or a power loss" in log, log
    # The copy: named after the WAL's last change and size, whole (no .part left).
    copies = [f for f in os.listdir(d.state_dir) if f.startswith("convod.db-wal.damaged-")]
    assert len(copies) == 1 and copies[0].endswith("-%d" % len(data)), os.listdir(d.state_dir)
    assert ("a copy of %s as it was is %s\n" % (wal, os.path.join(d.state_dir, copies[0]))
            in log), log
    with open(os.path.join(d.state_dir, copies[0]), "rb") as f:
        assert f.read() == bytes(data)
    # The frames dropped are gone from the WAL, so that they cannot show again.
    assert "after that recovery, the WAL was checkpointed" in log, log
    assert os.path.getsize(wal) < len(data) // 2, os.path.getsize(wal)
    # The daemon goes on with what recovery kept: a prefix of the conversation, all of the
    # first run's turns at least, and it takes new ones.
    c = d.connect()
    assert c.ok({"op": "stats"})["store"]["wal_commits_dropped"] == len(later)
    msgs = c.ok({"op": "get_messages", "conversation": "w"})["messages"]
    texts = [m["message"]["contents"][0] for m in msgs]
    assert n <= len(texts) < 2 * n, texts
    assert texts == ["turn %d" % i for i in range(len(texts))], texts
    for i in range(len(texts), len(texts) + 5):  # the last one long: frames of its own
        c.ok({"op": "add_user" if i % 2 == 0 else "add_assistant", "conversation": "w",
              "contents": "turn %d" % i + (" " + "x" * 12000 if i == len(texts) + 4 else "")})
    kept = len(texts) + 5
    d.stop(signal.SIGKILL)

    # A frame of the last commit alone, as a power loss while it was written leaves it: a
    # warning, that commit dropped, no copy.
    with open(wal, "rb") as f:
        data = bytearray(f.read())
    frames = wal_frames(data)
    commits = [j for j, (_, _, commit, own) in enumerate(frames, 1) if commit and own]
    last = commits[-1]
    assert last == max(j for j, f in enumerate(frames, 1) if f[3]) and last - commits[-2] >= 2, \
        (len(frames), commits[-3:])
    data[frames[commits[-2]][0] + 24 + 100] ^= 0x01  # the last commit's first frame
    with open(wal, "wb") as f:
        f.write(data)
    before = len(d.log())
    d.start()
    log = d.log()[before:]
    assert ("convod.db-wal: frame %d is not as it was written, and SQLite's recovery drops "
            "the last commit of the file (frame %d), which it belongs to" %
            (commits[-2] + 1, last)) in log, log
    assert "SQLite's recovery stops" not in log, log
    assert "after that recovery, the WAL was checkpointed" in log, log
    assert len([f for f in os.listdir(d.state_dir) if ".damaged-" in f]) == 1
    c = d.connect()
    assert c.ok({"op": "stats"})["store"]["wal_commits_dropped"] == 1
    msgs = c.ok({"op": "get_messages", "conversation": "w"})["messages"]
    assert [m["message"]["contents"][0] for m in msgs] == ["turn %d" % i
                                                           for i in range(kept - 1)]
    assert d.stop() == 0, d.log()


def test_wal_refused_by_sqlite_is_copied_once(daemon_factory):
    """A WAL header naming another format (its checksum right): SQLite refuses the store, and
    the start fails (exit 1) after saying so and keeping a copy of the WAL; a start that
    fails again on the same file keeps that copy, not a second one. The header put back,
    the daemon starts with everything, saying nothing of its WAL."""
    from test_config import run_convod
    d = daemon_factory(["--durability", "machine"])
    c = d.connect()
    n = 10
    for i in range(n):
        c.ok({"op": "add_user" if i % 2 == 0 else "add_assistant", "conversation": "v",
              "contents": "turn %d" % i})
    d.stop(signal.SIGKILL)
    wal = os.path.join(d.state_dir, "convod.db-wal")
    with open(wal, "rb") as f:
        data = f.read()
    assert struct.unpack(">II", data[:8]) == (0x377f0682, 3007000)  # little-endian sums
    header = bytearray(data[:32])
    header[4:8] = struct.pack(">I", 3007001)
    s1 = s2 = 0
    for k in range(0, 24, 8):
        x0, x1 = struct.unpack("<II", header[k:k + 8])
        s1 = (s1 + x0 + s2) & 0xffffffff
        s2 = (s2 + x1 + s1) & 0xffffffff
    header[24:32] = struct.pack(">II", s1, s2)
    with open(wal, "r+b") as f:
        f.write(header)
    # Frame 1's checksum follows from the header's, changed here: a commit there is not
    # whole any more (the first commit has frames of its own unless the WAL started over
    # after an idle checkpoint, as on a slow host or under valgrind).
    commits = sum(1 for j, (_, _, commit, own) in enumerate(wal_frames(data), 1)
                  if commit and own and j > 1)

    args = ["--socket", d.socket, "--state-dir", d.state_dir, "--durability", "machine"]
    rc, _, err = run_convod(args)
    assert rc == 1, err
    assert ("convod.db-wal: its header is not as SQLite wrote it, so SQLite's recovery "
            "ignores the whole file (or refuses it), and drops %d commits" % commits) in err, err
    copies = [f for f in os.listdir(d.state_dir) if f.startswith("convod.db-wal.damaged-")]
    assert len(copies) == 1, os.listdir(d.state_dir)
    assert "a copy of %s as it was is %s\n" % (wal, os.path.join(d.state_dir, copies[0])) in err
    rc, _, err = run_convod(args)
    assert rc == 1, err
    assert "a copy of %s as it was is %s (kept by an earlier start)" % (
        wal, os.path.join(d.state_dir, copies[0])) in err, err
    assert [f for f in os.listdir(d.state_dir) if ".damaged-" in f] == copies
    with open(os.path.join(d.state_dir, copies[0]), "rb") as f:
        assert f.read()[32:] == data[32:]

    with open(wal, "r+b") as f:
        f.write(data[:32])
    before = len(d.log())
    d.start()
    c = d.connect()
    msgs = c.ok({"op": "get_messages", "conversation": "v"})["messages"]
    assert len(msgs) == n
    assert c.ok({"op": "stats"})["store"]["wal_commits_dropped"] == 0
    assert "SQLite's recovery" not in d.log()[before:]
    assert d.stop() == 0, d.log()


def test_damaged_wal_whose_copy_fails_is_left_as_it_is(daemon_factory):
    """The copy of a damaged WAL cannot be written (its .part name is taken by a directory):
    the start says so, and leaves the WAL as it is instead of emptying it, since it holds
    the only copy of the commits SQLite dropped. The daemon goes on with what recovery
    kept."""
    d = daemon_factory(["--durability", "machine"])
    n = 20
    add_turns(d.connect(), "x", 0, n)
    d.stop(signal.SIGKILL)
    wal = os.path.join(d.state_dir, "convod.db-wal")
    data, _, _, _, later = damage_midway(wal, n)
    copy = copy_name(wal)
    os.mkdir(copy + ".part")

    d.start()
    log = d.log()
    assert "SQLite's recovery stops at frame" in log, log
    assert ("cannot keep a copy of %s: Is a directory; the WAL stays as it is" % wal) in log, log
    assert not os.path.exists(copy)
    wal_left_as_it_is(d, log, wal, data, later, "x", n)
    assert d.stop() == 0, d.log()


def test_damaged_wal_beside_a_linked_database_is_checked(daemon_factory):
    """convod.db a symbolic link (relative) to a file in another directory: SQLite keeps the
    WAL beside the file the link leads to, and that is the WAL checked at start, copied when
    damaged, and counted in stats; nothing is looked for beside the link."""
    # No quiet flush tick: its idle fold would grow the WAL between the two reads of its size.
    d = daemon_factory(["--durability", "machine", "--flush-interval", "600000"], start=False)
    disk = os.path.realpath(os.path.join(d.dir, "disk"))  # the path the daemon names
    os.makedirs(d.state_dir)
    os.mkdir(disk)
    os.symlink(os.path.join("..", "disk", "store.db"), os.path.join(d.state_dir, "convod.db"))
    d.start()
    n = 20
    c = d.connect()
    add_turns(c, "y", 0, n)
    wal = os.path.join(disk, "store.db-wal")
    assert c.ok({"op": "stats"})["store"]["wal_bytes"] == os.path.getsize(wal) > 0
    d.stop(signal.SIGKILL)
    assert not os.path.exists(os.path.join(d.state_dir, "convod.db-wal"))
    data, frames, commits, bad, later = damage_midway(wal, n)

    d.start()
    log = d.log()
    assert ("error store: %s: SQLite's recovery stops at frame %d of %d"
            % (wal, bad, len(frames))) in log, log
    copies = [f for f in os.listdir(disk) if f.startswith("store.db-wal.damaged-")]
    assert len(copies) == 1, os.listdir(disk)
    with open(os.path.join(disk, copies[0]), "rb") as f:
        assert f.read() == bytes(data)
    assert not [f for f in os.listdir(d.state_dir) if f.startswith("convod.db-")], \
        os.listdir(d.state_dir)
    c = d.connect()
    assert c.ok({"op": "stats"})["store"]["wal_commits_dropped"] == len(later)
    texts = [m["message"]["contents"][0]
             for m in c.ok({"op": "get_messages", "conversation": "y"})["messages"]]
    assert texts == ["turn %d" % i for i in range(len(texts))] and len(texts) < n, texts
    assert d.stop() == 0, d.log()


@pytest.mark.parametrize("kept_before", [False, True])
def test_damaged_wal_copy_that_would_fill_the_disk_is_not_kept(daemon_factory, small_fs,
                                                               kept_before):
    """A damaged WAL on a file system with less free space than twice its size: the copy
    would leave the daemon less room than it takes, so none is made. The start says so and
    leaves the WAL as it is, as when a copy fails; the daemon goes on with what recovery
    kept. A copy kept by an earlier start (kept_before) takes its room already: that one is
    named, and the WAL emptied as usual."""
    from test_disk_full import fill
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state, "--durability", "machine"])
    n = 20
    add_turns(d.connect(), "z", 0, n)
    d.stop(signal.SIGKILL)
    wal = os.path.join(state, "convod.db-wal")
    data, _, _, _, later = damage_midway(wal, n)
    copy = copy_name(wal)
    if kept_before:
        with open(copy, "wb") as f:
            f.write(data)
    filler = fill(small_fs)
    os.truncate(filler, max(0, os.path.getsize(filler) - len(data) * 3 // 2))
    fs = os.statvfs(small_fs)
    free = fs.f_bavail * fs.f_frsize
    assert len(data) <= free < 2 * len(data), (free, len(data))

    d.start()
    log = d.log()
    assert "SQLite's recovery stops at frame" in log, log
    if kept_before:
        assert ("a copy of %s as it was is %s (kept by an earlier start)" % (wal, copy)) in log
        assert "after that recovery, the WAL was checkpointed" in log, log
        assert d.connect().ok({"op": "stats"})["store"]["wal_commits_dropped"] == len(later)
    else:
        m = re.search(r"cannot keep a copy of %s: its (\d+) bytes would leave less than that "
                      r"free \((\d+) bytes are\); the WAL stays as it is" % re.escape(wal),
                      log)
        assert m and int(m.group(1)) == len(data) and int(m.group(2)) < 2 * len(data), log
        assert not os.path.exists(copy), os.listdir(state)
        wal_left_as_it_is(d, log, wal, data, later, "z", n)
    os.unlink(filler)
    assert d.stop() == 0, d.log()
