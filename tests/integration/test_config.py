"""The config file (convod.conf(5)): --check-config on good, bad and missing files, flags
over the file, SIGHUP reloads (a limit taking effect on the next request, settings that
need a restart, a broken file), the journal log format and the rate limit on repeated log
lines."""
import os
import re
import signal
import socket
import subprocess
import tempfile
import time

import pytest

import ddb
from conftest import CONVOD, ROOT, VALGRIND, Conn, Daemon, scaled

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEYsecret"
TOKEN = "FwoGZXIvYXdzEXAMPLESESSIONTOKENvalue"
KEY_ID = "AKIAIOSFODNN7EXAMPLEWXYZ"

# Every setting of the command line is a key of the file.
ALL_KEYS = ["socket", "state-dir", "max-line-bytes", "max-output-bytes", "max-connections",
            "max-conversations", "max-messages", "max-conversation-bytes",
            "max-conversation-id-bytes", "allow-uids", "allow-gids", "log-level", "log-format",
            "durability", "memory-only", "dynamodb-table", "create-table", "flush-interval",
            "idle-ms", "batch-items", "retry-base-ms", "retry-max-ms", "spool-max-items",
            "expires-days", "closed-retention-days", "drain-ms", "connect-timeout-ms",
            "request-timeout-ms", "ignore-crc32"]


def no_sanitizer_report(text):
    assert "Sanitizer" not in text and "runtime error:" not in text, text


def write(path, text):
    """Replaces the file at once, as an editor saving it would."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def run_convod(args, env=None, timeout=20):
    full_env = dict(os.environ)
    for k in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_DYNAMODB",
              "AWS_PROFILE"):
        full_env.pop(k, None)
    full_env.update(env or {})
    p = subprocess.run([CONVOD] + args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, env=full_env, timeout=timeout)
    out, err = p.stdout.decode(errors="replace"), p.stderr.decode(errors="replace")
    no_sanitizer_report(out + err)
    return p.returncode, out, err


def parse_report(out):
    """--check-config's lines into {key: (value, source)}."""
    settings = {}
    for line in out.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-z0-9-]+) = (.*?)\s+# (default|file \(line \d+\)|flag)$", line)
        assert m, "unexpected line %r" % line
        assert m.group(1) not in settings, "printed twice: %s" % m.group(1)
        settings[m.group(1)] = (m.group(2), m.group(3))
    return settings


def wait_log(d, pattern, timeout=10.0, count=1):
    """Waits until the daemon's log matches pattern (a regex) count times; returns the log.
    The wait is longer under valgrind (a daemon's start there can take seconds)."""
    deadline = time.time() + scaled(timeout)
    while True:
        log = d.log()
        if len(re.findall(pattern, log)) >= count:
            return log
        if time.time() > deadline:
            raise AssertionError("log never matched %r %d times:\n%s" % (pattern, count, log[-4000:]))
        time.sleep(0.02)


def fill(c, conv, n):
    """Adds n alternating user/assistant messages (no merges, no fake message)."""
    for i in range(n):
        c.ok({"op": "add_user" if i % 2 == 0 else "add_assistant", "conversation": conv,
              "contents": "m%d" % i})


def next_role(i):
    return "add_user" if i % 2 == 0 else "add_assistant"


@pytest.fixture
def tmpdir_path():
    d = tempfile.mkdtemp(prefix="convod-config-")
    yield d
    subprocess.run(["rm", "-rf", d])


# --- --check-config ----------------------------------------------------------------------


def test_check_config_good_file(tmpdir_path):
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "# a config\n"
                "max-line-bytes = 2048\n"
                "max-messages = 12   # trailing comment\n"
                "allow-uids = 0, 4242\n"
                "log-format = journal\n"
                "memory-only = true\n"
                "socket = %s/s.sock\n" % tmpdir_path)
    env = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_SESSION_TOKEN": TOKEN}
    rc, out, err = run_convod(["--check-config", "--max-connections", "3", "--config", conf,
                               "--max-messages", "13"], env=env)
    assert rc == 0, err
    s = parse_report(out)
    assert sorted(s) == sorted(ALL_KEYS)
    assert s["max-line-bytes"] == ("2048", "file (line 2)")
    assert s["max-messages"] == ("13", "flag")          # the flag wins, whatever the order
    assert s["max-connections"] == ("3", "flag")
    assert s["allow-uids"] == ("0,4242", "file (line 4)")
    assert s["log-format"] == ("journal", "file (line 5)")
    assert s["memory-only"] == ("true", "file (line 6)")
    assert s["socket"][0] == "%s/s.sock" % tmpdir_path
    assert s["max-output-bytes"] == ("8388608", "default")
    assert s["durability"] == ("process", "default")
    assert s["allow-gids"] == ("", "default")
    # Secrets: never printed; the key id by its last 4 characters only.
    for text in (out, err):
        assert SECRET not in text and TOKEN not in text and KEY_ID not in text
    assert "****WXYZ" in out
    assert re.search(r"secret-access-key = \(set\)", out)
    assert re.search(r"session-token = \(set\)", out)
    # It only checked: nothing was created.
    assert not os.path.exists(os.path.join(tmpdir_path, "s.sock"))


def test_check_config_report_is_a_valid_file(tmpdir_path):
    """What --check-config prints reads back as a config file with the same settings."""
    conf = os.path.join(tmpdir_path, "a.conf")
    write(conf, "max-messages = 7\nsocket = \"%s/with #hash.sock\"\n" % tmpdir_path)
    rc, out, err = run_convod(["--check-config", "--config", conf, "--drain-ms", "9"])
    assert rc == 0, err
    again = os.path.join(tmpdir_path, "b.conf")
    write(again, out)
    rc, out2, err = run_convod(["--check-config", "--config", again])
    assert rc == 0, err
    first = {k: v for k, (v, _) in parse_report(out).items()}
    second = {k: v for k, (v, _) in parse_report(out2).items()}
    assert first == second
    assert first["socket"] == '"%s/with #hash.sock"' % tmpdir_path
    assert first["drain-ms"] == "9"


def test_check_config_no_file_defaults_and_flags():
    rc, out, err = run_convod(["--check-config", "--log-level", "debug"],
                              env={"AWS_SECRET_ACCESS_KEY": SECRET, "AWS_ACCESS_KEY_ID": KEY_ID})
    assert rc == 0, err
    s = parse_report(out)
    assert s["log-level"] == ("debug", "flag")
    assert s["socket"] == ("/run/convod/convod.sock", "default")
    assert all(src in ("default", "flag") for _, src in s.values())
    assert SECRET not in out + err


@pytest.mark.parametrize("text,line,key,what", [
    ("max-line-bytes = 2048\nno-such-key = 1\n", 2, "no-such-key", "unknown key"),
    ("# comment\n\nmax-messages = lots\n", 3, "max-messages", "lots"),
    ("max-messages = 5\nmax-connections = 2\nmax-messages = 6\n", 3, "max-messages", "duplicate"),
    ("memory-only = yes\n", 1, "memory-only", "true or false"),
    ("log-format = xml\n", 1, "log-format", "xml"),
    ("allow-uids = 0,,1\n", 1, "allow-uids", "empty entry"),
    ("allow-uids = no-such-user-xyzzy\n", 1, "allow-uids", "unknown user"),
    ("batch-items = 26\n", 1, "batch-items", "25"),
    ("retry-base-ms = 500\nretry-max-ms = 100\n", 2, "retry-max-ms", "at least"),
])
def test_check_config_bad_file(tmpdir_path, text, line, key, what):
    conf = os.path.join(tmpdir_path, "bad.conf")
    write(conf, text)
    rc, out, err = run_convod(["--check-config", "--config", conf])
    assert rc == 2, (out, err)
    assert "%s:%d: %s" % (conf, line, key) in err, err
    assert what in err, err
    assert out.strip() == "", "settings printed for a bad file: %r" % out


def test_check_config_missing_file(tmpdir_path):
    conf = os.path.join(tmpdir_path, "nope.conf")
    rc, out, err = run_convod(["--check-config", "--config", conf])
    assert rc == 2
    assert conf in err and "No such file" in err, err
    assert out.strip() == ""


def test_bad_file_stops_the_start_with_exit_2(tmpdir_path):
    conf = os.path.join(tmpdir_path, "bad.conf")
    write(conf, "max-messages = 0\n")
    sock = os.path.join(tmpdir_path, "s.sock")
    rc, out, err = run_convod(["--config", conf, "--socket", sock, "--state-dir",
                               os.path.join(tmpdir_path, "state")])
    assert rc == 2
    assert "%s:1: max-messages" % conf in err, err
    assert not os.path.exists(sock)
    rc, out, err = run_convod(["--config", os.path.join(tmpdir_path, "missing.conf"), "--socket", sock])
    assert rc == 2 and "missing.conf" in err


NO_AWS_FILES = {"AWS_CONFIG_FILE": "/nonexistent/convod-test-config",
                "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/convod-test-credentials"}


@pytest.mark.parametrize("args,named", [
    (["--dynamodb-table", "my-table"], "dynamodb-table"),
    (["--create-table"], "create-table"),
    ([], None),
])
def test_table_asked_for_without_a_region_warns(daemon_factory, tmpdir_path, args, named):
    """DynamoDB is on only where a region or an endpoint is configured. A table named (by
    flag or file) or --create-table without one is most likely a region missing from the
    host's environment: the daemon starts on the local store as the spec says, but warns,
    since nothing would ever reach the table. The plain default stays an info line."""
    if any(os.environ.get(k) for k in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
                                       "AWS_ENDPOINT_URL_DYNAMODB")):
        pytest.skip("this environment configures an AWS region or endpoint")
    d = daemon_factory(list(args), env=NO_AWS_FILES)
    assert d.connect().ok({"op": "ping"})["pong"] is True
    log = d.log()
    if named:
        assert re.search(r"warn sink: %s is set but no AWS region or DynamoDB endpoint is"
                         % named, log), log
        assert "the local store is the sink" in log
    else:
        assert "is set but no AWS region" not in log, log
        assert "no DynamoDB configured: the local store is the sink" in log, log
    # From the file too.
    if named == "dynamodb-table":
        conf = os.path.join(tmpdir_path, "convod.conf")
        write(conf, "dynamodb-table = from-file\n")
        d2 = daemon_factory(["--config", conf], env=NO_AWS_FILES)
        assert "dynamodb-table is set but no AWS region" in d2.log(), d2.log()


def test_memory_only_says_dynamodb_is_off(daemon_factory, dynalite):
    """--memory-only has no store for a spool, so DynamoDB is off too, even with an
    endpoint configured: a table asked for with it is a warning, and nothing reaches it."""
    env = {"AWS_ENDPOINT_URL_DYNAMODB": dynalite, "AWS_REGION": "us-east-1",
           "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", **NO_AWS_FILES}
    table = "convod-mo-%d" % os.getpid()
    d = daemon_factory(["--memory-only", "--dynamodb-table", table, "--create-table"], env=env)
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "mo", "contents": "hi"})
    assert c.ok({"op": "flush"}) == {"flushed": 1}
    assert c.ok({"op": "stats"})["sink"]["kind"] == "none"
    log = d.log()
    assert "warn sink: memory-only is set: dynamodb-table and create-table are ignored" in log
    assert table not in ddb.list_tables(dynalite)
    # Without a table asked for, only the memory-only warning.
    d2 = daemon_factory(["--memory-only"], env=env)
    d2.connect().ok({"op": "ping"})
    assert "memory only: nothing survives a restart" in d2.log()
    assert "are ignored" not in d2.log()


def test_bad_flag_value_names_the_flag():
    rc, out, err = run_convod(["--check-config", "--allow-uid", "no-such-user-xyzzy"])
    assert rc == 2
    assert "--allow-uid" in err and "no-such-user-xyzzy" in err, err


def test_example_config_lists_every_setting_with_its_default(tmpdir_path):
    """systemd/convod.conf.example: every key once, commented out, with the real default."""
    with open(os.path.join(ROOT, "systemd", "convod.conf.example")) as f:
        example = f.read()
    settings = re.findall(r"^#([a-z0-9-]+ =.*)$", example, re.M)
    assert sorted(l.split(" =")[0] for l in settings) == sorted(ALL_KEYS)
    conf = os.path.join(tmpdir_path, "uncommented.conf")
    write(conf, "\n".join(settings) + "\n")
    rc, out, err = run_convod(["--check-config", "--config", conf])
    assert rc == 0, err
    from_file = parse_report(out)
    assert all(src.startswith("file") for _, src in from_file.values()), out
    rc, out, err = run_convod(["--check-config"])
    assert rc == 0, err
    defaults = parse_report(out)
    assert {k: v for k, (v, _) in from_file.items()} == {k: v for k, (v, _) in defaults.items()}


def test_docs_name_every_key():
    with open(os.path.join(ROOT, "daemon", "convod.conf.5")) as f:
        man5 = f.read()
    rc, help_text, err = run_convod(["--help"])
    assert rc == 0
    for key in ALL_KEYS:
        assert ".BI %s " % key.replace("-", "\\-") in man5, key
        flag = {"allow-uids": "allow-uid", "allow-gids": "allow-gid"}.get(key, key)
        assert "--" + flag in help_text, key
    for flag in ("--config FILE", "--check-config", "--log-format"):
        assert flag in help_text


# --- a running daemon ---------------------------------------------------------------------


def test_flags_override_the_file(daemon_factory, tmpdir_path):
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "max-messages = 3\nmax-conversation-id-bytes = 4\n")
    d = daemon_factory(["--max-messages", "5", "--config", conf])
    c = d.connect()
    fill(c, "abcd", 5)  # the flag's 5, not the file's 3
    c.err({"op": next_role(5), "conversation": "abcd", "contents": "x"}, "too_large")
    c.err({"op": "add_user", "conversation": "abcde", "contents": "x"}, "too_large")  # the file's 4


def test_sighup_limit_takes_effect_on_the_next_request(daemon_factory, tmpdir_path):
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "max-messages = 10\n")
    d = daemon_factory(["--config", conf])
    c = d.connect()
    fill(c, "before", 5)          # 5 messages: fine under 10
    fill(c, "after", 4)
    write(conf, "max-messages = 4\n")
    d.signal(signal.SIGHUP)
    log = wait_log(d, r"config: max-messages 10 -> 4")
    assert "reloaded: 1 setting changed" in wait_log(d, r"reloaded: ")
    # The connection opened before the reload sees the new limit on its next request.
    c.err({"op": next_role(4), "conversation": "after", "contents": "fifth"}, "too_large")
    c.err({"op": "add_assistant", "conversation": "before", "contents": "sixth"}, "too_large")
    # Merging adds no message: still fine.
    c.ok({"op": "add_assistant", "conversation": "after", "contents": "merged"})
    # And back up again.
    write(conf, "max-messages = 6\n")
    d.signal(signal.SIGHUP)
    wait_log(d, r"config: max-messages 4 -> 6")
    c.ok({"op": "add_user", "conversation": "after", "contents": "fifth"})
    assert "needs a restart" not in log


def test_sighup_reload_reapplies_the_flags(daemon_factory, tmpdir_path):
    """A flag keeps overriding the file after a reload; a setting removed from the file goes
    back to its default."""
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "max-messages = 3\nmax-conversation-id-bytes = 4\n")
    d = daemon_factory(["--config", conf, "--max-messages", "4"])
    c = d.connect()
    write(conf, "max-messages = 2\n")
    d.signal(signal.SIGHUP)
    log = wait_log(d, r"config: max-conversation-id-bytes 4 -> 256")
    assert "max-messages" not in log.split("SIGHUP")[1]
    fill(c, "a-long-conversation-id", 4)
    c.err({"op": next_role(4), "conversation": "a-long-conversation-id", "contents": "x"},
          "too_large")


class FileDaemon(Daemon):
    """A daemon whose socket and state directory come from its config file only."""

    def start(self, wait=True):
        env = dict(os.environ)
        if self.env:
            env.update(self.env)
        self.stderr = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen([CONVOD] + self.args, stdin=subprocess.DEVNULL,
                                     stdout=self.stderr, stderr=self.stderr, env=env)
        if wait:
            self.wait_ready()
        return self


@pytest.fixture
def file_daemon():
    made = []

    def make(conf_text_fn, args=()):
        d = FileDaemon()
        conf = os.path.join(d.dir, "convod.conf")
        write(conf, conf_text_fn(d))
        d.args = ["--config", conf] + list(args)
        d.conf = conf
        made.append(d)
        return d.start()

    yield make
    for d in made:
        running = d.proc is not None and d.proc.poll() is None
        rc = d.stop()
        log = d.log()
        d.cleanup()
        assert not running or rc == 0, log
        no_sanitizer_report(log)


def test_sighup_socket_change_needs_a_restart(file_daemon):
    d = file_daemon(lambda d: "socket = %s\nstate-dir = %s\nmax-messages = 9\n"
                    % (d.socket, d.state_dir))
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "x", "contents": "hi"})
    new_sock = os.path.join(d.dir, "other.sock")
    write(d.conf, "socket = %s\nstate-dir = %s/elsewhere\nmax-messages = 8\n"
          % (new_sock, d.state_dir))
    d.signal(signal.SIGHUP)
    log = wait_log(d, r"reloaded: ")
    assert re.search(r"socket changed to %s; needs a restart; keeping %s"
                     % (re.escape(new_sock), re.escape(d.socket)), log), log
    assert re.search(r"state-dir changed to .*elsewhere; needs a restart; keeping", log), log
    assert "config: max-messages 9 -> 8" in log
    # Still serving where it was; nothing at the new path.
    assert not os.path.exists(new_sock)
    c.ok({"op": "ping"})
    c2 = d.connect()
    assert len(c2.ok({"op": "get_messages", "conversation": "x"})["messages"]) == 1


def test_sighup_broken_file_keeps_the_running_settings(daemon_factory, tmpdir_path):
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "max-messages = 3\n")
    d = daemon_factory(["--config", conf])
    c = d.connect()
    write(conf, "max-messages = 50\nmax-connections = many\n")
    d.signal(signal.SIGHUP)
    log = wait_log(d, r"keeping the running settings")
    assert re.search(r"error config: .*%s:2: max-connections: .*'many'; keeping the running settings"
                     % re.escape(conf), log), log
    # Nothing of the broken file was applied, not even its good line.
    fill(c, "k", 3)
    c.err({"op": next_role(3), "conversation": "k", "contents": "x"}, "too_large")
    d.connect().ok({"op": "ping"})
    # A missing file too.
    os.unlink(conf)
    d.signal(signal.SIGHUP)
    wait_log(d, r"cannot open: No such file or directory; keeping the running settings")
    c.err({"op": next_role(3), "conversation": "k", "contents": "x"}, "too_large")
    # Fixed: applied.
    write(conf, "max-messages = 4\n")
    d.signal(signal.SIGHUP)
    wait_log(d, r"config: max-messages 3 -> 4")
    c.ok({"op": next_role(3), "conversation": "k", "contents": "x"})


def test_sighup_log_level(daemon_factory, tmpdir_path):
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "log-level = info\n")
    d = daemon_factory(["--config", conf])
    write(conf, "log-level = warn\n")
    d.signal(signal.SIGHUP)
    wait_log(d, r"SIGHUP: reloading")
    d.connect().ok({"op": "ping"})
    # The change of level is applied before its own report, which is info: not shown.
    write(conf, "log-level = warn\ndurability = machine\n")
    d.signal(signal.SIGHUP)
    log = wait_log(d, r"needs a restart")
    assert log.count("SIGHUP: reloading") == 1, log  # the second one was info: dropped


# --- log format and rate limit ---------------------------------------------------------


def test_journal_log_format(daemon_factory):
    d = daemon_factory(["--log-format", "journal"])
    d.connect().ok({"op": "ping"})
    log = wait_log(d, r"ready")
    lines = [l for l in log.splitlines() if l]
    assert lines, log
    for l in lines:
        assert re.match(r"^<[3467]>(error|warn|info|debug) [a-z]+: ", l), l
    assert any(l.startswith("<6>info main: ") for l in lines), log


def test_auto_log_format_under_systemd(daemon_factory):
    d = daemon_factory(["--log-format", "auto"], env={"INVOCATION_ID": "0123456789abcdef0123456789abcdef"})
    assert re.search(r"^<6>info main: .*ready", wait_log(d, r"ready"), re.M)
    d2 = daemon_factory(["--log-format", "plain"], env={"INVOCATION_ID": "0123456789abcdef0123456789abcdef"})
    log2 = wait_log(d2, r"ready")
    assert re.search(r"^info main: .*ready", log2, re.M) and "<6>" not in log2


def test_rate_limit_suppresses_a_flood(daemon_factory):
    """25 SIGHUPs and 25 refused peers within 10 s: 10 log lines each, then, at the next one
    after the window, one line with the count of the other 15."""
    me = os.getuid()
    # Nobody may connect (the harness's ping too): wait for the log instead.
    d = daemon_factory(["--allow-uid", str(me + 1000)], start=False)
    d.start(wait=False)
    wait_log(d, r"ready")
    start = time.time()
    refused_re = r"warn server: [^\n]*uid %d\b" % me
    for i in range(25):
        d.signal(signal.SIGHUP)
        # A refused connection; the answer also shows the daemon has run since the signal
        # (it was delivered before the daemon got back to its loop), so no two coalesce.
        c = Conn(d.socket)
        r = c.recv()
        assert r["ok"] is False, r
        c.close()
    flood_took = time.time() - start
    assert flood_took < 8, "the flood took too long to test the window: %.1fs" % flood_took
    wait_log(d, r"reloaded: ", count=25)  # every reload did happen (unlimited report)
    wait_log(d, refused_re, count=10)
    time.sleep(0.3)
    log = d.log()
    assert log.count("SIGHUP: reloading") == 10, log
    assert len(re.findall(refused_re, log)) == 10, log
    assert "suppressed" not in log
    # After the window, the next one of each reports what was dropped.
    time.sleep(max(0, start + 10.3 - time.time()))
    d.signal(signal.SIGHUP)
    c = Conn(d.socket)
    c.recv()
    c.close()
    log = wait_log(d, r"reloaded: ", count=26)
    log = wait_log(d, refused_re, count=11)
    assert re.search(r"info config: \(suppressed 15 similar messages\)\ninfo config: SIGHUP: reloading",
                     log), log
    assert re.search(r"warn server: \(suppressed 15 similar messages\)\n" + refused_re, log), log
    assert log.count("SIGHUP: reloading") == 11


def test_optional_config_file_may_be_missing(tmp_path):
    """--config -FILE (systemd's '-' idiom): a missing FILE is no error, a present one is read."""
    import subprocess
    from conftest import CONVOD
    missing = tmp_path / "nope.conf"
    p = subprocess.run([CONVOD, "--config", "-" + str(missing), "--check-config"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "max-messages = 100000" in p.stdout
    present = tmp_path / "c.conf"
    present.write_text("max-messages = 77\n")
    p = subprocess.run([CONVOD, "--config", "-" + str(present), "--check-config"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    assert "max-messages = 77" in p.stdout
    present.write_text("no-such-key = 1\n")
    p = subprocess.run([CONVOD, "--config", "-" + str(present), "--check-config"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "no-such-key" in p.stderr
    # Without the dash a missing file is still an error.
    p = subprocess.run([CONVOD, "--config", str(missing), "--check-config"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 2


def test_optional_file_gone_at_reload_keeps_the_running_settings(daemon_factory, tmpdir_path):
    """--config -FILE (the shipped unit's form) read at start, then renamed away (an editor,
    a configuration tool) before a reload: that is a file that cannot be read, and changes
    nothing. It used to be "no file", and every setting went back to its default, the
    allow-list included, without a warning."""
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "max-messages = 3\nallow-uids = 0, 4242\n")
    d = daemon_factory(["--config", "-" + conf])
    assert "config: settings from %s\n" % conf in d.log(), d.log()
    c = d.connect()
    fill(c, "k", 3)
    c.err({"op": next_role(3), "conversation": "k", "contents": "x"}, "too_large")
    os.rename(conf, conf + ".bak")
    d.signal(signal.SIGHUP)
    log = wait_log(d, r"no such file; keeping the running settings")
    assert "error config: %s: no such file; keeping the running settings" % conf in log, log
    assert "allow-uids" not in log and "max-messages 3" not in log, log
    c.err({"op": next_role(3), "conversation": "k", "contents": "x"}, "too_large")
    # Back, changed: applied, and the reload after that reads it again.
    write(conf, "max-messages = 4\nallow-uids = 0, 4242\n")
    d.signal(signal.SIGHUP)
    wait_log(d, r"config: max-messages 3 -> 4")
    c.ok({"op": next_role(3), "conversation": "k", "contents": "x"})
    # A -FILE absent from the start is no error at a reload either: defaults and flags.
    e = daemon_factory(["--config", "-" + conf + ".none", "--max-messages", "2"])
    assert "%s.none does not exist: defaults and flags only" % conf in e.log(), e.log()
    assert "-/" not in e.log(), e.log()
    e.signal(signal.SIGHUP)
    wait_log(e, r"reloaded: 0 settings changed")
    assert "keeping the running settings" not in e.log(), e.log()


def test_sighup_while_starting_is_a_reload(daemon_factory, tmpdir_path):
    """A SIGHUP sent while the daemon restores its store (systemctl reload, a log rotation
    hook) used to end it: its handler was installed only once it listened. The signal is
    now blocked from the start of main and runs as a reload once the daemon is ready."""
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "max-messages = 10\n")
    d = daemon_factory(["--config", conf])
    c = d.connect()
    n = 30000  # conversations: a restore long enough to signal in
    c.send_raw(b"".join(b'{"op":"add_user","conversation":"c%d","contents":"x"}\n' % i
                        for i in range(n)))
    for _ in range(n):
        assert c.recv()["ok"]
    assert d.stop() == 0
    before = len(d.log())  # the log file goes on from the first start
    d.start(wait=False)
    deadline = time.time() + scaled(20)
    while "settings from" not in d.log()[before:]:  # the file read
        assert time.time() < deadline and d.proc.poll() is None, d.log()
        time.sleep(0.001)
    write(conf, "max-messages = 20\n")
    d.signal(signal.SIGHUP)
    early = d.log()[before:]
    d.wait_ready()
    assert " ready " not in early, "the signal came after the start: %s" % early
    log = wait_log(d, r"config: max-messages 10 -> 20")[before:]
    assert log.index(" ready ") < log.index("SIGHUP: reloading"), log
    c = d.connect()
    fill(c, "fresh", 20)
    c.err({"op": next_role(20), "conversation": "fresh", "contents": "x"}, "too_large")


@pytest.mark.parametrize("flags,want", [
    (["--allow-uid", "0", "--allow-uid", ""], ""),
    (["--allow-uid", "0", "--allow-uid", "", "--allow-uid", "5"], "5"),
    (["--allow-uid", "0", "--allow-uid", "7"], "0,7"),
])
def test_an_empty_list_flag_empties_the_list(tmpdir_path, flags, want):
    """convod.conf(5): repeated --allow-uid/--allow-gid flags add up, "an empty one empties
    the list", wherever it comes (an empty one after another was ignored), over the file
    too."""
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "allow-uids = 3\nallow-gids = 3\n")
    for key in ("uid", "gid"):
        args = [f.replace("uid", key) for f in flags]
        rc, out, err = run_convod(["--config", conf, "--check-config"] + args)
        assert rc == 0, err
        assert parse_report(out)["allow-%ss" % key] == (want, "flag"), out


@pytest.mark.parametrize("flag,value", [
    ("--state-dir", '/srv/a"b'), ("--state-dir", "/srv/a\nb"), ("--socket", "/tmp/x\x01y"),
    ("--dynamodb-table", "tab\x7f"),
])
def test_flags_refuse_what_the_file_refuses(flag, value):
    """The file refuses a control character or an inner double quote in a value; a flag took
    them, and --check-config then printed a line that no file could hold."""
    rc, out, err = run_convod(["--check-config", flag, value])
    assert rc == 2 and "%s: control character or double quote in the value" % flag in err, err


def test_check_config_long_lists_read_back(tmpdir_path):
    """--check-config's setting lines are a valid file: an allow-list of 4096 ids (the most
    it takes) is one line of about 45 kB, over the old 4096-byte line limit."""
    ids = ",".join(str(1000000 + i) for i in range(4096))
    rc, out, err = run_convod(["--check-config", "--allow-uid", ids, "--allow-gid", ids])
    assert rc == 0, err
    conf = os.path.join(tmpdir_path, "report.conf")
    write(conf, "".join(line + "\n" for line in out.splitlines() if not line.startswith("#")))
    rc, out2, err = run_convod(["--config", conf, "--check-config"])
    assert rc == 0, err
    first = {k: v[0] for k, v in parse_report(out).items()}
    again = {k: v[0] for k, v in parse_report(out2).items()}
    assert first == again and len(first["allow-uids"]) == 4096 * 8 - 1


@pytest.mark.parametrize("end", ["\n", "\r\n"])
def test_line_limit_does_not_count_the_cr(tmpdir_path, end):
    """Lines of at most 65536 bytes, LF or CRLF: the CR is not part of the line."""
    conf = os.path.join(tmpdir_path, "convod.conf")
    with open(conf, "w", newline="") as f:
        f.write("#" + "x" * 65535 + end + "max-messages = 9" + end)
    rc, out, err = run_convod(["--config", conf, "--check-config"])
    assert rc == 0, err
    assert parse_report(out)["max-messages"] == ("9", "file (line 2)")
    with open(conf, "w", newline="") as f:
        f.write("#" + "x" * 65536 + end)
    rc, out, err = run_convod(["--config", conf, "--check-config"])
    assert rc == 2 and ":1: line longer than 65536 bytes" in err, err


def test_suppressed_count_written_at_the_stop_reload_report_never_suppressed(daemon_factory,
                                                                             tmpdir_path):
    """15 reloads within 10 s: "SIGHUP: reloading" is written 10 times, the 5 repeats held
    back are counted at the stop (they were lost), and every reload's report of what it
    changed is there, unlimited (a setting change is never dropped from the log)."""
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "max-messages = 1000\n")
    d = daemon_factory(["--config", conf])
    for i in range(15):
        write(conf, "max-messages = %d\n" % (1001 + i))
        d.signal(signal.SIGHUP)
        wait_log(d, r"reloaded: 1 setting changed", count=i + 1)
    assert d.stop() == 0
    log = d.log()
    assert log.count("SIGHUP: reloading") == 10, log
    assert log.count("reloaded: 1 setting changed") == 15, log
    assert "config: max-messages 1014 -> 1015" in log, log
    assert re.search(r"info config: \(suppressed 5 similar messages\)\ninfo main: stopped\n$",
                     log), log[-2000:]


# --- AWS settings the embedded default does not use ----------------------------------------


def aws_free_env(tmp, **extra):
    """No AWS variable from the caller's environment; HOME at tmp (no ~/.aws there)."""
    env = {k: "" for k in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
                           "AWS_ENDPOINT_URL_DYNAMODB", "AWS_PROFILE", "AWS_ACCESS_KEY_ID",
                           "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                           "AWS_SHARED_CREDENTIALS_FILE")}
    env["HOME"] = tmp
    env.update(extra)
    return env


def _aws_home(tmp, config=None, credentials_dir=False):
    os.makedirs(os.path.join(tmp, ".aws"), exist_ok=True)
    if config is not None:
        write(os.path.join(tmp, ".aws", "config"), config)
    if credentials_dir:
        os.makedirs(os.path.join(tmp, ".aws", "credentials"), exist_ok=True)
    return {}


BROKEN_AWS = {
    "missing profile": (lambda t: {"AWS_PROFILE": "work"}, "profile 'work' is in neither"),
    "bad profile name": (lambda t: {"AWS_PROFILE": "a]b"}, "not a profile name"),
    "half a key pair": (lambda t: {"AWS_ACCESS_KEY_ID": "AKIAIOSFODNN7EXAMPLE"},
                        "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"),
    "credentials a directory": (lambda t: _aws_home(t, credentials_dir=True),
                                "credentials: is a directory"),
    "config a FIFO": (lambda t: (_aws_home(t), os.mkfifo(os.path.join(t, ".aws", "config")),
                                 {})[-1], "config: not a regular file"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_AWS))
def test_embedded_default_starts_despite_unusable_aws_settings(daemon_factory, tmpdir_path,
                                                               case):
    """AWS settings that cannot be used (a shell's AWS_PROFILE, a stale ~/.aws) do not keep
    the embedded default from starting: with no table named and no region or endpoint
    anywhere, DynamoDB is not used, so they are a warning, and the local store works. Where
    DynamoDB is wanted (a region in the environment, a table named) they stop the start as
    before, and --check-config gives the same verdicts."""
    make, says = BROKEN_AWS[case]
    env = aws_free_env(tmpdir_path, **make(tmpdir_path))
    d = daemon_factory([], env=env)
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "local", "contents": "kept"})
    assert c.ok({"op": "stats"})["sink"]["kind"] == "local"
    assert re.search(r"warn aws: .*%s.*DynamoDB is not used: the local store is the sink"
                     % re.escape(says), d.log()), d.log()
    rc, out, err = run_convod(["--check-config"], env=env, timeout=scaled(5))
    assert rc == 0 and "DynamoDB is not used" in err, (rc, err)
    # Wanted: the same settings stop the start.
    for extra, args in (({"AWS_REGION": "us-east-1"}, []), ({}, ["--dynamodb-table", "my-table"])):
        d2 = daemon_factory(args, env=dict(env, **extra), start=False)
        d2.start(wait=False)
        assert d2.proc.wait(scaled(20)) == 1, d2.log()
        assert "error aws: " in d2.log() and says in d2.log(), d2.log()
        rc, out, err = run_convod(["--check-config"] + args, env=dict(env, **extra),
                                  timeout=scaled(5))
        assert rc == 2 and says in err, (rc, err)


def test_aws_config_section_header_may_carry_a_comment(tmpdir_path):
    """'[default]  # mine' is a section header to the AWS tools' parser, and here."""
    _aws_home(tmpdir_path, config="[default]  # mine\nregion = eu-west-1 \n"
                                  "[profile b] ; theirs\nregion = us-east-2\n")
    rc, out, err = run_convod(["--check-config"], env=aws_free_env(tmpdir_path), timeout=scaled(5))
    assert rc == 0, err
    assert re.search(r"region = eu-west-1 \(config file\)", out), out
    rc, out, err = run_convod(["--check-config"],
                              env=aws_free_env(tmpdir_path, AWS_PROFILE="b"), timeout=scaled(5))
    assert rc == 0 and re.search(r"region = us-east-2 \(config file\)", out), (out, err)
    _aws_home(tmpdir_path, config="[default] region = x\n")
    rc, out, err = run_convod(["--check-config"], env=aws_free_env(tmpdir_path), timeout=scaled(5))
    assert rc == 0 and "expected '[section]'" in err, (rc, err)  # not wanted: a warning


def test_reload_of_a_config_fifo_keeps_serving(daemon_factory, tmpdir_path):
    """A config file replaced by a FIFO: the reload refuses it (reading it would hold the
    loop until a writer came) and keeps the running settings; requests go on."""
    conf = os.path.join(tmpdir_path, "convod.conf")
    write(conf, "max-messages = 3\n")
    d = daemon_factory(["--config", conf])
    c = d.connect()
    os.unlink(conf)
    os.mkfifo(conf)
    d.signal(signal.SIGHUP)
    wait_log(d, r"not a regular file \(a FIFO or pipe\); a reload reads regular files only; "
                r"keeping the running settings")
    assert c.ok({"op": "ping"})["pong"] is True
    fill(c, "fifo", 3)
    # max-messages = 3 still holds
    c.err({"op": next_role(3), "conversation": "fifo", "contents": "one more"}, "too_large")


@pytest.mark.skipif(os.geteuid() != 0 or VALGRIND,
                    reason="runs the daemon as nobody: needs root, and the binary itself (under "
                    "valgrind it is a wrapper in a directory only root reads)")
def test_memory_only_needs_no_state_dir(tmpdir_path):
    """--memory-only has no store and no lock: a state directory the user cannot create
    does not stop it."""
    os.chmod(tmpdir_path, 0o777)
    sock = os.path.join(tmpdir_path, "s")
    p = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                          CONVOD, "--memory-only", "--socket", sock,
                          "--state-dir", "/root/convod-not-creatable/x"],
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + scaled(15)
        while not os.path.exists(sock) and p.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        assert p.poll() is None, p.stdout.read().decode()
        c = Conn(sock)
        assert c.request({"op": "ping"})["ok"] is True
        c.close()
        assert not os.path.exists("/root/convod-not-creatable")
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(scaled(20)) == 0


def test_reload_keeps_the_endpoint_and_says_so(daemon_factory, tmpdir_path, dynalite,
                                               ddb_table):
    """A SIGHUP rereads the AWS settings for their keys only: an endpoint and region changed
    in the AWS config file are logged as needing a restart, the log never claims the new
    ones, and writes still go to the running endpoint."""
    from test_persistence import ddb_env, wait_drained
    aws = os.path.join(tmpdir_path, "aws-config")
    write(aws, "[default]\nregion = us-east-1\nendpoint_url = %s\n" % dynalite)
    env = dict(ddb_env(dynalite), AWS_CONFIG_FILE=aws, AWS_REGION="",
               AWS_ENDPOINT_URL_DYNAMODB="")
    d = daemon_factory(["--dynamodb-table", ddb_table, "--flush-interval", "50"], env=env)
    c = d.connect()
    write(aws, "[default]\nregion = eu-west-1\nendpoint_url = http://127.0.0.1:9\n")
    d.signal(signal.SIGHUP)
    log = wait_log(d, r"AWS credentials reread")
    assert re.search(r"warn sink: the AWS settings now give endpoint http://127\.0\.0\.1:9, "
                     r"region eu-west-1; that needs a restart: keeping %s, region us-east-1"
                     % re.escape(dynalite), log), log
    assert "reread: dynamodb: endpoint http://127.0.0.1:9" not in log
    c.ok({"op": "add_user", "conversation": "kept-endpoint", "contents": "hi"})
    c.ok({"op": "flush", "conversation": "kept-endpoint"})
    st = wait_drained(c)
    assert st["sink"]["confirmed"] >= 1 and st["sink"]["failures"] == 0, st["sink"]
    # The same endpoint again: the usual line, no warning.
    write(aws, "[default]\nregion = us-east-1\nendpoint_url = %s\n" % dynalite)
    d.signal(signal.SIGHUP)
    log = wait_log(d, r"AWS credentials reread", count=2)
    assert log.count("that needs a restart") == 1, log
    assert re.search(r"AWS credentials reread: dynamodb: endpoint %s" % re.escape(dynalite),
                     log), log


def test_reload_with_a_bad_file_still_rereads_the_credentials(daemon_factory, tmpdir_path,
                                                              dynalite, ddb_table):
    """A SIGHUP whose config file does not parse changes no setting, but the AWS keys, which
    live in their own file, are reread all the same (README, convod.8): a rotated key does
    not wait for a fix of convod's file. Writes go on with the new key."""
    from test_persistence import ddb_env, wait_drained
    conf = os.path.join(tmpdir_path, "convod.conf")
    creds = os.path.join(tmpdir_path, "credentials")
    write(conf, "max-messages = 10\n")
    write(creds, "[default]\naws_access_key_id = AKIAOLDKEY00000A1111\n"
                 "aws_secret_access_key = old-secret\n")
    env = dict(ddb_env(dynalite), AWS_ACCESS_KEY_ID="", AWS_SECRET_ACCESS_KEY="",
               AWS_SHARED_CREDENTIALS_FILE=creds)
    d = daemon_factory(["--config", conf, "--dynamodb-table", ddb_table,
                        "--flush-interval", "50"], env=env)
    c = d.connect()
    write(conf, "max-messages = banana\n")
    write(creds, "[default]\naws_access_key_id = AKIANEWKEY00000A2222\n"
                 "aws_secret_access_key = new-secret\n")
    d.signal(signal.SIGHUP)
    log = wait_log(d, r"AWS credentials reread")
    after = log.split("SIGHUP: reloading")[1]
    assert "keeping the running settings" in after, after
    assert "access key ****2222" in after, after
    # The running settings are kept: still 10 messages allowed, not the default.
    fill(c, "rotated", 10)
    c.err({"op": next_role(10), "conversation": "rotated", "contents": "x"}, "too_large")
    c.ok({"op": "flush", "conversation": "rotated"})
    st = wait_drained(c)
    assert st["sink"]["confirmed"] >= 10 and st["sink"]["failures"] == 0, st["sink"]
