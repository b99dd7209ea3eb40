#!/bin/sh
# Compares convod with the json-baseline floor: load runs without and with pipelining, then a
# fill of many conversations to measure the daemon's resident memory. Builds nothing.
#
# usage: tests/bench/run-bench.sh [BUILD]     (BUILD defaults to "build")
# environment (defaults): DURATION=5 WARMUP=1 CONNECTIONS=50 CONVERSATIONS=1000 PIPELINE=16
#   MESSAGE_BYTES=40 FILL_CONVERSATIONS=100000 FILL_MESSAGES=20 FILL_PIPELINE=64
#   BENCH_ARGS="" (extra convod-bench options for the load runs)
#   REDIS=0 (1: also time redis LPUSH of MESSAGE_BYTES values with redis-benchmark, when
#   redis-server and redis-benchmark are installed, to compare with the adds-only mix)
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
prog=run-bench
. "$root/tests/bench/lib.sh"
bench_build "${1:-build}"
bench_need "$convod" "$bench" "$baseline"

DURATION=${DURATION:-5}
WARMUP=${WARMUP:-1}
CONNECTIONS=${CONNECTIONS:-50}
CONVERSATIONS=${CONVERSATIONS:-1000}
PIPELINE=${PIPELINE:-16}
MESSAGE_BYTES=${MESSAGE_BYTES:-40}
FILL_CONVERSATIONS=${FILL_CONVERSATIONS:-100000}
FILL_MESSAGES=${FILL_MESSAGES:-20}
FILL_PIPELINE=${FILL_PIPELINE:-64}
BENCH_ARGS=${BENCH_ARGS:-}
REDIS=${REDIS:-0}

bench_tmpdir bench

start_convod() {
	rm -rf "$dir/state"
	mkdir -p "$dir/state"
	sock=$dir/convod.sock
	start_server convod "$dir/convod-$1.log" "$convod" --socket "$sock" \
		--state-dir "$dir/state" --log-level warn
}

# run LABEL ARGS...: one convod-bench run; its JSON summary goes to $dir/results
run() {
	label=$1
	shift
	echo "run-bench: $label ..." >&2
	rc=0
	"$bench" --socket "$sock" --json "$@" >"$dir/out.json" 2>"$dir/bench.err" || rc=$?
	if [ $rc -ne 0 ]; then
		status=1
		sed 's/^/  /' "$dir/bench.err" >&2
	fi
	if [ -s "$dir/out.json" ]; then
		printf '%s\t%s\n' "$label" "$(cat "$dir/out.json")" >>"$dir/results"
	else
		printf '%s\tFAILED (exit %s)\n' "$label" "$rc" >>"$dir/results"
	fi
	if [ -n "$server_pid" ] && ! kill -0 "$server_pid" 2>/dev/null; then
		echo "run-bench: the server died during '$label'" >&2
		status=1
		server_pid=
	fi
}

load="--connections $CONNECTIONS --conversations $CONVERSATIONS --duration $DURATION"
load="$load --warmup $WARMUP --message-bytes $MESSAGE_BYTES $BENCH_ARGS"
: >"$dir/results"

start_convod load
# shellcheck disable=SC2086
run "convod voice" $load --pipeline 1
# shellcheck disable=SC2086
run "convod voice" $load --pipeline "$PIPELINE"
# shellcheck disable=SC2086
run "convod adds-only" $load --pipeline "$PIPELINE" --mix adds-only
stop_server

start_baseline
# shellcheck disable=SC2086
run "json-baseline voice" $load --pipeline 1
# shellcheck disable=SC2086
run "json-baseline voice" $load --pipeline "$PIPELINE"
stop_server

# redis_run PIPELINE REQUESTS: one redis-benchmark LPUSH run, as a row of $dir/results
redis_run() {
	echo "run-bench: redis LPUSH pipeline $1 ..." >&2
	csv=$(redis-benchmark -s "$sock" -c "$CONNECTIONS" -P "$1" -n "$2" -d "$MESSAGE_BYTES" \
		-t lpush --csv 2>/dev/null | grep '^"LPUSH"' || true)
	printf 'redis LPUSH\tredis,%s,%s,%s\n' "$CONNECTIONS" "$1" "${csv:-FAILED}" \
		>>"$dir/results"
}

if [ "$REDIS" = 1 ]; then
	if command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null; then
		sock=$dir/redis.sock
		start_server redis "$dir/redis.log" redis-server --port 0 --unixsocket "$sock" \
			--save '' --appendonly no
		redis_run 1 300000
		redis_run "$PIPELINE" 1000000
		stop_server
	else
		echo "run-bench: REDIS=1 but redis-server or redis-benchmark is missing" >&2
	fi
fi

start_convod fill
run "convod fill" --fill --connections "$CONNECTIONS" --pipeline "$FILL_PIPELINE" \
	--conversations "$FILL_CONVERSATIONS" --messages-per-conversation "$FILL_MESSAGES" \
	--message-bytes "$MESSAGE_BYTES" --pid "$server_pid" --timeout 30
stop_server

python3 - "$dir/results" <<'EOF'
import json, sys

rows = []
fills = []
for raw in open(sys.argv[1]):
    label, _, payload = raw.rstrip("\n").partition("\t")
    if payload.startswith("redis,"):
        # redis,conns,pipe,"LPUSH",rps,avg_ms,min_ms,p50_ms,p95_ms,p99_ms,max_ms
        f = [x.strip('"') for x in payload.split(",")]
        if len(f) == 11:
            ms = lambda x: float(x) * 1000
            rows.append((label, {"connections": int(f[1]), "pipeline": int(f[2]),
                                 "throughput_rps": float(f[4]),
                                 "latency_us": {"p50": ms(f[7]), "p99": ms(f[9]),
                                                "p999": float("nan"), "max": ms(f[10])},
                                 "errors": {"total": 0, "by_code": {}}}))
        else:
            rows.append((label, "FAILED"))
        continue
    if not payload.startswith("{"):
        rows.append((label, payload))
        continue
    r = json.loads(payload)
    if r["mode"] == "fill":
        fills.append((label, r))
    else:
        rows.append((label, r))

head = "%-22s %5s %4s %10s %9s %9s %9s %9s %7s" % (
    "run", "conns", "pipe", "req/s", "p50 us", "p99 us", "p99.9 us", "max us", "errors")
print(head)
print("-" * len(head))
for label, r in rows:
    if isinstance(r, str):
        print("%-22s %s" % (label, r))
        continue
    lat = r["latency_us"]
    us = lambda x: "%9s" % "-" if x != x else "%9.0f" % x
    print("%-22s %5d %4d %10.0f %s %s %s %s %7d" % (
        label, r["connections"], r["pipeline"], r["throughput_rps"], us(lat["p50"]),
        us(lat["p99"]), us(lat["p999"]), us(lat["max"]), r["errors"]["total"]))
    for code, n in sorted(r["errors"]["by_code"].items()):
        print("%-22s   %s: %d" % ("", code, n))
for label, r in fills:
    msgs = r["requests"]
    line = "%s: %d conversations x %d messages in %.1f s (%.0f req/s), errors %d" % (
        label, r["conversations"], r["messages_per_conversation"], r["seconds"],
        r["throughput_rps"], r["errors"]["total"])
    rss = r.get("rss_kb")
    if rss and rss["before"] >= 0 and rss["after"] >= 0:
        line += "\n  daemon RSS %.1f MiB -> %.1f MiB (peak %.1f MiB), %.0f bytes/message" % (
            rss["before"] / 1024, rss["after"] / 1024, rss["hwm_after"] / 1024,
            (rss["after"] - rss["before"]) * 1024 / msgs if msgs else 0)
    print(line)
EOF
exit $status
