"""Replays proto/transcripts/*.jsonl against the real daemon and checks them against
proto/schema/ (format: proto/transcripts/README.md)."""
import base64
import copy
import glob
import json
import os
import re

import pytest

from jsonschema_mini import WILDCARD, Validator, json_equal

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROTO = os.path.join(ROOT, "proto")
SCHEMA_DIR = os.path.join(PROTO, "schema")
TRANSCRIPTS = sorted(glob.glob(os.path.join(PROTO, "transcripts", "*.jsonl")))

ULID_RE = re.compile(r"^[0-7][0-9A-HJKMNP-TV-Z]{25}$")
PLACEHOLDER = re.compile(r"^\$(ULID|INT|STR|ANY)(?::([A-Za-z0-9_]+))?$")
REF_IN_RE = re.compile(r"\$=([A-Za-z0-9_]+)")
OPS = {"add_user", "add_assistant", "add_message", "get_messages", "get_summary_info",
       "add_summary", "get_last_summary", "to_messages_map", "set_metadata", "describe",
       "flush", "close", "list", "stats", "ping", "dead_letters", "retry_dead_letters",
       "create_table"}
EXAMPLE = {"ULID": "01ARZ3NDEKTSV4RRFFQ69G5FAV", "INT": 1, "STR": "x", "ANY": None}

_validator = None


def validator():
    global _validator
    if _validator is None:
        _validator = Validator(SCHEMA_DIR)
    return _validator


# ---------------------------------------------------------------- reading transcripts

class Step:
    """One line of a transcript: kind is send/send_raw/send_raw_b64/expect."""

    def __init__(self, lineno, kind, value, blind=None):
        self.lineno, self.kind, self.value, self.blind = lineno, kind, value, blind


def load(path):
    """Returns (meta, [Step]); raises AssertionError on a malformed file."""
    meta, steps = {}, []
    with open(path, encoding="utf-8") as f:
        for lineno, text in enumerate(f, 1):
            if not text.strip():
                continue
            line = json.loads(text)
            assert isinstance(line, dict), "%s:%d: not an object" % (path, lineno)
            keys = set(line)
            if keys == {"meta"}:
                assert not steps and not meta, "%s:%d: meta must be the first line" % (path, lineno)
                meta = line["meta"]
                assert set(meta) <= {"title", "args"}, "%s:%d: unknown meta key" % (path, lineno)
            elif keys == {"comment"}:
                pass
            elif keys in ({"send"}, {"send", "schema_blind"}):
                assert isinstance(line["send"], dict), "%s:%d: send needs an object" % (path, lineno)
                steps.append(Step(lineno, "send", line["send"], line.get("schema_blind")))
            elif keys == {"send_raw"}:
                steps.append(Step(lineno, "send_raw", line["send_raw"]))
            elif keys == {"send_raw_b64"}:
                steps.append(Step(lineno, "send_raw_b64", base64.b64decode(line["send_raw_b64"], validate=True)))
            elif keys == {"expect"}:
                steps.append(Step(lineno, "expect", line["expect"]))
            else:
                raise AssertionError("%s:%d: unknown line %s" % (path, lineno, sorted(keys)))
    return meta, steps


def substitute(value, captures):
    """Replaces every string "$=name" in value by the captured value ("$$..." stands for
    the literal "$...")."""
    if isinstance(value, str):
        if value.startswith("$$"):
            return value[1:]
        if value.startswith("$="):
            name = value[2:]
            assert name in captures, "nothing captured as %r yet" % name
            return copy.deepcopy(captures[name])
        return value
    if isinstance(value, list):
        return [substitute(v, captures) for v in value]
    if isinstance(value, dict):
        return {k: substitute(v, captures) for k, v in value.items()}
    return value


def wire_bytes(step, captures):
    """The bytes a send step writes, newline included."""
    if step.kind == "send":
        req = substitute(step.value, captures)
        return json.dumps(req, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"
    if step.kind == "send_raw":
        return step.value.encode("utf-8") + b"\n"
    return step.value + b"\n"


def request_lines(data):
    """Splits sent bytes into the lines that get an answer: for each non-blank line, the
    parsed request object, or None when it is not a JSON object in valid UTF-8."""
    out = []
    for line in data.split(b"\n")[:-1]:
        if line.strip(b" \t\r") == b"":
            continue
        try:
            obj = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            obj = None
        out.append(obj if isinstance(obj, dict) else None)
    return out


# ---------------------------------------------------------------- matching

class Mismatch(Exception):
    pass


def match(pattern, actual, captures, path="$"):
    """Raises Mismatch naming the first place where actual does not fit pattern."""
    if isinstance(pattern, str) and pattern.startswith("$"):
        if pattern.startswith("$$"):
            pattern = pattern[1:]
        elif pattern.startswith("$="):
            name = pattern[2:]
            if name not in captures:
                raise Mismatch("%s: nothing captured as %r" % (path, name))
            if not json_equal(captures[name], actual):
                raise Mismatch("%s: expected %s (captured %s), got %s"
                               % (path, json.dumps(captures[name]), name, json.dumps(actual)))
            return
        elif pattern.startswith("$RE:"):
            if not isinstance(actual, str):
                raise Mismatch("%s: expected a string, got %s" % (path, json.dumps(actual)))

            def ref(m):
                if m.group(1) not in captures:
                    raise Mismatch("%s: nothing captured as %r" % (path, m.group(1)))
                return re.escape(str(captures[m.group(1)]))
            regex = REF_IN_RE.sub(ref, pattern[4:])
            if not re.fullmatch(regex, actual):
                raise Mismatch("%s: %s does not match /%s/" % (path, json.dumps(actual), regex))
            return
        else:
            m = PLACEHOLDER.match(pattern)
            if not m:
                raise Mismatch("%s: unknown pattern %s" % (path, pattern))
            kind, name = m.groups()
            ok = {"ULID": isinstance(actual, str) and ULID_RE.match(actual) is not None,
                  "INT": isinstance(actual, int) and not isinstance(actual, bool),
                  "STR": isinstance(actual, str),
                  "ANY": True}[kind]
            if not ok:
                raise Mismatch("%s: expected %s, got %s" % (path, pattern, json.dumps(actual)))
            if name is not None:
                if name in captures:
                    if not json_equal(captures[name], actual):
                        raise Mismatch("%s: expected %s (captured %s), got %s"
                                       % (path, json.dumps(captures[name]), name, json.dumps(actual)))
                else:
                    captures[name] = copy.deepcopy(actual)
            return
    if isinstance(pattern, dict):
        if not isinstance(actual, dict):
            raise Mismatch("%s: expected an object, got %s" % (path, json.dumps(actual)))
        if set(pattern) != set(actual):
            raise Mismatch("%s: keys differ: missing %s, unexpected %s"
                           % (path, sorted(set(pattern) - set(actual)), sorted(set(actual) - set(pattern))))
        for k in pattern:
            match(pattern[k], actual[k], captures, "%s.%s" % (path, k))
        return
    if isinstance(pattern, list):
        if not isinstance(actual, list):
            raise Mismatch("%s: expected an array, got %s" % (path, json.dumps(actual)))
        if len(pattern) != len(actual):
            raise Mismatch("%s: expected %d items, got %d: %s" % (path, len(pattern), len(actual), json.dumps(actual)))
        for i, (p, a) in enumerate(zip(pattern, actual)):
            match(p, a, captures, "%s[%d]" % (path, i))
        return
    if not json_equal(pattern, actual):
        raise Mismatch("%s: expected %s, got %s" % (path, json.dumps(pattern), json.dumps(actual)))


def instantiate(pattern):
    """The pattern with every placeholder replaced by WILDCARD, for schema checks."""
    if isinstance(pattern, str) and pattern.startswith("$") and not pattern.startswith("$$"):
        return WILDCARD
    if isinstance(pattern, str) and pattern.startswith("$$"):
        return pattern[1:]
    if isinstance(pattern, list):
        return [instantiate(p) for p in pattern]
    if isinstance(pattern, dict):
        return {k: instantiate(v) for k, v in pattern.items()}
    return pattern


def capture_names(pattern, out):
    """Collects name -> kind for every "$KIND:name" in pattern."""
    if isinstance(pattern, str):
        m = PLACEHOLDER.match(pattern)
        if m and m.group(2):
            out.setdefault(m.group(2), m.group(1))
    elif isinstance(pattern, list):
        for p in pattern:
            capture_names(p, out)
    elif isinstance(pattern, dict):
        for p in pattern.values():
            capture_names(p, out)


def result_schema(op, req=None):
    """The schema of op's result; stats has another shape with "format": "prometheus"."""
    if op in ("add_user", "add_assistant", "add_message"):
        return "result-add.schema.json"
    if op == "stats" and isinstance(req, dict) and req.get("format") == "prometheus":
        return "result-stats-prometheus.schema.json"
    return "result-%s.schema.json" % op


def schema_errors_for_response(req, response):
    """Schema errors of one response (actual, or an instantiated pattern)."""
    v = validator()
    errors = v.validate(response, "response.schema.json")
    if errors:
        return errors
    if isinstance(response, dict) and response.get("ok") is True:
        op = req.get("op") if isinstance(req, dict) else None
        if op not in OPS:
            return ["a success answer to a request without a known op"]
        return v.validate(response["result"], result_schema(op, req))
    return []


# ---------------------------------------------------------------- the tests

def pairs(steps):
    """Yields (request-or-None, send step, expect step) pairing each expect with the
    non-blank line it answers; example values stand in for captures."""
    captures = {}
    pending = []
    for step in steps:
        if step.kind == "expect":
            assert pending, "line %d: an expect without a pending request" % step.lineno
            req, send = pending.pop(0)
            names = {}
            capture_names(step.value, names)
            for name, kind in names.items():
                captures.setdefault(name, EXAMPLE[kind])
            yield req, send, step
        else:
            for req in request_lines(wire_bytes(step, captures)):
                pending.append((req, step))
    assert not pending, "requests without an expect at the end (line %d)" % pending[0][1].lineno


def test_transcripts_exist():
    names = {os.path.basename(p) for p in TRANSCRIPTS}
    assert "worked_example.jsonl" in names
    for code in ("parse_error", "too_large", "unknown_op", "bad_request", "not_found", "conflict"):
        assert any(code in n for n in names), "no transcript for " + code


def test_schemas_are_well_formed():
    v = validator()
    assert v.check_schemas() == []
    for op in OPS:
        assert result_schema(op) in v.names(), "no result schema for " + op
    assert result_schema("stats", {"op": "stats", "format": "prometheus"}) in v.names()


def test_validator_rejects_what_it_should():
    """The subset validator must really reject: a test that always passes proves nothing."""
    v = validator()
    good = {"id": "01ARZ3NDEKTSV4RRFFQ69G5FAV", "message": {"role": "user", "contents": ["Hi"]},
            "metadata": {"timing": {"creation": 1}}}
    assert v.validate(good, "message-map.schema.json") == []
    bad = [
        dict(good, id="01arz3ndektsv4rrffq69g5fav"),
        dict(good, id="81ARZ3NDEKTSV4RRFFQ69G5FAV"),
        dict(good, message={"role": "system", "contents": ["Hi"]}),
        dict(good, message={"role": "user", "contents": []}),
        dict(good, metadata={"timing": {"creation": 1, "bogus": 2}}),
        dict(good, metadata={"timing": {"playStart": 1}}),
        dict(good, metadata={"timing": {"creation": True}}),
        dict(good, metadata={"timing": {"creation": 1}, "aux": {}}),
        dict(good, metadata={"timing": {"creation": 1}, "attribute": ["merged", "fake"]}),
        dict(good, metadata={"timing": {"creation": 1}, "summaryIds": ["01ARZ3NDEKTSV4RRFFQ69G5FAV"]}),
        dict(good, extra=1),
        {"id": good["id"], "message": {"role": "summary", "contents": ["s"]}, "metadata": {"timing": {"creation": 1}}},
    ]
    for b in bad:
        assert v.validate(b, "message-map.schema.json"), b
    assert v.validate({"op": "add_user", "conversation": "c", "contents": "\u00a0\u3000"}, "request.schema.json")
    assert v.validate({"op": "add_user", "conversation": "c", "contents": "\u200b"}, "request.schema.json") == []
    assert v.validate({"op": "add_message", "conversation": "c", "role": "summary", "contents": "x"}, "request.schema.json")
    assert v.validate({"op": "nope"}, "request.schema.json")
    assert v.validate({"op": "dead_letters", "limit": 0}, "request.schema.json")
    assert v.validate({"op": "dead_letters", "limit": 100}, "request.schema.json") == []
    assert v.validate({"op": "stats", "format": "yaml"}, "request.schema.json")
    # "conversation" is checked where an op takes it, an unknown field elsewhere.
    assert v.validate({"op": "describe", "conversation": ""}, "request.schema.json")
    assert v.validate({"op": "flush", "conversation": 5}, "request.schema.json")
    assert v.validate({"op": "ping", "conversation": 5}, "request.schema.json") == []
    assert v.validate({"op": "list", "conversation": ""}, "request.schema.json") == []
    assert v.validate({"format": "json", "text": "x"}, "result-stats-prometheus.schema.json")
    assert v.validate({"dead_letters": [{"conversation": "c", "sk": "x", "version": 1,
                                         "error": "e", "at": 1}]}, "result-dead_letters.schema.json")
    assert v.validate({"ok": False, "error": {"code": "bad_request", "message": "m"}, "result": {}},
                      "response.schema.json")
    assert v.validate({"ok": True}, "response.schema.json")


@pytest.mark.parametrize("path", TRANSCRIPTS, ids=lambda p: os.path.basename(p)[:-6])
def test_transcript_schemas(path):
    """Every request and expectation of the transcript against the JSON Schemas."""
    _, steps = load(path)
    v = validator()
    problems = []
    n = 0
    for req, send, exp in pairs(steps):
        n += 1
        where = "%s:%d (answering line %d)" % (os.path.basename(path), exp.lineno, send.lineno)
        pattern = exp.value
        ok = pattern.get("ok") if isinstance(pattern, dict) else None
        code = pattern.get("error", {}).get("code") if ok is False else None
        if ok is False and set(pattern["error"]) == {"code", "message"} and pattern["error"]["message"] != "$STR":
            problems.append("%s: error messages are matched with \"$STR\"" % where)
        if req is None:
            if code not in ("parse_error", "too_large"):
                problems.append("%s: a line that is not a JSON object must get parse_error or too_large" % where)
        else:
            errors = v.validate(req, "request.schema.json")
            if ok is True or code in ("not_found", "conflict", "unavailable"):
                if errors:
                    problems.append("%s: request should be schema-valid: %s" % (where, errors))
            elif code in ("bad_request", "unknown_op") and not send.blind:
                if not errors:
                    problems.append("%s: request should be schema-invalid (%s)" % (where, code))
            elif code == "parse_error":
                problems.append("%s: a JSON object cannot get parse_error" % where)
            # The id: echoed exactly, except for unreadable lines.
            if "id" in req and code not in ("parse_error", "too_large"):
                if "id" not in pattern or not json_equal(pattern["id"], req["id"]):
                    problems.append("%s: the expectation must echo the id %s" % (where, json.dumps(req["id"])))
            if "id" not in req and "id" in pattern:
                problems.append("%s: an id is expected but none was sent" % where)
        errors = schema_errors_for_response(req, instantiate(pattern))
        if errors:
            problems.append("%s: expectation does not fit the schema: %s" % (where, errors))
    assert n > 0, "no expectations"
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", TRANSCRIPTS, ids=lambda p: os.path.basename(p)[:-6])
def test_transcript_replay(path, daemon_factory):
    """A fresh daemon, one connection, every line in order; responses match and fit the
    schemas."""
    meta, steps = load(path)
    d = daemon_factory(args=meta.get("args", []))
    conn = d.connect()
    name = os.path.basename(path)
    captures = {}
    pending = []
    for step in steps:
        if step.kind != "expect":
            data = wire_bytes(step, captures)
            conn.send_raw(data)
            pending += [(req, step) for req in request_lines(data)]
            continue
        assert pending, "%s:%d: expect without a pending request" % (name, step.lineno)
        req, send = pending.pop(0)
        line = conn.recv_line()
        try:
            actual = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as e:
            pytest.fail("%s:%d: response is not JSON (%s): %r" % (name, step.lineno, e, line[:500]))
        try:
            match(step.value, actual, captures)
        except Mismatch as e:
            pytest.fail("%s:%d (answering line %d): %s\n  expected: %s\n  got:      %s"
                        % (name, step.lineno, send.lineno, e, json.dumps(step.value, ensure_ascii=False),
                           line.decode("utf-8", "replace")))
        errors = schema_errors_for_response(req, actual)
        assert not errors, "%s:%d: response does not fit the schema: %s\n  got: %s" % (
            name, step.lineno, errors, line.decode("utf-8", "replace"))
    assert not pending, "%s: requests without an expect at the end" % name
    # Nothing else may have been answered: the next line must be this ping's.
    conn.send({"id": "end-of-transcript", "op": "ping"})
    last = json.loads(conn.recv_line())
    assert last.get("id") == "end-of-transcript" and last.get("ok") is True, \
        "%s: an extra response after the transcript: %s" % (name, last)
