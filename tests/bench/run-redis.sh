#!/bin/sh
# convod against Redis on the same machine, in one go: Debian's redis-server on a temporary
# Unix socket driven by redis-benchmark (LPUSH), convod driven by convod-bench (add_user and
# add_assistant alternating in each conversation, the adds-only mix) at the same concurrency,
# and the json-baseline floor. Prints each pair side by side with the ratio convod / other
# and PASS or FAIL against the targets of issue 5. Builds nothing.
#
# Pairs (CONNECTIONS connections, MESSAGE_BYTES-byte messages / LPUSH values):
#   (a) no pipelining: convod --durability process (the default) vs LPUSH, AOF off; target
#       ratio >= 1.0. convod --memory-only is shown too, for information. And convod's p99
#       latency in that run; target < 1 ms.
#   (b) pipeline PIPELINE: convod (process) vs LPUSH -P PIPELINE, no target (there JSON is
#       the floor, not the socket), and convod vs json-baseline under the same convod-bench
#       load, target >= 0.8; convod --memory-only for information in both.
#   (c) durable, no pipelining: convod --durability process vs Redis appendonly yes,
#       appendfsync everysec; convod --durability machine vs appendfsync always; target
#       >= 1.0 for both.
# Every server is fresh (new process, new state or AOF directory under TMPDIR, whose file
# system decides what an fsync costs; removed and synced once it stopped, so that its
# writeback does not fall into the next run) and each pair runs back to back, convod first
# in odd rounds and last in even ones. The whole sequence
# runs ROUNDS times: a pair's ratio is the median of its rounds' ratios (each round's two
# runs a few seconds apart), its req/s the medians of each side, and the p99 target the
# median of the rounds' p99s, so that one run disturbed by the machine (a shared 2-core VM
# moves 20-30% from minute to minute) does not decide a verdict alone. Every round's
# figures are printed too. convod-bench measures
# DURATION seconds after WARMUP seconds of unmeasured load; redis-benchmark has no duration,
# so each Redis run is first calibrated (-n grown x8 until a run lasts >= 0.3 s, which also
# warms the server up) and then measured with -n = calibrated req/s x DURATION. Redis'
# req/s and latencies come from its --csv output.
#
# A second table gives the CPU time a request took, on each side: the server's (all its
# threads, from /proc/PID/stat, per request it answered: convod's stats, redis-benchmark's
# -n) and the load generator's (the shell's children, from `times`). Both include warmup
# and calibration; kernel threads' work for a server's I/O counts for neither side. Unlike
# req/s, these hardly move with what else the 2 cores run, so they show where a ratio comes
# from: the server's cost, or the generator's. json-baseline tells its requests only in the
# line it logs as it exits: its row is written after it stopped (baseline_cpu_row). The
# table also gives the bytes each server had written to storage a request (/proc/PID/io
# write_bytes: its WAL, database or AOF), the work the kernel's writeback threads then do
# on the same 2 cores.
#
# usage: tests/bench/run-redis.sh [options] [BUILD]     (BUILD defaults to "build")
#   --duration SEC     measured seconds per run (DURATION, 5)
#   --rounds N         how many times the whole sequence runs (ROUNDS, 3)
#   --quick            a smoke run: 0.3 s per run, 0.1 s warmup, 0.1 s Redis calibration,
#                      one round
#   --require-redis    fail (exit 2) when redis-server or redis-benchmark is missing;
#                      without it the Redis pairs are skipped with a note and the rest runs
#   --no-redis         skip the Redis pairs even when Redis is installed
#   --strict           exit 1 when a target is missed (default: only errors fail the run)
# environment (defaults): DURATION=5 ROUNDS=3 WARMUP=1 CONNECTIONS=50 CONVERSATIONS=1000 PIPELINE=16
#   MESSAGE_BYTES=40 BENCH_ARGS="" (extra convod-bench options) CONVOD_ARGS="" (extra convod
#   options) TMPDIR (/tmp)
# exit: 0 done (targets missed are reported, not fatal unless --strict), 1 a run failed, had
#   request errors or a server died (or a target was missed with --strict), 2 usage or
#   missing binaries.
set -eu

root=$(cd "$(dirname "$0")/../.." && pwd)
build=
quick=0
require_redis=0
use_redis=1
deferred= # the json-baseline run's CPU row, waiting for its request count
strict=0
while [ $# -gt 0 ]; do
	case $1 in
	--duration)
		[ $# -ge 2 ] || { echo "run-redis: --duration needs a value" >&2; exit 2; }
		DURATION=$2
		shift 2
		;;
	--duration=*)
		DURATION=${1#--duration=}
		shift
		;;
	--rounds)
		[ $# -ge 2 ] || { echo "run-redis: --rounds needs a value" >&2; exit 2; }
		ROUNDS=$2
		shift 2
		;;
	--rounds=*)
		ROUNDS=${1#--rounds=}
		shift
		;;
	--quick)
		quick=1
		shift
		;;
	--require-redis)
		require_redis=1
		shift
		;;
	--no-redis)
		use_redis=0
		shift
		;;
	--strict)
		strict=1
		shift
		;;
	-h | --help)
		sed -n '2,/^set -eu/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
		exit 0
		;;
	-*)
		echo "run-redis: unknown option $1 (see --help)" >&2
		exit 2
		;;
	*)
		[ -z "$build" ] || { echo "run-redis: one BUILD directory only" >&2; exit 2; }
		build=$1
		shift
		;;
	esac
done
prog=run-redis
. "$root/tests/bench/lib.sh"
bench_build "${build:-build}"
bench_need "$convod" "$bench" "$baseline" "$convoctl"

CAL_SECS=0.3
if [ $quick = 1 ]; then
	DURATION=${DURATION:-0.3}
	WARMUP=${WARMUP:-0.1}
	CAL_SECS=0.1
	ROUNDS=${ROUNDS:-1}
fi
DURATION=${DURATION:-5}
ROUNDS=${ROUNDS:-3}
WARMUP=${WARMUP:-1}
CONNECTIONS=${CONNECTIONS:-50}
CONVERSATIONS=${CONVERSATIONS:-1000}
PIPELINE=${PIPELINE:-16}
MESSAGE_BYTES=${MESSAGE_BYTES:-40}
BENCH_ARGS=${BENCH_ARGS:-}
CONVOD_ARGS=${CONVOD_ARGS:-}
case $DURATION in
'' | *[!0-9.]* | *.*.* | .)
	echo "run-redis: bad duration '$DURATION'" >&2
	exit 2
	;;
esac
case $ROUNDS in
'' | *[!0-9]* | 0)
	echo "run-redis: bad number of rounds '$ROUNDS'" >&2
	exit 2
	;;
esac

redis_note=
if [ $use_redis = 0 ]; then
	redis_note="skipped (--no-redis)"
elif ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
	if [ $require_redis = 1 ]; then
		echo "run-redis: redis-server or redis-benchmark is missing (apt install redis-server" \
			"redis-tools) and --require-redis was given" >&2
		exit 2
	fi
	redis_note="skipped: redis-server or redis-benchmark is not installed"
	echo "run-redis: $redis_note; only the json-baseline pair and the latency target run" >&2
	use_redis=0
fi

bench_tmpdir redis

# start_convod TAG CONVOD-OPTIONS...: a fresh daemon on a fresh state directory, no AWS sink
start_convod() {
	tag=$1
	shift
	rm -rf "$dir/state"
	mkdir -p "$dir/state"
	sock=$dir/convod.sock
	# shellcheck disable=SC2086
	start_server "convod ($tag)" "$dir/convod-$tag.log" without_aws \
		"$convod" --socket "$sock" --state-dir "$dir/state" --log-level warn "$@" $CONVOD_ARGS
}

# start_redis TAG REDIS-OPTIONS...: a fresh redis-server, no RDB snapshots, its own directory
start_redis() {
	tag=$1
	shift
	rm -rf "$dir/redis"
	mkdir -p "$dir/redis"
	sock=$dir/redis.sock
	start_server "redis-server ($tag)" "$dir/redis-$tag.log" redis-server --port 0 \
		--unixsocket "$sock" --unixsocketperm 700 --save '' --dir "$dir/redis" \
		--daemonize no --logfile '' "$@"
}

# bench_run KEY PIPELINE: one convod-bench adds-only run against $sock, a row of results
bench_run() {
	key=$1
	echo "run-redis: $key ..." >&2
	rc=0
	ticks0=$(cpu_ticks "$server_pid")
	disk0=$(disk_bytes "$server_pid")
	served0=$(served)
	times >"$dir/times0"
	# shellcheck disable=SC2086
	"$bench" --socket "$sock" --json --mix adds-only --connections "$CONNECTIONS" \
		--conversations "$CONVERSATIONS" --pipeline "$2" --duration "$DURATION" \
		--warmup "$WARMUP" --message-bytes "$MESSAGE_BYTES" $BENCH_ARGS \
		>"$dir/out.json" 2>"$dir/bench.err" || rc=$?
	if [ "$server_name" != json-baseline ]; then
		cpu_row "$key" "$ticks0" "$served0" "$(served)"
	else
		# json-baseline: the figures now, the requests once it exits (baseline_cpu_row)
		deferred="$key $ticks0 $(cpu_ticks "$server_pid")"
		times >"$dir/times1"
	fi
	if [ $rc -ne 0 ]; then
		status=1
		sed 's/^/  /' "$dir/bench.err" >&2
	fi
	if [ -s "$dir/out.json" ]; then
		printf '%s\tbench\t%s\n' "$key" "$(cat "$dir/out.json")" >>"$dir/results"
	else
		printf '%s\tfailed\texit %s\n' "$key" "$rc" >>"$dir/results"
	fi
	if ! kill -0 "$server_pid" 2>/dev/null; then
		echo "run-redis: $server_name died during $key" >&2
		status=1
	fi
}

# served: the requests the convod under test has answered (its stats), or nothing for
# another server
served() {
	case $server_name in
	convod*)
		"$convoctl" --socket "$sock" --raw --timeout 10 stats 2>/dev/null |
			sed -n 's/.*"requests":{"total":\([0-9]*\).*/\1/p'
		;;
	esac
}

# cpu_row KEY TICKS0 SERVED0 SERVED1: a row of the CPU time the server (all its threads, from
# TICKS0 on) and the load generator (the shell's children since times0) took for the
# requests from SERVED0 to SERVED1 (warmup and calibration included on both sides), and of
# the bytes the server had written to storage since disk0 (empty when unknown); a CPU
# figure missing, no row. `times` writes to a file: in a command substitution it would be a
# new process's, with no children.
cpu_row() {
	ticks1=$(cpu_ticks "$server_pid")
	disk1=$(disk_bytes "$server_pid")
	times >"$dir/times1"
	gen1=$(children_cpu "$dir/times1")
	gen0=$(children_cpu "$dir/times0")
	disk=
	if [ -n "$disk0" ] && [ -n "$disk1" ]; then
		disk=$((disk1 - disk0))
	fi
	if [ -n "$2" ] && [ -n "$ticks1" ] && [ -n "$3" ] && [ -n "$4" ] && [ -n "$gen0" ] &&
		[ -n "$gen1" ]; then
		printf '%s\tcpu\t%s,%s,%s - %s,%s\n' "$1" "$((ticks1 - $2))" "$(($4 - $3))" "$gen1" \
			"$gen0" "$disk" >>"$dir/results"
	fi
}

# baseline_cpu_row: the CPU row of the json-baseline run bench_run deferred, with the requests
# the stopped server logged ("json-baseline: N requests on M connections"); it started fresh
# for that run, so they are all the run's, warmup included.
baseline_cpu_row() {
	# shellcheck disable=SC2086
	set -- $deferred
	deferred=
	n=$(sed -n 's/^json-baseline: \([0-9]*\) requests on .*/\1/p' "$server_log" | tail -n 1)
	gen1=$(children_cpu "$dir/times1")
	gen0=$(children_cpu "$dir/times0")
	if [ $# -eq 3 ] && [ -n "$3" ] && [ -n "$n" ] && [ "$n" -gt 0 ] && [ -n "$gen0" ] &&
		[ -n "$gen1" ]; then
		printf '%s\tcpu\t%s,%s,%s - %s,\n' "$1" "$(($3 - $2))" "$n" "$gen1" "$gen0" \
			>>"$dir/results"
	fi
}

# children_cpu FILE: the user plus system seconds of the children in FILE, what `times`
# printed (its second line, as 0m1.230000s 0m0.450000s)
children_cpu() {
	awk 'NR == 2 {
		split($1, u, "m"); split($2, s, "m")
		printf "%.6f", u[1] * 60 + u[2] + s[1] * 60 + s[2]
	}' "$1"
}

# redis_csv N PIPELINE: the LPUSH row of redis-benchmark --csv, or nothing
redis_csv() {
	redis-benchmark -s "$sock" -c "$CONNECTIONS" -P "$2" -n "$1" -d "$MESSAGE_BYTES" \
		-t lpush --csv 2>"$dir/redis-benchmark.err" | grep '^"LPUSH",' || true
}

# redis_run KEY PIPELINE: calibrates -n, then one measured redis-benchmark run
redis_run() {
	key=$1
	echo "run-redis: $key ..." >&2
	n=$((CONNECTIONS * $2 * 20))
	tries=0
	measured=
	while :; do
		csv=$(redis_csv "$n" "$2")
		rps=$(printf '%s\n' "$csv" | awk -F, '{ gsub(/"/, ""); print $2 }')
		if [ -z "$rps" ]; then
			break
		fi
		tries=$((tries + 1))
		# long enough (>= CAL_SECS) to trust the rate, or four tries: size the measured run
		if [ $tries -ge 4 ] ||
			awk -v n="$n" -v r="$rps" -v s="$CAL_SECS" 'BEGIN { exit !(n / r >= s) }'; then
			n=$(awk -v r="$rps" -v d="$DURATION" -v c="$CONNECTIONS" -v p="$2" \
				'BEGIN { n = int(r * d); if (n < c * p) n = c * p; print n }')
			ticks0=$(cpu_ticks "$server_pid")
			disk0=$(disk_bytes "$server_pid")
			times >"$dir/times0"
			measured=$(redis_csv "$n" "$2")
			[ -z "$measured" ] || cpu_row "$key" "$ticks0" 0 "$n"
			break
		fi
		n=$((n * 8))
	done
	if [ -n "$measured" ]; then
		printf '%s\tredis\t%s,%s,%s\n' "$key" "$n" "$2" "$measured" >>"$dir/results"
	else
		status=1
		sed 's/^/  /' "$dir/redis-benchmark.err" >&2
		printf '%s\tfailed\tredis-benchmark gave no LPUSH row\n' "$key" >>"$dir/results"
	fi
	if ! kill -0 "$server_pid" 2>/dev/null; then
		echo "run-redis: $server_name died during $key" >&2
		status=1
	fi
}

: >"$dir/results"
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")

# stop: the server goes, and so do its files before the next run starts: left behind, the
# dirty pages of a durable run's WAL, database or AOF were written back while the other
# side ran (deleted first, most are never written), and sync writes back the rest.
stop() {
	stop_server
	rm -rf "$dir/state" "$dir/redis"
	sync
}

# one_convod TAG KEY PIPELINE CONVOD-OPTIONS... and one_redis TAG KEY PIPELINE REDIS-OPTIONS...:
# a fresh server, one run of this round, the server gone
one_convod() {
	otag=$1 okey=$2 opipe=$3
	shift 3
	start_convod "$otag" "$@"
	bench_run "$okey#$round" "$opipe"
	stop
}
one_redis() {
	[ $use_redis = 1 ] || return 0
	otag=$1 okey=$2 opipe=$3
	shift 3
	start_redis "$otag" "$@"
	redis_run "$okey#$round" "$opipe"
	stop
}

# The pairs' sides, as functions so that a round can run them in either order.
a_convod() {
	one_convod a-process a.convod 1 --durability process
	one_convod a-memory a.convod_memory 1 --memory-only
}
a_redis() { one_redis a a.redis 1 --appendonly no; }
b_convod() {
	one_convod b-process b.convod "$PIPELINE" --durability process
	one_convod b-memory b.convod_memory "$PIPELINE" --memory-only
}
b_others() {
	start_baseline
	bench_run b.baseline#$round "$PIPELINE"
	stop
	baseline_cpu_row
	one_redis b b.redis "$PIPELINE" --appendonly no
}
c_process() { one_convod c-process c.convod_process 1 --durability process; }
c_everysec() { one_redis c-everysec c.redis_everysec 1 --appendonly yes --appendfsync everysec; }
c_machine() { one_convod c-machine c.convod_machine 1 --durability machine; }
c_always() { one_redis c-always c.redis_always 1 --appendonly yes --appendfsync always; }

# Odd rounds run convod first in each pair, even rounds the other side first, so that a
# machine whose speed drifts during a pair favours neither side over the rounds.
round=0
while [ $round -lt "$ROUNDS" ]; do
	round=$((round + 1))
	[ "$ROUNDS" -eq 1 ] || echo "run-redis: round $round of $ROUNDS" >&2
	if [ $((round % 2)) -eq 1 ]; then
		a_convod; a_redis       # (a) 50 connections, no pipelining
		b_convod; b_others      # (b) pipeline
		c_process; c_everysec   # (c) durable, no pipelining
		c_machine; c_always
	else
		a_redis; a_convod
		b_others; b_convod
		c_everysec; c_process
		c_always; c_machine
	fi
done

fs=$(findmnt -n -o FSTYPE -T "$dir" 2>/dev/null || stat -f -c %T "$dir" 2>/dev/null || echo "?")
redis_version=
if [ $use_redis = 1 ]; then
	redis_version=$(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')
fi
load_after=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo "?")
verdict=0
python3 - "$dir/results" "$DURATION" "$WARMUP" "$CONNECTIONS" "$PIPELINE" "$MESSAGE_BYTES" \
	"$fs" "${TMPDIR:-/tmp}" "$redis_version" "$redis_note" "$load_before" "$load_after" \
	"$ROUNDS" "$(getconf CLK_TCK 2>/dev/null || echo 100)" <<'EOF' || verdict=$?
import json, sys

(path, duration, warmup, conns, pipeline, msg_bytes, fs, tmpdir, redis_version, redis_note,
 load_before, load_after, nrounds, clk_tck) = sys.argv[1:15]
nrounds = int(nrounds)
clk_tck = float(clk_tck)
runs = {}  # "a.convod#2" -> the run's figures (dict) or why it has none (str)
cpu = {}   # "a.convod#2" -> (server us, load generator us) of CPU a request, disk bytes or None
order = []
for raw in open(path):
    key, kind, payload = raw.rstrip("\n").split("\t", 2)
    if kind == "cpu":
        # server ticks, requests, "load generator s after - before", bytes to storage or ""
        f = payload.split(",")
        n = int(f[1])
        after, before = (float(x) for x in f[2].split(" - "))
        if n > 0:
            cpu[key] = (int(f[0]) / clk_tck * 1e6 / n, (after - before) * 1e6 / n,
                        int(f[3]) / n if len(f) > 3 and f[3] else None)
        continue
    order.append(key)
    if kind == "bench":
        r = json.loads(payload)
        r["label"] = "convod-bench"
        runs[key] = r
    elif kind == "redis":
        # n,pipeline,"LPUSH",rps,avg_ms,min_ms,p50_ms,p95_ms,p99_ms,max_ms
        f = [x.strip('"') for x in payload.split(",")]
        if len(f) != 10:
            runs[key] = "unreadable redis-benchmark row: " + payload
            continue
        ms = lambda x: float(x) * 1000.0
        runs[key] = {"requests": int(f[0]), "pipeline": int(f[1]), "throughput_rps": float(f[3]),
                     "latency_us": {"p50": ms(f[6]), "p99": ms(f[8]), "p999": float("nan"),
                                    "max": ms(f[9])},
                     "errors": {"total": 0, "by_code": {}}, "label": "redis-benchmark"}
    else:
        runs[key] = "FAILED: " + payload

def rps(key, rnd):
    r = runs.get("%s#%d" % (key, rnd))
    return r["throughput_rps"] if isinstance(r, dict) else None

def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2.0

rounds = range(1, nrounds + 1)
missed = skipped = 0
# (label, convod key, other key, target ratio or None for information)
pairs = [
    ("(a) p1  adds, process  / LPUSH", "a.convod", "a.redis", 1.0),
    ("    p1  adds, memory-only / LPUSH", "a.convod_memory", "a.redis", None),
    ("(b) p%s adds, process  / LPUSH -P %s" % (pipeline, pipeline), "b.convod", "b.redis", None),
    ("    p%s adds, memory-only / LPUSH -P %s" % (pipeline, pipeline), "b.convod_memory",
     "b.redis", None),
    ("(b) p%s adds, process  / json-baseline" % pipeline, "b.convod", "b.baseline", 0.8),
    ("    p%s adds, memory-only / json-baseline" % pipeline, "b.convod_memory", "b.baseline",
     None),
    ("(c) p1  process / LPUSH everysec", "c.convod_process", "c.redis_everysec", 1.0),
    ("(c) p1  machine / LPUSH always", "c.convod_machine", "c.redis_always", 1.0),
]
fmt = "%-41s %12s %12s %6s %7s  %-6s %s"
head = fmt % ("pair", "convod req/s", "other req/s", "ratio", "target", "result",
              "ratio by round" if nrounds > 1 else "")
print("convod vs %s and json-baseline: %s connections, %s-byte messages, %s s measured per run"
      % ("Redis " + redis_version if redis_version else "Redis", conns, msg_bytes, duration))
print("(convod-bench after %s s warmup; redis-benchmark -n from a calibration), state and AOF"
      " on %s (%s)" % (warmup, fs, tmpdir))
if nrounds > 1:
    print("%d rounds of every run: ratio = the median of the rounds' ratios, req/s and p99 ="
          " the medians of the rounds" % nrounds)
print("load average before %s, after %s (2-core machine: anything above ~0.5 before means"
      " noise)" % (load_before, load_after))
if redis_note:
    print("Redis pairs: " + redis_note)
print()
print(head.rstrip())
print("-" * len(head))
for label, ck, ok_, target in pairs:
    tgt = ">= %.1f" % target if target is not None else "info"
    cs = [rps(ck, k) for k in rounds]
    os_ = [rps(ok_, k) for k in rounds]
    if ".redis" in ok_ and not any("%s#%d" % (ok_, k) in runs for k in rounds):
        c = [x for x in cs if x]
        print((fmt % (label, "%.0f" % median(c) if c else "-", "-", "-", tgt,
                      "SKIP" if target is not None else "", "")).rstrip())
        skipped += target is not None
        continue
    if any(x is None for x in cs + os_) or any(o <= 0 for o in os_):
        c = [x for x in cs if x]
        o = [x for x in os_ if x]
        print((fmt % (label, "%.0f" % median(c) if c else "FAILED",
                      "%.0f" % median(o) if o else "FAILED", "-", tgt,
                      "FAIL" if target is not None else "", "a run failed")).rstrip())
        if target is not None:
            missed += 1
        continue
    ratios = [c / o for c, o in zip(cs, os_)]
    ratio = median(ratios)
    result = ""
    if target is not None:
        result = "PASS" if ratio >= target else "FAIL"
        missed += result == "FAIL"
    by_round = " ".join("%.2f" % x for x in ratios) if nrounds > 1 else ""
    print((fmt % (label, "%.0f" % median(cs), "%.0f" % median(os_), "%.2f" % ratio, tgt, result,
                  by_round)).rstrip())
p99s = [runs["a.convod#%d" % k]["latency_us"]["p99"] for k in rounds
        if isinstance(runs.get("a.convod#%d" % k), dict)]
label = "(a) p1  adds, process: p99 latency"
if len(p99s) == nrounds:
    p99 = median(p99s)
    ok = p99 < 1000.0
    missed += not ok
    by_round = " ".join("%.0f" % x for x in p99s) if nrounds > 1 else ""
    print((fmt % (label, "%.0f us" % p99, "", "", "< 1 ms", "PASS" if ok else "FAIL",
                  by_round)).rstrip())
else:
    missed += 1
    print((fmt % (label, "FAILED", "", "", "< 1 ms", "FAIL", "")).rstrip())

names = {
    "a.convod": "convod process p1", "a.convod_memory": "convod memory-only p1",
    "a.redis": "redis LPUSH p1", "b.convod": "convod process p%s" % pipeline,
    "b.convod_memory": "convod memory-only p%s" % pipeline,
    "b.baseline": "json-baseline p%s" % pipeline, "b.redis": "redis LPUSH p%s" % pipeline,
    "c.convod_process": "convod process p1", "c.redis_everysec": "redis AOF everysec p1",
    "c.convod_machine": "convod machine p1", "c.redis_always": "redis AOF always p1",
}
print()
print("CPU a request, in us (medians of the rounds): the server's, all its threads, and the load")
print("generator's; warmup and calibration included, kernel threads' I/O work not; and the")
print("bytes a request the server had written to storage (/proc/PID/io write_bytes)")
head = "%-41s %10s %10s %10s %10s %8s %8s" % ("pair", "convod srv", "other srv", "convod gen",
                                             "other gen", "convod B", "other B")
print(head)
print("-" * len(head))
for label, ck, ok_, target in pairs:
    row = []
    for side in (0, 1, 2):
        for key in (ck, ok_):
            v = [cpu["%s#%d" % (key, k)][side] for k in rounds if "%s#%d" % (key, k) in cpu]
            v = [x for x in v if x is not None]
            row.append(("%.0f" if side == 2 else "%.1f") % median(v) if len(v) == nrounds
                       else "-")
    print("%-41s %10s %10s %10s %10s %8s %8s" % ((label,) + tuple(row)))
print()
head = "%-29s %10s %10s %9s %9s %9s %9s %7s" % ("run", "requests", "req/s", "p50 us", "p99 us",
                                               "p99.9 us", "max us", "errors")
print(head)
print("-" * len(head))
us = lambda x: "%9s" % "-" if x != x else "%9.0f" % x
for key in order:
    r = runs[key]
    base, rnd = key.split("#")
    name = "%s %s" % (base.split(".")[0], names.get(base, base))
    if nrounds > 1:
        name = "%s %s" % (rnd, name)
    if isinstance(r, str):
        print("%-29s %s" % (name, r))
        continue
    lat = r["latency_us"]
    print("%-29s %10d %10.0f %s %s %s %s %7d" % (name, r["requests"], r["throughput_rps"],
                                                us(lat["p50"]), us(lat["p99"]), us(lat["p999"]),
                                                us(lat["max"]), r["errors"]["total"]))
    for code, n in sorted(r["errors"]["by_code"].items()):
        print("%-29s   %s: %d" % ("", code, n))
print()
print("targets: %s missed" % missed if missed else "targets: all met", end="")
print(", %d skipped (no Redis run)" % skipped if skipped else "")
sys.exit(3 if missed else 0)
EOF
case $verdict in
0) ;;
3) [ $strict = 0 ] || status=1 ;;
*) status=1 ;;
esac
exit $status
