#!/usr/bin/env bash
# Installs what convod needs to build and test, from Debian's packages (idempotent: does
# nothing when everything is there). Needs root or sudo when something is missing.
set -eu
pkgs=(meson ninja-build pkg-config gcc libuv1-dev libjansson-dev libcurl4-openssl-dev
      libssl-dev libsqlite3-dev python3 python3-pytest socat valgrind libfaketime)
# node and npm run dynalite, the DynamoDB-compatible server of the tests; the machine's
# own node is used when there is one.
command -v node >/dev/null && command -v npm >/dev/null || pkgs+=(nodejs npm)
missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
	echo "tests/deps.sh: installing ${missing[*]}" >&2
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	export DEBIAN_FRONTEND=noninteractive
	$sudo apt-get update -qq
	$sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# dynalite and the AWS SDK (benchmark peer), pinned by tests/package-lock.json.
here=$(cd "$(dirname "$0")" && pwd)
if [ ! -d "$here/node_modules/dynalite" ]; then
	echo "tests/deps.sh: npm ci in tests/" >&2
	(cd "$here" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi
