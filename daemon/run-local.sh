#!/usr/bin/env bash
# Builds convod and starts it on the embedded default, in the foreground:
# socket ./build/run/convod.sock, state in ./build/run/state. Extra arguments go to convod.
set -eu
cd "$(dirname "$0")/.."
tests/deps.sh
[ -f build/build.ninja ] || meson setup build >/dev/null
meson compile -C build >/dev/null
mkdir -p build/run
echo "convod: socket $(pwd)/build/run/convod.sock (Ctrl-C stops it)" >&2
exec build/daemon/convod --socket "$(pwd)/build/run/convod.sock" \
	--state-dir "$(pwd)/build/run/state" "$@"
