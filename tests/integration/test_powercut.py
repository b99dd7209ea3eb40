"""A power loss, staged (shared/spec/persistence.md, promise 1: `machine` survives a power
loss, `process` only a crash of the daemon).

convod runs with powercut.c preloaded, which records every creation, write, truncation, sync
and removal that the daemon makes to its state directory (the database, its WAL, the journal
of the first start, the directory's own syncs). Clients add messages to a few conversations,
pause until the daemon has checkpointed (the database file written and synced, the WAL then
started over), add more, and the daemon is killed (kill -9) while they do. The test then
builds, from the record, what a power loss at that moment could have left on the disk: each
file as of its last successful sync, there only if its creation was followed by a sync of
the directory. Later writes are all lost ("lost": the page cache never written back), or
some of them kept, out of order and perhaps torn ("torn"). A fresh daemon, without the
library, starts on that image, and must hold every message acknowledged at `machine`; at any
durability what it holds is a prefix of what was sent, in a sound database.

At `machine` the same record is cut at earlier moments too, where the library's record of
the daemon's answers tells what had been acknowledged by then: inside the checkpoint (the
database half written, its sync not made), around the first write of the WAL started over,
and a few moments after; and at every moment of the first start, where SQLite creates the
store (a rollback journal, then the WAL), up to the first answer.

At `process` the "lost" image loses what was acknowledged since the checkpoint: commits
there do not sync. That run is the control: it shows that the image really drops unsynced
writes, so that `machine` passing means something.

At `machine` with DynamoDB (dynalite) as the sink, the daemon restarted on the image sends
what its spool still holds, and the table ends exactly as the daemon holds each
conversation. So too at earlier moments of the record, each with a table of its own into
which the BatchWriteItem requests the daemon had sent by then (the library records what it
sends) are written first: a version sent before the store could keep it would be in the
table and not in the daemon.

Three operations that change many rows at once are cut at every sync, just before and just
after it, and halfway between two: a schema upgrade at the start (5 to 7: the index of the
dead letters and the repairs table; and 1 or 2 to 7, from a store of convod's old schemas
written here, whose messages and journal become segments, then copied into the database file by a checkpoint;
and 4 to 7 on a store a crash left with its batches not folded, which the start then folds),
the start on a store a crash left in the middle of a fold cycle (which it folds, with the
batches committed after the cycle began), retry_dead_letters' move in parts, and the
retention purge. Each image must
hold the operation done or not done (each part of the move, whole), never half of it. A
stop (its checkpoint, then the WAL removed) is cut the same way: every acknowledged message
stays.
"""
import json
import os
import random
import shutil
import sqlite3
import struct
import time

import pytest

import ddb
from conftest import VALGRIND, _probe_real, scaled
from test_clock import FAKETIME, faked
from test_crash import Writer, check_log_shape, flat_log, kill9, kill_while_writing
from test_persistence import (FAST, _all_dead_lettered, ddb_daemon, ddb_env, merged_version,
                              sort_key, store_rows, table_matches_daemon, wait_drained,
                              wait_until)

NCONVS = 4
SCHEMA = 7  # the store's schema (store.c, STORE_SCHEMA_VERSION)
SEED = int(os.environ.get("CONVOD_CRASH_SEED", "424242"))


def recorded(d):
    """Has the daemon d (not started) run with powercut.c preloaded, after what d.env
    preloads already; returns the path of the library's record."""
    lib = _probe_real("POWERCUT_LIB", "libpowercut.so")  # in the build of $CONVOD_BIN
    assert os.path.exists(lib), "libpowercut.so not built at %s" % lib
    log = os.path.join(d.dir, "powercut.log")
    env = dict(d.env or {})
    env.update({"LD_PRELOAD": " ".join(filter(None, [env.get("LD_PRELOAD"), lib])),
                "POWERCUT_DIR": d.state_dir, "POWERCUT_LOG": log,
                # An ASan build wants its runtime first; the library only passes calls on.
                "ASAN_OPTIONS": os.environ.get("ASAN_OPTIONS", "") +
                ":verify_asan_link_order=0"})
    d.env = env
    return log


def recorded_writers(d, prefix, rng):
    """Starts d (not started) recorded, and a test_crash Writer on each of NCONVS
    conversations named prefix-k; returns the record's path and the writers."""
    log = recorded(d)
    d.start()
    writers = [Writer(d.socket, "%s-%d" % (prefix, k), random.Random(rng.random()), None, "a")
               for k in range(NCONVS)]
    for w in writers:
        w.start()
    return log, writers


def checkpointed(c):
    """Waits until the daemon of connection c has checkpointed (a quiet tick asks for it:
    the database file written and synced, the next commit starting the WAL over), then four
    quiet ticks more, so that the round that checkpointed all of it is done."""
    deadline = time.time() + scaled(10)
    while c.ok({"op": "stats"})["store"]["checkpoints"] == 0:
        assert time.time() < deadline, "no checkpoint in a quiet spell"
        time.sleep(0.02)
    time.sleep(0.2)


def after_checkpoint(d, first, rng, seconds):
    """Waits for the writers first (started) to end and for daemon d to checkpoint, then
    starts a writer on each of their conversations, kills d (kill -9) after seconds, and
    returns those writers, ended."""
    for w in first:
        w.join(30)
        assert not w.is_alive() and not w.refused, w.refused
    checkpointed(d.connect())
    writers = [Writer(d.socket, w.conv, random.Random(rng.random()), w.last_role, "b")
               for w in first]
    kill_while_writing(d, writers, seconds)
    return writers


def recorded_start(d, first=None):
    """Starts daemon d (not started) recorded, on the state directory already there (synced
    first), calls first(connection) when given, waits for a checkpoint and kills d (kill -9).
    Returns the directory's files as the record began (synced_image's base) and the
    record."""
    os.sync()
    base = files_of(d.state_dir)
    log = recorded(d)
    d.start()
    c = d.connect()
    if first:
        first(c)
    checkpointed(c)
    kill9(d)
    records = read_records(log)
    print("the record:", "".join(r[0] for r in records))
    return base, records


def read_records(path):
    """The library's records: (kind, path, offset or size, data). A record cut short by the
    kill (the library writes each in a few calls) is left out: it ended no call."""
    with open(path, "rb") as f:
        raw = f.read()
    out, i = [], 0
    while i + 21 <= len(raw):
        kind = chr(raw[i])
        plen, off, dlen = struct.unpack_from("<IQQ", raw, i + 1)
        end = i + 21 + plen + dlen
        if end > len(raw):
            break
        name = raw[i + 21:i + 21 + plen].decode()
        out.append((kind, name, off, raw[i + 21 + plen:end]))
        i = end
    return out


def synced_image(records, src_dir, out_dir, rng=None, base=None):
    """Writes into out_dir each followed file of src_dir as a power loss now could leave it.

    - The directory: a file's creation or removal is kept only when the directory was
      synced after it (SQLite syncs it after creating a journal or a WAL; it deletes a
      rollback journal without that sync at synchronous=FULL, and a journal that comes back
      is rolled back). So a file is there as of its last creation before the directory's
      last sync, unless removed before that sync too; base: {name: bytes}, the files there
      (and synced) when the record began.
    - That file (that creation's inode: the writes between it and the next creation or
      removal of the name) holds its writes and truncations up to its own last sync, and
      nothing after: a page cache never written back.
    - With rng, some of the later ones too, as a page cache written back in part and out of
      order would: each with an even chance, a write perhaps cut short at a 512-byte
      boundary (a torn write).

    Returns {name: (operations kept, operations after the last sync, whether it is there)}."""
    base = base or {}
    ops = {os.path.join(src_dir, rel): [] for rel in base}
    dir_synced = max((i for i, r in enumerate(records) if r[0] == "S" and r[1] == src_dir),
                     default=-1)
    for i, rec in enumerate(records):
        # Not an answer, a request sent, or the directory's own sync.
        if rec[0] not in "AN" and rec[1] != src_dir:
            ops.setdefault(rec[1], []).append((i,) + rec)
    summary = {}
    for path, lst in ops.items():
        rel = os.path.relpath(path, src_dir)
        assert not rel.startswith(".."), path
        assert rel in base or (lst and lst[0][1] == "C"), (rel, lst[:1])
        # The name's inodes, each from its creation (or the record's start) to the next
        # creation or removal; the one the directory kept, if any.
        kept, inode = (0 if rel in base else None), 0
        lives = [[]]
        for op in lst:
            if op[1] in "CU":
                lives.append([])
                inode += 1
                if op[0] < dir_synced:
                    kept = inode if op[1] == "C" else None
            else:
                lives[-1].append(op)
        content, life = None, []
        if kept is not None:
            content = bytearray(base[rel]) if kept == 0 and rel in base else bytearray()
            life = lives[kept]
        last = max((k for k, r in enumerate(life) if r[1] == "S"), default=-1)
        for k, (i, kind, _, off, data) in enumerate(life):
            if k > last and not (rng and rng.random() < 0.5):
                continue
            if kind == "W":
                if k > last and rng.random() < 0.3:
                    data = data[:512 * rng.randrange(0, len(data) // 512 + 1)]
                if len(content) < off:
                    content.extend(b"\0" * (off - len(content)))
                content[off:off + len(data)] = data
            elif kind == "T":
                del content[off:]
                content.extend(b"\0" * (off - len(content)))
        summary[rel] = (last + 1, len(life) - last - 1, content is not None)
        if content is not None:
            with open(os.path.join(out_dir, rel), "wb") as f:
                f.write(content)
    return summary


@pytest.mark.skipif(VALGRIND, reason="a preloaded library under valgrind: the normal and "
                    "ASan stages run it")
@pytest.mark.parametrize("unsynced", ["lost", "torn"])
@pytest.mark.parametrize("durability", ["machine", "process"])
def test_power_loss(durability, unsynced, daemon_factory):
    rng = random.Random(SEED)
    d = daemon_factory(["--durability", durability, "--flush-interval", "50"], start=False)
    log = recorded(d)
    d.start()
    convs = ["power-%s-%d" % (durability, k) for k in range(NCONVS)]
    # First adds, then a pause that lets the daemon checkpoint (a quiet tick asks for it):
    # the database file is written and synced, and the next commit starts the WAL over.
    first = [Writer(d.socket, conv, random.Random(rng.random()), None, "a") for conv in convs]
    for w in first:
        w.start()
    # Then more adds, into the WAL started over, and the power loss while they are made.
    writers = after_checkpoint(d, first, rng, 0.3)
    acked = sum(len(w.acked) for w in first + writers)
    assert sum(len(w.acked) for w in writers) >= 20, "too few adds before the kill"

    records = read_records(log)
    kinds = {k: sum(1 for r in records if r[0] == k and r[1] != d.state_dir) for k in "WTSUA"}
    kinds["D"] = sum(1 for r in records if r[0] == "S" and r[1] == d.state_dir)
    print(durability, "records", kinds, "acknowledged", acked)
    assert kinds["W"] > 0 and kinds["S"] > 0 and kinds["A"] > 0, kinds
    image_rng = random.Random(rng.random()) if unsynced == "torn" else None

    # The power loss at the kill: everything the clients saw acknowledged.
    lost = check_image(daemon_factory, durability, records, d.state_dir, image_rng, first,
                       writers, None)
    if durability == "process" and unsynced == "lost":
        # The control: at process commits are not synced, so the image lost some.
        assert lost > 0, "the image kept every unsynced commit: it stages no power loss"
    if durability != "machine":
        return
    # And at earlier moments of the same record, where the answers written by then must
    # all be there: inside the checkpoint (the database half written, not synced yet),
    # around the first write of the WAL started over, and a few anywhere after.
    db = os.path.join(d.state_dir, "convod.db")
    db_syncs = [i for i, r in enumerate(records) if r[0] == "S" and r[1] == db]
    assert len(db_syncs) >= 2, "no checkpoint synced the database"
    ck = db_syncs[1]
    ck_writes = [i for i, r in enumerate(records[:ck]) if r[0] == "W" and r[1] == db
                 and i > db_syncs[0]]
    assert ck_writes, "the checkpoint wrote nothing to the database"
    wal = db + "-wal"
    again = next((i for i, r in enumerate(records) if i > ck and r[0] == "W" and r[1] == wal
                  and r[2] == 0), None)
    assert again is not None, "the WAL did not start over after the checkpoint"
    cuts = [ck_writes[len(ck_writes) // 2], ck, ck + 1, again, again + 1]
    cuts += sorted(rng.randrange(again + 2, len(records)) for _ in range(3))
    # And at every moment of the first start, up to the first answer: the store created
    # (a rollback journal, then the WAL), where a start on any image must find a store it
    # can use, or none.
    answer = next(i for i, r in enumerate(records) if r[0] == "A")
    print("the first start:", "".join(r[0] for r in records[:answer]))
    assert "C" in (r[0] for r in records[:answer]), "no file created before the first answer"
    cuts = list(range(1, answer + 1)) + cuts
    for cut in cuts:
        lost = check_image(daemon_factory, durability, records[:cut], d.state_dir, image_rng,
                           first, writers, answered(records[:cut]))
        assert lost == 0, cut


def answered(records):
    """The texts of every message the daemon's answers (in records) had acknowledged."""
    pending, texts = {}, set()
    for kind, _, fd, data in records:
        if kind != "A":
            continue
        *lines, pending[fd] = (pending.get(fd, b"") + data).split(b"\n")
        for line in lines:
            r = json.loads(line)
            if r.get("ok") and isinstance(r.get("result"), dict) and "message" in r["result"]:
                texts.update(r["result"]["message"]["message"]["contents"])
    return texts


def check_image(daemon_factory, durability, records, state_dir, rng, first, writers, texts,
                args=(), env=None, then=None):
    """Starts a daemon on what a power loss after records could leave, and checks what it
    holds: a prefix of what each conversation was sent (first's adds, when given, then
    writers'), and at machine everything acknowledged (the clients' answers, or those in
    texts when given). args and env go to the daemon; then(c, convs, stored), when given,
    runs before it stops, stored the conversations the image's store held (read from a copy
    before the daemon started: with DynamoDB as the sink, a conversation the daemon does not
    hold comes back from the table when asked for). Returns how many acknowledged messages
    are missing."""
    d2, copy, summary = image_dir(daemon_factory, ["--durability", durability] + list(args),
                                  env, records, state_dir, rng, copy=True)
    stored = set()
    if os.path.exists(os.path.join(copy, "convod.db")):
        db = sqlite3.connect(os.path.join(copy, "convod.db"))
        try:
            stored = {bytes(conv).decode() for conv, in
                      db.execute("SELECT id FROM conversations")}
        except sqlite3.OperationalError:  # a cut in the first start: no tables yet
            pass
        finally:
            db.close()
    print("image of %d records (operations kept, after the last sync, there): %s" % (
        len(records), summary))
    # At the kill the store is there; a cut in the first start may come before it is.
    assert texts is not None or "convod.db" in os.listdir(d2.state_dir), summary
    d2.start()
    c = d2.connect()
    lost = 0
    for w0, w in zip(first or [None] * len(writers), writers):
        r = c.request({"op": "to_messages_map", "conversation": w.conv, "incremental": False})
        if r.get("ok"):
            maps = r["result"]["messages"]
        else:  # a cut before the conversation's first commit was synced
            assert r["error"]["code"] == "not_found" and texts is not None, r
            maps = []
        seq, _ = flat_log(maps)
        sent = [(role, text) for role, text, _, _ in (w0.acked if w0 else []) + w.acked]
        sent += [w.inflight] if w.inflight else []
        if texts is None:
            want = len(sent) - (1 if w.inflight else 0)
        else:
            want = max((k + 1 for k, (_, t) in enumerate(sent) if t in texts), default=0)
        # Nothing out of order, nothing torn.
        assert seq == sent[:len(seq)], (w.conv, len(seq), want)
        if maps:
            check_log_shape(w.conv, maps)
        lost += max(0, want - len(seq))
        print("  %s: %d acknowledged, %d in the image" % (w.conv, want, len(seq)))
        if durability == "machine":
            assert len(seq) >= want, "%s: %d acknowledged, %d left after the power loss" % (
                w.conv, want, len(seq))
    wal_check_said(d2)
    # The store the image made is sound, and the new daemon goes on writing to it.
    c.ok({"op": "add_message", "conversation": writers[0].conv + "-after", "role": "user",
          "contents": "after the power loss"})
    if then:
        then(c, [w.conv for w in writers] + [writers[0].conv + "-after"], stored)
    assert d2.stop() == 0, d2.log()
    db = sqlite3.connect(os.path.join(d2.state_dir, "convod.db"))
    try:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    finally:
        db.close()
    shutil.rmtree(d2.dir, ignore_errors=True)
    return lost


@pytest.mark.skipif(VALGRIND, reason="a preloaded library under valgrind: the normal and "
                    "ASan stages run it")
@pytest.mark.parametrize("unsynced", ["lost", "torn"])
def test_power_loss_with_dynamodb(unsynced, dynalite, ddb_table, daemon_factory):
    """The power loss at machine while the flusher sends to DynamoDB (dynalite) every 50 ms,
    merges sending messages again at higher versions. The daemon restarted on the image
    holds everything acknowledged, sends what its spool still holds, and the table ends
    exactly as the daemon holds each conversation (persistence.md, promises 2 and 3): no
    message lost on the way, none older in the table than in the daemon, nothing else."""
    rng = random.Random(SEED + 1)
    args = ["--dynamodb-table", ddb_table] + FAST
    d = daemon_factory(["--durability", "machine"] + args, env=ddb_env(dynalite), start=False)
    log, first = recorded_writers(d, "power-ddb", rng)
    kill_while_writing(d, first, 0.4)  # at machine, about half of each writer's adds
    sent = ddb.scan_all(dynalite, ddb_table)
    print("acknowledged", sum(len(w.acked) for w in first), "in DynamoDB at the loss",
          len(sent))
    assert sent, "nothing reached DynamoDB before the power loss"
    records = read_records(log)

    def drained_into(c, convs, stored, table):
        c.ok({"op": "flush"})
        st = wait_drained(c, timeout=60)
        assert st["sink"]["dead_lettered"] == 0, st["sink"]
        # Those the image's store held (an early cut has none of some), and the one
        # check_image added last: the table holds them as the daemon does, and nothing of
        # the others. (Asking the daemon which it holds would not do: it restores one it
        # lacks from the table.)
        held = [conv for conv in convs[:-1] if conv in stored] + convs[-1:]
        table_matches_daemon(dynalite, table, c, held, timeout=30)

    def drained(c, convs, stored):
        drained_into(c, convs, stored, ddb_table)

    image_rng = random.Random(rng.random()) if unsynced == "torn" else None
    lost = check_image(daemon_factory, "machine", records, d.state_dir, image_rng, None,
                       first, None, args, ddb_env(dynalite), drained)
    assert lost == 0

    # And at earlier moments, each with a table of its own that holds what the requests
    # sent by then wrote (DynamoDB applies what has left the host, whatever then becomes
    # of the host): the daemon must not have sent a version its store could lose, and
    # sends what its spool held at that moment.
    requests = sent_requests(records)
    writes = [(i, body) for i, op, body in requests if op == "BatchWriteItem"]
    assert writes, "no BatchWriteItem in the record"
    assert {op for _, op, _ in requests} <= {"BatchWriteItem", "DescribeTable", "Query",
                                               "GetItem"}, {op for _, op, _ in requests}
    cuts = [k for k in cut_points(records, 0, most=10) if k < len(records)]
    for n, cut in enumerate(cuts):
        table = "%s-cut%d" % (ddb_table, n)
        ddb.create_table(dynalite, table)
        applied = 0
        for i, body in writes:
            if i < cut:
                (reqs,) = body["RequestItems"].values()
                r = ddb.request(dynalite, "BatchWriteItem", {"RequestItems": {table: reqs}})
                assert not r.get("UnprocessedItems"), r
                applied += len(reqs)
        print("cut", cut, "writes applied", applied)
        cut_args = ["--dynamodb-table", table] + FAST
        lost = check_image(daemon_factory, "machine", records[:cut], d.state_dir, image_rng,
                           None, first, answered(records[:cut]), cut_args,
                           ddb_env(dynalite),
                           lambda c, convs, stored, t=table: drained_into(c, convs, stored,
                                                                          t))
        assert lost == 0, cut
        ddb.delete_table(dynalite, table)


@pytest.mark.skipif(VALGRIND, reason="a preloaded library under valgrind: the normal and "
                    "ASan stages run it")
@pytest.mark.parametrize("unsynced", ["lost", "torn"])
def test_power_loss_at_process_with_dynamodb(unsynced, dynalite, ddb_table, daemon_factory):
    """At process (the default) a power loss may take what was acknowledged since the last
    checkpoint (persistence.md, promise 1), and DynamoDB may already hold some of it: the
    table can end ahead of the daemon restarted on the image, with messages it lost and
    versions newer than those it kept. What still holds: every message the restarted daemon
    holds reaches the table, at its version or a newer one (promise 2 for what the store
    kept). The test reports how far ahead of the daemon the table ends."""
    rng = random.Random(SEED + 6)
    args = ["--dynamodb-table", ddb_table] + FAST
    d = daemon_factory(["--durability", "process"] + args, env=ddb_env(dynalite), start=False)
    log, first = recorded_writers(d, "process-ddb", rng)
    writers = after_checkpoint(d, first, rng, 0.4)
    records = read_records(log)
    ahead = {}

    def covered(c2, convs, _stored):
        c2.ok({"op": "flush"})
        st = wait_drained(c2, timeout=60)
        assert st["sink"]["dead_lettered"] == 0, st["sink"]
        for conv in convs:
            r = c2.request({"op": "to_messages_map", "conversation": conv,
                            "incremental": False})
            maps = r["result"]["messages"] if r.get("ok") else []
            items = {it["sk"]["S"]: it for it in ddb.query_all(dynalite, ddb_table, conv)}
            held = {sort_key(m): merged_version(m) for m in maps}
            for sk, version in held.items():
                assert sk in items, (conv, sk, "held by the daemon, not in the table")
                got = int(items[sk]["version"]["N"])
                assert got >= version, (conv, sk, got, version)
                ahead["newer"] = ahead.get("newer", 0) + (got > version)
            ahead["lost"] = ahead.get("lost", 0) + len(set(items) - set(held))
            ahead["held"] = ahead.get("held", 0) + len(held)

    lost = check_image(daemon_factory, "process", records, d.state_dir,
                       random.Random(rng.random()) if unsynced == "torn" else None, first,
                       writers, None, args, ddb_env(dynalite), covered)
    print("acknowledged and lost by the image", lost, "; the table against the daemon:",
          ahead)
    if unsynced == "lost":
        # The staging drops what was not synced, and the table is ahead of the daemon.
        assert lost > 0 and ahead["lost"] > 0, (lost, ahead)


def sent_requests(records):
    """The HTTP requests the record's 'N' records hold (each descriptor's bytes, one request
    after the other): (index of the record that sent its last byte, X-Amz-Target's
    operation, its JSON body), in the order they were sent in full."""
    streams, out = {}, []
    for i, (kind, _, fd, data) in enumerate(records):
        if kind != "N":
            continue
        buf = streams.get(fd, b"") + data
        while b"\r\n\r\n" in buf:
            head, rest = buf.split(b"\r\n\r\n", 1)
            headers = {k.strip().lower(): v.strip() for k, _, v in
                       (line.partition(b":") for line in head.split(b"\r\n")[1:])}
            length = int(headers[b"content-length"])
            if len(rest) < length:
                break
            target = headers[b"x-amz-target"].decode()
            out.append((i, target.split(".", 1)[1], json.loads(rest[:length])))
            buf = rest[length:]
        streams[fd] = buf
    return out


@pytest.mark.skipif(VALGRIND, reason="a preloaded library under valgrind: the normal and "
                    "ASan stages run it")
@pytest.mark.parametrize("unsynced", ["lost", "torn"])
def test_power_loss_in_a_stop(unsynced, daemon_factory):
    """The power fails while the daemon stops (SIGTERM) at machine, or right after: the stop
    checkpoints the WAL into the database and removes it. At every sync of that, just before
    and after, and halfway between two, the image holds everything acknowledged."""
    rng = random.Random(SEED + 2)
    d = daemon_factory(["--durability", "machine", "--flush-interval", "50"], start=False)
    log, writers = recorded_writers(d, "power-stop", rng)
    for w in writers:
        w.join(30)
        assert not w.is_alive() and not w.refused, w.refused
    d.connect().ok({"op": "stats"})  # the answer marks where the cuts begin
    assert d.stop() == 0, d.log()
    records = read_records(log)
    lo = max(i for i, r in enumerate(records) if r[0] == "A" and b'"uptime_ms"' in r[3])
    wal = os.path.join(d.state_dir, "convod.db-wal")
    # What the stop did: the database synced, the WAL removed (and that made durable).
    assert any(r[0] == "U" and r[1] == wal for r in records[lo:]), "the stop left the WAL"
    cuts = cut_points(records, lo)
    print("the stop:", "".join(r[0] for r in records[lo + 1:]), "cuts", cuts)
    image_rng = random.Random(rng.random()) if unsynced == "torn" else None
    for cut in cuts:
        lost = check_image(daemon_factory, "machine", records[:cut], d.state_dir, image_rng,
                           None, writers, None)
        assert lost == 0, cut


def cut_points(records, lo, most=40):
    """Moments after record lo to cut the record at (a cut k keeps records[:k]): just
    before and just after each sync, and halfway through the writes between two syncs;
    the end too. At most `most` of them, spread evenly, the end always kept."""
    cuts, prev = {len(records)}, lo
    for i in range(lo, len(records)):
        if records[i][0] == "S":
            cuts.update((i, i + 1, (prev + i) // 2))
            prev = i + 1
    cuts = sorted(k for k in cuts if lo < k <= len(records))
    if len(cuts) > most:
        cuts = sorted({cuts[k * len(cuts) // most] for k in range(most)} | {len(records)})
    return cuts


def files_of(state_dir):
    """The followed files of state_dir and their bytes (synced: the caller synced them)."""
    out = {}
    for name in os.listdir(state_dir):
        if not name.endswith("-shm"):
            with open(os.path.join(state_dir, name), "rb") as f:
                out[name] = f.read()
    return out


def image_dir(daemon_factory, args, env, records, state_dir, rng, base=None, copy=False):
    """A daemon, not started, whose state directory is the image a power loss after
    records could leave; with copy, a copy of that image too, to read before the daemon
    opens it (a read recovers the WAL into it). Returns the daemon, the copy's path (or
    None) and synced_image's summary."""
    d2 = daemon_factory(args, env=env, start=False)
    os.makedirs(d2.state_dir)
    summary = synced_image(records, state_dir, d2.state_dir, rng, base)
    path = None
    if copy:
        path = os.path.join(d2.dir, "copy")
        shutil.copytree(d2.state_dir, path)
    return d2, path, summary


def images(daemon_factory, args, records, state_dir, rng, base):
    """For each of cut_points(records, 0): the cut, a daemon (args, not started) whose state
    directory is the image of that cut, and a copy of the image to read first."""
    for cut in cut_points(records, 0):
        d2, copy, _ = image_dir(daemon_factory, args, None, records[:cut], state_dir, rng,
                                base, copy=True)
        yield cut, d2, copy


def wal_check_said(d2):
    """What the start of d2 said of its WAL (store.c, wal_check), printed. At machine a power
    loss can cut the commit being written (the start's warning) and, while the fold's idle
    steps commit without a sync, keep later writes of those and lose earlier ones (the
    start's error, and a copy of the WAL): neither loses what was acknowledged, which the
    caller checks. A copy that could not be kept would be a failure of its own."""
    log = d2.log()
    assert "cannot keep a copy" not in log, log
    if "drops the last commit of the file" in log:
        print("  the start dropped the last commit of the WAL, cut by the power loss")
    if "SQLite's recovery stops" in log or "SQLite's recovery ignores" in log:
        print("  the start dropped commits after a frame the power loss left unwritten")


def stopped_at_now(d2, upgrade, cut):
    """Stops d2 (at machine), started on the image of cut, which must have logged the
    upgrade (None: no upgrade) and left its store at schema SCHEMA, sound; removes its
    directory."""
    wal_check_said(d2)
    assert d2.stop() == 0, d2.log()
    upgraded = [line[line.index("upgraded"):] for line in d2.log().splitlines()
                if "upgraded from schema" in line]
    assert upgraded == ([upgrade] if upgrade else []), (cut, upgraded)
    assert store_rows(d2.state_dir, "PRAGMA user_version")[0][0] == SCHEMA
    assert store_rows(d2.state_dir, "PRAGMA integrity_check")[0][0] == "ok"
    shutil.rmtree(d2.dir, ignore_errors=True)


@pytest.mark.skipif(VALGRIND, reason="a preloaded library under valgrind: the normal and "
                    "ASan stages run it")
@pytest.mark.parametrize("unsynced", ["lost", "torn"])
def test_power_loss_in_upgrade_and_retry_move(unsynced, faultproxy, dynalite, ddb_table,
                                              daemon_factory):
    """A store of schema 5 holding dead letters; the daemon, at machine, upgrades it as it
    starts (one transaction: the index of the dead letters over all of them), and a
    retry_dead_letters moves them back to the spool in parts of 256, a transaction each.
    A power loss anywhere in that leaves the store at schema 5 or 7, never between, and
    each dead letter in exactly one of the two tables, moved in whole parts; once the
    client had its answer, all of them moved. The fresh daemon started on each image
    reports what the image holds, and leaves it sound."""
    n = 2000  # 8 parts
    args = ["--durability", "machine", "--drain-ms", "0"]
    d = ddb_daemon(daemon_factory, faultproxy.url, ddb_table, args)
    _all_dead_lettered(d, faultproxy, n, "move")  # stops d; DynamoDB stays down
    # Back to schema 5, as test_store makes one: no index of the dead letters yet.
    db = sqlite3.connect(os.path.join(d.state_dir, "convod.db"))
    try:
        db.executescript("DROP INDEX dead_letters_by_message; DROP TABLE repairs;"
                         " PRAGMA user_version=5")
    finally:
        db.close()
    os.sync()
    base = files_of(d.state_dir)
    log = recorded(d)
    d.start()
    c = d.connect()
    assert c.ok({"op": "retry_dead_letters"})["retried"] == n
    assert "upgraded from schema 5 to %d" % SCHEMA in d.log()
    time.sleep(0.2)  # quiet ticks: a checkpoint, most likely
    kill9(d)

    records = read_records(log)
    answer = next(i for i, r in enumerate(records) if r[0] == "A" and b'"retried"' in r[3])
    cuts = cut_points(records, 0)
    rng = random.Random(SEED) if unsynced == "torn" else None
    seen = []
    for cut in cuts:
        d2, copy, _ = image_dir(daemon_factory, ["--dynamodb-table", ddb_table] + args,
                                ddb_env(faultproxy.url), records[:cut], d.state_dir, rng, base,
                                copy=True)
        # What the image holds, read from a copy before the daemon opens it.
        (version,), = store_rows(copy, "PRAGMA user_version")
        indexed = store_rows(copy, "SELECT count(*) FROM sqlite_schema"
                        " WHERE name IN ('dead_letters_by_message', 'repairs')")[0][0]
        (spool, dead, both), = store_rows(
            copy, "SELECT (SELECT count(*) FROM spool), (SELECT count(*) FROM dead_letters),"
            " (SELECT count(*) FROM spool s JOIN dead_letters l"
            "  ON l.conversation = s.conversation AND l.sk = s.sk)")
        seen.append((cut, version, spool))
        assert (version, indexed) in ((5, 0), (SCHEMA, 2)), (cut, version, indexed)
        assert spool + dead == n and both == 0, (cut, spool, dead, both)
        assert spool % 256 == 0 or spool == n, (cut, spool)  # whole parts
        assert version == SCHEMA or spool == 0, (cut, version, spool)  # upgrade came first
        if cut > answer:
            assert spool == n, (cut, spool)
        # The daemon on the image: it upgrades a schema 5, and reports the same rows.
        d2.start()
        c2 = d2.connect()
        assert c2.ok({"op": "stats"})["spool"]["items"] == spool, cut
        assert len(c2.ok({"op": "dead_letters", "limit": 100000})["dead_letters"]) == dead
        stopped_at_now(d2, "upgraded from schema 5 to %d" % SCHEMA if version == 5 else None,
                       cut)
    print("cuts (record, schema, moved):", seen)
    if rng is None:  # the images of later cuts hold no less
        assert [s for _, _, s in seen] == sorted(s for _, _, s in seen), seen
        assert [v for _, v, _ in seen] == sorted(v for _, v, _ in seen), seen
    # The cuts fell before the upgrade, inside the move, and after it.
    assert seen[0][1] == 5 and seen[-1][2] == n, seen
    assert any(0 < s < n for _, _, s in seen) or rng, seen


# convod's schema 1, and the journal that schema 2 added, as test_store.c writes them.
OLD_SCHEMA = """
CREATE TABLE conversations(id BLOB PRIMARY KEY NOT NULL, updated INTEGER NOT NULL,
 closed INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID;
CREATE TABLE messages(conversation BLOB NOT NULL, sk TEXT NOT NULL,
 version INTEGER NOT NULL, updated INTEGER NOT NULL, client_seen INTEGER NOT NULL,
 confirmed INTEGER NOT NULL DEFAULT 0, map_bytes INTEGER NOT NULL, map TEXT NOT NULL,
 PRIMARY KEY(conversation, sk));
CREATE TABLE spool(seq INTEGER PRIMARY KEY, conversation BLOB NOT NULL, sk TEXT NOT NULL,
 version INTEGER NOT NULL, enqueued INTEGER NOT NULL, UNIQUE(sk, conversation));
CREATE TABLE dead_letters(seq INTEGER PRIMARY KEY, conversation BLOB NOT NULL,
 sk TEXT NOT NULL, version INTEGER NOT NULL, item TEXT, error TEXT NOT NULL,
 at INTEGER NOT NULL);
PRAGMA application_id=1668183652;
"""
OLD_JOURNAL = """
CREATE TABLE journal(seq INTEGER PRIMARY KEY, conversation BLOB NOT NULL,
 sk TEXT NOT NULL, version INTEGER NOT NULL, updated INTEGER NOT NULL,
 client_seen INTEGER NOT NULL, map_bytes INTEGER NOT NULL, map TEXT NOT NULL);
"""


def write_old_store(daemon_factory, path, schema, nconvs, nmsgs):
    """A store as convod's schema 1 or 2 wrote it at path: nconvs conversations of nmsgs
    messages (their maps made by a memory-only daemon) at version 1, every third one
    changed once more (version 2, other text): with schema 2 in the journal, over version
    1 in the messages table; with schema 1 in the table. Returns {conversation: the texts
    get_messages must give, in order}."""
    m = daemon_factory(["--memory-only"])
    c = m.connect()
    want, rows, journal = {}, [], []
    for k in range(nconvs):
        conv = "old-%d" % k
        want[conv] = []
        for i in range(nmsgs):
            op = "add_user" if i % 2 == 0 else "add_assistant"
            text = "%s says %d" % (conv, i)
            msg = c.ok({"op": op, "conversation": conv, "contents": text})["message"]
            rows.append((conv.encode(), msg["id"], 1, 1000 + i, json.dumps(msg)))
            if i % 3 == 0:
                msg["message"]["contents"] = [text + " again"]
                newer = (conv.encode(), msg["id"], 2, 2000 + i, json.dumps(msg))
                if schema == 2:
                    journal.append(newer)
                else:
                    rows[-1] = newer
                text += " again"
            want[conv].append(text)
    assert m.stop() == 0
    db = sqlite3.connect(path)
    try:
        db.executescript(OLD_SCHEMA + (OLD_JOURNAL if schema == 2 else "") +
                         "PRAGMA user_version=%d;" % schema)
        db.executemany("INSERT INTO conversations VALUES(?, 3000, 0)",
                       [(conv.encode(),) for conv in want])
        db.executemany("INSERT INTO messages(conversation, sk, version, updated, client_seen,"
                       " map_bytes, map) VALUES(?, ?, ?, ?, 0, length(?5), ?5)", rows)
        if journal:
            db.executemany("INSERT INTO journal(conversation, sk, version, updated,"
                           " client_seen, map_bytes, map)"
                           " VALUES(?, ?, ?, ?, 0, length(?5), ?5)", journal)
        db.commit()
    finally:
        db.close()
    return want


@pytest.mark.skipif(VALGRIND, reason="a preloaded library under valgrind: the normal and "
                    "ASan stages run it")
@pytest.mark.parametrize("unsynced", ["lost", "torn"])
@pytest.mark.parametrize("schema", [1, 2])
def test_power_loss_in_old_schema_upgrade(schema, unsynced, daemon_factory):
    """A store of convod's schema 1 (a messages table) or 2 (and a journal of newer
    versions), upgraded to 7 as the daemon starts at machine: one transaction that folds
    the journal into the messages, builds each conversation's segment from them and drops
    the old tables. A power loss anywhere in it leaves the old schema with its tables or 7
    without them, never between, and every conversation whole, at its newest versions,
    either way."""
    args = ["--durability", "machine"]
    upgrade = "upgraded from schema %d to %d" % (schema, SCHEMA)
    old = {"messages", "journal"} if schema == 2 else {"messages"}
    d = daemon_factory(args, start=False)
    os.makedirs(d.state_dir)
    want = write_old_store(daemon_factory, os.path.join(d.state_dir, "convod.db"), schema,
                           60, 40)
    # The start, and the checkpoint that copies the upgrade into the database file.
    base, records = recorded_start(d, lambda c: c.ok({"op": "get_messages",
                                                      "conversation": "old-0"})["messages"])
    assert upgrade in d.log()
    rng = random.Random(SEED) if unsynced == "torn" else None
    seen = []
    for cut, d2, copy in images(daemon_factory, args, records, d.state_dir, rng, base):
        # A copy: a connection that may roll back a hot journal, as the daemon's will.
        db = sqlite3.connect(os.path.join(copy, "convod.db"))
        try:
            (version,), = db.execute("PRAGMA user_version").fetchall()
            tables = {name for name, in db.execute("SELECT name FROM sqlite_schema"
                                                   " WHERE type = 'table'")}
        finally:
            db.close()
        seen.append((cut, version))
        assert (version, tables & {"messages", "journal"}, "segments" in tables) in (
            (schema, old, False), (SCHEMA, set(), True)), (cut, version, sorted(tables))
        d2.start()
        c2 = d2.connect()
        for conv, texts in want.items():
            got = c2.ok({"op": "get_messages", "conversation": conv})["messages"]
            assert [m["message"]["contents"] for m in got] == [[t] for t in texts], (cut, conv)
        stopped_at_now(d2, upgrade if version == schema else None, cut)
    print("cuts (record, schema):", seen)
    if rng is None:  # the images of later cuts hold no less
        assert [v for _, v in seen] == sorted(v for _, v in seen), seen
    # The cuts fell before the upgrade's commit and after it.
    assert seen[0][1] == schema and seen[-1][1] == SCHEMA, seen


@pytest.mark.skipif(VALGRIND, reason="a preloaded library under valgrind: the normal and "
                    "ASan stages run it")
@pytest.mark.parametrize("unsynced", ["lost", "torn"])
def test_power_loss_in_schema4_upgrade_and_replay(unsynced, daemon_factory):
    """A store of schema 4 that a crash left with its turns' batches not folded yet (one
    table of batches), as the daemon starts on it at machine: the upgrade to 7 (the second
    table of batches and the index of the dead letters, one transaction), then the fold of
    the batches the crash left (the segments written and the batches emptied, one
    transaction), then a checkpoint. A power loss anywhere in that leaves schema 4 or 7,
    never between; the batches gone only when every conversation's segment is there; and
    every conversation whole at its newest versions, the merges' included. (Schema 3's
    upgrade is the same transaction: 3 and 4 differ only in how records are encoded, which
    test_store reads back.)"""
    args = ["--durability", "machine"]
    upgrade = "upgraded from schema 4 to %d" % SCHEMA
    nconvs, nturns = 12, 30
    # The crash: turns committed at machine, none folded, then kill -9.
    w = daemon_factory(args)
    c = w.connect()
    rng = random.Random(SEED + 4)
    want = {}
    for k in range(nconvs):
        conv = "replay-%d" % k
        for i in range(nturns):
            # A turn of the same role as the last one merges into it: a newer version of
            # that message, in a later batch than the first.
            op = rng.choice(["add_user", "add_assistant"])
            c.ok({"op": op, "conversation": conv, "contents": "%s turn %d" % (conv, i)})
        want[conv] = c.ok({"op": "get_messages", "conversation": conv})["messages"]
        assert any(m["message"].get("contents", [])[1:] for m in want[conv]), "no merge"
    stats = c.ok({"op": "stats"})["store"]
    kill9(w)
    assert stats["fold"]["records"] == 0 and stats["pending_records"] > 0, stats
    # Back to schema 4, as test_store makes one: every batch in the one table.
    path = os.path.join(w.state_dir, "convod.db")
    db = sqlite3.connect(path)
    try:
        db.executescript("INSERT INTO batches SELECT * FROM batches1; DROP TABLE batches1;"
                         " DROP INDEX dead_letters_by_message; DROP TABLE repairs;"
                         " PRAGMA user_version=4")
        (nbatches,), = db.execute("SELECT count(*) FROM batches").fetchall()
        (segments0,), = db.execute("SELECT count(*) FROM segments").fetchall()
    finally:
        db.close()
    assert nbatches >= nconvs * nturns // 2, nbatches
    d = daemon_factory(args, start=False)
    shutil.copytree(w.state_dir, d.state_dir)
    base, records = recorded_start(d)
    assert upgrade in d.log()
    rng = random.Random(SEED) if unsynced == "torn" else None
    seen = []
    for cut, d2, copy in images(daemon_factory, args, records, d.state_dir, rng, base):
        (version,), = store_rows(copy, "PRAGMA user_version")
        names = {n for n, in store_rows(copy, "SELECT name FROM sqlite_schema")}
        (batches, segments), = store_rows(
            copy, "SELECT (SELECT count(*) FROM batches), (SELECT count(*) FROM segments)")
        seen.append((cut, version, batches))
        new = {"batches1", "dead_letters_by_message", "repairs"}
        assert (version, new & names) in ((4, set()), (SCHEMA, new)), (
            cut, version, sorted(names))
        # The batches emptied only once the segments made of them are there (a crash
        # between the two leaves both: the next start folds the batches again); never
        # folded before the upgrade.
        assert (batches, segments) in ((nbatches, segments0), (nbatches, segments0 + nconvs),
                                       (0, segments0 + nconvs)), (cut, batches, segments)
        assert version == SCHEMA or batches == nbatches, (cut, version, batches)
        d2.start()
        check_conversations(d2.connect(), want, cut)
        stopped_at_now(d2, upgrade if version == 4 else None, cut)
    print("cuts (record, schema, batches):", seen)
    if rng is None:  # the images of later cuts hold no less
        assert [v for _, v, _ in seen] == sorted(v for _, v, _ in seen), seen
        assert [b for _, _, b in seen] == sorted((b for _, _, b in seen), reverse=True), seen
    # The cuts fell before the upgrade, between it and the fold, and after the fold.
    assert seen[0][1:] == (4, nbatches) and seen[-1][1:] == (SCHEMA, 0), seen
    assert any(s[1:] == (SCHEMA, nbatches) for s in seen) or rng, seen


class Adds:
    """Adds to convs made in bursts on one connection, each request mostly of the role
    other than that of the conversation's last message, one in 20 of the same (a merge: a
    newer version of that message). want[conv][message id] holds the message each answer
    returned: the newest version of each, in the log's order."""

    def __init__(self, c, convs, rng):
        self.c, self.convs, self.rng = c, convs, rng
        self.want, self.last, self.n = {}, {}, 0

    def make(self, n):
        """n requests, not sent yet."""
        reqs = []
        for _ in range(n):
            conv = self.rng.choice(self.convs)
            role = "assistant" if self.last.get(conv) == "user" else "user"
            if conv in self.last and self.rng.random() < 0.05:
                role = self.last[conv]
            self.last[conv] = role
            self.n += 1
            reqs.append({"op": "add_" + role, "conversation": conv,
                         "contents": "add %d" % self.n})
        return reqs

    def send(self, reqs, first=None):
        """Sends reqs at once, then reads and checks their answers (after calling first,
        when given, to read an answer to a request sent before them)."""
        self.c.send_raw(b"".join(json.dumps(r).encode() + b"\n" for r in reqs))
        if first:
            first()
        for req in reqs:
            r = self.c.recv()
            assert r.get("ok") is True, r
            m = r["result"]["message"]
            self.want.setdefault(req["conversation"], {})[m["id"]] = m


@pytest.mark.skipif(VALGRIND, reason="a preloaded library under valgrind: the normal and "
                    "ASan stages run it")
@pytest.mark.parametrize("unsynced", ["lost", "torn"])
def test_power_loss_in_replay_of_a_fold_under_way(unsynced, daemon_factory):
    """A store a crash left in the middle of a fold cycle (schema 7): the cycle's batches in
    one table, some of their conversations' segments written, and the batches committed
    since in the other table. The daemon starts on it at machine and folds both tables'
    batches (the replay). A power loss anywhere in that start leaves every conversation
    whole at its newest versions, and never a table of batches emptied before the
    segments made of it are there."""
    args = ["--durability", "machine"]
    rng = random.Random(SEED + 5)
    convs = ["cycle-%d" % k for k in range(10000)]
    for attempt in range(8):
        w = daemon_factory(["--durability", "process"])
        adds = Adds(w.connect(), convs, rng)
        t0 = time.time()
        # Up to STORE_FOLD_RECORDS (32768) records pending, where a fold cycle starts: it
        # folds them a step of 1024 records at a time, in the writer's idle time.
        while adds.c.ok({"op": "stats"})["store"]["pending_records"] < 32768:
            adds.send(adds.make(1000))
        # Three adds once the cycle is under way: their batch goes to the other table.
        # Each time a stats request goes first in the same write, so that the adds come in
        # the loop turn that saw the cycle (none ended by then), with no round trip between.
        while True:
            got = {}
            adds.c.send_raw(b'{"op":"stats"}\n')
            adds.send(adds.make(3), first=lambda: got.update(adds.c.recv()))
            fold = got["result"]["store"]["fold"]
            if fold["segments"] or fold["cycles"] or time.time() > t0 + scaled(10):
                break
        kill9(w)
        (b0, b1, segments), = store_rows(
            w.state_dir, "SELECT (SELECT count(*) FROM batches), (SELECT count(*) FROM"
            " batches1), (SELECT count(*) FROM segments)")
        print("attempt %d: %.2f s, at the last stats %s; batches %d + %d, segments %d" % (
            attempt, time.time() - t0, fold, b0, b1, segments))
        if b0 and b1 and 0 < segments < len(convs):
            break
    else:
        pytest.fail("no kill fell inside a fold cycle in 8 attempts")
    want = {conv: list(m.values()) for conv, m in adds.want.items()}
    # The conversations each table of batches names, and the last segment before the start.
    named = [{conv for blob, in store_rows(w.state_dir, "SELECT data FROM " + table)
              for conv in record_conversations(blob)} for table in ("batches", "batches1")]
    assert named[0] and named[1], named
    (seg_seq,), = store_rows(w.state_dir, "SELECT max(seq) FROM segments")

    # The start on that store, at machine, recorded.
    d = daemon_factory(args, start=False)
    shutil.copytree(w.state_dir, d.state_dir,
                    ignore=lambda _, names: [n for n in names if n.endswith("-shm")])
    base, records = recorded_start(d)
    rng = random.Random(SEED) if unsynced == "torn" else None
    seen = []
    for cut, d2, copy in images(daemon_factory, args, records, d.state_dir, rng, base):
        (n0, n1, segs), = store_rows(
            copy, "SELECT (SELECT count(*) FROM batches), (SELECT count(*) FROM batches1),"
            " (SELECT count(*) FROM segments)")
        seen.append((cut, n0 + n1, segs))
        # A table of batches is emptied whole, and only once a segment of each of its
        # conversations is written; the batches of the cycle under way before those
        # committed after it.
        assert (n0, n1) in ((b0, b1), (0, b1), (0, 0)), (cut, n0, n1)
        folded = {bytes(conv).decode() for conv, in store_rows(
            copy, "SELECT DISTINCT conversation FROM segments WHERE seq > %d" % seg_seq)}
        for n, names in zip((n0, n1), named):
            assert n or names <= folded, (cut, len(names - folded))
        d2.start()
        check_conversations(d2.connect(), want, cut)
        stopped_at_now(d2, None, cut)
    print("cuts (record, batches, segments):", seen)
    if rng is None:  # the images of later cuts hold no less
        assert [b for _, b, _ in seen] == sorted((b for _, b, _ in seen), reverse=True), seen
    # The cuts fell before the replay's fold and after it.
    assert seen[0][1] == b0 + b1 and seen[-1][1] == 0, seen


def record_conversations(blob):
    """The conversations the message records of blob (a row of batches, msgrec.c's packed
    records) belong to, in order."""
    def varint(i):
        v = shift = 0
        while True:
            b = blob[i]
            i += 1
            v |= (b & 0x7f) << shift
            shift += 7
            if b < 0x80:
                return v, i
    out, i = [], 0
    while i < len(blob):
        assert blob[i:i + 1] == b"P", (i, blob[i:i + 1])
        n, i = varint(i + 1)
        out.append(blob[i:i + n].decode())
        i += n
        i += 1 + blob[i]  # the sort key
        for _ in range(3):  # version, client_seen, updated
            _, i = varint(i)
        n, i = varint(i)
        i += n  # the map
    return out


def check_conversations(c, want, cut):
    """Asserts that get_messages on connection c gives want[conv] for each conversation
    (asked in bursts of 1000)."""
    convs = sorted(want)
    for k in range(0, len(convs), 1000):
        part = convs[k:k + 1000]
        c.send_raw(b"".join(json.dumps({"op": "get_messages", "conversation": conv}).encode()
                            + b"\n" for conv in part))
        for conv in part:
            r = c.recv()
            assert r.get("ok") is True, (cut, conv, r)
            assert r["result"]["messages"] == want[conv], (cut, conv)


@pytest.mark.skipif(not FAKETIME, reason="libfaketime is not installed (tests/deps.sh)")
@pytest.mark.skipif(VALGRIND, reason="a preloaded library under valgrind: the normal and "
                    "ASan stages run it")
@pytest.mark.parametrize("unsynced", ["lost", "torn"])
def test_power_loss_in_retention_purge(unsynced, tmp_path, daemon_factory, dynalite,
                                      ddb_table):
    """The retention purge at machine (test_clock's, the clock moved by libfaketime; with
    DynamoDB as the sink, without which nothing is purged): it folds what is pending, then
    removes the closed conversations past retention in one transaction. A power loss
    anywhere in that leaves all of them whole or all of them gone, and the open ones whole;
    once the daemon logged the removal, all are gone. The images start without DynamoDB,
    which would bring a purged conversation back: what they hold is the store's own."""
    nclosed, nopen, nmsg = 12, 3, 20
    env, control = faked(tmp_path)
    env.update(ddb_env(dynalite))
    d = daemon_factory(["--durability", "machine", "--closed-retention-days", "30",
                        "--dynamodb-table", ddb_table] + FAST, env=env, start=False)
    log = recorded(d)
    d.start()
    c = d.connect()
    closed = ["purged-%d" % k for k in range(nclosed)]
    kept = ["kept-%d" % k for k in range(nopen)]
    texts = {conv: ["%s says %d" % (conv, k) for k in range(nmsg)] for conv in closed + kept}
    for conv in closed + kept:
        for k, text in enumerate(texts[conv]):
            c.ok({"op": "add_user" if k % 2 == 0 else "add_assistant", "conversation": conv,
                  "contents": text})
    for conv in closed:
        c.ok({"op": "close", "conversation": conv})
    wait_drained(c)  # the purge leaves what DynamoDB does not hold yet
    c.ok({"op": "stats"})  # the answer marks where the record's cuts begin
    control.write_text("+31d\n")
    wait_until(lambda: "removed %d closed conversations past retention" % nclosed in d.log(),
               scaled(20), "the retention purge in the log")
    time.sleep(0.3)  # quiet ticks: a checkpoint copies the removal into the database
    kill9(d)

    records = read_records(log)
    lo = max(i for i, r in enumerate(records) if r[0] == "A" and b'"uptime_ms"' in r[3])
    cuts = cut_points(records, lo)
    rng = random.Random(SEED) if unsynced == "torn" else None
    seen = []
    for cut in cuts:
        d2, _, _ = image_dir(daemon_factory, ["--durability", "machine"], None, records[:cut],
                             d.state_dir, rng)
        d2.start()
        c2 = d2.connect()
        there = []
        for conv in closed + kept:
            r = c2.request({"op": "get_messages", "conversation": conv})
            if not r["ok"]:
                assert r["error"]["code"] == "not_found" and conv in closed, (cut, conv, r)
                continue
            got = [t for m in r["result"]["messages"] for t in m["message"]["contents"]]
            assert got == texts[conv], (cut, conv, got)  # whole
            there.append(conv)
        gone = nclosed + nopen - len(there)
        assert gone in (0, nclosed), (cut, there)  # one transaction
        seen.append(gone)
        assert d2.stop() == 0, d2.log()
        assert store_rows(d2.state_dir, "PRAGMA integrity_check")[0][0] == "ok"
        shutil.rmtree(d2.dir, ignore_errors=True)
    print("cuts", cuts, "conversations gone", seen)
    assert seen[-1] == nclosed, seen  # logged after its commit was synced
    assert seen[0] == 0 or rng, seen
    if rng is None:
        assert seen == sorted(seen), seen


def test_image_model(tmp_path):
    """synced_image on a record made by hand: what the power loss keeps of each file."""
    src = str(tmp_path / "state")

    def image(records, base=None):
        out = tmp_path / ("image-%d" % len(list(tmp_path.iterdir())))
        out.mkdir()
        synced_image(records, src, str(out), base=base)
        return {p.name: p.read_bytes() for p in out.iterdir()}

    db, wal = src + "/convod.db", src + "/convod.db-wal"
    made = [("C", db, 0, b""), ("W", db, 0, b"abcd"), ("S", db, 0, b"")]
    # A creation the directory's sync did not follow is lost, with what was written to it.
    assert image(made) == {}
    # After the directory's sync: the file, as of its own last sync.
    synced = made + [("S", src, 0, b""), ("W", db, 2, b"XY"), ("T", db, 3, b"")]
    assert image(synced) == {"convod.db": b"abcd"}
    assert image(synced + [("S", db, 0, b"")]) == {"convod.db": b"abX"}
    # A write past the end leaves a hole of zeros.
    assert image(synced[:4] + [("W", db, 6, b"z"), ("S", db, 0, b"")]) == {
        "convod.db": b"abcd\0\0z"}
    # A removal counts once the directory is synced after it; a new file of the same name,
    # not made durable, leaves the old one as it was.
    gone = synced + [("U", db, 0, b""), ("C", db, 0, b""), ("W", db, 0, b"new"),
                     ("S", db, 0, b"")]
    assert image(gone) == {"convod.db": b"abcd"}
    assert image(gone[:7] + [("S", src, 0, b"")]) == {}
    assert image(gone + [("S", src, 0, b"")]) == {"convod.db": b"new"}
    # A file there when the record began (base), and the answers, which are no file.
    assert image([("W", wal, 1, b"b"), ("A", "", 5, b"{}\n"), ("S", wal, 0, b"")],
                 base={"convod.db-wal": b"xyz"}) == {"convod.db-wal": b"xbz"}
    assert image([("W", wal, 1, b"b")], base={"convod.db-wal": b"xyz"}) == {
        "convod.db-wal": b"xyz"}
