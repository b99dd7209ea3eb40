"""Every op of protocol.md end to end against the real convod: the worked example of
semantics.md over the socket, merges, fake messages, summaries, versions, renderings,
metadata, incremental maps, flush/close, list, stats and ping."""
import json
import os
import re
import time

from conftest import ROOT, scaled

ULID_RE = re.compile(r"^[0-7][0-9A-HJKMNP-TV-Z]{25}$")
CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
TIMING_KEYS = {"creation", "playStart", "playEnd", "listenStart", "listenEnd", "llmStart", "llmEnd"}
# Clock slack between this process and the daemon (same machine, same clock).
SLACK_MS = 2000


def project_version():
    with open(os.path.join(ROOT, "meson.build")) as f:
        m = re.search(r"version\s*:\s*'([^']+)'", f.read())
    assert m, "no version in meson.build"
    return m.group(1)


def now_ms():
    return int(time.time() * 1000)


def ulid_ms(ulid):
    n = 0
    for ch in ulid[:10]:
        n = n * 32 + CROCKFORD.index(ch)
    return n


def add(c, op, cid, contents, **kw):
    req = {"op": op, "conversation": cid, "contents": contents}
    req.update(kw)
    return c.ok(req)


def full_log(c, cid):
    return c.ok({"op": "to_messages_map", "conversation": cid, "incremental": False})["messages"]


def tmap(c, cid, **kw):
    req = {"op": "to_messages_map", "conversation": cid}
    req.update(kw)
    return c.ok(req)["messages"]


def summary_info(c, cid, **kw):
    req = {"op": "get_summary_info", "conversation": cid}
    req.update(kw)
    return c.ok(req)


def roles(log):
    return [m["message"]["role"] for m in log]


def ids(log):
    return [m["id"] for m in log]


def check_map(m):
    """The shape of a message map (semantics.md, "Mapping the log")."""
    assert set(m) == {"id", "message", "metadata"}, m
    assert ULID_RE.match(m["id"]), m
    assert set(m["message"]) == {"role", "contents"}, m
    assert m["message"]["role"] in ("user", "assistant", "summary"), m
    cs = m["message"]["contents"]
    assert isinstance(cs, list) and cs and all(isinstance(s, str) for s in cs), m
    md = m["metadata"]
    assert set(md) <= {"attribute", "summaryIds", "timing", "aux"}, m
    assert isinstance(md["timing"]["creation"], int), m
    for k, v in md["timing"].items():
        assert k in TIMING_KEYS and isinstance(v, int) and not isinstance(v, bool) and v >= 0, m
    if "attribute" in md:
        assert md["attribute"] and set(md["attribute"]) <= {"fake", "merged"}, m
    if "aux" in md:
        assert isinstance(md["aux"], dict) and md["aux"], m
    assert ("summaryIds" in md) == (m["message"]["role"] == "summary"), m
    if "summaryIds" in md:
        assert md["summaryIds"] and all(ULID_RE.match(i) for i in md["summaryIds"]), m


def parse_describe(text):
    """Rows of describe: [{index, marks, role, id, line}], and the index of its last line."""
    lines = text.split("\n")
    assert lines[0].startswith("META MESSAGES ("), text
    assert text.endswith("\n"), text
    rows, tail = [], None
    for line in lines[1:]:
        if line == "":
            continue
        m = re.match(r"^\.\s+-\s+->\s+index (\d+)\.$", line)
        if m:
            assert tail is None, text
            tail = int(m.group(1))
            continue
        assert tail is None, "row after the last line: " + text
        b = line.index("[")
        head = line[:b]
        idx = int(head.split()[0])
        marks = set(head[len(str(idx)):]) - {" "}
        assert marks <= {"*", "-", "^"}, line
        role = line[b + 1:line.index("]")]
        mid = re.search(r" -- '([0-9A-Z]{26})'", line)
        assert mid, line
        rows.append({"index": idx, "marks": marks, "role": role, "id": mid.group(1), "line": line})
    assert tail is not None, text
    for r in rows[:-1]:
        assert r["line"].endswith(","), r["line"]
    if rows:
        assert rows[-1]["line"].endswith("."), rows[-1]["line"]
    return rows, tail


def describe(c, cid):
    return parse_describe(c.ok({"op": "describe", "conversation": cid})["text"])


def stats(c):
    return c.ok({"op": "stats"})


def test_ping(conn):
    r = conn.request({"id": 1, "op": "ping"})
    assert r == {"id": 1, "ok": True, "result": {"pong": True, "version": project_version(), "protocol": 1}}


def test_worked_example(conn):
    c, cid = conn, "example"
    t0 = now_ms()

    r = add(c, "add_assistant", cid, "Hello!")
    assert r["merged"] is False
    check_map(r["message"])
    assert r["message"]["message"] == {"role": "assistant", "contents": ["Hello!"]}
    log = full_log(c, cid)
    assert roles(log) == ["user", "assistant"]
    assert log[0]["message"]["contents"] == ["..."]
    assert log[0]["metadata"]["attribute"] == ["fake"]
    assert set(log[0]["metadata"]) == {"attribute", "timing"}
    assert set(log[0]["metadata"]["timing"]) == {"creation"}
    assert log[1] == r["message"]
    assert set(log[1]["metadata"]) == {"timing"}

    r = add(c, "add_user", cid, "Hi, there")
    assert r["merged"] is False
    r2 = add(c, "add_user", cid, "how are you")
    assert r2["merged"] is True
    assert r2["message"]["id"] == r["message"]["id"]
    assert r2["message"]["message"]["contents"] == ["Hi, there", "how are you"]
    assert r2["message"]["metadata"]["attribute"] == ["merged"]
    assert r2["message"]["metadata"]["timing"] == r["message"]["metadata"]["timing"]

    r = add(c, "add_assistant", cid, ["I am fine,", "and you?"])
    assert r["merged"] is False
    r = c.ok({"op": "add_message", "conversation": cid, "role": "user",
          "contents": ["Good, ", "thank you!"]})
    assert r["merged"] is False
    assert r["message"]["message"] == {"role": "user", "contents": ["Good, ", "thank you!"]}

    log = full_log(c, cid)
    assert roles(log) == ["user", "assistant", "user", "assistant", "user"]
    before = ids(log)

    info = summary_info(c, cid)
    assert [m["index"] for m in info["messages"]] == [1, 2, 3]
    assert info["messages"][1] == {"id": before[2], "role": "user",
                       "contents": ["Hi, there", "how are you"], "index": 2, "version": 2}
    assert info["messages"][0] == {"id": before[1], "role": "assistant", "contents": ["Hello!"],
                       "index": 1, "version": 1}
    assert info["ids"] == before[1:4]
    assert info["versions"] == [1, 2, 1]
    assert info["previous_summary"] is None
    assert info["text"] == ("[Assistant]: Hello!\n[User]: Hi, there. how are you.\n"
                "[Assistant]: I am fine,. and you?")

    s = c.ok({"op": "add_summary", "conversation": cid, "contents": "...", "ids": info["ids"],
          "versions": info["versions"]})["message"]
    check_map(s)
    assert s["message"] == {"role": "summary", "contents": ["..."]}
    assert s["metadata"]["summaryIds"] == before[1:4]
    assert "attribute" not in s["metadata"]

    log = full_log(c, cid)
    assert roles(log) == ["user", "assistant", "user", "assistant", "summary", "user"]
    assert log[4] == s
    assert ids(log)[5] == before[4]
    gm = c.ok({"op": "get_messages", "conversation": cid})
    assert gm == {"messages": [log[5]], "summary": ["..."]}

    r = add(c, "add_assistant", cid, "How can I help you?")
    assert r["merged"] is False
    id6 = r["message"]["id"]
    got = tmap(c, cid, incremental=True, exclude_last=True)
    assert ids(got) == ids(log)[:6]
    for m in got:
        check_map(m)
    rows, tail = describe(c, cid)
    assert [x["index"] for x in rows] == list(range(7))
    assert [x["marks"] for x in rows] == [set(), set(), set(), set(), {"^"}, {"*"}, {"-"}]
    assert tail == 6

    r = add(c, "add_assistant", cid, "Are you still there?")
    assert r["merged"] is True
    assert r["message"]["id"] == id6
    r = add(c, "add_user", cid, "Yes, but I do not need help!")
    assert r["merged"] is False
    id7 = r["message"]["id"]
    play = now_ms()
    sm = c.ok({"op": "set_metadata", "conversation": cid, "message_id": id7,
           "aux": {"stopped": True}, "timing": {"playStart": play}})["message"]
    check_map(sm)
    assert sm["id"] == id7
    assert sm["metadata"]["aux"] == {"stopped": True}
    assert sm["metadata"]["timing"]["playStart"] == play
    assert sm["metadata"]["timing"]["creation"] == r["message"]["metadata"]["timing"]["creation"]

    got = tmap(c, cid, incremental=True, exclude_last=False)
    assert ids(got) == [id6, id7]
    assert got[0]["message"]["contents"] == ["How can I help you?", "Are you still there?"]
    assert got[1] == sm

    assert c.ok({"op": "get_last_summary", "conversation": cid}) == {"message": s}

    # The final log of semantics.md.
    log = full_log(c, cid)
    t1 = now_ms()
    for m in log:
        check_map(m)
    assert [(m["message"]["role"], m["message"]["contents"]) for m in log] == [
        ("user", ["..."]),
        ("assistant", ["Hello!"]),
        ("user", ["Hi, there", "how are you"]),
        ("assistant", ["I am fine,", "and you?"]),
        ("summary", ["..."]),
        ("user", ["Good, ", "thank you!"]),
        ("assistant", ["How can I help you?", "Are you still there?"]),
        ("user", ["Yes, but I do not need help!"]),
    ]
    assert [m["metadata"].get("attribute") for m in log] == [
        ["fake"], None, ["merged"], None, None, None, ["merged"], None]
    assert [m["metadata"].get("aux") for m in log] == [None] * 7 + [{"stopped": True}]
    assert log[4]["metadata"]["summaryIds"] == [log[1]["id"], log[2]["id"], log[3]["id"]]
    assert [set(m["metadata"]["timing"]) for m in log] == [{"creation"}] * 7 + [{"creation", "playStart"}]
    # ULIDs: unique, increasing in creation order; the summary was created after 5, before 6.
    lid = ids(log)
    assert len(set(lid)) == 8
    plain = [lid[i] for i in (0, 1, 2, 3, 5, 6, 7)]
    assert plain == sorted(plain)
    assert lid[5] < lid[4] < lid[6]
    for m in log:
        cr = m["metadata"]["timing"]["creation"]
        assert t0 - SLACK_MS <= cr <= t1 + SLACK_MS, m
        assert abs(ulid_ms(m["id"]) - cr) <= SLACK_MS, m

    rows, tail = describe(c, cid)
    assert [x["index"] for x in rows] == list(range(8))
    assert [x["id"] for x in rows] == lid
    assert [x["role"] for x in rows] == roles(log)
    assert [x["marks"] for x in rows] == [set(), set(), set(), set(), {"^"}, {"*"}, set(), set()]
    assert tail == 8
    assert "attribute=[fake]" in rows[0]["line"]
    assert "{'...'}" in rows[0]["line"]
    assert "{'Hi, there' 'how are you'}" in rows[2]["line"]
    assert "attribute=[merged]" in rows[2]["line"]
    assert "summaryIds=[%s, %s, %s]" % (lid[1], lid[2], lid[3]) in rows[4]["line"]
    assert "aux=" in rows[7]["line"] and "playStart=%d" % play in rows[7]["line"]
    assert "creation=%d" % log[7]["metadata"]["timing"]["creation"] in rows[7]["line"]

    gm = c.ok({"op": "get_messages", "conversation": cid})
    assert gm == {"messages": log[5:], "summary": ["..."]}


def test_merge_into_index_zero_and_repeated_merges(conn):
    c = conn
    r1 = add(c, "add_user", "z", "a")
    r2 = add(c, "add_user", "z", "b")
    r3 = add(c, "add_message", "z", ["c", "d"], role="user")
    assert (r1["merged"], r2["merged"], r3["merged"]) == (False, True, True)
    assert r1["message"]["id"] == r2["message"]["id"] == r3["message"]["id"]
    log = full_log(c, "z")
    assert len(log) == 1
    assert log[0]["message"]["contents"] == ["a", "b", "c", "d"]
    assert log[0]["metadata"]["attribute"] == ["merged", "merged"]
    assert log[0] == r3["message"]
    # Assistant after assistant merges too, never a fake in the middle.
    add(c, "add_assistant", "z", "x")
    r = add(c, "add_assistant", "z", "y")
    assert r["merged"] is True
    log = full_log(c, "z")
    assert roles(log) == ["user", "assistant"]
    assert log[1]["message"]["contents"] == ["x", "y"]


def test_blank_contents_dropped_others_kept_exactly(conn):
    c = conn
    ws = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
    r = add(c, "add_user", "blank", ["", "  ", " x ", ws, "\u00a0y\u00a0", "\u200b", "\ufeff", "\u180e"])
    assert r["message"]["message"]["contents"] == [" x ", "\u00a0y\u00a0", "\u200b", "\ufeff", "\u180e"]
    r = add(c, "add_user", "blank", [ws, "z"])
    assert r["merged"] is True
    assert r["message"]["message"]["contents"] == [" x ", "\u00a0y\u00a0", "\u200b", "\ufeff", "\u180e", "z"]
    # Non-ASCII text survives the round trip byte for byte.
    text = "h\u00e9llo \U0001F600 \u4f60\u597d \"quoted\" back\\slash"
    r = add(c, "add_assistant", "blank", text)
    assert r["message"]["message"]["contents"] == [text]
    assert full_log(c, "blank")[1]["message"]["contents"] == [text]


def test_fake_after_summary(conn):
    c, cid = conn, "fake2"
    add(c, "add_user", cid, "u1")
    add(c, "add_assistant", cid, "a1")
    info = summary_info(c, cid)
    assert len(info["ids"]) == 2
    c.ok({"op": "add_summary", "conversation": cid, "contents": "S", "ids": info["ids"]})
    assert c.ok({"op": "get_messages", "conversation": cid}) == {"messages": [], "summary": ["S"]}
    rows, _ = describe(c, cid)
    assert [x["marks"] - {"-"} for x in rows] == [set(), set(), {"^"}]
    r = add(c, "add_assistant", cid, "a2")
    assert r["merged"] is False
    assert r["message"]["message"] == {"role": "assistant", "contents": ["a2"]}
    log = full_log(c, cid)
    assert roles(log) == ["user", "assistant", "summary", "user", "assistant"]
    assert log[3]["message"]["contents"] == ["..."]
    assert log[3]["metadata"]["attribute"] == ["fake"]
    assert log[3]["id"] > log[2]["id"]
    assert c.ok({"op": "get_messages", "conversation": cid})["messages"] == log[3:]
    rows, _ = describe(c, cid)
    assert [x["marks"] - {"-"} for x in rows] == [set(), set(), {"^"}, {"*"}, set()]
    # The fake message is never summarized.
    add(c, "add_user", cid, "u3")
    info = summary_info(c, cid)
    assert info["ids"] == [log[2]["id"], log[4]["id"]]
    assert [m["index"] for m in info["messages"]] == [4]


def test_summary_round_two_with_format_and_previous(conn):
    c, cid = conn, "sum2"
    add(c, "add_user", cid, "u1")
    add(c, "add_assistant", cid, "a1")
    add(c, "add_user", cid, "pending")
    info = summary_info(c, cid)
    assert [m["contents"] for m in info["messages"]] == [["u1"], ["a1"]]
    s1 = c.ok({"op": "add_summary", "conversation": cid, "contents": ["S1", "  "], "ids": info["ids"],
           "versions": info["versions"]})["message"]
    assert s1["message"]["contents"] == ["S1"]
    log = full_log(c, cid)
    assert roles(log) == ["user", "assistant", "summary", "user"]
    # Nothing answered since the summary: nothing to summarize, even with a previous summary.
    info = summary_info(c, cid, preamble="PRE")
    assert info == {"messages": [], "previous_summary": None, "ids": [], "versions": [], "text": "PRE"}
    assert summary_info(c, cid)["text"] == ""

    add(c, "add_assistant", cid, "a2!")
    add(c, "add_user", cid, "u3?")
    log = full_log(c, cid)
    fmt = {"prefix": "<", "postfix": "> ", "user_tag": "U", "assistant_tag": "A", "summary_tag": "S",
           "separator": "|", "closure": ";", "summary_closure": "##"}
    info = summary_info(c, cid, preamble="P\n", include_previous_summary=True, format=fmt)
    assert info["previous_summary"] == s1
    assert info["ids"] == [s1["id"], log[3]["id"], log[4]["id"]]
    assert info["versions"] == [1, 1, 1]
    assert [m["index"] for m in info["messages"]] == [3, 4]
    assert info["text"] == "P\n<S> S1.##<U> pending.;<A> a2!"
    plain = summary_info(c, cid)
    assert plain["ids"] == info["ids"] and plain["previous_summary"] == s1
    assert plain["text"] == "[User]: pending.\n[Assistant]: a2!"
    only_prev = summary_info(c, cid, include_previous_summary=True)
    assert only_prev["text"] == "[Previous Dialogue]: S1.\n\n[User]: pending.\n[Assistant]: a2!"

    s2 = c.ok({"op": "add_summary", "conversation": cid, "contents": "S2", "ids": info["ids"],
           "versions": info["versions"]})["message"]
    assert s2["metadata"]["summaryIds"] == info["ids"]
    log = full_log(c, cid)
    assert roles(log) == ["user", "assistant", "summary", "user", "assistant", "summary", "user"]
    assert log[5] == s2
    assert c.ok({"op": "get_last_summary", "conversation": cid}) == {"message": s2}
    gm = c.ok({"op": "get_messages", "conversation": cid})
    assert gm == {"messages": [log[6]], "summary": ["S2"]}
    rows, _ = describe(c, cid)
    assert [x["marks"] - {"-"} for x in rows] == [set(), set(), set(), set(), set(), {"^"}, {"*"}]


def test_summary_multiple_contents_and_separator(conn):
    c, cid = conn, "sep"
    add(c, "add_user", cid, ["one", "", "two?"])
    add(c, "add_assistant", cid, ["three", "four."])
    info = summary_info(c, cid, format={"separator": " / ", "closure": " || "})
    assert info["text"] == "[User]: one. / two? || [Assistant]: three. / four."


def test_summary_allows_later_messages_and_checks_versions(conn):
    c, cid = conn, "later"
    add(c, "add_user", cid, "u1")
    add(c, "add_assistant", cid, "a1")
    info = summary_info(c, cid)
    # A new message after get_summary_info is allowed; it stays after the summary.
    add(c, "add_user", cid, "u2")
    s = c.ok({"op": "add_summary", "conversation": cid, "contents": "S", "ids": info["ids"],
          "versions": info["versions"]})["message"]
    log = full_log(c, cid)
    assert roles(log) == ["user", "assistant", "summary", "user"]
    assert log[2] == s and log[3]["message"]["contents"] == ["u2"]

    # Without versions a merge into a named message is not detected.
    cid = "later2"
    add(c, "add_user", cid, "u1")
    add(c, "add_assistant", cid, "a1")
    info = summary_info(c, cid)
    add(c, "add_assistant", cid, "a1b")
    s = c.ok({"op": "add_summary", "conversation": cid, "contents": "S", "ids": info["ids"]})["message"]
    assert roles(full_log(c, cid)) == ["user", "assistant", "summary"]
    assert c.ok({"op": "get_messages", "conversation": cid}) == {"messages": [], "summary": ["S"]}


def test_versions(conn):
    c, cid = conn, "ver"
    r = add(c, "add_user", cid, "u", metadata={"timing": {"listenStart": 5}, "aux": {"k": 1}})
    md = r["message"]["metadata"]
    assert md["timing"]["listenStart"] == 5 and md["aux"] == {"k": 1}
    add(c, "add_assistant", cid, "a")
    assert summary_info(c, cid)["versions"] == [1, 1]
    # A merge with metadata counts once.
    r = add(c, "add_assistant", cid, "b", metadata={"aux": {"x": [1, {"y": None}]}, "timing": {"playEnd": 9}})
    assert r["merged"] is True
    assert r["message"]["metadata"]["aux"] == {"x": [1, {"y": None}]}
    assert r["message"]["metadata"]["timing"]["playEnd"] == 9
    assert summary_info(c, cid)["versions"] == [1, 2]
    uid = full_log(c, cid)[0]["id"]
    # A set_metadata that changes something counts; one that does not, does not.
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": uid, "aux": {"k": 2}})
    assert summary_info(c, cid)["versions"] == [2, 2]
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": uid, "aux": {"k": 2}})
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": uid, "timing": {"listenStart": 5}})
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": uid, "aux": {"absent": None}})
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": uid})
    assert summary_info(c, cid)["versions"] == [2, 2]
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": uid, "timing": {"listenStart": 6}})
    assert summary_info(c, cid)["versions"] == [3, 2]
    info = summary_info(c, cid)
    assert [m["version"] for m in info["messages"]] == [3, 2]


def test_set_metadata_aux_and_timing(conn):
    c, cid = conn, "meta"
    r = add(c, "add_user", cid, "u")
    mid = r["message"]["id"]
    assert set(r["message"]["metadata"]) == {"timing"}
    m = c.ok({"op": "set_metadata", "conversation": cid, "message_id": mid,
          "aux": {"a": 1, "b": {"nested": [True, None, "s", 1.5]}, "c": "x"}})["message"]
    assert m["metadata"]["aux"] == {"a": 1, "b": {"nested": [True, None, "s", 1.5]}, "c": "x"}
    m = c.ok({"op": "set_metadata", "conversation": cid, "message_id": mid, "aux": {"a": None, "c": "y"}})["message"]
    assert m["metadata"]["aux"] == {"b": {"nested": [True, None, "s", 1.5]}, "c": "y"}
    m = c.ok({"op": "set_metadata", "conversation": cid, "message_id": mid, "aux": {"b": None, "c": None}})["message"]
    assert "aux" not in m["metadata"]
    assert "aux" not in full_log(c, cid)[0]["metadata"]
    # Every settable timing key; 0 is a valid time.
    t = {"playStart": 0, "playEnd": 1, "listenStart": 2, "listenEnd": 3, "llmStart": 4, "llmEnd": 2 ** 41}
    m = c.ok({"op": "set_metadata", "conversation": cid, "message_id": mid, "timing": t})["message"]
    want = dict(t)
    want["creation"] = r["message"]["metadata"]["timing"]["creation"]
    assert m["metadata"]["timing"] == want
    assert full_log(c, cid)[0] == m
    # Metadata on a summary message.
    add(c, "add_assistant", cid, "a")
    info = summary_info(c, cid)
    s = c.ok({"op": "add_summary", "conversation": cid, "contents": "S", "ids": info["ids"]})["message"]
    m = c.ok({"op": "set_metadata", "conversation": cid, "message_id": s["id"], "aux": {"model": "x"}})["message"]
    assert m["metadata"]["aux"] == {"model": "x"} and m["metadata"]["summaryIds"] == info["ids"]
    assert c.ok({"op": "get_last_summary", "conversation": cid})["message"] == m


def test_to_messages_map_incremental(conn):
    c, cid = conn, "inc"
    u1 = add(c, "add_user", cid, "u1")["message"]["id"]
    a1 = add(c, "add_assistant", cid, "a1")["message"]["id"]
    u2 = add(c, "add_user", cid, "u2")["message"]["id"]
    # Defaults: incremental, exclude_last.
    assert ids(tmap(c, cid)) == [u1, a1]
    assert tmap(c, cid) == []
    rows, tail = describe(c, cid)
    assert [x["marks"] for x in rows] == [{"*"}, set(), {"-"}] and tail == 2
    assert ids(tmap(c, cid, exclude_last=False)) == [u2]
    assert tmap(c, cid, exclude_last=False) == []
    rows, tail = describe(c, cid)
    assert [x["marks"] for x in rows] == [{"*"}, set(), set()] and tail == 3
    # A merge into a message already returned returns it again.
    add(c, "add_user", cid, "u2b")
    got = tmap(c, cid, exclude_last=False)
    assert ids(got) == [u2] and got[0]["message"]["contents"] == ["u2", "u2b"]
    # So does a metadata change, even far back; exclude_last only holds back the last.
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": u1, "aux": {"k": 1}})
    add(c, "add_user", cid, "u2c")
    got = tmap(c, cid)
    assert ids(got) == [u1] and got[0]["metadata"]["aux"] == {"k": 1}
    # incremental=false returns everything and moves nothing.
    c.ok({"op": "set_metadata", "conversation": cid, "message_id": a1, "aux": {"k": 2}})
    assert ids(tmap(c, cid, incremental=False)) == [u1, a1, u2]
    assert ids(tmap(c, cid, incremental=False, exclude_last=True)) == [u1, a1, u2]
    assert ids(tmap(c, cid, exclude_last=False)) == [a1, u2]
    # A summary inserted behind messages already returned is returned, alone.
    add(c, "add_assistant", cid, "a2")
    add(c, "add_user", cid, "u3")
    assert len(tmap(c, cid, exclude_last=False)) == 2
    info = summary_info(c, cid)
    s = c.ok({"op": "add_summary", "conversation": cid, "contents": "S", "ids": info["ids"]})["message"]
    log = full_log(c, cid)
    assert roles(log) == ["user", "assistant", "user", "assistant", "summary", "user"]
    assert tmap(c, cid, exclude_last=False) == [s]
    assert tmap(c, cid, exclude_last=False) == []


def test_get_messages_formats(conn):
    c, cid = conn, "fmt"
    add(c, "add_assistant", cid, "Hello!")
    add(c, "add_user", cid, ["Hi", "there"])
    log = full_log(c, cid)
    assert c.ok({"op": "get_messages", "conversation": cid}) == {"messages": log, "summary": None}
    assert c.ok({"op": "get_messages", "conversation": cid, "format": "meta"}) == {"messages": log, "summary": None}
    bedrock = [
        {"role": "user", "content": [{"text": "..."}]},
        {"role": "assistant", "content": [{"text": "Hello!"}]},
        {"role": "user", "content": [{"text": "Hi"}, {"text": "there"}]},
    ]
    typed = [{"role": m["role"], "content": [{"type": "text", "text": b["text"]} for b in m["content"]]}
         for m in bedrock]
    assert c.ok({"op": "get_messages", "conversation": cid, "format": "bedrock"}) == {"messages": bedrock, "summary": None}
    assert c.ok({"op": "get_messages", "conversation": cid, "format": "anthropic"}) == {"messages": typed, "summary": None}
    assert c.ok({"op": "get_messages", "conversation": cid, "format": "openai"}) == {"messages": typed, "summary": None}
    add(c, "add_assistant", cid, "a")
    add(c, "add_user", cid, "b")
    info = summary_info(c, cid)
    c.ok({"op": "add_summary", "conversation": cid, "contents": ["sum", "mary"], "ids": info["ids"]})
    log = full_log(c, cid)
    assert roles(log) == ["user", "assistant", "user", "assistant", "summary", "user"]
    want = {"meta": [log[5]], "bedrock": [{"role": "user", "content": [{"text": "b"}]}],
        "anthropic": [{"role": "user", "content": [{"type": "text", "text": "b"}]}],
        "openai": [{"role": "user", "content": [{"type": "text", "text": "b"}]}]}
    for f, msgs in want.items():
        r = c.ok({"op": "get_messages", "conversation": cid, "format": f})
        assert r == {"messages": msgs, "summary": ["sum", "mary"]}, f


def test_ids_echoed_unchanged(conn):
    c = conn
    for rid in [0, -7, 2 ** 62, "abc", "\u00e9\U0001F600", 1.5, True, False, None, [1, "x", None],
            {"a": {"b": [1, 2]}}, ""]:
        r = c.request({"id": rid, "op": "ping"})
        assert "id" in r and r["id"] == rid and type(r["id"]) is type(rid), (rid, r)
        r = c.request({"id": rid, "op": "describe", "conversation": "nope"})
        assert r["ok"] is False and "id" in r and r["id"] == rid, (rid, r)
    r = c.request({"op": "ping"})
    assert "id" not in r and r["ok"] is True
    r = c.request({"op": "describe", "conversation": "nope"})
    assert "id" not in r and r["ok"] is False


def test_numbers_jansson_cannot_hold(conn):
    """protocol.md: numbers are JSON's, of any size. Integers beyond 64 bits and reals
    beyond a double are valid JSON: in the id they are echoed byte for byte, in ignored
    fields they change nothing, where a field reads them they are out of range, and in
    what the conversation keeps (aux, metadata) they are refused, never stored changed."""
    c = conn
    for raw in [b"12345678901234567890", b"-9223372036854775809", b"1e400", b"-1E+999",
                b"0.1", b"1e2", b"-0", b"1.50", b'[1,99999999999999999999,{"a":-1e999}]']:
        c.send_raw(b'{"id":' + raw + b',"op":"ping"}\n')
        line = c.recv_line()
        assert line.startswith(b'{"id":' + raw + b',"ok":true,'), line
        c.send_raw(b'{"id":' + raw + b',"op":"describe","conversation":"nope"}\n')
        line = c.recv_line()
        assert line.startswith(b'{"id":' + raw + b',"ok":false,'), line
        assert json.loads(line)["error"]["code"] == "not_found"
    # However deep the rest nests (up to jansson's 2048 levels): jscan used to stop at 64,
    # and the id came back as jansson's value (1e300 for the first).
    for raw in [b"12345678901234567890", b"0e0", b"-0", b"1e-129"]:
        for depth in (64, 1000, 2046):
            c.send_raw(b'{"id":' + raw + b',"op":"ping","x":' + b"[" * depth + b"]" * depth +
                       b'}\n')
            line = c.recv_line()
            assert line.startswith(b'{"id":' + raw + b',"ok":true,'), (depth, line)
    # Ignored fields: the request runs as without them.
    c.send_raw(b'{"id":1,"op":"add_user","conversation":"big","contents":"a",'
               b'"x":1e400,"y":[123456789012345678901234567890]}\n')
    r = json.loads(c.recv_line())
    assert r["ok"] is True and r["result"]["message"]["message"]["contents"] == ["a"], r
    mid = r["result"]["message"]["id"]
    before = full_log(c, "big")
    # Read by a field: out of range, or refused where it would be kept.
    for line, msg in [
            (b'{"id":2,"op":"add_user","conversation":"big","contents":"b",'
             b'"metadata":{"timing":{"playStart":9223372036854775808}}}', "playStart"),
            (b'{"id":3,"op":"add_user","conversation":"big","contents":"b",'
             b'"metadata":{"aux":{"n":1e999}}}', "metadata: holds a number out of range"),
            (b'{"id":4,"op":"set_metadata","conversation":"big","message_id":"' +
             mid.encode() + b'","aux":{"n":[18446744073709551616]}}',
             "aux: holds a number out of range"),
            (b'{"id":5,"op":"to_messages_map","conversation":"big","incremental":1e999}',
             "incremental"),
            (b'{"id":6,"op":"add_summary","conversation":"big","contents":"s","ids":["' +
             mid.encode() + b'"],"versions":[99999999999999999999]}', "versions")]:
        c.send_raw(line + b"\n")
        r = json.loads(c.recv_line())
        assert r["ok"] is False and r["error"]["code"] == "bad_request", (line, r)
        assert msg in r["error"]["message"], (line, r)
        assert r["id"] == json.loads(line)["id"]
    assert full_log(c, "big") == before
    # Such numbers in aux of a request that is not kept (get_messages ignores metadata).
    c.send_raw(b'{"id":7,"op":"get_messages","conversation":"big","metadata":{"aux":1e999}}\n')
    assert json.loads(c.recv_line())["ok"] is True
    # Invalid JSON stays parse_error, naming the real fault rather than the number.
    c.send_raw(b'{"id":8,"op":"ping","x":1e400\n')
    r = json.loads(c.recv_line())
    assert r["ok"] is False and r["error"]["code"] == "parse_error" and "id" not in r, r
    assert "expected" in r["error"]["message"], r


def test_aux_reals_dynamodb_cannot_hold(conn):
    """persistence.md: refuse early what can never be stored. A double DynamoDB's numbers
    cannot hold (magnitude 1e126 or more, or below 1e-130 but not 0) is refused in aux,
    whatever the sink; it used to be acknowledged, then dead-lettered for good. The edges
    and 0 are kept."""
    c = conn
    r = c.ok({"op": "add_user", "conversation": "range", "contents": "a",
              "metadata": {"aux": {"edges": [9.99e125, -9.99e125, 1e-130, -1e-130, 0.0]}}})
    mid = r["message"]["id"]
    before = full_log(c, "range")
    for bad in (1.7976931348623157e308, 1e126, -1e126, 5e-324, 1e-131, -2.5e-200):
        for req in ({"op": "add_assistant", "conversation": "range", "contents": "b",
                     "metadata": {"aux": {"n": bad}}},
                    {"op": "set_metadata", "conversation": "range", "message_id": mid,
                     "aux": {"deep": [{"n": [bad]}]}},
                    {"op": "add_user", "conversation": "range-new", "contents": "b",
                     "metadata": {"aux": {"n": bad}}}):
            err = c.err(req, "bad_request")
            assert "DynamoDB's range" in err["message"], (bad, err)
    assert full_log(c, "range") == before
    not_found = c.request({"op": "describe", "conversation": "range-new"})
    assert not_found["error"]["code"] == "not_found", not_found


def test_whole_numbers_written_as_reals(conn):
    """JSON does not tell 1000 from 1000.0 (nor does the schemas' "integer"): an integer
    field takes a real without a fraction, below 2^53, and keeps it as the integer; a
    fraction, or a real of 2^53 or more (whose digits a double may have lost:
    9007199254740993.0 reads as 2^53), is bad_request."""
    c = conn
    c.send_raw(b'{"id":1,"op":"add_user","conversation":"whole","contents":"a",'
                   b'"metadata":{"timing":{"playStart":1000.0,"playEnd":1e3,'
                   b'"llmStart":9007199254740991.0,"llmEnd":0.0}}}\n')
    r = json.loads(c.recv_line())
    assert r["ok"] is True, r
    timing = r["result"]["message"]["metadata"]["timing"]
    assert timing["playStart"] == 1000 and timing["playEnd"] == 1000, timing
    assert timing["llmStart"] == 2 ** 53 - 1 and timing["llmEnd"] == 0, timing
    c.send_raw(b'{"id":2,"op":"get_messages","conversation":"whole"}\n')
    raw = c.recv_line()
    assert b'"playStart":1000,' in raw and b"1000.0" not in raw and b"1e3" not in raw, raw
    before = full_log(c, "whole")
    for value in (b"1000.5", b"9007199254740992.0", b"9007199254740993.0",
                  b"9007199254740994.0", b"-1.0", b"1e300", b"-0.5"):
        c.send_raw(b'{"id":3,"op":"add_user","conversation":"whole","contents":"b",'
                   b'"metadata":{"timing":{"playStart":' + value + b'}}}\n')
        r = json.loads(c.recv_line())
        assert r["ok"] is False and r["error"]["code"] == "bad_request", (value, r)
        assert "playStart" in r["error"]["message"], r
    assert full_log(c, "whole") == before
    # versions and limit take them too.
    add(c, "add_assistant", "whole", "b")
    info = c.ok({"op": "get_summary_info", "conversation": "whole"})
    c.err({"op": "add_summary", "conversation": "whole", "contents": "s", "ids": info["ids"],
           "versions": [v + 0.5 for v in info["versions"]]}, "bad_request")
    s = c.ok({"op": "add_summary", "conversation": "whole", "contents": "s", "ids": info["ids"],
              "versions": [float(v) for v in info["versions"]]})
    assert s["message"]["metadata"]["summaryIds"] == info["ids"]
    assert c.ok({"op": "dead_letters", "limit": 5.0}) == {"dead_letters": []}
    c.err({"op": "dead_letters", "limit": 5.5}, "bad_request")
    c.err({"op": "dead_letters", "limit": 0.0}, "bad_request")


def test_too_large_wins_over_other_field_problems(conn):
    """protocol.md: the first code in the table wins; contents over DynamoDB's item limit
    are too_large whatever else is wrong with the request."""
    c = conn
    big = "x" * 500000
    cases = [
        {"op": "add_user", "conversation": "tl", "contents": big,
         "metadata": {"timing": {"playStart": -1}}},
        {"op": "add_message", "role": "system", "conversation": "tl", "contents": big},
        {"op": "add_assistant", "conversation": "tl", "contents": [big],
         "metadata": {"bogus": 1}},
        {"op": "add_summary", "conversation": "tl-none", "contents": big, "ids": [5]},
    ]
    for i, req in enumerate(cases):
        e = c.err(dict(req, id=i), "too_large")
        assert "contents: 500000 bytes" in e["message"], e
    # Within the limit, the other problem is what is answered.
    c.err({"op": "add_user", "conversation": "tl", "contents": "x",
           "metadata": {"timing": {"playStart": -1}}}, "bad_request")
    c.err({"op": "add_summary", "conversation": "tl-none", "contents": "s", "ids": [5]},
          "bad_request")
    assert c.ok({"op": "list"}) == {"conversations": []}


def test_unknown_top_level_fields_ignored(conn):
    c = conn
    r = c.ok({"op": "add_user", "conversation": "fw", "contents": "x", "future": {"a": [1]}, "priority": 3})
    assert r["message"]["message"]["contents"] == ["x"]
    assert c.ok({"op": "ping", "extra": True})["pong"] is True


def test_list(conn):
    c = conn
    t0 = now_ms()
    assert c.ok({"op": "list"}) == {"conversations": []}
    add(c, "add_user", "b", "x")
    add(c, "add_assistant", "a", "x")
    add(c, "add_user", "c", "x")
    add(c, "add_assistant", "c", "y")
    add(c, "add_user", "c", "z")
    add(c, "add_user", "c", "z2")
    t1 = now_ms()
    lst = c.ok({"op": "list"})["conversations"]
    assert [(x["conversation"], x["messages"]) for x in lst] == [("a", 2), ("b", 1), ("c", 3)]
    for x in lst:
        assert set(x) == {"conversation", "messages", "updated"}
        assert t0 - SLACK_MS <= x["updated"] <= t1 + SLACK_MS
    time.sleep(0.01)
    add(c, "add_user", "a", "later")
    lst2 = {x["conversation"]: x for x in c.ok({"op": "list"})["conversations"]}
    assert lst2["a"]["messages"] == 3
    assert lst2["a"]["updated"] > {x["conversation"]: x for x in lst}["a"]["updated"]
    assert lst2["b"]["updated"] == lst[1]["updated"]
    # Byte order, not a locale's.
    add(c, "add_user", "B", "x")
    add(c, "add_user", "\u00e9", "x")
    add(c, "add_user", "a0", "x")
    names = [x["conversation"] for x in c.ok({"op": "list"})["conversations"]]
    assert names == ["B", "a", "a0", "b", "c", "\u00e9"]


def test_flush(conn):
    c, cid = conn, "fc"
    add(c, "add_user", cid, "u1")
    add(c, "add_assistant", cid, "a1")
    add(c, "add_user", cid, "u2")
    n = c.ok({"op": "flush", "conversation": cid})["flushed"]
    # The periodic flusher may have taken u1 and a1 already, never the last message.
    assert 1 <= n <= 3
    assert c.ok({"op": "flush", "conversation": cid}) == {"flushed": 0}
    add(c, "add_assistant", cid, "a2")
    assert c.ok({"op": "flush", "conversation": cid}) == {"flushed": 1}
    add(c, "add_assistant", cid, "a2b")
    assert c.ok({"op": "flush", "conversation": cid}) == {"flushed": 1}
    add(c, "add_user", "other", "x")
    n = c.ok({"op": "flush"})["flushed"]
    assert n == 1
    assert c.ok({"op": "flush"}) == {"flushed": 0}
    assert c.ok({"op": "flush", "conversation": cid}) == {"flushed": 0}
    c.err({"op": "flush", "conversation": "ghost"}, "not_found")


def wait_conversations(c, n, timeout=10):
    """Waits until the daemon holds n conversations in memory (close drops one once persisted)."""
    deadline = time.time() + scaled(timeout)
    while True:
        cur = stats(c)["conversations"]
        if cur == n:
            return
        assert time.time() < deadline, "daemon holds %d conversations, expected %d" % (cur, n)
        time.sleep(0.02)


def test_close_memory_only(daemon_factory):
    """Without a store, a closed conversation is gone: later reads answer not_found."""
    d = daemon_factory(["--memory-only"])
    c, cid = d.connect(), "gone"
    add(c, "add_user", cid, "u1")
    add(c, "add_assistant", cid, "a1")
    add(c, "add_user", "other", "x")
    before = stats(c)
    # The periodic flusher may have taken u1 already, never the last message.
    assert 1 <= c.ok({"op": "close", "conversation": cid})["flushed"] <= 2
    wait_conversations(c, before["conversations"] - 1)
    assert stats(c)["messages"] == before["messages"] - 2
    for op in ("describe", "get_messages", "get_summary_info", "get_last_summary", "to_messages_map", "close",
               "flush"):
        c.err({"op": op, "conversation": cid}, "not_found")
    c.err({"op": "set_metadata", "conversation": cid, "message_id": "01JRZJ166HZFPP405DV1QQB2X9"}, "not_found")
    assert [x["conversation"] for x in c.ok({"op": "list"})["conversations"]] == ["other"]
    assert full_log(c, "other")[0]["message"]["contents"] == ["x"]
    # Adding to the name again starts a new conversation.
    r = add(c, "add_assistant", cid, "new")
    assert roles(full_log(c, cid)) == ["user", "assistant"]
    assert r["message"]["message"]["contents"] == ["new"]


def test_close_then_restored(daemon):
    """With the local store, close drops the conversation from memory and a later request
    restores it as if it had never left."""
    c, cid = daemon.connect(), "back"
    add(c, "add_user", cid, "u1")
    add(c, "add_assistant", cid, "a1")
    info = summary_info(c, cid)
    c.ok({"op": "add_summary", "conversation": cid, "contents": "S", "ids": info["ids"]})
    r = add(c, "add_user", cid, "u2", metadata={"aux": {"k": [1, {"x": None}]}, "timing": {"listenEnd": 7}})
    add(c, "add_user", cid, "u2b")
    add(c, "add_user", "stays", "x")
    log = full_log(c, cid)
    # The client has taken all but the last message (incremental to_messages_map): where
    # it was is part of what the restore brings back.
    taken = c.ok({"op": "to_messages_map", "conversation": cid})["messages"]
    assert ids(taken) == ids(log)[:-1]
    text = c.ok({"op": "describe", "conversation": cid})["text"]
    gm = c.ok({"op": "get_messages", "conversation": cid})
    info = summary_info(c, cid)
    before = stats(c)
    n = c.ok({"op": "close", "conversation": cid})["flushed"]
    assert isinstance(n, int) and 1 <= n <= len(log)
    wait_conversations(c, before["conversations"] - 1)
    assert full_log(c, cid) == log
    assert c.ok({"op": "get_messages", "conversation": cid}) == gm
    assert summary_info(c, cid) == info
    assert c.ok({"op": "get_last_summary", "conversation": cid})["message"] == log[2]
    assert stats(c)["conversations"] == before["conversations"]
    assert c.ok({"op": "describe", "conversation": cid})["text"] == text
    rows, _ = parse_describe(text)
    assert [x["id"] for x in rows] == ids(log)
    assert [x["marks"] for x in rows] == [set(), set(), {"^"}, {"*", "-"}]
    assert c.ok({"op": "to_messages_map", "conversation": cid})["messages"] == []
    # It carries on: a merge into the restored last message, then a new one.
    r2 = add(c, "add_user", cid, "u2c")
    assert r2["merged"] is True and r2["message"]["id"] == r["message"]["id"]
    assert r2["message"]["message"]["contents"] == ["u2", "u2b", "u2c"]
    assert r2["message"]["metadata"]["aux"] == {"k": [1, {"x": None}]}
    add(c, "add_assistant", cid, "a2")
    assert roles(full_log(c, cid)) == ["user", "assistant", "summary", "user", "assistant"]
    assert summary_info(c, cid)["versions"] == [1, 3, 1]
    assert text.startswith("META MESSAGES")


def wait_connections(c, n, timeout=10):
    """Waits until the daemon counts n open connections (closes are seen asynchronously)."""
    deadline = time.time() + scaled(timeout)
    while True:
        cur = stats(c)["connections"]["current"]
        if cur == n:
            return
        assert time.time() < deadline, "daemon counts %d connections, expected %d" % (cur, n)
        time.sleep(0.02)


def test_stats_counters_move(daemon):
    c = daemon.connect()
    wait_connections(c, 1)
    s1 = stats(c)
    assert s1["connections"]["current"] == 1
    assert s1["version"] == project_version()
    assert isinstance(s1["uptime_ms"], int) and s1["uptime_ms"] >= 0
    for k in ("current", "accepted", "refused"):
        assert isinstance(s1["connections"][k], int)
    for k in ("items", "bytes", "oldest_pending_ms"):
        assert k in s1["spool"]
    for k in ("kind", "writes_sent", "confirmed", "retried", "dead_lettered", "last_error", "latency_ms"):
        assert k in s1["sink"]
    assert set(s1["sink"]["latency_ms"]) >= {"p50", "p99", "p999"}

    def by_op(s, op):
        return s["requests"]["by_op"].get(op, 0)

    def by_code(s, code):
        return s["errors"]["by_code"].get(code, 0)

    def errors_by_op(s, op):
        return s["errors"]["by_op"].get(op, 0)

    c.ok({"op": "ping"})
    c.ok({"op": "ping"})
    c.ok({"op": "ping"})
    add(c, "add_assistant", "st", "a")
    add(c, "add_user", "st", "u")
    add(c, "add_user", "st", "u2")
    c.err({"op": "get_messages", "conversation": "missing"}, "not_found")
    c.err({"op": "add_user", "conversation": "st", "contents": 5}, "bad_request")
    o1 = daemon.connect()
    o2 = daemon.connect()
    o1.ok({"op": "ping"})
    o2.ok({"op": "ping"})
    time.sleep(0.01)
    s2 = stats(c)
    assert s2["uptime_ms"] > s1["uptime_ms"]
    # 3+1+1 pings, 1 add_assistant, 3 add_user, 1 get_messages, and one of the stats.
    assert s2["requests"]["total"] - s1["requests"]["total"] == 11
    assert by_op(s2, "ping") - by_op(s1, "ping") == 5
    assert by_op(s2, "add_user") - by_op(s1, "add_user") == 3
    assert by_op(s2, "add_assistant") - by_op(s1, "add_assistant") == 1
    assert by_op(s2, "get_messages") - by_op(s1, "get_messages") == 1
    assert by_op(s2, "stats") - by_op(s1, "stats") == 1
    assert s2["errors"]["total"] - s1["errors"]["total"] == 2
    assert by_code(s2, "not_found") - by_code(s1, "not_found") == 1
    assert by_code(s2, "bad_request") - by_code(s1, "bad_request") == 1
    assert errors_by_op(s2, "get_messages") - errors_by_op(s1, "get_messages") == 1
    assert errors_by_op(s2, "add_user") - errors_by_op(s1, "add_user") == 1
    assert sum(s2["errors"]["by_op"].values()) - sum(s1["errors"]["by_op"].values()) == 2
    assert s2["conversations"] - s1["conversations"] == 1
    assert s2["messages"] - s1["messages"] == 3
    assert s2["connections"]["accepted"] - s1["connections"]["accepted"] == 2
    assert s2["connections"]["current"] - s1["connections"]["current"] == 2
    c.send_raw(b"{nope\n")
    assert c.recv()["error"]["code"] == "parse_error"
    s3 = stats(c)
    assert by_code(s3, "parse_error") - by_code(s2, "parse_error") == 1
    assert errors_by_op(s3, "unknown") - errors_by_op(s2, "unknown") == 1
    assert sum(s3["errors"]["by_op"].values()) == s3["errors"]["total"]
    assert s3["errors"]["total"] - s2["errors"]["total"] == 1
    o1.close()
    o2.close()
    wait_connections(c, 1)


def test_stats_time_by_op_counts_daemon_time(daemon):
    """time_ns_by_op grows for the ops served, by at least something and by less than the
    wall time the client waited, and stays put for ops not sent."""
    c = daemon.connect()
    for i in range(200):
        add(c, "add_user" if i % 2 == 0 else "add_assistant", "tm", "m%d" % i)
    s1 = stats(c)
    t = time.monotonic()
    for _ in range(50):
        c.ok({"op": "get_messages", "conversation": "tm"})
    wall_ns = (time.monotonic() - t) * 1e9
    s2 = stats(c)
    t1, t2 = s1["requests"]["time_ns_by_op"], s2["requests"]["time_ns_by_op"]
    assert set(t2) == set(s2["requests"]["by_op"])
    spent = t2["get_messages"] - t1["get_messages"]
    assert 0 < spent < wall_ns
    assert t2["describe"] == t1["describe"]
    assert t1["add_user"] > 0 and t1["add_assistant"] > 0
    text = c.ok({"op": "stats", "format": "prometheus"})["text"]
    assert "# TYPE convod_requests_time_ns_by_op_total counter" in text
    assert re.search(r'^convod_requests_time_ns_by_op_total\{op="get_messages"\} [1-9][0-9]*$',
                     text, re.M)


def thread_names(pid):
    names = []
    for tid in os.listdir("/proc/%d/task" % pid):
        try:
            with open("/proc/%d/task/%s/comm" % (pid, tid)) as f:
                names.append(f.read().strip())
        except OSError:
            pass  # a thread that just ended
    return names


def test_store_threads_are_named(daemon_factory):
    """The store's threads carry names (top -H, perf, /proc): the writer and the checkpoint
    thread; without a store there are neither."""
    d = daemon_factory(["--durability", "machine"])
    d.connect().ok({"op": "ping"})
    names = thread_names(d.proc.pid)
    assert names.count("convod-writer") == 1, names
    assert names.count("convod-ckpt") == 1, names
    m = daemon_factory(["--memory-only"])
    m.connect().ok({"op": "ping"})
    names = thread_names(m.proc.pid)
    assert "convod-writer" not in names and "convod-ckpt" not in names, names


def test_stats_store(daemon_factory):
    """stats.store counts the local store's work: group commits and the turns and message
    versions they held, their time, the fold that later takes every version into its
    conversation's segment when the daemon is quiet (deleting the journal rows it folded),
    and the files' sizes; null without a store, and counters or gauges in the Prometheus
    text."""
    scale = float(os.environ.get("CONVOD_TIMEOUT_SCALE", "1"))
    d = daemon_factory(["--flush-interval", "100"])
    c = d.connect()
    s0 = stats(c)["store"]
    assert s0["durability"] == "process"
    for i in range(120):
        add(c, "add_user" if i % 2 == 0 else "add_assistant", "st-%d" % (i % 3), "m%d" % i)
    # Three more in one write: one turn, one commit (at most one more, for a split read).
    c.sock.sendall(b"".join(json.dumps({"op": "add_user", "conversation": "st-x",
                                        "contents": "p%d" % i, "id": i}).encode() + b"\n"
                            for i in range(3)))
    for _ in range(3):
        assert c.recv()["ok"]
    s1 = stats(c)["store"]
    commits = s1["commits"] - s0["commits"]
    assert 1 <= commits <= 123
    assert s1["turns"] - s0["turns"] >= commits
    # Each of the 120 adds is a new message, committed alone; the three merge into one
    # message, which is written once per commit whatever changed it in that turn.
    assert 121 <= s1["records"] - s0["records"] <= 123
    assert s1["commit_ns"] > s0["commit_ns"]
    assert s1["commit_max_ns"] * commits >= s1["commit_ns"] - s0["commit_ns"]
    assert s1["inline_commits"] <= s1["commits"]
    assert s1["cohort"] == {"waits": 0, "short": 0, "ns": 0}  # machine only
    assert s1["retry"] == {"running": False, "moves": 0, "moved": 0, "parts": 0, "pauses": 0,
                           "ns": 0}  # no retry_dead_letters yet
    assert s1["db_bytes"] > 0 and s1["wal_bytes"] > 0 and s1["wal_pages"] > 0
    # A quiet tick folds what is pending into segments, one per conversation here.
    deadline = time.monotonic() + 20 * scale
    while True:
        s2 = stats(c)["store"]
        if (s2["pending_records"] == 0 and s2["fold"]["records"] >= 121
                and s2["fold"]["dead_batches"] == 0):
            break
        assert time.monotonic() < deadline, s2
        time.sleep(0.05)
    assert s2["fold"]["cycles"] >= 1 and s2["fold"]["segments"] >= 4 and s2["fold"]["ns"] > 0
    text = c.ok({"op": "stats", "format": "prometheus"})["text"]
    assert "# TYPE convod_store_commits counter" in text
    assert "# TYPE convod_store_pending_records gauge" in text
    assert re.search(r"^convod_store_fold_records [1-9][0-9]*$", text, re.M)
    assert "# TYPE convod_store_fold_dead_batches gauge" in text
    assert "# TYPE convod_store_cohort_waits counter" in text
    assert "# TYPE convod_store_wal_writebacks counter" in text
    assert "# TYPE convod_store_wal_syncs counter" in text
    assert "# TYPE convod_store_db_syncs counter" in text
    assert re.search(r"^convod_store_cohort_short 0$", text, re.M)
    assert re.search(r"^convod_store_fold_dead_batches 0$", text, re.M)
    assert "# TYPE convod_store_retry_moved counter" in text
    assert "# TYPE convod_store_retry_running gauge" in text
    assert re.search(r"^convod_store_retry_running 0$", text, re.M)  # a boolean: 1 or 0
    assert "durability" not in text  # strings are left out
    # machine: every commit goes through the writer thread, which syncs it.
    m = daemon_factory(["--durability", "machine"]).connect()
    for i in range(3):
        add(m, "add_user" if i % 2 == 0 else "add_assistant", "st-m", "hello %d" % i)
    sm = stats(m)["store"]
    assert sm["durability"] == "machine"
    assert sm["commits"] >= 3 and sm["inline_commits"] == 0 and sm["records"] >= 3
    # A lone client's commits hold one record each: the writer never waits for more.
    assert sm["cohort"] == {"waits": 0, "short": 0, "ns": 0}
    assert sm["wal_writebacks"] == 0  # every commit syncs: nothing to start early
    # No store: null, and no store metric.
    n = daemon_factory(["--memory-only"]).connect()
    add(n, "add_user", "st-n", "hello")
    assert stats(n)["store"] is None
    # The sink's keys are there all the same (proto: every key always present).
    assert set(stats(n)["sink"]) == set(stats(c)["sink"])
    assert stats(n)["sink"]["kind"] == "none" and stats(n)["sink"]["inflight"] == 0
    assert "convod_store" not in n.ok({"op": "stats", "format": "prometheus"})["text"]
