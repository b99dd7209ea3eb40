#!/bin/sh
# How fast convod's DynamoDB flusher gets confirmed items into dynalite, next to what the AWS
# SDK for JavaScript v3 gets from the same dynalite (tests/bench/sdk_batchwrite.mjs), and
# whether the cost per message grows with the conversation. Everything on 127.0.0.1; every
# process started here is stopped at the end. Builds nothing.
#
#  1. starts dynalite (tests/node_modules; installed with `npm ci --prefix tests` if missing)
#  2. convod with the DynamoDB sink (--flush-interval 100 --idle-ms 0), a fresh table, loaded
#     by convod-bench (adds-only) for DURATION s; `stats` is polled until the spool is empty:
#     steady-state confirmed items/s (1 s intervals with a backlog at both ends), drain time,
#     the daemon's and dynalite's CPU (from /proc/PID/stat)
#  3. sdk_batchwrite.mjs with SDK_CONCURRENCY calls in flight for DURATION s; then the
#     ceiling of dynalite itself: the SDK at each of CEILING_CONCURRENCY for CEILING_SECONDS
#  4. a fill of TOTAL messages as conversations of each of LENGTHS messages: items/s and the
#     daemon's CPU time per confirmed item
# The machine is shared: the "others %" columns show the CPU every other process took
# meanwhile; figures taken while it is high are not the ceiling of either side.
#
# usage: tests/bench/run-flusher.sh [BUILD]     (BUILD defaults to "build")
# environment (defaults): DURATION=10 CONNECTIONS=50 PIPELINE=16 CONVERSATIONS=1000
#   MESSAGE_BYTES=100 (convod-bench --message-bytes and sdk --content-bytes)
#   SDK_CONCURRENCY=20 CEILING_CONCURRENCY="1 50" CEILING_SECONDS=5 LENGTHS="10 1000"
#   TOTAL=200000 DURABILITY=process FLUSH_INTERVAL=100 IDLE_MS=0 DRAIN_TIMEOUT=180
#   TIMELINE=1 (print the per-second samples of step 2) VERIFY=1 (count the items of step
#   2's table with a Scan) PERF=0 (1: `perf record --call-graph dwarf` a copy of the daemon
#   during step 2 and print its top symbols, inclusive) CONVOD_ARGS="" (extra convod options)
#   STEPS="load sdk lengths" (which of steps 2, 3 and 4 to run)
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
prog=run-flusher
. "$root/tests/bench/lib.sh"
bench_build "${1:-build}"
bench_need "$convod" "$bench"
if ! command -v node >/dev/null; then
	echo "run-flusher: node is not installed (dynalite and the SDK baseline need it)" >&2
	exit 2
fi
if [ ! -f "$root/tests/node_modules/dynalite/cli.js" ] ||
	[ ! -d "$root/tests/node_modules/@aws-sdk/client-dynamodb" ]; then
	echo "run-flusher: installing tests/node_modules (npm ci --prefix tests) ..." >&2
	npm ci --prefix "$root/tests" --no-audit --no-fund >&2
fi

exec python3 - "$root" "$convod" "$bench" <<'EOF'
import json, os, signal, socket, subprocess, sys, tempfile, time, shutil

root, convod, bench = sys.argv[1:4]
sys.path.insert(0, os.path.join(root, "tests", "integration"))
import ddb  # noqa: E402  (SigV4-signed requests to dynalite)

def env_num(name, default, cast=int):
    v = os.environ.get(name, "")
    return cast(v) if v else default

DURATION = env_num("DURATION", 10.0, float)
CONNECTIONS = env_num("CONNECTIONS", 50)
PIPELINE = env_num("PIPELINE", 16)
CONVERSATIONS = env_num("CONVERSATIONS", 1000)
MESSAGE_BYTES = env_num("MESSAGE_BYTES", 100)
SDK_CONCURRENCY = env_num("SDK_CONCURRENCY", 20)
CEILING = [int(x) for x in os.environ.get("CEILING_CONCURRENCY", "1 50").split()]
CEILING_SECONDS = env_num("CEILING_SECONDS", 5.0, float)
LENGTHS = [int(x) for x in os.environ.get("LENGTHS", "10 1000").split()]
TOTAL = env_num("TOTAL", 200000)
DURABILITY = os.environ.get("DURABILITY") or "process"
FLUSH_INTERVAL = env_num("FLUSH_INTERVAL", 100)
IDLE_MS = env_num("IDLE_MS", 0)
DRAIN_TIMEOUT = env_num("DRAIN_TIMEOUT", 180.0, float)
TIMELINE = os.environ.get("TIMELINE", "1") == "1"
VERIFY = os.environ.get("VERIFY", "1") == "1"
PERF = os.environ.get("PERF", "0") == "1"
CONVOD_ARGS = os.environ.get("CONVOD_ARGS", "").split()
STEPS = os.environ.get("STEPS", "load sdk lengths").split()
TICK = os.sysconf("SC_CLK_TCK")
POLL = 0.1         # stats poll period, s
SATURATED = 200    # spool items at both ends of an interval for it to count as backlogged

os.environ["no_proxy"] = os.environ["NO_PROXY"] = "127.0.0.1,localhost"
work = tempfile.mkdtemp(prefix="convod-flusher.")
procs = []  # every process started here, stopped in the finally below


def log(msg):
    print("run-flusher: " + msg, file=sys.stderr, flush=True)


def on_signal(signum, frame):
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, on_signal)


def start(args, logname, env=None):
    f = open(os.path.join(work, logname), "ab")
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=f, stderr=f, env=env)
    f.close()
    procs.append(p)
    return p


def stop(p, sig=signal.SIGTERM, timeout=30):
    if p.poll() is None:
        p.send_signal(sig)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if p in procs:
        procs.remove(p)
    return p.returncode


def tail(logname, n=20):
    try:
        with open(os.path.join(work, logname), "rb") as f:
            return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
    except OSError:
        return ""


def cpu_ticks(pid):
    """utime + stime of a live process, in clock ticks."""
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def machine_ticks():
    """Busy clock ticks of the whole machine (every CPU) since boot."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[0] + v[1] + v[2] + v[5] + v[6]  # user nice system irq softirq


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stats:
    """One connection to convod's socket for `stats`."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.f = self.sock.makefile("rwb")
        self.n = 0

    def get(self):
        self.n += 1
        self.f.write(b'{"op":"stats","id":%d}\n' % self.n)
        self.f.flush()
        r = json.loads(self.f.readline())
        if not r.get("ok"):
            raise RuntimeError("stats failed: %r" % r)
        return r["result"]

    def close(self):
        self.f.close()
        self.sock.close()


def start_dynalite():
    for _ in range(5):
        port = free_port()
        endpoint = "http://127.0.0.1:%d" % port
        p = start(["node", os.path.join(root, "tests/node_modules/dynalite/cli.js"),
                   "--host", "127.0.0.1", "--port", str(port), "--createTableMs", "0",
                   "--deleteTableMs", "0", "--updateTableMs", "0"], "dynalite.log")
        deadline = time.time() + 30
        while p.poll() is None and time.time() < deadline:
            try:
                ddb.request(endpoint, "ListTables", {}, timeout=2)
                return p, endpoint
            except (OSError, ddb.DdbError):
                time.sleep(0.05)
        stop(p, signal.SIGKILL)
    raise RuntimeError("dynalite did not start:\n" + tail("dynalite.log"))


def count_items(endpoint, table):
    n, key = 0, None
    while True:
        req = {"TableName": table, "Select": "COUNT"}
        if key:
            req["ExclusiveStartKey"] = key
        r = ddb.request(endpoint, "Scan", req, timeout=120)
        n += r["Count"]
        key = r.get("LastEvaluatedKey")
        if not key:
            return n


def convod_run(label, endpoint, dyn, bench_args, perf=False):
    """One daemon on a fresh state directory and table, loaded by convod-bench; polls stats
    until the spool is empty. Returns a dict of samples and results."""
    table = "convod-flusher-%s-%d" % (label, int(time.time() * 1000))
    ddb.create_table(endpoint, table)
    state = os.path.join(work, "state-" + label)
    sock = os.path.join(work, "convod-%s.sock" % label)
    os.makedirs(state)
    env = dict(os.environ, AWS_ENDPOINT_URL_DYNAMODB=endpoint, AWS_REGION="us-east-1",
               AWS_ACCESS_KEY_ID="convod-bench", AWS_SECRET_ACCESS_KEY="convod-bench-secret")
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        env.pop(k, None)
    logname = "convod-%s.log" % label
    binary = convod
    if perf:
        # a private copy: a rebuild of BUILD during the run would hide the symbols from perf
        binary = os.path.join(work, "convod")
        shutil.copy2(convod, binary)
    d = start([binary, "--socket", sock, "--state-dir", state, "--log-level", "warn",
               "--durability", DURABILITY, "--dynamodb-table", table,
               "--flush-interval", str(FLUSH_INTERVAL), "--idle-ms", str(IDLE_MS)]
              + CONVOD_ARGS, logname, env=env)
    deadline = time.time() + 10
    while not os.path.exists(sock):
        if d.poll() is not None or time.time() > deadline:
            raise RuntimeError("convod did not come up:\n" + tail(logname))
        time.sleep(0.05)
    st = Stats(sock)
    pf = None
    if perf:
        pf = start(["perf", "record", "-F", "499", "--call-graph", "dwarf,8192", "-o",
                    os.path.join(work, "perf.data"), "-p", str(d.pid)], "perf.log")
        time.sleep(0.5)
    samples = []
    out_path = os.path.join(work, "bench-%s.json" % label)

    bench_pid = [None, 0]  # pid, its last tick count

    def sample(phase):
        s = st.get()
        if bench_pid[0]:
            try:
                bench_pid[1] = cpu_ticks(bench_pid[0])
            except (OSError, IndexError, ValueError):
                pass  # exited: its last count stays
        samples.append({"t": time.monotonic(), "phase": phase,
                        "confirmed": s["sink"]["confirmed"], "spool": s["spool"]["items"],
                        "messages": s["messages"], "stats": s,
                        "cpu": cpu_ticks(d.pid), "dyn": cpu_ticks(dyn.pid),
                        "box": machine_ticks(), "bench": bench_pid[1]})
        return samples[-1]

    sample("start")
    with open(out_path, "wb") as out:
        b = subprocess.Popen([bench, "--socket", sock, "--json", "--timeout", "60"] + bench_args,
                             stdin=subprocess.DEVNULL, stdout=out,
                             stderr=open(os.path.join(work, "bench-%s.err" % label), "wb"))
        procs.append(b)
        bench_pid[0] = b.pid
        while b.poll() is None:
            time.sleep(POLL)
            if b.poll() is None:
                sample("load")
        procs.remove(b)
    t_load_end = time.monotonic()
    load_end = sample("load-end")
    if b.returncode != 0:
        log("convod-bench (%s) exited %d: %s" % (label, b.returncode,
            tail("bench-%s.err" % label, 5)))
    empty = None
    while time.monotonic() - t_load_end < DRAIN_TIMEOUT:
        time.sleep(POLL)
        s = sample("drain")
        if (s["spool"] == 0 and s["t"] - t_load_end > 2 * FLUSH_INTERVAL / 1000.0
                and s["confirmed"] >= s["messages"]):
            empty = s
            break
        if d.poll() is not None:
            break
    if pf is not None:
        stop(pf, signal.SIGINT)
    final = samples[-1]["stats"]
    st.close()
    rc = stop(d)
    if rc != 0:
        log("convod (%s) exited %s; its log:\n%s" % (label, rc, tail(logname)))
    with open(out_path) as f:
        text = f.read().strip()
    res = {"label": label, "table": table, "samples": samples, "load_end": load_end,
           "empty": empty, "final": final, "bench": json.loads(text) if text else None,
           "exit": rc}
    return res


def analyse(r):
    s = r["samples"]
    t0 = s[0]["t"]
    # the per-second series: the first sample at or after each whole second since the start
    sec, nxt = [], 0.0
    for x in s:
        if x["t"] - t0 >= nxt or x is r["empty"]:
            sec.append(x)
            nxt = (x["t"] - t0) // 1.0 + 1.0
    r["seconds"] = sec
    conf = dt = cpu = dyn = box = ben = 0.0
    for a, b in zip(sec, sec[1:]):
        if a["spool"] >= SATURATED and b["spool"] >= SATURATED and a["confirmed"] > 0:
            conf += b["confirmed"] - a["confirmed"]
            dt += b["t"] - a["t"]
            cpu += b["cpu"] - a["cpu"]
            dyn += b["dyn"] - a["dyn"]
            box += b["box"] - a["box"]
            ben += b["bench"] - a["bench"]
    r["steady"] = {"items_s": conf / dt if dt else None, "seconds": dt,
                   "cpu_pct": 100.0 * cpu / TICK / dt if dt else None,
                   "dyn_pct": 100.0 * dyn / TICK / dt if dt else None,
                   "box_pct": 100.0 * box / TICK / dt if dt else None,
                   "other_pct": 100.0 * (box - cpu - dyn - ben) / TICK / dt if dt else None}
    le, end = r["load_end"], r["empty"] or s[-1]
    ddt = end["t"] - le["t"]
    dconf = end["confirmed"] - le["confirmed"]
    r["drain"] = {"seconds": ddt, "items": dconf, "done": r["empty"] is not None,
                  "items_s": dconf / ddt if ddt > 0 else None,
                  "cpu_pct": 100.0 * (end["cpu"] - le["cpu"]) / TICK / ddt if ddt > 0 else None,
                  "dyn_pct": 100.0 * (end["dyn"] - le["dyn"]) / TICK / ddt if ddt > 0 else None,
                  "box_pct": 100.0 * (end["box"] - le["box"]) / TICK / ddt if ddt > 0 else None,
                  "other_pct": 100.0 * ((end["box"] - le["box"]) - (end["cpu"] - le["cpu"])
                                        - (end["dyn"] - le["dyn"]) - (end["bench"] - le["bench"]))
                  / TICK / ddt if ddt > 0 else None,
                  "cpu_us_item": 1e6 * (end["cpu"] - le["cpu"]) / TICK / dconf if dconf else None,
                  "dyn_us_item": 1e6 * (end["dyn"] - le["dyn"]) / TICK / dconf if dconf else None}
    tot = end["confirmed"] - s[0]["confirmed"]
    wall = end["t"] - s[0]["t"]
    r["total"] = {"items": tot, "seconds": wall, "items_s": tot / wall if wall else None,
                  "cpu_s": (end["cpu"] - s[0]["cpu"]) / TICK,
                  "cpu_us_item": 1e6 * (end["cpu"] - s[0]["cpu"]) / TICK / tot if tot else None}
    return r


def median(v):
    v = sorted(v)
    return v[len(v) // 2] if v else None


def sdk_run(endpoint, dyn, concurrency, seconds):
    """One sdk_batchwrite.mjs run; CPU % of the node client, dynalite and the rest are
    the medians of 1 s samples while it runs (its measured phase dominates)."""
    out_path = os.path.join(work, "sdk-%d.out" % concurrency)
    err_path = os.path.join(work, "sdk-%d.err" % concurrency)
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        p = subprocess.Popen(["node", os.path.join(root, "tests/bench/sdk_batchwrite.mjs"),
                              "--seconds", str(seconds), "--concurrency", str(concurrency),
                              "--content-bytes", str(MESSAGE_BYTES), "--warmup", "1"],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=err, cwd=root,
                             env=dict(os.environ, DYNAMODB_ENDPOINT=endpoint))
    procs.append(p)
    deadline = time.monotonic() + seconds + 120
    pct = {"client": [], "dyn": [], "other": []}
    prev = None
    while p.poll() is None and time.monotonic() < deadline:
        try:
            cur = (time.monotonic(), cpu_ticks(p.pid), cpu_ticks(dyn.pid), machine_ticks())
        except (OSError, IndexError, ValueError):
            cur = None  # node is exiting
        if prev and cur:
            dt = cur[0] - prev[0]
            d = [100.0 * (cur[i] - prev[i]) / TICK / dt for i in (1, 2, 3)]
            pct["client"].append(d[0])
            pct["dyn"].append(d[1])
            pct["other"].append(d[2] - d[0] - d[1])
        prev = cur
        time.sleep(1.0)
    if p.poll() is None:
        stop(p, signal.SIGKILL)
        return {"error": "timed out"}
    procs.remove(p)
    with open(out_path) as f:
        lines = [x for x in f.read().splitlines() if x.startswith("{")]
    if p.returncode != 0 or not lines:
        with open(err_path, errors="replace") as f:
            return {"error": "exit %s: %s" % (p.returncode, f.read()[-300:])}
    j = json.loads(lines[0])
    j["client_pct"], j["dyn_pct"], j["other_pct"] = (median(pct[k]) for k in ("client", "dyn",
                                                                               "other"))
    return j


def fmt(v, f="%.0f"):
    return "-" if v is None else f % v


def print_timeline(r):
    print("%s: per-second samples (confirmed = sink.confirmed, spool = spool.items)" % r["label"])
    print("%7s %6s %10s %9s %9s %9s %11s %8s %9s" % ("t s", "phase", "confirmed", "items/s",
                                                      "spool", "convod %", "dynalite %",
                                                      "bench %", "others %"))
    sec = r["seconds"]
    t0 = sec[0]["t"]
    for a, b in zip(sec, sec[1:]):
        dt = b["t"] - a["t"]
        print("%7.1f %6s %10d %9.0f %9d %9.0f %11.0f %8.0f %9.0f" % (
            b["t"] - t0, b["phase"].split("-")[0], b["confirmed"],
            (b["confirmed"] - a["confirmed"]) / dt, b["spool"],
            100.0 * (b["cpu"] - a["cpu"]) / TICK / dt, 100.0 * (b["dyn"] - a["dyn"]) / TICK / dt,
            100.0 * (b["bench"] - a["bench"]) / TICK / dt,
            100.0 * ((b["box"] - a["box"]) - (b["cpu"] - a["cpu"]) - (b["dyn"] - a["dyn"])
                     - (b["bench"] - a["bench"])) / TICK / dt))


def check(r):
    """Problems with a run: not drained, dead letters, messages not all confirmed."""
    f = r["final"]
    bad = []
    if not r["empty"]:
        bad.append("the spool did not empty within %.0f s (%d left)" % (DRAIN_TIMEOUT,
                                                                          f["spool"]["items"]))
    if f["sink"]["dead_lettered"]:
        bad.append("%d dead-lettered" % f["sink"]["dead_lettered"])
    if f["sink"]["confirmed"] < f["messages"]:
        bad.append("confirmed %d < messages %d" % (f["sink"]["confirmed"], f["messages"]))
    if r["bench"] is None or r["bench"]["errors"]["total"]:
        bad.append("bench errors: %s" % (r["bench"]["errors"] if r["bench"] else "no output"))
    if r["exit"] != 0:
        bad.append("convod exit %s" % r["exit"])
    return bad


status = 0
dyn = None
try:
    dyn, endpoint = start_dynalite()
    cores = os.cpu_count()
    load_before = loadavg()
    log("dynalite at %s" % endpoint)

    # (a) the flusher under load
    main = scanned = None
    if "load" in STEPS:
        log("convod flusher: adds-only load for %.0f s, then the drain ..." % DURATION)
        main = analyse(convod_run("load", endpoint, dyn, [
            "--mix", "adds-only", "--connections", str(CONNECTIONS), "--pipeline",
            str(PIPELINE), "--conversations", str(CONVERSATIONS), "--duration", str(DURATION),
            "--message-bytes", str(MESSAGE_BYTES)], perf=PERF))
        if VERIFY:
            log("counting the items of %s ..." % main["table"])
            scanned = count_items(endpoint, main["table"])
        ddb.delete_table(endpoint, main["table"], wait=False)

    # (b) the SDK at the same duration, (c) dynalite's ceiling
    sdk = {}
    if "sdk" in STEPS:
        for c in [SDK_CONCURRENCY] + [c for c in CEILING if c != SDK_CONCURRENCY]:
            secs = DURATION if c == SDK_CONCURRENCY else CEILING_SECONDS
            log("SDK BatchWriteItem, %d concurrent, %.0f s ..." % (c, secs))
            sdk[c] = sdk_run(endpoint, dyn, c, secs)

    # (d) conversation length: the same total as conversations of each length
    lengths = []
    for k in LENGTHS if "lengths" in STEPS else []:
        n = max(1, TOTAL // k)
        log("fill: %d conversations x %d messages ..." % (n, k))
        lengths.append((k, n, analyse(convod_run("len%d" % k, endpoint, dyn, [
            "--fill", "--connections", str(CONNECTIONS), "--conversations", str(n),
            "--messages-per-conversation", str(k), "--message-bytes", str(MESSAGE_BYTES)]))))
        ddb.delete_table(endpoint, lengths[-1][2]["table"], wait=False)

    # --- report ---
    def per_item(pct, rate):
        return 1e4 * pct / rate if pct is not None and rate else None

    if main and TIMELINE:
        print_timeline(main)
        print()
    if main:
        mb = main["bench"] or {}
        fin = main["final"]
        lat = fin["sink"]["latency_ms"]
        print("convod flusher: adds-only, %d connections, pipeline %d, %d conversations, %d-byte "
              "messages, %.0f s load, --durability %s --flush-interval %d --idle-ms %d" % (
                  CONNECTIONS, PIPELINE, CONVERSATIONS, MESSAGE_BYTES, DURATION, DURABILITY,
                  FLUSH_INTERVAL, IDLE_MS))
        print("  ingest %s req/s (p50 %s us, p99 %s us); %d messages, %d confirmed%s; drain "
              "%.1f s after the load%s; retried %d, unprocessed %d, dead-lettered %d; call "
              "latency p50 %s ms p99 %s ms" % (
                  fmt(mb.get("throughput_rps")), fmt(mb.get("latency_us", {}).get("p50")),
                  fmt(mb.get("latency_us", {}).get("p99")), fin["messages"],
                  fin["sink"]["confirmed"],
                  "" if scanned is None else " (Scan counts %d items)" % scanned,
                  main["drain"]["seconds"], "" if main["drain"]["done"] else " (NOT EMPTY)",
                  fin["sink"]["retried"], fin["sink"].get("unprocessed", 0),
                  fin["sink"]["dead_lettered"], fmt(lat["p50"]), fmt(lat["p99"])))
    print("CPU %%: 100 = one core of %d; client = convod or the SDK's node process; others = "
          "every other process on the machine (convod-bench excluded); us = CPU microseconds "
          "per confirmed item, so 1e6 / us is what one core would carry; load average %s "
          "before, %s after" % (cores, load_before, loadavg()))
    print()
    row = "%-42s %8s %8s %10s %8s %9s %11s"
    head = row % ("dynalite 127.0.0.1, one table per run", "items/s", "client %", "dynalite %",
                  "others %", "client us", "dynalite us")
    if main or sdk:
        print(head)
        print("-" * len(head))
    st = main["steady"] if main else {"items_s": None}
    if main:
        dr = main["drain"]
        for name, x in (("convod flusher, steady (backlog, %.0f s)" % st["seconds"], st),
                        ("convod flusher, drain only (%.1f s)" % dr["seconds"], dr)):
            print(row % (name, fmt(x["items_s"]), fmt(x["cpu_pct"]), fmt(x["dyn_pct"]),
                         fmt(x["other_pct"]), fmt(per_item(x["cpu_pct"], x["items_s"]), "%.1f"),
                         fmt(per_item(x["dyn_pct"], x["items_s"]), "%.1f")))
        print(row % ("convod flusher, whole run (%.1f s)" % main["total"]["seconds"],
                     fmt(main["total"]["items_s"]), "", "", "", "", ""))
    for c, j in sdk.items():
        name = "SDK BatchWriteItem, %d concurrent (%.0f s)" % (
            c, DURATION if c == SDK_CONCURRENCY else CEILING_SECONDS)
        if "error" in j:
            print("%-42s FAILED %s" % (name, j["error"]))
            status = 1
        else:
            print(row % (name, j["items_per_s"], fmt(j["client_pct"]), fmt(j["dyn_pct"]),
                         fmt(j["other_pct"]),
                         fmt(per_item(j["client_pct"], j["items_per_s"]), "%.1f"),
                         fmt(per_item(j["dyn_pct"], j["items_per_s"]), "%.1f")))
    base = sdk.get(SDK_CONCURRENCY, {})
    if st["items_s"] and base.get("items_per_s"):
        print("%-42s %8.2f" % ("ratio convod steady / SDK %d concurrent" % SDK_CONCURRENCY,
                                st["items_s"] / base["items_per_s"]))
    best = max((j.get("items_per_s", 0) for j in sdk.values()), default=0)
    if st["items_s"] and best:
        print("%-42s %8.2f" % ("ratio convod steady / best SDK", st["items_s"] / best))
    if lengths:
        if main or sdk:
            print()
        head = "%9s %13s %9s %9s %9s %8s %11s %11s %11s %9s" % (
            "msgs/conv", "conversations", "fill r/s", "items/s", "drain i/s", "drain s",
            "us/item", "drain us/it", "dynalite us", "others %")
        print("conversation length: %d messages in total, filled as fast as convod-bench goes; "
              "items/s = steady (backlog); us/item = convod's CPU (utime+stime) per confirmed "
              "item over the whole run (fill and drain), drain us/it over the drain alone; "
              "dynalite us and others %% over the drain" % TOTAL)
        print(head)
        print("-" * len(head))
    for k, n, r in lengths:
        print("%9d %13d %9s %9s %9s %8.1f %11s %11s %11s %9s" % (
            k, n, fmt((r["bench"] or {}).get("throughput_rps")), fmt(r["steady"]["items_s"]),
            fmt(r["drain"]["items_s"]), r["drain"]["seconds"],
            fmt(r["total"]["cpu_us_item"], "%.1f"), fmt(r["drain"]["cpu_us_item"], "%.1f"),
            fmt(r["drain"]["dyn_us_item"], "%.1f"), fmt(r["drain"]["other_pct"])))
    runs = ([("load", main)] if main else []) + [("len%d" % k, r) for k, _, r in lengths]
    for label, r in runs:
        for problem in check(r):
            print("PROBLEM (%s): %s" % (label, problem))
            status = 1
    if PERF and main:
        print()
        print("perf: convod during step 2's load and drain; inclusive (children) and self share "
              "of its samples, named symbols at or above 1.5%")
        rep = subprocess.run(["perf", "report", "-i", os.path.join(work, "perf.data"),
                              "--children", "--stdio", "--sort", "symbol", "-g", "none",
                              "--percent-limit", "1.5"], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, timeout=600)
        rows = [x.rstrip(" -") for x in rep.stdout.decode(errors="replace").splitlines()
                if x.strip() and not x.startswith("#") and "[.] 0x" not in x
                and "[k] 0x" not in x]
        print("\n".join(rows[:60]))
except KeyboardInterrupt:
    status = 130
finally:
    for p in reversed(procs[:]):
        stop(p, signal.SIGTERM, 10)
    shutil.rmtree(work, ignore_errors=True)
sys.exit(status)
EOF
