#!/bin/sh
# How request cost grows, measured with the daemon's own clock (stats requests.time_ns_by_op:
# nanoseconds from a request line to its queued answer, summed per op) and with convod-bench
# on the client side. Three tables, each on a fresh daemon and state directory:
#   1. get_messages (format meta, the whole conversation) on one conversation of
#      GET_MESSAGES messages: daemon time per request, target < 100 us, and the round trip
#      the client sees (one connection, no pipelining).
#   2. conversations: for each count in CONV_SIZES, fill that many conversations with
#      FILL_MESSAGES messages each, then REQUESTS add_user / add_assistant (alternating in
#      each conversation) spread round robin over all of them: daemon ns per add, client
#      req/s and latency, and the daemon's resident memory after the fill. The requests are
#      the same in every row, so with few conversations each one grows by REQUESTS/count
#      messages (the 1-conversation row ends with REQUESTS + FILL_MESSAGES messages).
#   3. one conversation growing to GROW_TO messages in windows of WINDOW adds: daemon ns per
#      add in each window, client req/s, and get_messages of the whole conversation at the
#      end of each window (GETS_PER_WINDOW requests) for information.
# Flat means: the last row costs about what the first does (the "x first" columns); a scan
# of the log or of the conversations on each add would grow with the row.
# Each step checks its counts against the daemon's stats (conversations, messages, requests
# by op) and fails on any request error. Builds nothing.
#
# usage: tests/bench/run-scale.sh [options] [BUILD]     (BUILD defaults to "build")
#   --quick    a smoke run: sizes up to 1,000 conversations, 2,000 adds, growth to 2,000
#   --only LIST  comma-separated parts to run: get,conversations,growth (all)
# environment (defaults): CONV_SIZES="1 10 100 1000 10000 100000" FILL_MESSAGES=2
#   REQUESTS=100000 CONNECTIONS=1 PIPELINE=16 (the add load of tables 2 and 3; one
#   connection so that every row has the same shape) FILL_CONNECTIONS=8 FILL_PIPELINE=64
#   GET_MESSAGES=1000 GET_REQUESTS=2000 GROW_TO=10000 WINDOW=1000 GETS_PER_WINDOW=50
#   MESSAGE_BYTES=40 DURABILITY=process (convod --durability; "memory-only" for
#   --memory-only) CONVOD_ARGS="" (extra convod options) TMPDIR (/tmp)
# exit: 0 done (a missed get_messages target is reported, not fatal), 1 a step failed or
#   a count did not match, 2 usage or missing binaries.
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
build=
quick=0
only=get,conversations,growth
while [ $# -gt 0 ]; do
	case $1 in
	--quick)
		quick=1
		shift
		;;
	--only)
		[ $# -ge 2 ] || { echo "run-scale: --only needs a value" >&2; exit 2; }
		only=$2
		shift 2
		;;
	--only=*)
		only=${1#--only=}
		shift
		;;
	-h | --help)
		sed -n '2,/^set -eu/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
		exit 0
		;;
	-*)
		echo "run-scale: unknown option $1 (see --help)" >&2
		exit 2
		;;
	*)
		[ -z "$build" ] || { echo "run-scale: one BUILD directory only" >&2; exit 2; }
		build=$1
		shift
		;;
	esac
done
for part in $(echo "$only" | tr ',' ' '); do
	case $part in
	get | conversations | growth) ;;
	*)
		echo "run-scale: unknown part '$part' in --only (get, conversations, growth)" >&2
		exit 2
		;;
	esac
done
want() {
	case ",$only," in
	*",$1,"*) return 0 ;;
	*) return 1 ;;
	esac
}

prog=run-scale
. "$root/tests/bench/lib.sh"
bench_build "${build:-build}"
bench_need "$convod" "$bench"

if [ $quick = 1 ]; then
	CONV_SIZES=${CONV_SIZES:-1 10 100 1000}
	REQUESTS=${REQUESTS:-2000}
	GET_REQUESTS=${GET_REQUESTS:-100}
	GROW_TO=${GROW_TO:-2000}
	GETS_PER_WINDOW=${GETS_PER_WINDOW:-5}
fi
CONV_SIZES=${CONV_SIZES:-1 10 100 1000 10000 100000}
FILL_MESSAGES=${FILL_MESSAGES:-2}
REQUESTS=${REQUESTS:-100000}
CONNECTIONS=${CONNECTIONS:-1}
PIPELINE=${PIPELINE:-16}
FILL_CONNECTIONS=${FILL_CONNECTIONS:-8}
FILL_PIPELINE=${FILL_PIPELINE:-64}
GET_MESSAGES=${GET_MESSAGES:-1000}
GET_REQUESTS=${GET_REQUESTS:-2000}
GROW_TO=${GROW_TO:-10000}
WINDOW=${WINDOW:-1000}
GETS_PER_WINDOW=${GETS_PER_WINDOW:-50}
MESSAGE_BYTES=${MESSAGE_BYTES:-40}
DURABILITY=${DURABILITY:-process}
CONVOD_ARGS=${CONVOD_ARGS:-}

for v in FILL_MESSAGES REQUESTS CONNECTIONS PIPELINE FILL_CONNECTIONS FILL_PIPELINE \
	GET_MESSAGES GET_REQUESTS GROW_TO WINDOW GETS_PER_WINDOW MESSAGE_BYTES; do
	eval "x=\$$v"
	case $x in
	'' | *[!0-9]* | 0)
		echo "run-scale: $v must be a positive integer, not '$x'" >&2
		exit 2
		;;
	esac
done
for x in $CONV_SIZES; do
	case $x in
	'' | *[!0-9]* | 0)
		echo "run-scale: CONV_SIZES holds '$x', not a positive integer" >&2
		exit 2
		;;
	esac
done
# an odd count would end a conversation on a user message and merge the next add into it
if [ $((FILL_MESSAGES % 2)) -ne 0 ] || [ $((GET_MESSAGES % 2)) -ne 0 ] ||
	[ $((WINDOW % 2)) -ne 0 ] || [ $((GROW_TO % WINDOW)) -ne 0 ]; then
	echo "run-scale: FILL_MESSAGES, GET_MESSAGES and WINDOW must be even, GROW_TO a" \
		"multiple of WINDOW" >&2
	exit 2
fi
case $DURABILITY in
memory-only) durability_args=--memory-only ;;
none | process | machine) durability_args="--durability $DURABILITY" ;;
*)
	echo "run-scale: DURABILITY is none, process, machine or memory-only" >&2
	exit 2
	;;
esac
# room for the largest conversation any table builds
max_messages=$((REQUESTS + FILL_MESSAGES + GROW_TO + GET_MESSAGES + 1000))

bench_tmpdir scale
sock=$dir/convod.sock

fail() {
	echo "run-scale: $*" >&2
	exit 1
}

# start_convod TAG: a fresh daemon on a fresh state directory, no AWS sink
start_convod() {
	rm -rf "$dir/state"
	mkdir -p "$dir/state"
	log=$dir/convod-$1.log
	# shellcheck disable=SC2086
	start_server convod "$log" without_aws "$convod" --socket "$sock" \
		--state-dir "$dir/state" --log-level warn --max-messages "$max_messages" \
		$durability_args $CONVOD_ARGS
}

# client OP [CONVERSATION]: one request on a new connection; prints the result object, or
# for get_messages the number of messages it returned
client() {
	python3 -c '
import json, socket, sys
sock, op = sys.argv[1], sys.argv[2]
req = {"op": op}
if len(sys.argv) > 3:
    req["conversation"] = sys.argv[3]
s = socket.socket(socket.AF_UNIX)
s.settimeout(60)
s.connect(sock)
s.sendall((json.dumps(req) + "\n").encode())
buf = b""
while not buf.endswith(b"\n"):
    d = s.recv(1 << 20)
    if not d:
        sys.exit("connection closed before the answer")
    buf += d
r = json.loads(buf)
if not r.get("ok"):
    sys.exit("%s: %s" % (op, json.dumps(r.get("error"))))
res = r["result"]
if op == "get_messages":
    print(len(res["messages"]))
else:
    print(json.dumps(res, separators=(",", ":")))
' "$sock" "$@"
}

# record KIND KEY: the daemon's stats and resident memory, a line of $dir/results
record() {
	st=$(client stats) || fail "stats failed"
	rss=$(awk '/^VmRSS:/ { print $2 }' "/proc/$server_pid/status" 2>/dev/null || echo -1)
	printf '%s\t%s\tstats\t%s\t%s\n' "$1" "$2" "${rss:--1}" "$st" >>"$dir/results"
}

# bench KIND KEY CONVOD-BENCH-OPTIONS...: one convod-bench run, a line of $dir/results
bench() {
	kind=$1
	key=$2
	shift 2
	rc=0
	"$bench" --socket "$sock" --json --message-bytes "$MESSAGE_BYTES" "$@" \
		>"$dir/out.json" 2>"$dir/bench.err" || rc=$?
	if [ $rc -ne 0 ] || [ ! -s "$dir/out.json" ]; then
		sed 's/^/  /' "$dir/bench.err" >&2
		fail "convod-bench failed (exit $rc) in $kind $key: $*"
	fi
	if ! kill -0 "$server_pid" 2>/dev/null; then
		fail "convod died during $kind $key; its log: $(tail -n 5 "$log")"
	fi
	printf '%s\t%s\tbench\t-\t%s\n' "$kind" "$key" "$(cat "$dir/out.json")" >>"$dir/results"
}

# expect WHAT WANT GOT
expect() {
	if [ "$2" != "$3" ]; then
		fail "$1: expected $2, the daemon says $3"
	fi
}

stat_field() {
	printf '%s\n' "$st" | python3 -c 'import json, sys
r = json.load(sys.stdin)
for k in sys.argv[1].split("."):
    r = r[k]
print(r)' "$1"
}

: >"$dir/results"
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")

# 1. get_messages on one conversation of GET_MESSAGES messages
if want get; then
	echo "run-scale: get_messages on $GET_MESSAGES messages ..." >&2
	start_convod get
	bench get-fill get --fill --run-id get --conversations 1 --connections 1 \
		--pipeline "$FILL_PIPELINE" --messages-per-conversation "$GET_MESSAGES"
	got=$(client get_messages bench-get-0) || fail "get_messages failed"
	expect "get_messages on the filled conversation" "$GET_MESSAGES" "$got"
	record get before
	bench get-reads get --mix reads --run-id get --conversations 1 --connections 1 \
		--pipeline 1 --requests "$GET_REQUESTS"
	record get after
	stop_server
fi

# 2. request cost as the number of conversations grows
if want conversations; then
	for m in $CONV_SIZES; do
		echo "run-scale: $m conversations ..." >&2
		start_convod "conv-$m"
		record conv "$m.start"
		bench conv-fill "$m" --fill --run-id c --conversations "$m" \
			--connections "$FILL_CONNECTIONS" --pipeline "$FILL_PIPELINE" \
			--messages-per-conversation "$FILL_MESSAGES"
		record conv "$m.filled"
		expect "conversations after the fill" "$m" "$(stat_field conversations)"
		expect "messages after the fill" "$((m * FILL_MESSAGES))" "$(stat_field messages)"
		bench conv-adds "$m" --mix adds-only --run-id c --conversations "$m" \
			--connections "$CONNECTIONS" --pipeline "$PIPELINE" --requests "$REQUESTS"
		record conv "$m.after"
		expect "conversations after the adds" "$m" "$(stat_field conversations)"
		expect "messages after the adds" "$((m * FILL_MESSAGES + REQUESTS))" \
			"$(stat_field messages)"
		stop_server
	done
fi

# 3. one conversation growing to GROW_TO messages
if want growth; then
	echo "run-scale: one conversation growing to $GROW_TO messages ..." >&2
	start_convod growth
	n=0
	while [ $n -lt "$GROW_TO" ]; do
		key=$n-$((n + WINDOW))
		record growth "$key.start"
		bench grow-adds "$key" --mix adds-only --run-id g --conversations 1 --connections 1 \
			--pipeline "$PIPELINE" --requests "$WINDOW"
		record growth "$key.added"
		n=$((n + WINDOW))
		expect "messages after $n adds" "$n" "$(stat_field messages)"
		bench grow-reads "$key" --mix reads --run-id g --conversations 1 --connections 1 \
			--pipeline 1 --requests "$GETS_PER_WINDOW"
		record growth "$key.read"
	done
	got=$(client get_messages bench-g-0) || fail "get_messages failed"
	expect "get_messages after the growth" "$GROW_TO" "$got"
	stop_server
fi

load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
python3 - "$dir/results" "$load_before" "$load_after" "$DURABILITY" "$MESSAGE_BYTES" \
	"$CONNECTIONS" "$PIPELINE" "$FILL_MESSAGES" "$REQUESTS" "$GET_MESSAGES" <<'EOF' || status=1
import json, sys

(path, load_before, load_after, durability, msg_bytes, conns, pipeline, fill_messages,
 requests, get_messages) = sys.argv[1:11]
ADDS = ("add_user", "add_assistant")
stats, benches, order = {}, {}, {}
for raw in open(path):
    kind, key, what, rss, payload = raw.rstrip("\n").split("\t", 4)
    if what == "stats":
        s = json.loads(payload)
        s["rss_kb"] = int(rss)
        stats[(kind, key)] = s
    else:
        benches[(kind, key)] = json.loads(payload)
        order.setdefault(kind, [])
        if key not in order[kind]:
            order[kind].append(key)

have_time = all("time_ns_by_op" in s["requests"] for s in stats.values())
problems = []

def daemon_ns(kind, k0, k1, ops):
    """Daemon ns per request of ops between two stats snapshots, and the request count."""
    a, b = stats[(kind, k0)]["requests"], stats[(kind, k1)]["requests"]
    n = sum(b["by_op"][o] - a["by_op"][o] for o in ops)
    if not have_time or n <= 0:
        return float("nan"), n
    t = sum(b["time_ns_by_op"][o] - a["time_ns_by_op"][o] for o in ops)
    return t / n, n

def check(what, want, got):
    if want != got:
        problems.append("%s: the bench sent %d, the daemon counted %d" % (what, want, got))

num = lambda x, f="%.0f": "-" if x != x else f % x
print("request cost by scale: convod --%s, %s-byte messages; load before %s, after %s"
      % ("memory-only" if durability == "memory-only" else "durability " + durability,
         msg_bytes, load_before, load_after))
if not have_time:
    print("this convod's stats have no requests.time_ns_by_op: daemon times are left out")

if ("get", "before") in stats:
    r = benches[("get-reads", "get")]
    ns, n = daemon_ns("get", "before", "after", ("get_messages",))
    check("get_messages", r["requests"], n)
    lat = r["latency_us"]
    us = ns / 1000.0
    verdict = "-" if us != us else ("PASS" if us < 100.0 else "FAIL")
    print()
    print("get_messages (format meta, whole conversation) on %s messages, %d requests, one"
          " connection, no pipelining" % (get_messages, n))
    head = "%-22s %10s %10s %10s %10s %8s  %s" % ("", "daemon us", "client p50", "client p99",
                                                  "client/s", "target", "result")
    print(head)
    print("-" * len(head))
    print("%-22s %10s %10s %10s %10s %8s  %s" % (
        "per request", num(us, "%.1f"), num(lat["p50"], "%.1f"), num(lat["p99"], "%.1f"),
        num(r["throughput_rps"]), "< 100 us", verdict))
    resp = r["bytes"]["received"] / n if n else float("nan")
    print("(answers average %s bytes; client us = round trip seen by convod-bench)"
          % num(resp))

if "conv-adds" in order:
    print()
    print("add_user/add_assistant as the conversations grow: fill with %s messages each, then"
          " %s adds spread over all of them (%s connection(s), pipeline %s)"
          % (fill_messages, requests, conns, pipeline))
    head = "%13s %9s %8s %10s %9s %9s %9s %10s" % (
        "conversations", "ns/add", "x first", "adds/s", "x first", "p99 us", "fill/s",
        "RSS MiB")
    print(head)
    print("-" * len(head))
    first_ns = first_rps = None
    for m in order["conv-adds"]:
        r = benches[("conv-adds", m)]
        ns, n = daemon_ns("conv", m + ".filled", m + ".after", ADDS)
        check("adds with %s conversations" % m, r["requests"], n)
        fill = benches[("conv-fill", m)]
        rss = stats[("conv", m + ".filled")]["rss_kb"]
        if first_ns is None:
            first_ns, first_rps = ns, r["throughput_rps"]
        print("%13s %9s %8s %10s %9s %9s %9s %10s" % (
            m, num(ns), num(ns / first_ns if first_ns else float("nan"), "%.2f"),
            num(r["throughput_rps"]), num(r["throughput_rps"] / first_rps, "%.2f"),
            num(r["latency_us"]["p99"]), num(fill["throughput_rps"]),
            num(rss / 1024.0 if rss >= 0 else float("nan"), "%.1f")))

if "grow-adds" in order:
    print()
    print("one conversation growing: adds in windows (1 connection, pipeline %s), then"
          " get_messages of the whole conversation (1 connection, no pipelining)" % pipeline)
    head = "%13s %9s %8s %10s %9s %9s | %13s %13s" % (
        "messages", "ns/add", "x first", "adds/s", "x first", "p99 us", "get daemon us",
        "get client us")
    print(head)
    print("-" * len(head))
    first_ns = first_rps = None
    for key in order["grow-adds"]:
        r = benches[("grow-adds", key)]
        ns, n = daemon_ns("growth", key + ".start", key + ".added", ADDS)
        check("adds in window %s" % key, r["requests"], n)
        g = benches[("grow-reads", key)]
        gns, gn = daemon_ns("growth", key + ".added", key + ".read", ("get_messages",))
        check("get_messages after window %s" % key, g["requests"], gn)
        if first_ns is None:
            first_ns, first_rps = ns, r["throughput_rps"]
        print("%13s %9s %8s %10s %9s %9s | %13s %13s" % (
            key, num(ns), num(ns / first_ns if first_ns else float("nan"), "%.2f"),
            num(r["throughput_rps"]), num(r["throughput_rps"] / first_rps, "%.2f"),
            num(r["latency_us"]["p99"]), num(gns / 1000.0, "%.1f"),
            num(g["latency_us"]["p50"], "%.1f")))

for p in problems:
    print("run-scale: " + p, file=sys.stderr)
sys.exit(1 if problems else 0)
EOF
exit $status
