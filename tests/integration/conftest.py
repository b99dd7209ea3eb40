"""Harness for integration tests: starts the real convod on a temporary Unix socket.

CONVOD_BIN / CONVOCTL_BIN name the binaries under test (tests/run sets them for each
build); by default the ones in build/.

CONVOD_VALGRIND=1 runs every program of the project that the tests start (convod, convoctl,
the probes) under valgrind's memcheck: CONVOD, CONVOCTL, SINK_PROBE_BIN and
DDBCLIENT_PROBE_BIN then name small wrapper scripts that exec valgrind on the real binary,
each process writing its report to its own log. Any memory error, and any definite or
indirect leak, fails the test that started the process (its report is printed). Waits of
this harness are multiplied by TIMEOUT_SCALE (CONVOD_TIMEOUT_SCALE, 10 under valgrind).
"""
import atexit
import json
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONVOD_REAL = os.environ.get("CONVOD_BIN", os.path.join(ROOT, "build", "daemon", "convod"))
CONVOCTL_REAL = os.environ.get("CONVOCTL_BIN",
                               os.path.join(ROOT, "build", "clients", "convoctl"))

# --- valgrind ------------------------------------------------------------------------------

VALGRIND = os.environ.get("CONVOD_VALGRIND", "") not in ("", "0")
TIMEOUT_SCALE = float(os.environ.get("CONVOD_TIMEOUT_SCALE", "10" if VALGRIND else "1"))
# For the tests' own waits: float(os.environ.get("CONVOD_TIMEOUT_SCALE", "1")).
os.environ["CONVOD_TIMEOUT_SCALE"] = repr(TIMEOUT_SCALE)
VALGRIND_OPTIONS = ["-q", "--error-exitcode=99", "--leak-check=full",
                    "--errors-for-leak-kinds=definite,indirect",
                    "--show-leak-kinds=definite,indirect", "--trace-children=no",
                    "--child-silent-after-fork=yes", "--num-callers=40"]
# A report holds an error or a leak when it has a stack ("at 0x..." / "by 0x..."): valgrind's
# warnings without -v (an unhandled ioctl, a large range of address perms) have none.
_VG_STACK = re.compile(r"^==\d+==\s+(at|by) 0x", re.M)


def scaled(seconds):
    """A wait of this harness, longer under valgrind."""
    return seconds * TIMEOUT_SCALE


def _valgrind_setup():
    """Makes the wrapper scripts; returns (their directory, the reports' directory)."""
    vg = shutil.which("valgrind")
    if vg is None:
        raise RuntimeError("CONVOD_VALGRIND is set but valgrind is not installed")
    top = tempfile.mkdtemp(prefix="convod-vg-")
    atexit.register(shutil.rmtree, top, True)
    logs = os.path.join(top, "logs")
    os.mkdir(logs)
    return top, logs


def _valgrind_wrapper(top, logs, real):
    """A script that execs valgrind on real with its arguments: the pid stays the one the
    test started (signals, LISTEN_PID, MAINPID), the report goes to logs/<pid>.vg."""
    path = os.path.join(top, os.path.basename(real))
    opts = " ".join(VALGRIND_OPTIONS + ["--log-file=" + os.path.join(logs, "%p.vg")])
    with open(path, "w") as f:
        f.write("#!/bin/sh\nexec %s %s '%s' \"$@\"\n" % (shutil.which("valgrind"), opts, real))
    os.chmod(path, stat.S_IRWXU)
    return path


def _probe_real(env_var, name):
    """Where test_sink.py / test_ddbclient.py look for a probe when env_var is not set."""
    if os.environ.get(env_var):
        return os.environ[env_var]
    build = os.path.dirname(os.path.dirname(CONVOD_REAL))
    return os.path.join(build, "tests", "integration", name)


def valgrind_report(path):
    """The report in path when it shows an error or a leak, else "" (also when absent)."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return text if _VG_STACK.search(text) else ""


if VALGRIND:
    VG_TOP, VG_LOGS = _valgrind_setup()
    CONVOD = _valgrind_wrapper(VG_TOP, VG_LOGS, CONVOD_REAL)
    CONVOCTL = _valgrind_wrapper(VG_TOP, VG_LOGS, CONVOCTL_REAL)
    # Read by test_sink.py and test_ddbclient.py when they are imported, after this file.
    for _var, _name in (("SINK_PROBE_BIN", "sink_probe"),
                        ("DDBCLIENT_PROBE_BIN", "ddbclient_probe")):
        os.environ[_var] = _valgrind_wrapper(VG_TOP, VG_LOGS, _probe_real(_var, _name))
else:
    VG_TOP = VG_LOGS = None
    CONVOD = CONVOD_REAL
    CONVOCTL = CONVOCTL_REAL


def _collect_valgrind_reports(paths=None):
    """Reads and removes the reports (all of them when paths is None); returns the texts
    of those that show an error or a leak, each headed by its file name."""
    if paths is None:
        paths = [os.path.join(VG_LOGS, n) for n in sorted(os.listdir(VG_LOGS))]
    bad = []
    for p in paths:
        text = valgrind_report(p)
        if text:
            bad.append("valgrind report %s:\n%s" % (os.path.basename(p), text[-12000:]))
        try:
            os.unlink(p)
        except OSError:
            pass
    return bad


# Tests left out under valgrind, by node id (without parameters) -> why.
VALGRIND_SKIP = {
    # The normal stage runs these on the same binaries, already under valgrind (their own
    # wrapping); here valgrind would only watch the shell of this file's wrapper.
    "test_ddbclient.py::test_failure_paths_valgrind": "runs valgrind itself (normal stage)",
    "test_ddbclient.py::test_roundtrip_dynalite_valgrind": "runs valgrind itself (normal stage)",
    "test_ddbclient.py::test_crc32_damaged_valgrind": "runs valgrind itself (normal stage)",
    "test_sink.py::test_valgrind_faults_and_close": "runs valgrind itself (normal stage)",
}


def pytest_collection_modifyitems(config, items):
    if not VALGRIND:
        return
    for item in items:
        key = "%s::%s" % (os.path.basename(str(item.fspath)), item.originalname)
        if key in VALGRIND_SKIP:
            item.add_marker(pytest.mark.skip(reason="under valgrind: " + VALGRIND_SKIP[key]))


@pytest.fixture(autouse=True)
def _valgrind_check():
    """Under valgrind: after each test (and after its daemons were stopped, this fixture
    being set up first), every report left by a process the test started must be clean."""
    yield
    if VALGRIND:
        bad = _collect_valgrind_reports()
        assert not bad, "\n".join(bad)


class Conn:
    """One client connection speaking newline-delimited JSON."""

    def __init__(self, path, timeout=10.0):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(scaled(timeout))
        self.sock.connect(path)
        self.buf = b""

    def send_raw(self, data: bytes):
        self.sock.sendall(data)

    def send(self, obj):
        self.send_raw(json.dumps(obj).encode() + b"\n")

    def recv_line(self) -> bytes:
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise EOFError("connection closed by daemon")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line

    def recv(self):
        return json.loads(self.recv_line())

    def request(self, obj):
        self.send(obj)
        return self.recv()

    def ok(self, obj):
        """Sends obj, asserts success, returns the result."""
        r = self.request(obj)
        assert r.get("ok") is True, r
        return r["result"]

    def err(self, obj, code):
        """Sends obj, asserts failure with that code, returns the error object."""
        r = self.request(obj)
        assert r.get("ok") is False, r
        assert r["error"]["code"] == code, r
        return r["error"]

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass


class Daemon:
    def __init__(self, args=(), env=None, nofile=None):
        self.dir = tempfile.mkdtemp(prefix="convod-test-")
        self.socket = os.path.join(self.dir, "convod.sock")
        self.state_dir = os.path.join(self.dir, "state")
        self.args = list(args)
        self.env = env
        self.nofile = nofile  # RLIMIT_NOFILE (soft and hard) to start it with, or None
        self.proc = None
        self.conns = []
        self.stderr_path = os.path.join(self.dir, "stderr.log")
        self.valgrind_log = None  # under valgrind: where the report of the last start goes

    def start(self, wait=True):
        cmd = [CONVOD, "--socket", self.socket, "--state-dir", self.state_dir] + self.args
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        self.stderr = open(self.stderr_path, "ab")
        nofile = self.nofile
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
                 ) if nofile else None
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.stderr,
                                     stderr=self.stderr, env=env, preexec_fn=limit)
        if VALGRIND:
            self.valgrind_log = os.path.join(VG_LOGS, "%d.vg" % self.proc.pid)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout=15.0):
        deadline = time.time() + scaled(timeout)
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("convod exited with %s: %s" % (self.proc.returncode, self.log()))
            try:
                c = Conn(self.socket, timeout=2)  # scaled by Conn
                r = c.request({"op": "ping"})
                c.close()
                if r.get("ok"):
                    return
            except (OSError, EOFError, ValueError):
                pass
            time.sleep(0.02)
        raise RuntimeError("convod did not become ready: " + self.log())

    def connect(self, timeout=10.0):
        c = Conn(self.socket, timeout)
        self.conns.append(c)
        return c

    def log(self):
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def signal(self, sig):
        self.proc.send_signal(sig)

    def stop(self, sig=None, timeout=30):
        """Stops the daemon (SIGTERM unless sig is given); returns its exit code."""
        # The default is resolved here: in the class body `signal` is the method above.
        if sig is None:
            sig = signal.SIGTERM
        for c in self.conns:
            c.close()
        self.conns = []
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(scaled(timeout))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError("convod did not exit within %ss after %s"
                                     % (scaled(timeout), sig))
        rc = self.proc.returncode if self.proc else 0
        if self.proc:
            self.stderr.close()
        return rc

    def cleanup(self):
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def daemon_factory():
    """daemon_factory(args=[...], env={...}, start=True, nofile=None) -> Daemon; all stopped
    at teardown (nofile: the open-file limit it starts with).
    A daemon that exited non-zero or printed a sanitizer report fails the test, and so does
    one whose valgrind report shows an error or a leak (CONVOD_VALGRIND)."""
    made = []

    def make(args=(), env=None, start=True, nofile=None):
        d = Daemon(args, env, nofile)
        made.append(d)
        if start:
            d.start()
        return d

    yield make
    problems = []
    for d in made:
        running = d.proc is not None and d.proc.poll() is None
        rc = d.stop()
        log = d.log()
        if running and rc != 0:
            problems.append("convod exited %s at teardown:\n%s" % (rc, log[-4000:]))
        if "Sanitizer" in log or "runtime error:" in log:
            problems.append("sanitizer report:\n" + log[-8000:])
        if d.valgrind_log:
            problems += ["convod %s: %s" % (d.socket, r)
                         for r in _collect_valgrind_reports([d.valgrind_log])]
        d.cleanup()
    assert not problems, "\n".join(problems)


@pytest.fixture
def daemon(daemon_factory):
    """A running convod with default settings."""
    return daemon_factory()


@pytest.fixture
def conn(daemon):
    """A connection to the default daemon."""
    return daemon.connect()


# --- DynamoDB: a local dynalite server, fresh tables, and a fault-injecting proxy -----

import uuid  # noqa: E402

import ddb as _ddb  # noqa: E402  (this folder is on sys.path, as for jsonschema_mini)
from faultproxy import FaultProxy  # noqa: E402

TESTS_DIR = os.path.join(ROOT, "tests")
DYNALITE_CLI = os.path.join(TESTS_DIR, "node_modules", "dynalite", "cli.js")


def _ensure_dynalite():
    """Returns the node binary, installing tests/node_modules from the lockfile first when
    it is missing; skips only when node or npm is not installed at all."""
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed: the DynamoDB tests need dynalite (Node.js)")
    if not os.path.exists(DYNALITE_CLI):
        npm = shutil.which("npm")
        if npm is None:
            pytest.skip("npm is not installed and tests/node_modules is missing: "
                        "cannot install dynalite for the DynamoDB tests")
        r = subprocess.run([npm, "ci", "--prefix", TESTS_DIR, "--no-audit", "--no-fund"],
                           cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, timeout=600)
        if r.returncode != 0 or not os.path.exists(DYNALITE_CLI):
            pytest.fail("npm ci --prefix tests failed (%s):\n%s"
                        % (r.returncode, r.stdout.decode(errors="replace")[-4000:]))
    return node


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def dynalite():
    """A dynalite server (in-memory) on a free loopback port for the whole session;
    yields its endpoint URL "http://127.0.0.1:PORT"."""
    node = _ensure_dynalite()
    logdir = tempfile.mkdtemp(prefix="dynalite-")
    log_path = os.path.join(logdir, "dynalite.log")
    proc = None
    endpoint = None
    with open(log_path, "ab") as log:
        for _ in range(5):  # another process may grab the port between probe and bind
            port = _free_port()
            proc = subprocess.Popen(
                [node, DYNALITE_CLI, "--host", "127.0.0.1", "--port", str(port),
                 "--createTableMs", "0", "--deleteTableMs", "0", "--updateTableMs", "0"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
            endpoint = "http://127.0.0.1:%d" % port
            deadline = time.time() + 30
            while proc.poll() is None and time.time() < deadline:
                try:
                    _ddb.request(endpoint, "ListTables", {}, timeout=2)
                    break
                except (OSError, _ddb.DdbError):
                    time.sleep(0.05)
            else:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                proc = None
                continue
            break
    if proc is None:
        with open(log_path, "rb") as f:
            out = f.read().decode(errors="replace")
        shutil.rmtree(logdir, ignore_errors=True)
        raise RuntimeError("dynalite did not start:\n" + out[-4000:])
    try:
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(logdir, ignore_errors=True)


@pytest.fixture
def ddb_table(dynalite, request):
    """A fresh, empty table (conversation S HASH, sk S RANGE, on-demand) on the session's
    dynalite; yields its name and deletes it afterwards."""
    name = "convod-test-%s" % uuid.uuid4().hex[:12]
    _ddb.create_table(dynalite, name)
    yield name
    try:
        _ddb.delete_table(dynalite, name, wait=False)
    except (OSError, _ddb.DdbError):
        pass


@pytest.fixture
def faultproxy(dynalite):
    """A FaultProxy (tests/integration/faultproxy.py) in front of dynalite, stopped at
    teardown: .url, .push(fault, n=1, op=None, ms=None), .set_probability(),
    .set_down(bool, seconds=None), .counts, .log. Fails the test if the proxy itself hit an
    unexpected error."""
    p = FaultProxy(dynalite).start()
    yield p
    p.stop()
    assert not p.errors, "faultproxy handler errors:\n" + "\n".join(p.errors)
