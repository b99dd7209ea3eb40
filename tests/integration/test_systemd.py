"""convod under a service manager: socket activation (LISTEN_FDS/LISTEN_PID, driven through
systemd-socket-activate), the sd_notify datagrams (READY=1, WATCHDOG=1, STOPPING=1 on a
socket of the test's own), the SO_PEERCRED allow-list (clients run under another uid with
setpriv), and `systemd-analyze verify` on the units in systemd/.
"""
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
import uuid

import pytest

from conftest import CONVOD, ROOT, Conn

SOCKET_ACTIVATE = shutil.which("systemd-socket-activate")
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
SETPRIV = shutil.which("setpriv")
SANITIZER_ENV = ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS")
NOBODY = 65534


def _sanitizer_free(log):
    assert "Sanitizer" not in log and "runtime error:" not in log, log[-8000:]


def _wait_path(path, proc, timeout=10.0):
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert proc.poll() is None, "exited early with %s" % proc.returncode
        assert time.time() < deadline, "%s never appeared" % path
        time.sleep(0.02)


# --- socket activation ------------------------------------------------------------------

@pytest.fixture
def tmpdir_short():
    """A short temporary directory (Unix socket paths are limited to 107 bytes)."""
    d = tempfile.mkdtemp(prefix="convod-sd-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _run_activated(tmp):
    """Starts convod under systemd-socket-activate on tmp/convod.sock; returns (proc, socket
    path, unused --socket path, log path). The daemon starts at the first connection and
    execs in place of systemd-socket-activate, so proc is convod itself."""
    sock = os.path.join(tmp, "convod.sock")
    unused = os.path.join(tmp, "flag.sock")
    log_path = os.path.join(tmp, "stderr.log")
    cmd = [SOCKET_ACTIVATE, "-l", sock]
    # systemd-socket-activate hands the child a minimal environment: pass the sanitizer
    # settings through explicitly.
    for k in SANITIZER_ENV:
        if k in os.environ:
            cmd += ["-E", k]
    cmd += [CONVOD, "--socket", unused, "--state-dir", os.path.join(tmp, "state")]
    log = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    return proc, sock, unused, log_path


def _read(path):
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")


@pytest.mark.skipif(SOCKET_ACTIVATE is None,
                    reason="systemd-socket-activate is missing (Debian package systemd)")
def test_socket_activation_serves_the_passed_socket(tmpdir_short):
    proc, sock, unused, log_path = _run_activated(tmpdir_short)
    try:
        _wait_path(sock, proc)
        before = os.stat(sock)
        # This connection exists before convod does: systemd-socket-activate starts it on
        # the first connection, and convod must accept it from the passed socket.
        c = Conn(sock, timeout=30)
        r = c.request({"id": 1, "op": "ping"})
        assert r["ok"] is True and r["id"] == 1 and r["result"]["pong"] is True, r
        r = c.request({"id": 2, "op": "add_user", "conversation": "sa-1", "contents": "Hi"})
        assert r["ok"] is True and r["result"]["merged"] is False, r
        c.close()
        c2 = Conn(sock)
        msgs = c2.ok({"op": "get_messages", "conversation": "sa-1"})["messages"]
        assert [m["message"]["contents"] for m in msgs] == [["Hi"]], msgs
        c2.close()
        after = os.stat(sock)
        # Not replaced, not re-created, not chmod-ed: the service manager owns that file.
        assert (after.st_ino, after.st_dev, stat.S_IMODE(after.st_mode)) == \
            (before.st_ino, before.st_dev, stat.S_IMODE(before.st_mode))
        assert not os.path.exists(unused), "convod created its own --socket"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, _read(log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = _read(log_path)
    assert os.path.exists(sock) and os.stat(sock).st_ino == before.st_ino, \
        "convod removed the socket file it did not create"
    assert "socket activation" in log and sock in log, log
    assert "created by convod" not in log, log
    _sanitizer_free(log)


def test_listen_pid_of_another_process_is_ignored(daemon_factory):
    # LISTEN_* meant for another process (say, a parent that forgot to unset them): convod
    # creates its own socket as usual and never touches fd 3.
    d = daemon_factory(env={"LISTEN_PID": "1", "LISTEN_FDS": "1"})
    c = d.connect()
    assert c.ok({"op": "ping"})["pong"] is True
    assert stat.S_ISSOCK(os.stat(d.socket).st_mode)
    assert "created by convod" in d.log()
    assert "socket activation" not in d.log()


def _exec_with_fd3(tmp, fd3):
    """Runs convod with fd 3 = fd3, LISTEN_PID = its own pid and LISTEN_FDS=1, to
    completion; returns (exit code, stderr, the --socket path)."""
    sock = os.path.join(tmp, "own.sock")

    def child():  # after fork, before exec: the pid is already convod's
        os.dup2(fd3, 3, inheritable=True)
        os.environ["LISTEN_PID"] = str(os.getpid())
        os.environ["LISTEN_FDS"] = "1"

    r = subprocess.run([CONVOD, "--socket", sock, "--state-dir", os.path.join(tmp, "state")],
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, pass_fds=(fd3,), preexec_fn=child, timeout=30)
    return r.returncode, r.stderr.decode(errors="replace"), sock


def test_activation_with_a_file_as_fd3_fails_clearly(tmpdir_short):
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        rc, err, sock = _exec_with_fd3(tmpdir_short, fd)
    finally:
        os.close(fd)
    assert rc == 1, err
    assert "fd 3 is not a listening Unix stream socket" in err, err
    assert not os.path.exists(sock), "fell back to creating a socket"
    _sanitizer_free(err)


def test_activation_with_an_unlistened_socket_fails_clearly(tmpdir_short):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        rc, err, sock = _exec_with_fd3(tmpdir_short, a.fileno())
    finally:
        a.close()
        b.close()
    assert rc == 1, err
    assert "fd 3 is not a listening Unix stream socket" in err, err
    assert not os.path.exists(sock)
    _sanitizer_free(err)


# --- sd_notify --------------------------------------------------------------------------

class NotifyListener:
    """A datagram socket standing in for systemd's notification socket."""

    def __init__(self, address):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(address)
        self.messages = []

    def next(self, timeout):
        self.sock.settimeout(timeout)
        data = self.sock.recv(4096).decode()
        self.messages.append(data)
        return data

    def wait_for(self, pred, timeout=15.0):
        """Receives until pred(message) holds; returns that message."""
        deadline = time.time() + timeout
        while True:
            left = deadline - time.time()
            assert left > 0, "not received; got %r" % self.messages
            m = self.next(left)
            if pred(m):
                return m

    def close(self):
        self.sock.close()


def _fields(message):
    return dict(line.split("=", 1) for line in message.split("\n") if line)


def test_notify_ready_watchdog_stopping_in_order(daemon_factory, tmpdir_short):
    path = os.path.join(tmpdir_short, "notify.sock")
    n = NotifyListener(path)
    try:
        d = daemon_factory(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "200000"})
        ready = n.wait_for(lambda m: _fields(m).get("READY") == "1")
        # READY=1 is the first thing said, and it comes with a status.
        assert n.messages == [ready]
        assert "restored" in _fields(ready).get("STATUS", ""), ready
        # Pings every 100 ms (half of WATCHDOG_USEC) while the daemon runs.
        t0 = time.time()
        n.wait_for(lambda m: m == "WATCHDOG=1")
        n.wait_for(lambda m: m == "WATCHDOG=1")
        assert time.time() - t0 < 5
        c = d.connect()
        assert c.ok({"op": "ping"})["pong"] is True
        d.signal(signal.SIGTERM)
        stopping = n.wait_for(lambda m: _fields(m).get("STOPPING") == "1")
        assert d.proc.wait(30) == 0, d.log()
        # Whatever came after STOPPING=1, READY=1 never again.
        while True:
            try:
                n.next(0.3)
            except socket.timeout:
                break
    finally:
        n.close()
    kinds = []
    for m in n.messages:
        f = _fields(m)
        kinds += [k for k in ("READY", "WATCHDOG", "STOPPING") if k in f]
    i_stop = kinds.index("STOPPING")
    assert kinds[0] == "READY" and kinds.count("READY") == 1, kinds
    assert kinds[1:i_stop].count("WATCHDOG") >= 2, kinds
    assert kinds.count("STOPPING") == 1, kinds
    assert "STATUS" in _fields(stopping)


def test_notify_ready_status_counts_restored_conversations(daemon_factory, tmpdir_short):
    path = os.path.join(tmpdir_short, "notify.sock")
    n = NotifyListener(path)
    try:
        d = daemon_factory(env={"NOTIFY_SOCKET": path})
        first = _fields(n.wait_for(lambda m: _fields(m).get("READY") == "1"))
        assert "0 conversations restored" in first["STATUS"], first
        c = d.connect()
        for conv in ("r-1", "r-2", "r-3"):
            c.ok({"op": "add_user", "conversation": conv, "contents": "Hi"})
        assert d.stop() == 0
        d.start()
        second = _fields(n.wait_for(lambda m: _fields(m).get("READY") == "1"))
        assert "3 conversations restored" in second["STATUS"], second
        # Without WATCHDOG_USEC: no pings at all.
        with pytest.raises(socket.timeout):
            n.wait_for(lambda m: "WATCHDOG=1" in m, timeout=0.5)
    finally:
        n.close()


def test_notify_abstract_socket(daemon_factory):
    name = "convod-test-%s" % uuid.uuid4().hex
    n = NotifyListener("\0" + name)
    try:
        daemon_factory(env={"NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "100000"})
        n.wait_for(lambda m: _fields(m).get("READY") == "1")
        n.wait_for(lambda m: m == "WATCHDOG=1")
    finally:
        n.close()


def test_notify_watchdog_for_another_pid_is_not_pinged(daemon_factory, tmpdir_short):
    path = os.path.join(tmpdir_short, "notify.sock")
    n = NotifyListener(path)
    try:
        daemon_factory(env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "100000",
                            "WATCHDOG_PID": "1"})
        n.wait_for(lambda m: _fields(m).get("READY") == "1")
        # Ten intervals: a daemon pinging for another process's watchdog would show here.
        with pytest.raises(socket.timeout):
            n.wait_for(lambda m: "WATCHDOG" in m, timeout=1.0)
    finally:
        n.close()


def test_notify_socket_gone_does_not_hurt(daemon_factory, tmpdir_short):
    # NOTIFY_SOCKET names nothing (systemd restarted, a stale variable): the daemon serves
    # and stops normally.
    d = daemon_factory(env={"NOTIFY_SOCKET": os.path.join(tmpdir_short, "absent.sock"),
                            "WATCHDOG_USEC": "100000"})
    c = d.connect()
    time.sleep(0.3)
    assert c.ok({"op": "ping"})["pong"] is True
    assert d.stop() == 0


# --- peer credentials -------------------------------------------------------------------

CLIENT = r"""
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(10)
s.connect(sys.argv[1])
out = {"pid": os.getpid(), "uid": os.getuid(), "data": "", "end": "eof"}
if len(sys.argv) > 2:
    try:
        s.sendall(sys.argv[2].encode() + b"\n")
    except (BrokenPipeError, ConnectionResetError):
        out["send"] = "refused"  # closed already; what it said is still there to read
data = b""
while True:
    try:
        chunk = s.recv(65536)
    except ConnectionResetError:
        out["end"] = "reset"
        break
    except socket.timeout:
        out["end"] = "timeout"
        break
    if not chunk:
        break
    data += chunk
    if len(sys.argv) > 2 and data.endswith(b"\n"):
        out["end"] = "answered"
        break
out["data"] = data.decode()
print(json.dumps(out))
"""


def _as_user(sock, groups=None, request=None, uid=NOBODY, gid=NOBODY):
    """Runs the client under uid/gid (and supplementary groups, none by default); returns
    its report and its pid."""
    cmd = [SETPRIV, "--reuid=%d" % uid, "--regid=%d" % gid]
    cmd += ["--groups=" + ",".join(map(str, groups))] if groups else ["--clear-groups"]
    cmd += ["/usr/bin/python3", "-c", CLIENT, sock]
    if request is not None:
        cmd.append(json.dumps(request))
    p = subprocess.Popen(cmd, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err.decode()
    report = json.loads(out)
    # setpriv execs python: the pid convod sees is this one.
    assert report["pid"] == p.pid and report["uid"] == uid
    return report


def _open_up(d):
    """Lets other users reach the daemon's socket (the test's directory is 0700)."""
    os.chmod(d.dir, 0o755)
    os.chmod(d.socket, 0o666)


needs_setpriv = pytest.mark.skipif(
    SETPRIV is None or os.geteuid() != 0,
    reason="needs setpriv (util-linux) and root to run a client under another uid")


@needs_setpriv
def test_allow_list_serves_listed_uid_and_refuses_others(daemon_factory):
    d = daemon_factory(args=["--allow-uid", str(os.getuid())])
    _open_up(d)
    c = d.connect()
    assert c.ok({"op": "ping"})["pong"] is True  # the listed uid is served

    r = _as_user(d.socket)
    assert r["end"] == "eof", r
    lines = r["data"].split("\n")
    assert len(lines) == 2 and lines[1] == "", r  # one line, then EOF
    e = json.loads(lines[0])
    assert e["ok"] is False and "id" not in e, e
    assert e["error"]["code"] == "unavailable"
    assert "permission denied" in e["error"]["message"] and "uid 65534" in e["error"]["message"]
    log = d.log()
    assert ("refused connection from pid %d uid 65534 gid 65534: not in the allow-list"
            % r["pid"]) in log, log

    # A refused client that sends a request at once gets the same line, not a reset.
    r = _as_user(d.socket, request={"id": 7, "op": "ping"})
    assert r["end"] in ("eof", "answered"), r
    e = json.loads(r["data"].split("\n")[0])
    assert e["ok"] is False and e["error"]["code"] == "unavailable", r

    stats = c.ok({"op": "stats"})
    assert stats["connections"]["denied"] == 2, stats
    assert stats["connections"]["refused"] == 0, stats
    assert c.ok({"op": "ping"})["pong"] is True  # the daemon goes on


@needs_setpriv
def test_allow_list_uid_0_is_not_special(daemon_factory):
    d = daemon_factory(args=["--allow-uid", str(NOBODY)], start=False)
    d.start(wait=False)
    _wait_path(d.socket, d.proc)
    deadline = time.time() + 15
    while "listening on" not in d.log():
        assert time.time() < deadline and d.proc.poll() is None, d.log()
        time.sleep(0.02)
    _open_up(d)
    # The test runs as root: not listed, so refused like anybody else.
    c = Conn(d.socket)
    line = c.recv_line()
    assert json.loads(line)["error"]["code"] == "unavailable"
    assert c.sock.recv(100) == b""
    c.close()
    assert "uid %d" % os.getuid() in d.log()
    # The listed uid is served.
    r = _as_user(d.socket, request={"id": 1, "op": "ping"})
    assert r["end"] == "answered", r
    ans = json.loads(r["data"])
    assert ans["ok"] is True and ans["result"]["pong"] is True and ans["id"] == 1, ans


@needs_setpriv
def test_allow_list_by_group_primary_and_supplementary(daemon_factory):
    d = daemon_factory(args=["--allow-gid", "4242"], start=False)
    d.start(wait=False)
    _wait_path(d.socket, d.proc)
    deadline = time.time() + 15
    while "listening on" not in d.log():
        assert time.time() < deadline and d.proc.poll() is None, d.log()
        time.sleep(0.02)
    _open_up(d)
    ping = {"id": 3, "op": "ping"}
    # Primary group listed.
    r = _as_user(d.socket, request=ping, gid=4242)
    assert json.loads(r["data"])["ok"] is True, r
    # Only a supplementary group listed (the usual "add the user to the group" setup).
    r = _as_user(d.socket, request=ping, groups=[100, 4242])
    assert json.loads(r["data"])["ok"] is True, r
    # Neither.
    r = _as_user(d.socket, request=ping, groups=[100])
    assert json.loads(r["data"].split("\n")[0])["error"]["code"] == "unavailable", r
    assert "uid 65534 gid 65534: not in the allow-list" in d.log()


# --- the units --------------------------------------------------------------------------

@pytest.mark.skipif(SYSTEMD_ANALYZE is None,
                    reason="systemd-analyze is missing (Debian package systemd)")
def test_units_verify_clean(tmpdir_short):
    src = os.path.join(ROOT, "systemd")
    for unit in ("convod.service", "convod.socket"):
        with open(os.path.join(src, unit)) as f:
            text = f.read()
        if unit == "convod.service":
            assert "ExecStart=/usr/sbin/convod " in text
            # verify checks that the binary exists: point it at the one under test.
            text = text.replace("/usr/sbin/convod", os.path.abspath(CONVOD))
        with open(os.path.join(tmpdir_short, unit), "w") as f:
            f.write(text)
    # Documentation= is checked with man(1): give it this tree's pages.
    env = dict(os.environ)
    man = os.path.join(tmpdir_short, "man")
    pages = {"convod.8": "man8", "convod.conf.5": "man5"}
    have_all = True
    for page, section in pages.items():
        p = os.path.join(ROOT, "daemon", page)
        if not os.path.exists(p):
            have_all = False
            continue
        os.makedirs(os.path.join(man, section), exist_ok=True)
        shutil.copy(p, os.path.join(man, section, page))
    env["MANPATH"] = man
    cmd = [SYSTEMD_ANALYZE, "verify"]
    if not have_all or shutil.which("man") is None:
        cmd.append("--man=no")
    r = subprocess.run(cmd + ["convod.service", "convod.socket"], cwd=tmpdir_short, env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    out = r.stdout.decode(errors="replace")
    assert r.returncode == 0 and out.strip() == "", out

    # The hardening is there, and nothing the allow-list cannot live with.
    with open(os.path.join(src, "convod.service")) as f:
        svc = f.read()
    for line in ("Type=notify", "WatchdogSec=", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "CapabilityBoundingSet=\n",
                 "StateDirectory=convod", "RuntimeDirectoryPreserve=yes"):
        assert line in svc, line
    assert "PrivateUsers=yes" not in svc  # SO_PEERCRED would see every peer as nobody
