"""A full disk under the local store: the group commit fails, the turn's changes are
answered `unavailable` and undone in memory, reads go on, and writes succeed again once
space returns (persistence.md: acknowledged means stored; nothing half written).

Needs root to mount a small tmpfs for the state directory; skipped otherwise."""
import os
import subprocess
import tempfile

import pytest


@pytest.fixture
def small_fs():
    d = tempfile.mkdtemp(prefix="convod-full-")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", d],
                       capture_output=True, text=True)
    if r.returncode != 0:
        os.rmdir(d)
        pytest.skip("cannot mount a tmpfs here: " + r.stderr.strip())
    yield d
    subprocess.run(["umount", "-l", d])
    os.rmdir(d)


def test_disk_full_answers_unavailable_and_recovers(daemon_factory, small_fs):
    state = os.path.join(small_fs, "state")
    d = daemon_factory(["--state-dir", state])
    c = d.connect()
    c.ok({"op": "add_user", "conversation": "full", "contents": "before"})
    # Fill the file system, leaving the daemon no room for its WAL.
    filler = os.path.join(small_fs, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\1" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    # Big messages need new pages: their commit fails.
    refused = None
    for i in range(50):
        role = "assistant" if i % 2 == 0 else "user"
        r = c.request({"id": i, "op": "add_message", "conversation": "full", "role": role,
                       "contents": "x%d " % i + "y" * 20000})
        if not r["ok"]:
            refused = r
            break
    assert refused is not None, "a full disk must refuse some change"
    assert refused["error"]["code"] == "unavailable", refused
    assert refused["id"] == i, "the refused answer keeps the request's id"
    # Nothing half written: the refused text is nowhere, in memory or after a reload.
    log = c.ok({"op": "to_messages_map", "conversation": "full", "incremental": False})
    texts = [t for m in log["messages"] for t in m["message"]["contents"]]
    assert not any(t.startswith("x%d " % i) for t in texts), texts[:3]
    assert c.ok({"op": "ping"})["pong"] is True  # reads go on
    # Space returns: the same change now succeeds.
    os.unlink(filler)
    r = c.ok({"id": "again", "op": "add_message", "conversation": "full", "role": role,
              "contents": "after"})
    assert "after" in r["message"]["message"]["contents"]
    # And it is durable: a restart has it.
    assert d.stop() == 0, d.log()
    d.start()
    c = d.connect()
    log = c.ok({"op": "to_messages_map", "conversation": "full", "incremental": False})
    texts = [t for m in log["messages"] for t in m["message"]["contents"]]
    assert "before" in texts and "after" in texts
    assert not any(t.startswith("x%d " % i) for t in texts)
