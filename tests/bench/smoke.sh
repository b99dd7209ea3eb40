#!/bin/sh
# Short run of convod-bench against json-baseline: both must exit 0 with the expected counts.
# usage: smoke.sh CONVOD_BENCH JSON_BASELINE
set -eu
bench=$1
baseline=$2
dir=$(mktemp -d)
sock=$dir/baseline.sock
pid=
cleanup() {
	if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
	rm -rf "$dir"
}
trap cleanup EXIT

"$baseline" --socket "$sock" 2>"$dir/baseline.log" &
pid=$!
i=0
while [ ! -S "$sock" ]; do
	i=$((i + 1))
	if [ $i -gt 100 ]; then echo "baseline did not start" >&2; exit 1; fi
	sleep 0.05
done

"$bench" --socket "$sock" --connections 8 --conversations 40 --pipeline 4 \
	--requests 4000 --json >"$dir/load.json"
grep -q '"requests":4000,' "$dir/load.json" || { cat "$dir/load.json"; exit 1; }
grep -q '"errors":{"total":0,' "$dir/load.json" || { cat "$dir/load.json"; exit 1; }

"$bench" --socket "$sock" --fill --connections 4 --conversations 100 \
	--messages-per-conversation 5 --pid "$pid" --json >"$dir/fill.json"
grep -q '"requests":500,' "$dir/fill.json" || { cat "$dir/fill.json"; exit 1; }
grep -q '"rss_kb":{"before":[1-9]' "$dir/fill.json" || { cat "$dir/fill.json"; exit 1; }

# an unreachable socket is a failure, not an empty report
if "$bench" --socket "$dir/none.sock" --requests 10 >/dev/null 2>&1; then
	echo "bench succeeded without a server" >&2
	exit 1
fi

kill -TERM "$pid"
wait "$pid"
pid=
grep -q '^json-baseline: 4[0-9]* requests' "$dir/baseline.log" || { cat "$dir/baseline.log"; exit 1; }
echo "bench smoke: ok"
