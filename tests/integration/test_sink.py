"""The flusher (daemon/sink.c) through sink_probe (tests/integration/sink_probe.c): messages
written to a real local store, sent to dynalite by BatchWriteItem, directly and through
faultproxy.py, then read back with ddb.py and compared field by field, both with what the
store holds and with the content the probe was told to generate.

Promises checked (shared/spec/persistence.md): a message leaves the spool only once
DynamoDB confirmed it, whatever fails on the way (2); the table ends with every message
once, at its newest version (3); a write refused for good is a counted dead letter (4); what
was pending when the sink stopped is sent by the next run (5).
"""
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import threading
import time

import pytest

import ddb
from conftest import VALGRIND

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECRET = "sink-probe-secret-value"
KEY_ID = "AKIDSINKPROBE0042"


def _probe_path(var, name):
    """$var if set, else the probe `name` in the build of $CONVOD_BIN (or build/)."""
    if os.environ.get(var):
        return os.environ[var]
    convod = os.environ.get("CONVOD_BIN")
    build = os.path.dirname(os.path.dirname(convod)) if convod else os.path.join(ROOT, "build")
    return os.path.join(build, "tests", "integration", name)


PROBE = _probe_path("SINK_PROBE_BIN", "sink_probe")


@pytest.fixture(scope="module")
def probe():
    assert os.path.exists(PROBE), "sink_probe not built at %s" % PROBE
    return PROBE


def _is_asan(path):
    with open(path, "rb") as f:
        return b"__asan_init" in f.read()


def _env(home, endpoint, credentials=True, **extra):
    """No AWS settings of the host, no files of the real HOME, no HTTP proxy."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and not k.lower().endswith("_proxy")}
    env["HOME"] = str(home)
    env["TMPDIR"] = str(home)  # the probe's store, left there if it fails
    env["AWS_SHARED_CREDENTIALS_FILE"] = str(home / "no-credentials")
    env["AWS_CONFIG_FILE"] = str(home / "no-config")
    env["AWS_ENDPOINT_URL_DYNAMODB"] = endpoint
    env["AWS_REGION"] = "us-east-1"
    if credentials:
        env["AWS_ACCESS_KEY_ID"] = KEY_ID
        env["AWS_SECRET_ACCESS_KEY"] = SECRET
    env.update(extra)
    return env


class Run:
    def __init__(self, proc_result):
        self.rc = proc_result.returncode
        self.out = proc_result.stdout.decode(errors="replace")
        self.err = proc_result.stderr.decode(errors="replace")
        self.doc = json.loads(self.out) if self.out.strip() else None

    @property
    def sink(self):
        return self.doc["stats"]["sink"]

    @property
    def spool(self):
        return self.doc["stats"]["spool"]

    def rate(self):
        m = re.search(r"(\d+) items confirmed in ([0-9.]+) s: (\d+) items/s", self.err)
        return int(m.group(3)) if m else None


def _run(cmd, env, timeout=300, prefix=()):
    r = subprocess.run(list(prefix) + cmd, env=env, stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=timeout)
    run = Run(r)
    assert "Sanitizer" not in run.err and "runtime error:" not in run.err, run.err[-8000:]
    return run


def _probe(probe, table, env, *args, timeout=300, prefix=()):
    return _run([probe, "--table", table] + [str(a) for a in args], env, timeout, prefix)


def _ok(run):
    assert run.rc == 0, run.err[-6000:]
    assert "sink_probe: OK" in run.err, run.err[-6000:]
    assert SECRET not in run.err and SECRET not in run.out
    return run


# --- what the probe generates (sink_probe.c: content(), write_workload(), update_round()) --


def expected_text(i, j, payload):
    head = "conversation %d message %d" % (i, j)
    return head + "".join(chr(ord("a") + (i + j + k) % 26) for k in range(payload))


def check_table(endpoint, table, dump, conversations, messages, payload=0, updates=0,
                absent=()):
    """Every message of the dump is in the table exactly once, equal field by field to the
    store's row and to what the probe generated; the sort keys in `absent` are not there."""
    by_conv = {}
    for m in dump:
        by_conv.setdefault(m["conversation"], []).append(m)
    assert len(by_conv) == conversations
    seen = 0
    for i in range(conversations):
        conv = "probe-%d" % i
        items = ddb.query_all(endpoint, table, conv, limit=37)  # several pages
        sks = [it["sk"]["S"] for it in items]
        assert len(sks) == len(set(sks)), "an item twice in %s" % conv
        assert sks == sorted(sks)
        expected = {m["sk"]: m for m in by_conv[conv] if m["sk"] not in absent}
        assert set(sks) == set(expected), (conv, sorted(set(sks) ^ set(expected)))
        for it in items:
            got = ddb.from_item(it)
            want = expected[got["sk"]]
            wmap = want["map"]
            assert set(got) == {"conversation", "sk", "id", "message", "metadata", "version",
                                "updated"}, sorted(got)
            assert got["conversation"] == conv
            assert got["id"] == wmap["id"] == got["sk"]
            assert got["message"] == wmap["message"]
            assert got["metadata"] == wmap["metadata"]
            assert got["version"] == want["version"]
            assert got["updated"] == want["updated"]
            # and against the generator, independently of the store
            j = [k for k, m in enumerate(by_conv[conv]) if m["sk"] == got["sk"]][0]
            if j < messages:
                assert got["message"]["role"] == ("assistant" if j % 2 else "user")
                assert got["message"]["contents"] == [expected_text(i, j, payload)]
                aux = got["metadata"]["aux"]
                assert aux["i"] == i and aux["j"] == j and aux["pi"] == 3.25
                assert aux["tags"] == ["probe", j]
                assert aux["nested"] == {"ok": True, "none": None}
                assert got["metadata"]["timing"]["playStart"] == 1000 + j
                rounds = updates if j % 2 == 0 else 0
                assert got["version"] == 1 + rounds
                assert aux.get("round") == (rounds or None)
            seen += 1
    return seen


# --- tests ---------------------------------------------------------------------------------


def test_local_sink(probe, tmp_path):
    r = _run([probe, "--local"], _env(tmp_path, "http://127.0.0.1:9"))
    assert r.rc == 0, r.err
    m = re.search(r"sink_probe local: (\d+) checks, 0 failed", r.err)
    assert m and int(m.group(1)) >= 10, r.err


def test_roundtrip_exact(probe, dynalite, ddb_table, tmp_path):
    env = _env(tmp_path, dynalite)
    r = _ok(_probe(probe, ddb_table, env, "--conversations", 3, "--messages", 41,
                   "--updates", 2, "--payload", 300, "--dump", "--query", "--log-level", "info"))
    total = 3 * 41
    s = r.sink
    assert s["kind"] == "dynamodb"
    assert s["confirmed"] == s["writes_sent"] >= total
    assert s["failures"] == 0 and s["dead_lettered"] == 0 and s["retried"] == 0
    assert s["last_error"] is None and s["inflight"] == 0
    assert s["latency_ms"]["p50"] is not None and s["latency_ms"]["p50"] <= s["latency_ms"]["p99"]
    assert r.spool == {"items": 0, "bytes": 0, "oldest_pending_ms": None}
    assert r.doc["spool_rows"] == 0 and r.doc["dead_letters"] == []
    assert r.doc["query_items"] == total and r.doc["query_mismatch"] == 0
    assert check_table(dynalite, ddb_table, r.doc["messages"], 3, 41, payload=300,
                       updates=2) == total
    # the log names the key by its last 4 characters only
    assert "****0042" in r.err and KEY_ID not in r.err


def test_throughput_dynalite(probe, dynalite, ddb_table, tmp_path):
    """10,000 messages over 50 conversations; prints the rate (see the report)."""
    env = _env(tmp_path, dynalite)
    r = _ok(_probe(probe, ddb_table, env, "--conversations", 50, "--messages", 200))
    assert r.sink["confirmed"] == 10000 and r.sink["failures"] == 0
    for i in (0, 49):
        assert len(ddb.query_all(dynalite, ddb_table, "probe-%d" % i)) == 200
    rate = r.rate()
    line = [ln for ln in r.err.splitlines() if "items confirmed" in ln][0]
    print("\nsink throughput into dynalite: %s items/s (%s)" % (rate, line))
    # A floor against stalls; the figure itself is machine-bound. Under valgrind the probe
    # is bound by its own CPU (2.8-3.1 ms an item here, 291-356 items/s), so the floor
    # there is a third of the normal one (CI at 41916de failed at 291 against 300). Both
    # leave a host 3 times slower than this one room (ASan: 1,150-1,340 items/s here).
    assert rate and rate > (50 if VALGRIND else 150)


ERROR_FAULTS = ["throttle", "500", "503", "credentials", "expired_token"]


@pytest.mark.parametrize("fault", ERROR_FAULTS + ["unprocessed", "refuse", "drop", "hang",
                                                  "slow", "garbage"])
def test_faults(probe, faultproxy, dynalite, ddb_table, tmp_path, fault):
    n = 3
    extra = []
    if fault == "hang":
        n = 2
        extra = ["--request-timeout-ms", 800]
    faultproxy.push(fault, n=n, op="BatchWriteItem", ms=300 if fault == "slow" else None)
    env = _env(tmp_path, faultproxy.url)
    r = _ok(_probe(probe, ddb_table, env, "--conversations", 3, "--messages", 40,
                   "--updates", 1, "--retry-base-ms", 20, "--retry-max-ms", 300, "--dump",
                   "--log-level", "info", *extra))
    assert faultproxy.pending == 0 and faultproxy.count(fault) == n
    s = r.sink
    assert s["dead_lettered"] == 0 and r.doc["dead_letters"] == []
    assert r.doc["spool_rows"] == 0
    if fault == "slow":
        assert s["failures"] == 0
    elif fault == "unprocessed":
        assert s["unprocessed"] >= n and s["retried"] >= n
    else:
        assert s["failures"] >= 1 and s["retried"] >= 1
        assert s["last_error"], s
    if fault in ERROR_FAULTS:
        assert s["failures"] == n and s["retried"] >= n
        assert SECRET not in s["last_error"] and KEY_ID not in s["last_error"]
    if fault in ("credentials", "expired_token"):
        assert "AWS credentials reread" in r.err
    if fault == "hang":
        assert "timeout" in s["last_error"].lower()
    if fault == "garbage":
        assert "unreadable answer" in s["last_error"], s
    # every failed send of an item is followed by exactly one more send of it
    assert s["confirmed"] == s["writes_sent"] - s["retried"]
    assert check_table(dynalite, ddb_table, r.doc["messages"], 3, 40, updates=1) == 120


def test_random_faults_newest_version(probe, faultproxy, dynalite, ddb_table, tmp_path):
    """A mix of failures on a third of the calls while new versions keep coming: the table
    still ends with every message once at its newest version."""
    for fault in ("throttle", "500", "unprocessed", "drop"):
        faultproxy.set_probability(fault, 0.08, op="BatchWriteItem")
    env = _env(tmp_path, faultproxy.url)
    r = _ok(_probe(probe, ddb_table, env, "--conversations", 4, "--messages", 60,
                   "--updates", 3, "--batch-items", 10, "--retry-base-ms", 10,
                   "--retry-max-ms", 100, "--dump"))
    faultproxy.clear()
    assert r.sink["failures"] >= 1 and r.sink["dead_lettered"] == 0
    assert check_table(dynalite, ddb_table, r.doc["messages"], 4, 60, updates=3) == 240


def test_validation_goes_to_dead_letters(probe, faultproxy, dynalite, ddb_table, tmp_path):
    """A refused batch is split into single writes; the one refused again is a dead letter,
    counted and left out of the table; the others all arrive."""
    faultproxy.push("validation", n=2, op="BatchWriteItem")
    env = _env(tmp_path, faultproxy.url)
    r = _probe(probe, ddb_table, env, "--conversations", 2, "--messages", 30, "--inflight", 1,
               "--expect-dead", 1, "--dump")
    _ok(r)
    assert faultproxy.count("validation") == 2
    s = r.sink
    assert s["dead_lettered"] == 1 and s["failures"] == 2
    assert s["retried"] >= 24  # the rest of the split batch, sent again one by one
    assert "ValidationException" in s["last_error"]
    (dead,) = r.doc["dead_letters"]
    assert "ValidationException" in dead["error"] and dead["version"] == 1
    assert dead["conversation"] in ("probe-0", "probe-1")
    assert r.doc["spool_rows"] == 0
    assert check_table(dynalite, ddb_table, r.doc["messages"], 2, 30,
                       absent={dead["sk"]}) == 59


def test_item_too_large_for_dynamodb(probe, dynalite, ddb_table, tmp_path):
    """A real refusal: a 500 KB message (over DynamoDB's 400 KB item limit) slipped into the
    store is refused by the server itself; only it becomes a dead letter."""
    env = _env(tmp_path, dynalite)
    r = _ok(_probe(probe, ddb_table, env, "--conversations", 2, "--messages", 20,
                   "--big-message", 500000, "--expect-dead", 1, "--dump"))
    (dead,) = r.doc["dead_letters"]
    big = [m for m in r.doc["messages"] if len(m["map"]["message"]["contents"][0]) == 500000]
    assert len(big) == 1 and dead["sk"] == big[0]["sk"] and dead["conversation"] == "probe-0"
    assert "ValidationException" in dead["error"]
    assert r.sink["dead_lettered"] == 1 and r.sink["failures"] >= 2
    assert check_table(dynalite, ddb_table, r.doc["messages"], 2, 20,
                       absent={dead["sk"]}) == 40


def test_endpoint_down_then_resume(probe, faultproxy, dynalite, ddb_table, tmp_path):
    """Nothing is confirmed while the endpoint is down, so everything stays in the spool
    when the sink stops; the next run sends it all."""
    state = tmp_path / "state"
    state.mkdir()
    env = _env(tmp_path, faultproxy.url)
    faultproxy.set_down(True)
    r1 = _run([probe, "--table", ddb_table, "--state-dir", str(state), "--conversations", "3",
               "--messages", "25", "--stop-after-ms", "1500", "--close-deadline-ms", "300",
               "--connect-timeout-ms", "300", "--retry-base-ms", "20", "--retry-max-ms", "200",
               "--dump"], env)
    assert r1.rc == 0, r1.err
    assert r1.doc["spool_rows"] == 75 and r1.spool["items"] == 75
    assert r1.spool["oldest_pending_ms"] >= 1000
    assert r1.sink["confirmed"] == 0 and r1.sink["failures"] >= 1 and r1.sink["last_error"]
    # backoff and the failure gate keep the calls against a dead endpoint few
    assert r1.sink["failures"] < 60, r1.sink
    assert "stay in the spool" in r1.err
    faultproxy.set_down(False)
    r2 = _ok(_probe(probe, ddb_table, env, "--state-dir", state, "--resume"))
    assert r2.sink["confirmed"] == 75
    assert check_table(dynalite, ddb_table, r1.doc["messages"], 3, 25) == 75


def test_credentials_appear_later(probe, dynalite, ddb_table, tmp_path):
    """Started without credentials, the sink waits and picks them up from the shared
    credentials file once it exists."""
    creds = tmp_path / "credentials"
    env = _env(tmp_path, dynalite, credentials=False, AWS_SHARED_CREDENTIALS_FILE=str(creds))
    proc = subprocess.Popen([probe, "--table", ddb_table, "--conversations", "2", "--messages",
                             "10", "--retry-base-ms", "50", "--retry-max-ms", "300",
                             "--log-level", "info", "--timeout-ms", "30000"],
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    # The file is written only once the sink has said it has none: a fixed sleep was too
    # short for a probe slowed down by valgrind, which then found the file at its start.
    out, err = [], []
    missing = threading.Event()

    def drain(stream, into, watch):
        for line in iter(stream.readline, b""):
            into.append(line)
            if watch and b"no AWS credentials" in line:
                missing.set()

    readers = [threading.Thread(target=drain, args=(proc.stdout, out, False)),
               threading.Thread(target=drain, args=(proc.stderr, err, True))]
    for t in readers:
        t.start()
    try:
        assert missing.wait(60), "the sink never said it had no credentials"
        time.sleep(0.2)  # it is now waiting between retries
        creds.write_text("[default]\naws_access_key_id = %s\naws_secret_access_key = %s\n"
                         % (KEY_ID, SECRET))
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for t in readers:
            t.join()
    r = Run(subprocess.CompletedProcess(proc.args, proc.returncode, b"".join(out),
                                        b"".join(err)))
    assert "Sanitizer" not in r.err and "runtime error:" not in r.err, r.err[-8000:]
    _ok(r)
    assert "no AWS credentials" in r.err and "AWS credentials reread" in r.err
    # The attempts without credentials were never sent: no failed call (proto/protocol.md).
    assert r.sink["confirmed"] == 20 and r.sink["failures"] == 0, r.sink
    assert len(ddb.query_all(dynalite, ddb_table, "probe-1")) == 10


def test_close_with_requests_hanging(probe, faultproxy, ddb_table, tmp_path):
    """sink_close with calls in flight that never answer: the deadline ends them, the
    entries stay in the spool, and the process exits cleanly."""
    faultproxy.push("hang", n=50, op="BatchWriteItem")
    env = _env(tmp_path, faultproxy.url)
    t0 = time.time()
    r = _probe(probe, ddb_table, env, "--conversations", 2, "--messages", 30,
               "--stop-after-ms", 400, "--close-deadline-ms", 300, timeout=60)
    assert r.rc == 0, r.err
    assert time.time() - t0 < 20
    assert r.doc["spool_rows"] == 60 and r.sink["confirmed"] == 0
    assert r.sink["inflight"] >= 1


def test_create_table(probe, dynalite, tmp_path):
    name = "convod-probe-create-%d" % os.getpid()
    env = _env(tmp_path, dynalite)
    try:
        r = _ok(_probe(probe, name, env, "--create-table", "--conversations", 1,
                       "--messages", 5))
        assert "create table: created" in r.err
        assert ddb.describe_table(dynalite, name)["TableStatus"] == "ACTIVE"
        assert len(ddb.query_all(dynalite, name, "probe-0")) == 5
        r = _ok(_probe(probe, name, env, "--create-table", "--conversations", 1,
                       "--messages", 5))
        assert "create table: File exists" in r.err
    finally:
        try:
            ddb.delete_table(dynalite, name, wait=False)
        except (OSError, ddb.DdbError):
            pass


def _valgrind(path):
    vg = shutil.which("valgrind")
    if vg is None or _is_asan(path):
        return None
    return [vg, "-q", "--leak-check=full", "--errors-for-leak-kinds=definite,indirect",
            "--error-exitcode=9"]


def test_valgrind_faults_and_close(probe, faultproxy, dynalite, ddb_table, tmp_path):
    vg = _valgrind(probe)
    if vg is None:
        pytest.skip("valgrind missing, or an ASan build (which checks leaks itself)")
    env = _env(tmp_path, faultproxy.url)
    faultproxy.push("throttle", n=1, op="BatchWriteItem")
    faultproxy.push("unprocessed", n=1, op="BatchWriteItem")
    faultproxy.push("validation", n=2, op="BatchWriteItem")
    faultproxy.push("credentials", n=1, op="BatchWriteItem")
    r = _probe(probe, ddb_table, env, "--conversations", 2, "--messages", 30, "--updates", 1,
               "--inflight", 1, "--retry-base-ms", 10, "--retry-max-ms", 50, "--expect-dead", 1,
               "--query", "--dump", prefix=vg, timeout=600)
    _ok(r)
    assert r.doc["query_mismatch"] == 0
    faultproxy.push("hang", n=50, op="BatchWriteItem")
    r = _probe(probe, ddb_table, env, "--conversations", 1, "--messages", 10,
               "--stop-after-ms", 1500, "--close-deadline-ms", 200, prefix=vg, timeout=600)
    assert r.rc == 0, r.err[-6000:]
    assert r.doc["spool_rows"] == 10


def test_query_retries_then_gives_up(probe, faultproxy, dynalite, ddb_table, tmp_path):
    """sink_query follows every page and retries throttling; a Query that keeps failing
    ends with an error after 1 + 4 attempts instead of waiting forever."""
    env = _env(tmp_path, faultproxy.url)
    faultproxy.push("throttle", n=2, op="Query")
    faultproxy.push("credentials", n=1, op="Query")
    r = _ok(_probe(probe, ddb_table, env, "--conversations", 2, "--messages", 30, "--query",
                   "--payload", 40000, "--log-level", "info"))
    assert faultproxy.count("throttle") == 2 and faultproxy.count("credentials") == 1
    assert r.doc["query_items"] == 60 and r.doc["query_mismatch"] == 0
    # 30 items of 40 KB: more than one 1 MB page per conversation
    assert faultproxy.count("op:Query") >= 2 * 2 + 3
    faultproxy.push("500", n=5, op="Query")
    r = _probe(probe, ddb_table, env, "--conversations", 1, "--messages", 3, "--query",
               "--retry-base-ms", 10, "--retry-max-ms", 20)
    assert r.rc == 1 and "query failed: Input/output error" in r.err, r.err
    assert faultproxy.pending == 0


# --- allocation failures (sink_alloc_probe) -----------------------------------------------

_ALLOC_LINE = re.compile(r"sink_alloc_probe: (\d+) allocations, refused (\d), (\d+) queries "
                         r"refused, (-?\d+) not freed")


@pytest.mark.skipif(VALGRIND, reason="thousands of probe runs; the normal and ASan stages "
                                     "run it")
def test_allocation_failures(dynalite, ddb_table, tmp_path):
    """The sink's whole work on 12 messages, half of them changed again while the first
    versions are on their way, in batches of 5 (items built from the store, BatchWriteItem
    signed, sent and its answer parsed, the confirmations recorded, then a Query of each
    conversation read back) with the Nth allocation of the loop's thread refused, for every
    N: sink.c, ddbclient.c, lib/ (items, signing, parsing), the local store and jansson
    (curl's own allocations are counted, not refused: see sink_probe.c). Each run must
    still confirm every write and leave no spool row, with no dead letter and the table
    equal to the store (where the refusal hit the recording of a confirmation, the sink
    reads the spool again and sends those rows again); nothing may hang or crash, and every
    allocation is freed."""
    probe = _probe_path("SINK_ALLOC_PROBE_BIN", "sink_alloc_probe")
    assert os.path.exists(probe), "sink_alloc_probe not built at %s" % probe
    env = _env(tmp_path, dynalite)
    conversations, messages = 3, 4
    total = conversations * messages

    def one(n):
        state = tmp_path / ("s%d" % n)
        state.mkdir()
        prefix = "n%d" % n
        r = _run([probe, "--table", ddb_table, "--prefix", prefix, "--state-dir", str(state),
                  "--conversations", str(conversations), "--messages", str(messages),
                  "--updates", "1", "--batch-items", "5",
                  "--query", "--retry-base-ms", "1", "--retry-max-ms", "4",
                  "--timeout-ms", "30000", "--fail-at", str(n)], env, timeout=120)
        m = _ALLOC_LINE.search(r.err)
        assert m, "N=%d: rc %d\n%s" % (n, r.rc, r.err[-3000:])
        calls, refused, queries_refused, live = (int(g) for g in m.groups())
        assert live == 0, "N=%d: %d allocations not freed\n%s" % (n, live, r.err[-3000:])
        assert r.doc and r.doc["dead_letters"] == [], "N=%d: %s" % (n, r.err[-3000:])
        assert "timed out" not in r.err, "N=%d: %s" % (n, r.err[-3000:])
        assert r.doc["query_mismatch"] == 0, "N=%d: %s" % (n, r.err[-3000:])
        assert r.rc == 0 and "sink_probe: OK" in r.err, "N=%d: %s" % (n, r.err[-3000:])
        assert r.doc["spool_rows"] == 0 and r.doc["query_items"] == total, r.err[-3000:]
        # A refusal while recording confirmations (sink.c) or committing them (the probe's
        # turn, as the daemon's) leaves their spool rows behind the sink's back: it reads
        # the spool again after the next commit and sends them again (sink_resync).
        lost = ("recording a confirmed write failed" in r.err or
                "sink_probe: commit refused" in r.err)
        resent = "read the spool again after a lost recording" in r.err
        if lost:
            assert resent, "N=%d: %s" % (n, r.err[-3000:])
        if resent or n % 97 == 0:
            # The table itself, for these and a sample of the others: every message once
            # (the probe's --query compared each with the store).
            for i in range(conversations):
                items = ddb.query_all(dynalite, ddb_table, "%s-%d" % (prefix, i))
                sks = [it["sk"]["S"] for it in items]
                assert len(sks) == len(set(sks)) == messages, (n, i, items)
        shutil.rmtree(state, ignore_errors=True)
        return calls, refused, queries_refused, r.sink, resent

    calls, refused, _, _, _ = one(0)
    assert refused == 0 and calls > 500, calls  # the run does reach the allocating paths
    # Under ASan every third N (the same paths, a third of the time).
    step = 3 if _is_asan(probe) else 1
    outcomes = {}
    n = 1
    while True:
        ns = list(range(n, n + 64 * step, step))
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
            for k, out in zip(ns, pool.map(one, ns)):
                outcomes[k] = out
        n += 64 * step
        if any(outcomes[k][1] == 0 for k in ns):
            break
        assert n < 4 * calls, "allocations keep being refused after %d runs" % n
    last = min(k for k in outcomes if outcomes[k][1] == 0)
    tried = [outcomes[k] for k in sorted(outcomes) if k < last]
    assert all(o[1] == 1 for o in tried)
    retried = sum(1 for o in tried if o[3]["retried"] or o[3]["failures"])
    queries = sum(1 for o in tried if o[2])
    resent = sum(1 for o in tried if o[4])
    print("\nsink allocation failures: %d allocations in a clean run, %d refused in turn "
          "(every %d): %d runs sent a write again, %d read a query again, %d lost a "
          "recording and read the spool again" % (calls, len(tried), step, retried, queries,
                                                  resent))
    assert last > calls // 2, (last, calls)
    if step == 1:
        assert resent > 0, "no refusal hit the recording of a confirmation"
    assert retried > 50 // step and queries > 10 // step, (retried, queries)
