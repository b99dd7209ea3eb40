"""The convod process itself: command line, the socket file (mode, stale and live files),
and shutdown on SIGTERM/SIGINT (answers what was sent, exits 0, removes its socket)."""
import json
import os
import re
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time

import pytest

from conftest import CONVOD, ROOT, VALGRIND, Conn

NUMERIC_FLAGS = ["--max-line-bytes", "--max-output-bytes", "--max-connections", "--max-conversations",
                 "--max-messages", "--max-conversation-bytes", "--max-conversation-id-bytes"]


def project_version():
    with open(os.path.join(ROOT, "meson.build")) as f:
        m = re.search(r"version\s*:\s*'([^']+)'", f.read())
    assert m
    return m.group(1)


def no_sanitizer_report(text):
    assert "Sanitizer" not in text and "runtime error:" not in text, text


def run_cli(args, timeout=15):
    """Runs convod with args plus a private socket and state dir; it must exit by itself
    without ever listening (a socket file appearing means it accepted the arguments)."""
    with tempfile.TemporaryDirectory(prefix="convod-cli-") as tmp:
        sock = os.path.join(tmp, "s.sock")
        # The flags under test come last, so that one missing its value really is missing it.
        cmd = [CONVOD, "--socket", sock, "--state-dir", os.path.join(tmp, "state")] + args
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.time() + timeout
        started = False
        while p.poll() is None and time.time() < deadline:
            if os.path.exists(sock):
                started = True
                break
            time.sleep(0.01)
        if p.poll() is None:
            p.kill()
        out, err = p.communicate()
        text = out.decode(errors="replace") + err.decode(errors="replace")
        assert not started, "convod %r accepted the arguments and started listening" % args
        assert p.returncode >= 0, "convod %r did not exit by itself" % args
        assert not os.path.exists(sock), "convod %r left a socket file" % args
        no_sanitizer_report(text)
        return p.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def test_help():
    rc, out, err = run_cli(["--help"])
    assert rc == 0, err
    for flag in ["--socket", "--state-dir", "--log-level", "--help", "--version"] + NUMERIC_FLAGS:
        assert flag in out, "--help does not mention %s:\n%s" % (flag, out)


def test_version():
    rc, out, err = run_cli(["--version"])
    assert rc == 0, err
    assert project_version() in out


@pytest.mark.parametrize("args", [["--no-such-flag"], ["--max-line-bytes-x", "10"], ["stray"]])
def test_unknown_flag(args):
    rc, out, err = run_cli(args)
    assert rc != 0
    assert err.strip(), "no message for %s" % args
    assert args[0].lstrip("-") in err, err


@pytest.mark.parametrize("flag", NUMERIC_FLAGS)
@pytest.mark.parametrize("value", ["abc", "-1", " -1", "12x", "", "1.5", "99999999999999999999999999", "0x10"])
def test_bad_numeric_values(flag, value):
    rc, out, err = run_cli([flag, value])
    assert rc != 0, "%s %r accepted" % (flag, value)
    assert flag.lstrip("-") in err, "message does not name %s: %r" % (flag, err)


@pytest.mark.parametrize("flag", NUMERIC_FLAGS + ["--log-level", "--socket", "--state-dir"])
def test_flag_without_value(flag):
    rc, out, err = run_cli([flag])
    assert rc != 0
    assert flag.lstrip("-") in err, err


def test_bad_log_level():
    rc, out, err = run_cli(["--log-level", "loud"])
    assert rc != 0
    assert "log-level" in err or "loud" in err, err


@pytest.mark.parametrize("level", ["debug", "info", "warn", "error"])
def test_log_levels_accepted(daemon_factory, level):
    d = daemon_factory(["--log-level", level])
    assert d.connect().ok({"op": "ping"})["pong"] is True


@pytest.mark.parametrize("mask", [0o000, 0o077, 0o022])
def test_socket_mode_0660_whatever_the_umask(daemon_factory, mask):
    d = daemon_factory(start=False)
    old = os.umask(mask)
    try:
        d.start(wait=False)
    finally:
        os.umask(old)
    d.wait_ready()
    st = os.stat(d.socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660, oct(st.st_mode)


def start_fails(d, why):
    """Starts d without waiting for its socket; returns its exit status once it exited (an
    AssertionError saying why when it is still running after 15 s)."""
    d.start(wait=False)
    try:
        return d.proc.wait(15)
    except subprocess.TimeoutExpired:
        raise AssertionError(why)


def test_stale_socket_replaced(daemon_factory):
    d = daemon_factory(start=False)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(d.socket)
    s.close()
    assert stat.S_ISSOCK(os.stat(d.socket).st_mode)
    with pytest.raises(ConnectionRefusedError):
        Conn(d.socket).close()
    d.start()
    c = d.connect()
    assert c.ok({"op": "ping"})["pong"] is True
    assert stat.S_IMODE(os.stat(d.socket).st_mode) == 0o660


def test_live_socket_not_replaced(daemon_factory):
    d1 = daemon_factory()
    c = d1.connect()
    c.ok({"op": "add_user", "conversation": "first", "contents": "x"})
    ino = os.stat(d1.socket).st_ino
    d2 = daemon_factory(start=False)
    d2.socket = d1.socket
    assert start_fails(d2, "a second convod on a live socket did not exit") != 0
    assert d2.log().strip(), "the second daemon exited without a message"
    # The first one is untouched: same socket file, still answering, same data.
    assert os.stat(d1.socket).st_ino == ino
    assert c.ok({"op": "ping"})["pong"] is True
    c2 = d1.connect()
    assert c2.ok({"op": "list"})["conversations"][0]["conversation"] == "first"


def test_file_at_the_socket_path_not_replaced(daemon_factory):
    """Only a socket is ever replaced at the socket path: a regular file there (a typo in
    --socket, another program's file) stops the start with a message and is left as it
    was."""
    d = daemon_factory(start=False)
    with open(d.socket, "w") as f:
        f.write("not a socket\n")
    assert start_fails(d, "convod started over a regular file at its socket path") != 0
    assert "is not a socket" in d.log() and d.socket in d.log(), d.log()
    with open(d.socket) as f:
        assert f.read() == "not a socket\n"


def test_second_daemon_on_the_same_state_dir_refused(daemon_factory):
    """Two daemons on one state directory would share one store: the second took its write
    lock, and every write of the first failed from then on. Now the second exits 1 with a
    message naming the first before it reads anything, the first goes on writing, and once
    the first stopped (or was killed) the state directory is free again."""
    d1 = daemon_factory()
    c = d1.connect()
    c.ok({"op": "add_user", "conversation": "one", "contents": "first"})
    for same_socket in (False, True):
        d2 = daemon_factory(start=False)
        d2.state_dir = d1.state_dir
        if same_socket:
            d2.socket = d1.socket
        assert start_fails(d2, "a second convod on the same state dir did not exit") == 1
        assert "state directory %s is in use by another convod (pid %d)" % (
            d1.state_dir, d1.proc.pid) in d2.log(), d2.log()
        assert "restored" not in d2.log(), d2.log()  # refused before the store was read
        c.ok({"op": "add_user" if same_socket else "add_assistant", "conversation": "one",
              "contents": "still %s" % same_socket})
    assert os.path.exists(d1.socket)
    # Killed, the first leaves the lock behind it free: a start on its directory works.
    d1.stop(signal.SIGKILL)
    d3 = daemon_factory(start=False)
    d3.state_dir = d1.state_dir
    d3.start()
    log = d3.connect().ok({"op": "to_messages_map", "conversation": "one",
                           "incremental": False})["messages"]
    assert [m["message"]["contents"] for m in log] == [["first"], ["still False"],
                                                       ["still True"]], log
    with open(os.path.join(d1.state_dir, "convod.lock")) as f:
        assert f.read() == "%d\n" % d3.proc.pid


def test_socket_directory_missing_named_before_the_store(daemon_factory):
    """--socket in a directory that does not exist: the start stops with a message naming
    the directory and the cause (libuv's bind says "permission denied"), and before the
    store is opened (a restore may take long)."""
    d = daemon_factory(start=False)
    d.socket = os.path.join(d.dir, "no-such-dir", "s.sock")
    assert start_fails(d, "convod started with its socket's directory missing") == 1
    assert "its directory %s: No such file or directory" % os.path.dirname(d.socket) in d.log()
    assert "permission denied" not in d.log(), d.log()
    assert not os.path.exists(os.path.join(d.state_dir, "convod.db")), d.log()


@pytest.mark.parametrize("args", [["--mem"], ["--sock", "/tmp/x.sock"], ["--max-mess", "7"],
                                  ["--max-messages=7", "--durab=none"], ["--ver"]])
def test_abbreviated_options_refused(args):
    """getopt_long takes any unambiguous prefix of an option's name; convod's options are
    written in full (--mem set --memory-only)."""
    rc, out, err = run_cli(args)
    assert rc == 2 and "not abbreviated" in err, (rc, err)
    wrong = [a for a in args if a.startswith("--") and a.split("=")[0] not in
             ("--max-messages",)][0]
    assert "'%s" % wrong in err, err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_answers_what_was_sent_then_exits(daemon_factory, sig):
    d = daemon_factory()
    idle = d.connect(timeout=30)
    assert idle.ok({"op": "ping"})["pong"] is True
    c = d.connect(timeout=30)
    reqs = []
    for i in range(500):
        if i % 3 == 0:
            reqs.append({"id": i, "op": "ping"})
        else:
            reqs.append({"id": i, "op": "add_user" if i % 3 == 1 else "add_assistant", "conversation": "sig",
                         "contents": "m%d" % i})
    c.send_raw(b"".join(json.dumps(r).encode() + b"\n" for r in reqs))
    d.signal(sig)
    for i, req in enumerate(reqs):
        try:
            r = c.recv()
        except (EOFError, ConnectionResetError) as e:
            raise AssertionError("after %s, %d of %d requests sent before it were answered, then %r"
                                 % (sig.name, i, len(reqs), e))
        assert r["id"] == i and r["ok"] is True, r
        if req["op"] != "ping":
            assert r["result"]["message"]["message"]["contents"] == [req["contents"]]
    with pytest.raises(EOFError):
        c.recv_line()
    with pytest.raises(EOFError):
        idle.recv_line()
    try:
        rc = d.proc.wait(30)
    except subprocess.TimeoutExpired:
        raise AssertionError("convod did not exit after %s" % sig)
    assert rc == 0, d.log()
    assert not os.path.exists(d.socket)
    no_sanitizer_report(d.log())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_with_idle_clients_exits_promptly(daemon_factory, sig):
    d = daemon_factory()
    conns = [d.connect() for _ in range(5)]
    for k in conns:
        k.ok({"op": "ping"})
    conns[0].send_raw(b'{"op":"add_user","conversation":"x","cont')  # an unfinished request
    t0 = time.time()
    d.signal(sig)
    for k in conns:
        with pytest.raises(EOFError):
            k.recv_line()
    rc = d.proc.wait(15)
    assert rc == 0, d.log()
    assert time.time() - t0 < 10
    assert not os.path.exists(d.socket)
    with pytest.raises((FileNotFoundError, ConnectionRefusedError)):
        Conn(d.socket)


@pytest.mark.skipif(VALGRIND, reason="a timing window of the last second of a stop: the "
                    "normal and ASan stages run it")
@pytest.mark.parametrize("second", [signal.SIGHUP, signal.SIGTERM])
def test_signal_in_the_last_phase_of_a_stop_still_exits_0(daemon_factory, second):
    """Once the flusher is closed the daemon gives up its signal handlers; the last commit,
    the fold and the store's close then take a second or more. A reload (systemctl reload
    racing the stop) or a second SIGTERM in that phase is ignored: the exit stays 0, where
    the signal's default action ended the process (129, 143)."""
    d = daemon_factory()
    s = socket.socket(socket.AF_UNIX)
    s.connect(d.socket)
    n = 60000
    s.settimeout(30)
    lines = b"".join(json.dumps({"op": "add_user" if i % 2 else "add_assistant",
                                 "conversation": "c%d" % (i % 500),
                                 "contents": "hello %d" % i}).encode() + b"\n"
                     for i in range(n))
    sender = threading.Thread(target=s.sendall, args=(lines,))  # while the answers are read
    sender.start()
    got = 0
    while got < n:
        got += s.recv(1 << 20).count(b"\n")
    sender.join()
    s.close()
    d.signal(signal.SIGTERM)
    deadline = time.time() + 30
    while "main: stopped" not in d.log() and time.time() < deadline:
        time.sleep(0.0005)
    assert d.proc.poll() is None, "exited before the second signal: %s" % d.proc.returncode
    d.signal(second)
    assert d.proc.wait(30) == 0, d.log()[-2000:]
