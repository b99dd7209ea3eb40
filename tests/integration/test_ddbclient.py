"""The daemon's DynamoDB client (daemon/ddbclient.c, daemon/awsconf.c) through
ddbclient_probe: a full write/read round trip against dynalite, the failure paths (refused,
timeout, close with requests in flight) with and without valgrind, and the exact request it
sends, captured by a local HTTP server and its SigV4 signature recomputed by ddb.py's
independent signer.
"""
import datetime
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import zlib

import pytest

import ddb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe_path():
    if os.environ.get("DDBCLIENT_PROBE_BIN"):
        return os.environ["DDBCLIENT_PROBE_BIN"]
    convod = os.environ.get("CONVOD_BIN")
    build = os.path.dirname(os.path.dirname(convod)) if convod else os.path.join(ROOT, "build")
    return os.path.join(build, "tests", "integration", "ddbclient_probe")


PROBE = _probe_path()


@pytest.fixture(scope="module")
def probe():
    assert os.path.exists(PROBE), "ddbclient_probe not built at %s" % PROBE
    return PROBE


def _is_asan(path):
    with open(path, "rb") as f:
        return b"__asan_init" in f.read()


def _clean_env(home, **extra):
    """An environment with no AWS settings but extra, no files of the real HOME, and no
    proxy (libcurl would honour one, even for the loopback servers of these tests)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AWS_") and not k.lower().endswith("_proxy")}
    env["HOME"] = str(home)
    env["AWS_SHARED_CREDENTIALS_FILE"] = str(home / "no-credentials")
    env["AWS_CONFIG_FILE"] = str(home / "no-config")
    env.update(extra)
    return env


def _run(cmd, env, stdin=b"", timeout=120):
    return subprocess.run(cmd, env=env, input=stdin, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, timeout=timeout)


def _valgrind(probe):
    vg = shutil.which("valgrind")
    if vg is None or _is_asan(probe):
        return None
    return [vg, "-q", "--leak-check=full", "--errors-for-leak-kinds=definite,indirect",
            "--error-exitcode=9"]


def _assert_passed(r, mode):
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 0, err[-4000:]
    m = re.search(r"ddbclient_probe %s: (\d+) checks, 0 failed" % mode, err)
    assert m and int(m.group(1)) > 0, err[-4000:]
    return err


def test_failure_paths(probe, tmp_path):
    r = _run([probe, "failures"], _clean_env(tmp_path))
    err = _assert_passed(r, "failures")
    assert "refused:" in err and "timeout:" in err


def test_failure_paths_valgrind(probe, tmp_path):
    vg = _valgrind(probe)
    if vg is None:
        pytest.skip("valgrind missing, or an ASan build (which checks leaks itself)")
    r = _run(vg + [probe, "failures"], _clean_env(tmp_path))
    _assert_passed(r, "failures")


def test_roundtrip_dynalite(probe, dynalite, tmp_path):
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL_DYNAMODB=dynalite, AWS_REGION="us-east-1",
                     AWS_ACCESS_KEY_ID="AKIDPROBE00000001", AWS_SECRET_ACCESS_KEY="probe-secret")
    r = _run([probe, "roundtrip"], env)
    err = _assert_passed(r, "roundtrip")
    assert "read 100 items in 4 pages, 100 matched" in err
    # the log line of awsconf: masked key id, never the secret
    assert "****0001" in err and "AKIDPROBE00000001" not in err
    assert "probe-secret" not in err


def test_roundtrip_dynalite_valgrind(probe, dynalite, tmp_path):
    vg = _valgrind(probe)
    if vg is None:
        pytest.skip("valgrind missing, or an ASan build (which checks leaks itself)")
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL_DYNAMODB=dynalite)
    r = _run(vg + [probe, "roundtrip"], env, timeout=300)
    err = _assert_passed(r, "roundtrip")
    assert "100 matched" in err


class _Capture(http.server.ThreadingHTTPServer):
    """Answers every POST with (status, body) and keeps what it received. raw_headers are
    header lines (bytes, no CRLF) sent verbatim after the usual ones; interim, when given,
    is written verbatim (a whole 1xx response) before the answer."""

    daemon_threads = True

    def __init__(self, status, body, request_id, raw_headers=(), interim=None):
        self.reply = (status, body, request_id)
        self.raw_headers = list(raw_headers)
        self.interim = interim
        self.requests = []
        super().__init__(("127.0.0.1", 0), _CaptureHandler)


class _CaptureHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server's naming)
        length = int(self.headers.get("Content-Length", "0"))
        body = self.rfile.read(length)
        self.server.requests.append({
            "method": self.command, "path": self.path,
            "headers": list(self.headers.items()), "body": body})
        status, answer, request_id = self.server.reply
        if self.server.interim is not None:
            self.wfile.write(self.server.interim)
        self.send_response(status)
        self.send_header("Content-Type", "application/x-amz-json-1.0")
        self.send_header("x-amzn-RequestId", request_id)
        self.send_header("Content-Length", str(len(answer)))
        for line in self.server.raw_headers:
            # send_header would put a space after the colon and refuse line breaks
            self._headers_buffer.append(line + b"\r\n")
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def capture():
    servers = []

    def make(status=200, body=b'{"TableNames":[]}', request_id="REQ-1234", raw_headers=(),
             interim=None):
        srv = _Capture(status, body, request_id, raw_headers, interim)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _header(req, name):
    values = [v for k, v in req["headers"] if k.lower() == name.lower()]
    assert len(values) <= 1, (name, values)
    return values[0] if values else None


def test_signed_request(probe, capture, tmp_path):
    """Credentials and region from the shared files of a named profile; the request as
    sent is checked header by header and its signature recomputed independently."""
    srv = capture(body=b'{"Table":{"TableStatus":"ACTIVE"}}', request_id="RID-42")
    port = srv.server_address[1]
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = AKIDWRONG\naws_secret_access_key = no\n"
                     "# the profile in use\n[probe]\naws_access_key_id = AKIDFILE00009876\n"
                     "aws_secret_access_key = file/secret+key\n"
                     "aws_session_token = tok/en+token==\n")
    config = tmp_path / "config"
    config.write_text("[profile probe]\nregion = eu-west-3\n")
    env = _clean_env(tmp_path, AWS_PROFILE="probe", AWS_SHARED_CREDENTIALS_FILE=str(creds),
                     AWS_CONFIG_FILE=str(config),
                     AWS_ENDPOINT_URL="http://127.0.0.1:%d" % port)
    body = json.dumps({"TableName": "convod-\u00e9t\u00e9", "n": list(range(300))}).encode()
    before = datetime.datetime.now(datetime.timezone.utc)
    r = _run([probe, "once", "DescribeTable"], env, stdin=body)
    _assert_passed(r, "once")
    out = json.loads(r.stdout)
    assert out == {**out, "operation": "DescribeTable", "status": 200, "error": "",
                   "body": '{"Table":{"TableStatus":"ACTIVE"}}', "request_id": "RID-42",
                   "timed_out": False, "canceled": False, "new_connections": 1}

    assert len(srv.requests) == 1
    req = srv.requests[0]
    assert req["method"] == "POST" and req["path"] == "/"
    assert req["body"] == body
    assert _header(req, "Host") == "127.0.0.1:%d" % port
    assert _header(req, "Content-Type") == "application/x-amz-json-1.0"
    assert _header(req, "X-Amz-Target") == "DynamoDB_20120810.DescribeTable"
    assert _header(req, "X-Amz-Security-Token") == "tok/en+token=="
    assert _header(req, "Expect") is None  # no 100-continue round trip
    amz_date = _header(req, "X-Amz-Date")
    assert re.fullmatch(r"\d{8}T\d{6}Z", amz_date)
    sent = datetime.datetime.strptime(amz_date, "%Y%m%dT%H%M%SZ").replace(
        tzinfo=datetime.timezone.utc)
    assert abs((sent - before).total_seconds()) < 60

    authz = _header(req, "Authorization")
    m = re.fullmatch(r"AWS4-HMAC-SHA256 Credential=([^/]+)/(\d{8})/([^/]+)/dynamodb/"
                     r"aws4_request, SignedHeaders=([a-z0-9;-]+), Signature=[0-9a-f]{64}", authz)
    assert m, authz
    assert m.group(1) == "AKIDFILE00009876" and m.group(3) == "eu-west-3"
    signed = m.group(4).split(";")
    for name in ("content-type", "host", "x-amz-date", "x-amz-security-token", "x-amz-target"):
        assert name in signed
    headers = [(k, v) for k, v in req["headers"] if k.lower() in signed]
    want, _, _ = ddb.sign("POST", "/", "", headers, body, amz_date, "eu-west-3", "dynamodb",
                          "AKIDFILE00009876", "file/secret+key")
    assert authz == want
    # the secret goes nowhere but into the signature
    assert b"file/secret+key" not in r.stderr + r.stdout


def test_error_answer_passed_through(probe, capture, tmp_path):
    answer = (b'{"__type":"com.amazonaws.dynamodb.v20120810#ProvisionedThroughputExceeded'
              b'Exception","message":"slow down"}')
    srv = capture(status=400, body=answer, request_id="RID-THROTTLED")
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL_DYNAMODB="http://127.0.0.1:%d/"
                     % srv.server_address[1], AWS_ACCESS_KEY_ID="AKIDERR0000000001",
                     AWS_SECRET_ACCESS_KEY="s")
    r = _run([probe, "once", "BatchWriteItem"], env, stdin=b"")
    _assert_passed(r, "once")
    out = json.loads(r.stdout)
    assert out["status"] == 400 and out["error"] == ""
    assert out["body"] == answer.decode() and out["request_id"] == "RID-THROTTLED"
    req = srv.requests[0]
    assert req["body"] == b"" and _header(req, "Content-Length") == "0"
    # no region configured anywhere: signed for the default one
    assert "/us-east-1/dynamodb/aws4_request" in _header(req, "Authorization")
    assert _header(req, "X-Amz-Security-Token") is None


# ---- x-amz-crc32 ------------------------------------------------------------------------
# DynamoDB sends the CRC-32 of each answer's body in decimal; ddbclient takes an answer
# whose body does not match as no answer (status 0, damaged) unless ignore_crc32 is set.
# A header that is not a number of at most 32 bits is no checksum: the answer is taken.

CRC_BODY = b'{"Count":1,"Items":[{"id":{"S":"crc"}}]}'
CRC_RIGHT = zlib.crc32(CRC_BODY)
CRC_WRONG = CRC_RIGHT ^ 1
assert CRC_RIGHT not in (0, 0xFFFFFFFF, 4294967296 & 0xFFFFFFFF)


def _crc_line(value):
    return b"x-amz-crc32:" + (value if isinstance(value, bytes) else b"%d" % value)


def _crc_call(probe, capture, tmp_path, raw_headers, ignore=False, interim=None, vg=()):
    srv = capture(body=CRC_BODY, request_id="RID-CRC", raw_headers=raw_headers,
                  interim=interim)
    env = _clean_env(tmp_path, AWS_ENDPOINT_URL_DYNAMODB="http://127.0.0.1:%d"
                     % srv.server_address[1], AWS_ACCESS_KEY_ID="AKIDCRC00000001",
                     AWS_SECRET_ACCESS_KEY="s")
    cmd = list(vg) + [probe, "once", "Query"] + (["ignore-crc32"] if ignore else [])
    r = _run(cmd, env, stdin=b'{"TableName":"t"}', timeout=300 if vg else 120)
    _assert_passed(r, "once")
    assert len(srv.requests) == 1  # a damaged answer is not retried by ddbclient itself
    return json.loads(r.stdout)


def _assert_taken(out):
    assert (out["status"], out["error"], out["damaged"]) == (200, "", False), out
    assert out["body"] == CRC_BODY.decode() and out["request_id"] == "RID-CRC"


def _assert_damaged(out):
    assert out["status"] == 0 and out["damaged"] is True, out
    assert "x-amz-crc32" in out["error"] and "damaged" in out["error"]
    assert not out["timed_out"] and not out["canceled"]


@pytest.mark.parametrize("value", [
    CRC_RIGHT,
    b" %d" % CRC_RIGHT,          # the usual "name: value"
    b" \t%d \t" % CRC_RIGHT,     # blanks around the number
    b" 000%d" % CRC_RIGHT,       # leading zeros are still the number
], ids=["bare", "space", "blanks", "zeros"])
def test_crc32_right_is_taken(probe, capture, tmp_path, value):
    _assert_taken(_crc_call(probe, capture, tmp_path, [_crc_line(value)]))


@pytest.mark.parametrize("line", [
    _crc_line(CRC_WRONG),
    _crc_line(b" %d " % CRC_WRONG),
    b"X-Amz-CRC32: %d" % CRC_WRONG,  # header names are case-insensitive
    _crc_line(b" 0"),                # 0 is a checksum like any other
    _crc_line(b" 4294967295"),       # the largest 32-bit value is still one
], ids=["bare", "blanks", "case", "zero", "max"])
def test_crc32_wrong_is_damaged(probe, capture, tmp_path, line):
    _assert_damaged(_crc_call(probe, capture, tmp_path, [line]))


def test_crc32_wrong_taken_with_ignore_crc32(probe, capture, tmp_path):
    _assert_taken(_crc_call(probe, capture, tmp_path, [_crc_line(b" %d" % CRC_WRONG)],
                            ignore=True))


@pytest.mark.parametrize("lines", [
    [],
    [b"x-amz-crc32:"],
    [b"x-amz-crc32:   \t"],
    [_crc_line(b" abc")],
    [_crc_line(b" 4294967296")],               # 2^32: would be 0 if truncated
    [_crc_line(b" %d" % (CRC_WRONG + (1 << 32)))],  # would be CRC_WRONG if truncated
    [_crc_line(b" 99999999999999999999999999")],  # beyond 64 bits too
    [_crc_line(b" +%d" % CRC_WRONG)],          # a sign is not a digit
    [_crc_line(b" -%d" % CRC_WRONG)],
    [_crc_line(b" %dabc" % CRC_WRONG)],        # a number followed by anything else
    [_crc_line(b" %d %d" % (CRC_WRONG, CRC_WRONG))],
    [_crc_line(b" 0x%x" % CRC_WRONG)],
    # an obsolete folded header whose first line is empty: no checksum
    [b"x-amz-crc32:", b" %d" % CRC_WRONG],
], ids=["absent", "empty", "blank", "letters", "2^32", "wrong+2^32", "huge", "plus", "minus",
        "trailing", "two-numbers", "hex", "folded"])
def test_crc32_no_checksum_is_taken(probe, capture, tmp_path, lines):
    _assert_taken(_crc_call(probe, capture, tmp_path, lines))


# The header twice: two different numbers contradict each other, and the answer is not
# believed whichever comes first; the same number twice is one checksum; something that is
# not a number leaves the one before in place.
@pytest.mark.parametrize("values,damaged", [
    ([CRC_RIGHT, CRC_RIGHT], False),
    ([CRC_RIGHT, CRC_WRONG], True),
    ([CRC_WRONG, CRC_RIGHT], True),
    ([CRC_WRONG, b" abc"], True),
    ([CRC_RIGHT, b""], False),
], ids=["same", "right-wrong", "wrong-right", "wrong-letters", "right-empty"])
def test_crc32_header_twice(probe, capture, tmp_path, values, damaged):
    out = _crc_call(probe, capture, tmp_path, [_crc_line(v) for v in values])
    (_assert_damaged if damaged else _assert_taken)(out)


def test_crc32_of_an_interim_response_is_forgotten(probe, capture, tmp_path):
    """A 100 Continue before the answer carries a wrong x-amz-crc32 of its own: the answer,
    which carries none, is taken; the one that carries the right one too."""
    interim = b"HTTP/1.1 100 Continue\r\nx-amz-crc32: %d\r\n\r\n" % CRC_WRONG
    _assert_taken(_crc_call(probe, capture, tmp_path, [], interim=interim))
    _assert_taken(_crc_call(probe, capture, tmp_path, [_crc_line(CRC_RIGHT)],
                            interim=interim))


def test_crc32_damaged_valgrind(probe, capture, tmp_path):
    vg = _valgrind(probe)
    if vg is None:
        pytest.skip("valgrind missing, or an ASan build (which checks leaks itself)")
    _assert_damaged(_crc_call(probe, capture, tmp_path, [_crc_line(CRC_WRONG)], vg=vg))
