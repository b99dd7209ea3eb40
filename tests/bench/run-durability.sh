#!/bin/sh
# What each durability level costs: convod-bench load (50 connections, no pipelining) against
# convod at --durability none, process and machine, one fresh daemon and state directory per
# level and mix, the embedded default sink (no AWS settings are passed on). Prints one
# side-by-side table per mix: req/s and latency percentiles for each level, with the CPU of
# convod and of every other process but the bench (others %: high means a noisy machine).
# Builds nothing.
#
# usage: tests/bench/run-durability.sh [BUILD]     (BUILD defaults to "build")
# environment (defaults): DURATION=8 WARMUP=2 CONNECTIONS=50 CONVERSATIONS=1000 PIPELINE=1
#   MESSAGE_BYTES=40 MIXES="adds-only voice" LEVELS="none process machine"
#   BENCH_ARGS="" (extra convod-bench options) CONVOD_ARGS="" (extra convod options)
#   TMPDIR (the state directories go there: its file system decides what an fsync costs)
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
prog=run-durability
. "$root/tests/bench/lib.sh"
bench_build "${1:-build}"
bench_need "$convod" "$bench"

DURATION=${DURATION:-8}
WARMUP=${WARMUP:-2}
CONNECTIONS=${CONNECTIONS:-50}
CONVERSATIONS=${CONVERSATIONS:-1000}
PIPELINE=${PIPELINE:-1}
MESSAGE_BYTES=${MESSAGE_BYTES:-40}
MIXES=${MIXES:-adds-only voice}
LEVELS=${LEVELS:-none process machine}
BENCH_ARGS=${BENCH_ARGS:-}
CONVOD_ARGS=${CONVOD_ARGS:-}

bench_tmpdir durability
sock=$dir/convod.sock

# start_convod LEVEL MIX: a daemon on a fresh state directory, without AWS settings
start_convod() {
	rm -rf "$dir/state"
	mkdir -p "$dir/state"
	# shellcheck disable=SC2086
	start_server "convod ($1)" "$dir/convod-$1-$2.log" without_aws "$convod" \
		--socket "$sock" --state-dir "$dir/state" --log-level warn --durability "$1" \
		$CONVOD_ARGS
}

# ticks PID: "<clock ticks busy on the machine> <utime+stime of PID>", from /proc
ticks() {
	awk '/^cpu / { print $2 + $3 + $4 + $7 + $8; exit }' /proc/stat
	# the fields after the command name, which may hold spaces: utime and stime are 12, 13
	sed 's/.*) //' "/proc/$1/stat" | awk '{ print $12 + $13 }'
}

: >"$dir/results"
for mix in $MIXES; do
	for level in $LEVELS; do
		echo "run-durability: $mix at --durability $level ..." >&2
		start_convod "$level" "$mix"
		rc=0
		before=$(ticks "$server_pid" | tr '\n' ' ')
		t0=$(date +%s.%N)
		# the bench under a wrapper that writes its CPU seconds to $dir/bench.cpu
		# shellcheck disable=SC2086
		python3 -c 'import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
u = resource.getrusage(resource.RUSAGE_CHILDREN)
open(sys.argv[1], "w").write("%.3f" % (u.ru_utime + u.ru_stime))
sys.exit(rc)' "$dir/bench.cpu" \
			"$bench" --socket "$sock" --json --mix "$mix" --connections "$CONNECTIONS" \
			--conversations "$CONVERSATIONS" --pipeline "$PIPELINE" \
			--duration "$DURATION" --warmup "$WARMUP" \
			--message-bytes "$MESSAGE_BYTES" $BENCH_ARGS \
			>"$dir/out.json" 2>"$dir/bench.err" || rc=$?
		t1=$(date +%s.%N)
		after=$(ticks "$server_pid" 2>/dev/null | tr '\n' ' ' || true)
		if [ $rc -ne 0 ]; then
			status=1
			sed 's/^/  /' "$dir/bench.err" >&2
		fi
		if ! kill -0 "$server_pid" 2>/dev/null; then
			echo "run-durability: convod died during $mix/$level; its log:" >&2
			tail -n 20 "$dir/convod-$level-$mix.log" >&2
			status=1
		fi
		if [ -s "$dir/out.json" ]; then
			printf '%s\t%s\t%s\t%s %s %s %s %s\n' "$mix" "$level" "$(cat "$dir/out.json")" \
				"$t0" "$t1" "$before" "$after" "$(cat "$dir/bench.cpu" 2>/dev/null || echo -)" \
				>>"$dir/results"
		else
			printf '%s\t%s\tFAILED (exit %s)\n' "$mix" "$level" "$rc" >>"$dir/results"
		fi
		stop_server
	done
done

fs=$(findmnt -n -o FSTYPE -T "$dir" 2>/dev/null || stat -f -c %T "$dir" 2>/dev/null || echo "?")
python3 - "$dir/results" "$fs" "$DURATION" "$WARMUP" <<'EOF'
import json, os, sys

path, fs, duration, warmup = sys.argv[1:5]
tick = os.sysconf("SC_CLK_TCK")
mixes, table = [], {}
for raw in open(path):
    mix, level, payload = raw.rstrip("\n").split("\t", 2)
    if mix not in table:
        mixes.append(mix)
        table[mix] = []
    r = payload
    if payload.startswith("{"):
        payload, _, cpu = payload.partition("\t")
        r = json.loads(payload)
        # CPU over the bench's whole run (warmup included): convod's, and everything else
        # on the machine but the bench itself; 100 = one core
        try:
            t0, t1, m0, c0, m1, c1, bench = cpu.split()
            wall = float(t1) - float(t0)
            conv = (int(c1) - int(c0)) / tick
            r["convod_pct"] = 100.0 * conv / wall
            r["others_pct"] = 100.0 * ((int(m1) - int(m0)) / tick - conv - float(bench)) / wall
        except ValueError:
            r["convod_pct"] = r["others_pct"] = float("nan")
    table[mix].append((level, r))

def cell(r, f):
    if isinstance(r, str):
        return "FAILED"
    v = f(r)
    return "-" if v != v else "%.0f" % v

metrics = [
    ("req/s", lambda r: r["throughput_rps"]),
    ("p50 us", lambda r: r["latency_us"]["p50"]),
    ("p99 us", lambda r: r["latency_us"]["p99"]),
    ("p99.9 us", lambda r: r["latency_us"]["p999"]),
    ("max us", lambda r: r["latency_us"]["max"]),
    ("errors", lambda r: r["errors"]["total"]),
    ("convod %", lambda r: r["convod_pct"]),
    ("others %", lambda r: r["others_pct"]),
]
first = True
for mix in mixes:
    rows = table[mix]
    some = next((r for _, r in rows if not isinstance(r, str)), None)
    if not first:
        print()
    first = False
    shape = ""
    if some:
        shape = ", %d connections, pipeline %d" % (some["connections"], some["pipeline"])
    print("%s%s, %s s measured after %s s warmup, state on %s" % (
        mix, shape, duration, warmup, fs))
    head = "%-10s" % "" + "".join(" %12s" % level for level, _ in rows)
    print(head)
    print("-" * len(head))
    for name, f in metrics:
        print("%-10s" % name + "".join(" %12s" % cell(r, f) for _, r in rows))
    for level, r in rows:
        if not isinstance(r, str):
            for code, n in sorted(r["errors"]["by_code"].items()):
                print("  %s: %s %d" % (level, code, n))
EOF
exit $status
