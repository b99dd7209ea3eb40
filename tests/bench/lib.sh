# Shared by the run-*.sh benchmark scripts, which source it after setting `prog` (their
# name, for messages) and `root` (the project's top directory): the build's programs, a
# temporary directory removed at exit, and one server at a time started in the background
# and stopped.
# shellcheck shell=sh
# shellcheck disable=SC2034,SC2154 # variables shared with the sourcing script

# bench_build BUILD: sets build (a directory, or a name under the project root), convod,
# bench, baseline and convoctl.
bench_build() {
	build=${1:-build}
	if [ ! -d "$build" ] && [ -d "$root/$build" ]; then
		build=$root/$build
	fi
	convod=$build/daemon/convod
	bench=$build/tests/bench/convod-bench
	baseline=$build/tests/bench/json-baseline
	convoctl=$build/clients/convoctl
}

# cpu_ticks PID: the user and system CPU time of process PID (all its threads) in clock
# ticks (getconf CLK_TCK), or nothing when it has gone. The command name, in parentheses,
# may hold spaces: the fields are counted from after it.
cpu_ticks() {
	sed -n 's/^.*) //p' "/proc/$1/stat" 2>/dev/null | awk '{ print $12 + $13 }'
}

# disk_bytes PID: the bytes process PID (all its threads) has had written to storage so far
# (write_bytes of /proc/PID/io: counted as it dirties page-cache pages, so a page written
# again before its writeback counts once), or nothing when it has gone.
disk_bytes() {
	sed -n 's/^write_bytes: //p' "/proc/$1/io" 2>/dev/null
}

# bench_need PROGRAM...: exits 2 unless each is an executable.
bench_need() {
	for f in "$@"; do
		if [ ! -x "$f" ]; then
			echo "$prog: $f is missing; build first (meson compile -C $build)" >&2
			exit 2
		fi
	done
}

# bench_tmpdir TAG: dir, a new temporary directory that goes at exit with the server.
bench_tmpdir() {
	dir=$(mktemp -d "${TMPDIR:-/tmp}/convod-$1.XXXXXX")
	server_pid=
	server_name=
	server_log=
	status=0
	trap bench_cleanup EXIT
	trap 'exit 130' INT TERM
}

# shellcheck disable=SC2317 # called by the trap
bench_cleanup() {
	if [ -n "$server_pid" ]; then
		kill -TERM "$server_pid" 2>/dev/null || true
		wait "$server_pid" 2>/dev/null || true
	fi
	rm -rf "$dir"
}

# without_aws COMMAND...: runs COMMAND without the AWS settings that would give convod a
# DynamoDB sink (exec: start_server's pid is the program's).
without_aws() {
	exec env -u AWS_REGION -u AWS_DEFAULT_REGION -u AWS_ENDPOINT_URL \
		-u AWS_ENDPOINT_URL_DYNAMODB -u AWS_PROFILE "$@"
}

# start_server NAME LOG COMMAND...: runs a server in the background, output to LOG, and
# waits until it listens on $sock; exits 1 with its log when it does not come up.
start_server() {
	server_name=$1
	server_log=$2
	shift 2
	rm -f "$sock"
	"$@" >"$server_log" 2>&1 &
	server_pid=$!
	i=0
	while [ ! -S "$sock" ]; do
		i=$((i + 1))
		if [ $i -gt 200 ] || ! kill -0 "$server_pid" 2>/dev/null; then
			echo "$prog: $server_name did not come up; its log:" >&2
			tail -n 20 "$server_log" >&2
			exit 1
		fi
		sleep 0.05
	done
}

# start_baseline: the json-baseline server on $dir/baseline.sock.
start_baseline() {
	sock=$dir/baseline.sock
	start_server json-baseline "$dir/baseline.log" "$baseline" --socket "$sock"
}

# stop_server: SIGTERM, and status=1 (with the log) unless the server exits cleanly.
stop_server() {
	if [ -n "$server_pid" ]; then
		kill -TERM "$server_pid" 2>/dev/null || true
		if ! wait "$server_pid"; then
			echo "$prog: $server_name did not exit cleanly on SIGTERM; its log:" >&2
			tail -n 20 "$server_log" >&2
			status=1
		fi
		server_pid=
	fi
}
