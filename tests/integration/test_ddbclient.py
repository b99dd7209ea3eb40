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
    """Answers every POST with (status, body) and keeps what it received."""

    daemon_threads = True

    def __init__(self, status, body, request_id):
        self.reply = (status, body, request_id)
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
        self.send_response(status)
        self.send_header("Content-Type", "application/x-amz-json-1.0")
        self.send_header("x-amzn-RequestId", request_id)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture
def capture():
    servers = []

    def make(status=200, body=b'{"TableNames":[]}', request_id="REQ-1234"):
        srv = _Capture(status, body, request_id)
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
