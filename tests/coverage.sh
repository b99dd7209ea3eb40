#!/bin/sh
# tests/coverage.sh [BUILD_DIR]: which lines of daemon/ and lib/ the unit and integration
# tests reach. Builds BUILD_DIR (default build-cov) with gcc's coverage instrumentation
# (-Db_coverage=true, no optimisation, so that lines map to code), runs the unit suite and
# the integration tests against that build's daemon, and prints gcovr's table: lines, lines
# run, and the line numbers never run, per file. It merges the counts of every program
# that compiles a file (the daemon, and the unit tests that link daemon/ sources). Needs
# gcovr (apt-get install gcovr). A look for untested paths, not a gate: nothing fails on a
# number. Extra arguments go to pytest (tests/coverage.sh build-cov -k persistence).
set -eu
cd "$(dirname "$0")/.."
build=${1:-build-cov}
[ $# -gt 0 ] && shift
command -v gcovr >/dev/null || { echo "coverage.sh: needs gcovr (apt-get install gcovr)" >&2; exit 2; }
if [ ! -d "$build" ]; then
	meson setup "$build" -Db_coverage=true -Dbuildtype=debug >/dev/null
fi
case "$build" in /*) abs=$build ;; *) abs=$PWD/$build ;; esac
meson compile -C "$build" >/dev/null
find "$build" -name '*.gcda' -delete
meson test -C "$build" --suite unit >/dev/null || echo "coverage.sh: some unit tests failed" >&2
CONVOD_BIN="$abs/daemon/convod" CONVOCTL_BIN="$abs/clients/convoctl" \
	/usr/bin/python3 -m pytest -q -p no:cacheprovider tests/integration "$@" ||
	echo "coverage.sh: some integration tests failed" >&2
gcovr -r "$PWD" --filter "$PWD/daemon/" --filter "$PWD/lib/" "$abs"
