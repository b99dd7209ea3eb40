"""A minimal DynamoDB client for the tests, standard library only.

Speaks the DynamoDB JSON protocol (POST / with X-Amz-Target) over urllib and signs every
request with AWS Signature Version 4 (service "dynamodb"). dynalite does not check
signatures, but the requests are well formed so the same code works against any
DynamoDB-compatible endpoint. Used to set up tables and to read back what convod wrote.
"""
import datetime
import hashlib
import hmac
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request

TARGET_PREFIX = "DynamoDB_20120810."
CONTENT_TYPE = "application/x-amz-json-1.0"


class DdbError(Exception):
    """A DynamoDB error answer: HTTP status, short error type and message."""

    def __init__(self, status, type_, message, body=b""):
        super().__init__("%s %s: %s" % (status, type_, message))
        self.status = status
        self.type = type_
        self.message = message
        self.body = body


def credentials():
    """(access key, secret key, session token or None, region) from the environment,
    with dummy values when unset (dynalite accepts any)."""
    return (os.environ.get("AWS_ACCESS_KEY_ID", "AKIDCONVODTEST"),
            os.environ.get("AWS_SECRET_ACCESS_KEY", "convod-test-secret"),
            os.environ.get("AWS_SESSION_TOKEN") or None,
            os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")


# --- Signature Version 4 -------------------------------------------------------------


def _sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _canonical_value(v: str) -> str:
    # Trim and collapse runs of spaces (AWS: "Trimall"); header folding is joined by ','.
    return " ".join(v.strip().split())


def canonical_request(method, path, query, headers, body):
    """headers: list of (name, value) pairs, names as sent. Returns (creq, signed headers)."""
    merged = {}
    for name, value in headers:
        merged.setdefault(name.lower(), []).append(_canonical_value(value))
    names = sorted(merged)
    canon_headers = "".join("%s:%s\n" % (n, ",".join(merged[n])) for n in names)
    signed = ";".join(names)
    pairs = sorted(urllib.parse.parse_qsl(query, keep_blank_values=True))
    canon_query = "&".join("%s=%s" % (urllib.parse.quote(k, safe="-_.~"),
                                      urllib.parse.quote(v, safe="-_.~")) for k, v in pairs)
    creq = "\n".join([method, path, canon_query, canon_headers, signed, _sha256_hex(body)])
    return creq, signed


def sign(method, path, query, headers, body, amz_date, region, service, access_key,
         secret_key):
    """Returns (Authorization header value, canonical request, string to sign).
    headers must already hold Host, X-Amz-Date and any X-Amz-Security-Token."""
    creq, signed = canonical_request(method, path, query, headers, body)
    day = amz_date[:8]
    scope = "%s/%s/%s/aws4_request" % (day, region, service)
    sts = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, _sha256_hex(creq.encode())])
    key = _hmac(("AWS4" + secret_key).encode(), day)
    key = _hmac(key, region)
    key = _hmac(key, service)
    key = _hmac(key, "aws4_request")
    sig = hmac.new(key, sts.encode(), hashlib.sha256).hexdigest()
    authz = "AWS4-HMAC-SHA256 Credential=%s/%s, SignedHeaders=%s, Signature=%s" % (
        access_key, scope, signed, sig)
    return authz, creq, sts


def signed_headers(endpoint, operation, body, now=None):
    """The full header set of one DynamoDB request to endpoint, signed."""
    access, secret, token, region = credentials()
    u = urllib.parse.urlsplit(endpoint)
    now = now or datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    headers = [("Host", u.netloc), ("Content-Type", CONTENT_TYPE), ("X-Amz-Date", amz_date),
               ("X-Amz-Target", TARGET_PREFIX + operation)]
    if token:
        headers.append(("X-Amz-Security-Token", token))
    authz, _, _ = sign("POST", "/", "", headers, body, amz_date, region, "dynamodb", access,
                       secret)
    headers.append(("Authorization", authz))
    return headers


# --- requests ------------------------------------------------------------------------


def request(endpoint, operation, payload, timeout=10.0):
    """Sends one operation; returns the decoded answer or raises DdbError."""
    body = json.dumps(payload).encode()
    req = urllib.request.Request(endpoint.rstrip("/") + "/", data=body, method="POST")
    for name, value in signed_headers(endpoint, operation, body):
        if name != "Host":  # urllib sets Host itself, to the same value
            req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            data = resp.read()
            return json.loads(data) if data else {}
    except urllib.error.HTTPError as e:
        data = e.read()
        try:
            doc = json.loads(data)
        except ValueError:
            doc = {}
        type_ = str(doc.get("__type", "")).rsplit("#", 1)[-1]
        msg = doc.get("message", doc.get("Message", data.decode(errors="replace")))
        raise DdbError(e.code, type_, msg, data) from None


def create_table(endpoint, table, wait=True, timeout=30.0):
    """Creates table with keys conversation (S, HASH) and sk (S, RANGE), on-demand;
    waits until it is ACTIVE unless wait is False."""
    request(endpoint, "CreateTable", {
        "TableName": table,
        "AttributeDefinitions": [{"AttributeName": "conversation", "AttributeType": "S"},
                                 {"AttributeName": "sk", "AttributeType": "S"}],
        "KeySchema": [{"AttributeName": "conversation", "KeyType": "HASH"},
                      {"AttributeName": "sk", "KeyType": "RANGE"}],
        "BillingMode": "PAY_PER_REQUEST",
    })
    if wait:
        wait_status(endpoint, table, "ACTIVE", timeout)


def describe_table(endpoint, table):
    return request(endpoint, "DescribeTable", {"TableName": table})["Table"]


def wait_status(endpoint, table, status, timeout=30.0):
    deadline = time.time() + timeout
    while True:
        try:
            current = describe_table(endpoint, table)["TableStatus"]
        except DdbError as e:
            if status is None and e.type == "ResourceNotFoundException":
                return
            raise
        if current == status:
            return
        if time.time() > deadline:
            raise TimeoutError("table %s still %s after %ss" % (table, current, timeout))
        time.sleep(0.02)


def delete_table(endpoint, table, wait=True, timeout=30.0):
    """Deletes table; waits until it is gone unless wait is False."""
    request(endpoint, "DeleteTable", {"TableName": table})
    if wait:
        wait_status(endpoint, table, None, timeout)


def list_tables(endpoint):
    names, start = [], None
    while True:
        payload = {"ExclusiveStartTableName": start} if start else {}
        r = request(endpoint, "ListTables", payload)
        names += r.get("TableNames", [])
        start = r.get("LastEvaluatedTableName")
        if not start:
            return names


def query_all(endpoint, table, conversation, limit=None):
    """Every item of one conversation in sort-key order, following LastEvaluatedKey.
    limit, if given, is the page size (to exercise paging)."""
    items, start = [], None
    while True:
        payload = {"TableName": table, "ConsistentRead": True,
                   "KeyConditionExpression": "#c = :c",
                   "ExpressionAttributeNames": {"#c": "conversation"},
                   "ExpressionAttributeValues": {":c": {"S": conversation}}}
        if limit:
            payload["Limit"] = limit
        if start:
            payload["ExclusiveStartKey"] = start
        r = request(endpoint, "Query", payload)
        items += r.get("Items", [])
        start = r.get("LastEvaluatedKey")
        if not start:
            return items


def scan_all(endpoint, table, limit=None):
    """Every item of the table, following LastEvaluatedKey."""
    items, start = [], None
    while True:
        payload = {"TableName": table, "ConsistentRead": True}
        if limit:
            payload["Limit"] = limit
        if start:
            payload["ExclusiveStartKey"] = start
        r = request(endpoint, "Scan", payload)
        items += r.get("Items", [])
        start = r.get("LastEvaluatedKey")
        if not start:
            return items


def batch_write(endpoint, table, items):
    """One BatchWriteItem of PutRequests (at most 25 items); returns the answer
    (UnprocessedItems is {} or absent when everything was written)."""
    return request(endpoint, "BatchWriteItem", {
        "RequestItems": {table: [{"PutRequest": {"Item": it}} for it in items]}})


def put_item(endpoint, table, item):
    return request(endpoint, "PutItem", {"TableName": table, "Item": item})


def get_item(endpoint, table, conversation, sk):
    r = request(endpoint, "GetItem", {"TableName": table, "ConsistentRead": True,
                                      "Key": {"conversation": {"S": conversation},
                                              "sk": {"S": sk}}})
    return r.get("Item")


# --- AttributeValue <-> Python -------------------------------------------------------


def to_av(v):
    """A JSON-like Python value as a DynamoDB AttributeValue (the mapping persistence.md
    gives for aux: None->NULL, bool->BOOL, number->N, str->S, list->L, dict->M)."""
    if v is None:
        return {"NULL": True}
    if isinstance(v, bool):
        return {"BOOL": v}
    if isinstance(v, (int, float)):
        return {"N": repr(v) if isinstance(v, float) else str(v)}
    if isinstance(v, str):
        return {"S": v}
    if isinstance(v, (list, tuple)):
        return {"L": [to_av(x) for x in v]}
    if isinstance(v, dict):
        return {"M": {k: to_av(x) for k, x in v.items()}}
    raise TypeError("no AttributeValue for %r" % type(v))


def from_av(av):
    """The inverse of to_av; N becomes int when integral, else float."""
    (t, v), = av.items()
    if t == "NULL":
        return None
    if t in ("BOOL", "S"):
        return v
    if t == "N":
        try:
            return int(v)
        except ValueError:
            return float(v)
    if t == "L":
        return [from_av(x) for x in v]
    if t == "M":
        return {k: from_av(x) for k, x in v.items()}
    if t == "SS":
        return set(v)
    raise ValueError("unsupported AttributeValue type %s" % t)


def from_item(item):
    """An item (name -> AttributeValue) as a plain dict."""
    return {k: from_av(v) for k, v in item.items()}
