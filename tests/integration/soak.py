#!/usr/bin/python3
"""Soak test of convod (issue 5): many client connections for a long time, with mixed
traffic, random disconnects, a flapping DynamoDB sink and one kill -9 and restart; then
every acknowledged message must be stored exactly once, and memory must be back to its
baseline.

By hand (starts dynalite, the fault proxy and the daemon itself; prints a summary; exits 1
on failure):

    /usr/bin/python3 tests/integration/soak.py --minutes 10 --connections 200

CONVOD_BIN selects the daemon binary (default build/daemon/convod). test_soak.py runs a
short version in CI through run_soak().

What happens, on one thread (selectors) plus a thread that flaps the sink:

- N connections each wake at random times and pick an action: add_user / add_assistant /
  add_message (one string or a list, blank strings mixed in, metadata now and then, bursts
  of pipelined adds), get_messages in every format, to_messages_map (incremental, and in
  full as an online exactly-once check), get_summary_info followed by add_summary with the
  ids and versions it returned, set_metadata, describe, flush, close, list/stats/ping;
  and random disconnects: closing with requests in flight, a half-sent line, a plain close.
  Conversations are shared by several connections and retired (closed, replaced by a new
  one) after a random number of contents, so many conversations go through the daemon.
- The fault proxy in front of dynalite changes state every few seconds: healthy, refusing
  connections, a black hole, 500/503, throttling, UnprocessedItems, dropped connections,
  slow answers, a mix (with 200 answers that are HTML pages, not JSON).
- kill -9 of the daemon at a random moment of the first half (a few conversations closed
  just before), restart on the same state directory; the connections reconnect by
  themselves. Right after the restart: everything acknowledged is there, and no
  conversation closed before the kill (and untouched since) is restored as open
  (persistence.md, promise 5).
- After a warm-up, everything is quiesced (answers awaited, sink healthy, spool drained,
  every conversation closed, every connection closed) and the daemon's VmRSS taken as the
  baseline. Traffic goes on for the second half, then the same quiescing, the checks, and
  the same closing, and VmRSS is compared with the baseline.

The ledger: every content string sent is unique. An add answered ok:true is "acked" (with
the id of the message that holds it), ok:false is "refused", one whose answer never came
(disconnect, kill -9) is "unknown", the content of a half-sent line is "never". Checked on
the daemon's full log (to_messages_map incremental=false) and on the DynamoDB table:

- every acked content is there exactly once, in the message its answer named, with its role;
  the strings of one request are consecutive in one message;
- an unknown content is there at most once; refused and never contents are not there; no
  string is there that was never sent (fake "..." user messages aside);
- order: when A was acknowledged before B was sent, A comes before B in the log;
- the log's shape: roles alternate outside summaries, fake messages only where one is due,
  one "merged" attribute per request merged into a message;
- get_messages (the LLM view) is the log after its last summary, without summaries;
- the table holds exactly the daemon's log (sort keys, contents, metadata), no more.

During the run, each full to_messages_map is checked the same way against what had been
acknowledged when it was sent, and each add's answer must end with the strings it sent.
"""
import argparse
import collections
import contextlib
import heapq
import json
import os
import random
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import conftest  # noqa: E402  (Daemon, Conn, the dynalite fixture's generator)
import ddb  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402
from test_crash import kill9  # noqa: E402
from test_persistence import av_diff, ddb_env, expected_item, merged_version, sort_key  # noqa: E402

FORMATS = ("meta", "bedrock", "openai", "anthropic")
BLANKS = ("", " ", "\t\n", "\u3000", "\u00a0 ")  # dropped by the daemon (White_Space)
DECOR = ("", "", "", " \u00e9t\u00e9", " \u4e2d\u6587", " \U0001F600", ' "quoted"',
         " back\\slash", " tab\there", " line\nbreak", "  ", " {json:[1]}")
ADD_OPS = ("add_user", "add_assistant", "add_message")

# Sink states the flapper picks from: (name, weight).
SINK_MODES = (("healthy", 30), ("refuse", 10), ("blackhole", 7), ("500", 10), ("503", 5),
              ("throttle", 10), ("unprocessed", 8), ("drop", 8), ("slow", 5), ("mixed", 7))

# Client actions: (name, weight).
ACTIONS = (("add", 40), ("burst", 4), ("get_messages", 10), ("tmm_incremental", 5),
           ("verify", 3), ("summary", 3), ("set_metadata", 3), ("describe", 1), ("flush", 3),
           ("close", 2), ("misc", 2), ("split_write", 2), ("drop_inflight", 1),
           ("half_line", 0.6), ("disconnect", 0.4))


class Config:
    """Knobs of one run. seconds: traffic time in all (kill, warm-up and baseline fall at
    fractions of it); rate: requests per second wanted over all connections."""

    def __init__(self, seconds=600.0, connections=200, conversations=None, rate=2000.0,
                 seed=None, kill_window=(0.25, 0.4), baseline_at=0.5, flap=(2.0, 5.0),
                 depth=16, retire=(30, 300), rss_slack_mib=8.0, rss_slack_frac=0.10,
                 drain_timeout=300.0, rss_check="raw", trim_probe=False, timeout_scale=1.0,
                 log=print):
        self.seconds = float(seconds)
        self.connections = int(connections)
        self.conversations = int(conversations or 2 * connections)
        self.rate = float(rate)
        self.seed = int(seed if seed is not None else random.SystemRandom().randrange(1 << 30))
        self.kill_window = kill_window
        self.baseline_at = baseline_at
        self.flap = flap
        self.depth = depth
        self.retire = retire
        self.rss_slack_mib = rss_slack_mib
        self.rss_slack_frac = rss_slack_frac
        self.timeout_scale = timeout_scale  # waits are multiplied by it (valgrind: 10)
        self.drain_timeout = drain_timeout * timeout_scale
        self.rss_check = rss_check  # "raw" VmRSS, or "trimmed" (after malloc_trim(0))
        self.trim_probe = trim_probe or rss_check == "trimmed"
        self.log = log


def daemon_args(table):
    """convod's options for the soak: DynamoDB sink at durability process, with short
    flush, idle, retry and timeout periods so that the flapping sink is felt often."""
    return ["--dynamodb-table", table, "--durability", "process", "--flush-interval", "100",
            "--idle-ms", "500", "--retry-base-ms", "20", "--retry-max-ms", "1000",
            "--request-timeout-ms", "2000", "--connect-timeout-ms", "1000",
            "--drain-ms", "2000", "--log-level", "warn"]


def rss_kib(pid):
    """VmRSS and VmHWM of a process, in KiB."""
    out = {}
    with open("/proc/%d/status" % pid) as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0])
    return out["VmRSS"], out["VmHWM"]


def instrumented(pid):
    """"AddressSanitizer" or "valgrind" when the process runs under one (its RSS says
    nothing then: freed memory sits in a quarantine, and valgrind's own memory counts),
    else None."""
    try:
        with open("/proc/%d/maps" % pid) as f:
            maps = f.read()
    except OSError:
        return None
    if "libasan" in maps:
        return "AddressSanitizer"
    if "vgpreload" in maps or "memcheck" in maps:
        return "valgrind"
    return None


def malloc_trim(pid):
    """Has process pid call glibc's malloc_trim(0) (through gdb, which must be installed
    and allowed to attach); returns its VmRSS afterwards in KiB, or None."""
    try:
        r = subprocess.run(["gdb", "-nx", "-batch", "-p", str(pid), "-ex",
                            "call (int)malloc_trim(0)"], stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0 or b"$1 = " not in r.stdout:
        return None
    time.sleep(0.2)
    return rss_kib(pid)[0]


class SoakFailure(Exception):
    pass


# --- the ledger ------------------------------------------------------------------------


class Entry:
    """One content string sent: which conversation, request and role, and what became of
    it (pending, acked, refused, unknown, never) with the event numbers of send and
    answer (one counter for both, so "acked before sent" can be compared)."""
    __slots__ = ("text", "conv", "req", "role", "kind", "state", "send", "ack", "mid")

    def __init__(self, text, conv, req, role, kind, send):
        self.text, self.conv, self.req, self.role, self.kind = text, conv, req, role, kind
        self.state, self.send, self.ack, self.mid = "pending", send, None, None


INF = float("inf")


class Ledger:
    def __init__(self):
        self.entries = {}  # text -> Entry
        self.by_conv = collections.defaultdict(list)
        self.counts = collections.Counter()

    def add(self, e):
        assert e.text not in self.entries, e.text
        self.entries[e.text] = e
        self.by_conv[e.conv].append(e)
        self.counts["sent"] += 1

    def settle(self, e, state, ack=None, mid=None):
        if e.state != "pending":
            return
        e.state, e.ack, e.mid = state, ack, mid
        self.counts[state] += 1

    def acked_before(self, conv, cutoff):
        return any(e.state == "acked" and e.ack < cutoff for e in self.by_conv.get(conv, ()))

    def check(self, conv, maps, cutoff=None, where="daemon"):
        """Problems (strings) of the log `maps` of conv against the ledger. cutoff: the
        event number of the read; only what was acknowledged before it must be there.
        None: everything acknowledged must be."""
        probs = []
        p = probs.append
        present = {}  # text -> [(message index, content index, message id, role)]
        flat = []  # add contents in log order (summaries and fakes left out)
        for mi, m in enumerate(maps):
            role = m["message"]["role"]
            attrs = m.get("metadata", {}).get("attribute", [])
            contents = m["message"]["contents"]
            if "fake" in attrs:
                if contents != ["..."] or role != "user":
                    p("%s %s: fake message %s is %r" % (where, conv, m["id"], m["message"]))
                continue
            for ci, s in enumerate(contents):
                present.setdefault(s, []).append((mi, ci, m["id"], role))
                if role != "summary":
                    flat.append(s)
        for s, locs in present.items():
            e = self.entries.get(s)
            if e is None:
                p("%s %s: %r is in the log but was never sent" % (where, conv, s[:80]))
                continue
            if e.conv != conv:
                p("%s %s: %r belongs to conversation %s" % (where, conv, s[:80], e.conv))
                continue
            if len(locs) > 1:
                p("%s %s: %r is there %d times (%s, state %s)" % (
                    where, conv, s[:80], len(locs), [loc[2] for loc in locs], e.state))
            if e.state in ("refused", "never"):
                p("%s %s: %r is there but was %s" % (where, conv, s[:80], e.state))
            if e.state == "acked" and e.mid != locs[0][2]:
                p("%s %s: %r is in message %s, its answer named %s" % (
                    where, conv, s[:80], locs[0][2], e.mid))
            if locs[0][3] != e.role:
                p("%s %s: %r has role %s, sent as %s" % (where, conv, s[:80], locs[0][3],
                                                         e.role))
        reqs = collections.defaultdict(list)
        req_size = collections.Counter()
        for e in self.by_conv.get(conv, ()):
            req_size[e.req] += 1
            if e.state == "acked" and (cutoff is None or e.ack < cutoff) and e.text not in present:
                p("%s %s: acknowledged %r (message %s) is missing" % (where, conv, e.text[:80],
                                                                      e.mid))
            if e.text in present:
                reqs[e.req].append(e)
        # The strings of one request are consecutive in one message.
        for req, es in reqs.items():
            locs = [present[e.text][0] for e in es]
            if len({loc[0] for loc in locs}) != 1 or [loc[1] for loc in locs] != list(
                    range(locs[0][1], locs[0][1] + len(locs))):
                if len(es) == req_size[req]:
                    p("%s %s: the strings of request %s are not consecutive: %s" % (
                        where, conv, req, locs))
        # Order: A acknowledged before B was sent => A before B in the log.
        ents = [self.entries[s] for s in flat if s in self.entries]
        suffix_min = [INF] * (len(ents) + 1)
        for i in range(len(ents) - 1, -1, -1):
            a = ents[i].ack if ents[i].state == "acked" else INF
            suffix_min[i] = min(suffix_min[i + 1], a)
        for i, e in enumerate(ents):
            if suffix_min[i + 1] < e.send:
                later = next(x for x in ents[i + 1:] if x.state == "acked" and x.ack < e.send)
                p("%s %s: %r (sent at event %d) is before %r, acknowledged earlier (event %d)"
                  % (where, conv, e.text[:60], e.send, later.text[:60], later.ack))
                break
        # One "merged" per request merged into a message.
        by_msg = collections.defaultdict(set)
        for s, locs in present.items():
            e = self.entries.get(s)
            if e is not None and e.kind == "add":
                by_msg[locs[0][2]].add(e.req)
        for m in maps:
            if m["message"]["role"] == "summary" or m["id"] not in by_msg:
                continue
            merged = m.get("metadata", {}).get("attribute", []).count("merged")
            if merged != len(by_msg[m["id"]]) - 1:
                p("%s %s: message %s holds %d requests but says merged %d times" % (
                    where, conv, m["id"], len(by_msg[m["id"]]), merged))
        return probs


def shape_problems(conv, maps, where="daemon"):
    """semantics.md invariants visible in the whole log: without summaries, roles alternate
    starting with user; a fake user message only starts the log or follows a summary;
    ids strictly increase among non-summary messages."""
    probs = []
    prev = None
    after_summary = True
    last_id = ""
    for m in maps:
        role = m["message"]["role"]
        if role == "summary":
            after_summary = True
            continue
        if "fake" in m.get("metadata", {}).get("attribute", []) and not after_summary:
            probs.append("%s %s: fake message %s not at a view's start" % (where, conv, m["id"]))
        if (prev is None and role != "user") or prev == role:
            probs.append("%s %s: roles do not alternate at %s (%s after %s)" % (
                where, conv, m["id"], role, prev))
        if m["id"] <= last_id:
            probs.append("%s %s: id %s after %s" % (where, conv, m["id"], last_id))
        prev, last_id, after_summary = role, m["id"], False
    return probs


def llm_view(maps):
    """(messages, summary contents) that get_messages must answer, from the whole log."""
    last = None
    for i, m in enumerate(maps):
        if m["message"]["role"] == "summary":
            last = i
    start = 0 if last is None else last + 1
    view = [m for m in maps[start:] if m["message"]["role"] != "summary"]
    return view, (None if last is None else maps[last]["message"]["contents"])


def item_to_map(item):
    it = ddb.from_item(item)
    return {"id": it["id"], "message": it["message"], "metadata": it.get("metadata", {})}


# --- clients -----------------------------------------------------------------------------


class Req:
    """A request waiting for its answer."""
    __slots__ = ("id", "kind", "conv", "entries", "send", "extra")

    def __init__(self, id_, kind, conv, entries, send, extra=None):
        self.id, self.kind, self.conv, self.entries = id_, kind, conv, entries
        self.send, self.extra = send, extra


class Client:
    __slots__ = ("idx", "sock", "rbuf", "wbuf", "pending", "hold", "wake", "mask", "connects")

    def __init__(self, idx):
        self.idx = idx
        self.sock = None
        self.rbuf = b""
        self.wbuf = bytearray()
        self.pending = collections.deque()
        self.hold = None  # the second half of a split write
        self.wake = 0.0
        self.mask = 0
        self.connects = 0


class Soak:
    def __init__(self, daemon, proxy, endpoint, table, cfg):
        self.d, self.proxy, self.cfg = daemon, proxy, cfg
        self.endpoint, self.table = endpoint, table
        self.log = cfg.log
        self.rng = random.Random(cfg.seed)
        self.tag = "%08x" % self.rng.getrandbits(32)
        self.ledger = Ledger()
        self.failures = []
        self.nfail = 0
        self.stats = collections.Counter()
        self.errors = collections.Counter()
        self.event = 0
        self.next_id = 0
        self.text_no = 0
        self.conv_no = 0
        self.pool = []
        self.conv_sent = collections.Counter()
        self.conv_limit = {}
        self.convs_used = []
        self.convs_seen = set()
        self.last_mid = {}
        # For "a closed conversation is not restored at start" (persistence.md, promise 5):
        # requests naming each conversation still unanswered, conversations that a request
        # lost unanswered may have changed at any time, the last request sent naming each
        # conversation, and the conversations whose last request was a close sent when
        # nothing else on them was under way.
        self.conv_open = collections.Counter()
        self.conv_last = {}
        self.conv_unknown = set()
        self.closed_clean = {}
        self.sel = selectors.DefaultSelector()
        self.clients = [Client(i) for i in range(cfg.connections)]
        self.heap = []
        self.flap_lock = threading.Lock()
        self.flap_on = False
        self.flap_stop = threading.Event()
        self.flap_thread = None
        self.sink_modes = collections.Counter()
        self.sink_state = "healthy"
        self.rss = {}
        self.rss_peak = 0
        self.timeline = []
        self.action_names = [a for a, _ in ACTIONS]
        self.action_weights = [w for _, w in ACTIONS]
        for _ in range(cfg.conversations):
            self.pool.append(self._new_conv())

    # --- bookkeeping ---

    def fail(self, msg):
        self.nfail += 1
        if len(self.failures) < 60:
            self.failures.append(msg)
        if self.nfail <= 10:
            self.log("FAIL: " + msg)

    def tick(self):
        self.event += 1
        return self.event

    def _new_conv(self):
        self.conv_no += 1
        conv = "soak-%s-%d" % (self.tag, self.conv_no)
        self.conv_limit[conv] = self.rng.randint(*self.cfg.retire)
        return conv

    def _use(self, conv):
        if conv not in self.convs_seen:
            self.convs_seen.add(conv)
            self.convs_used.append(conv)

    def _text(self, kind):
        self.text_no += 1
        r = self.rng.random()
        lead = "  " if r < 0.05 else ""
        body = "%s%s:%s#%d%s" % (lead, kind, self.tag, self.text_no, self.rng.choice(DECOR))
        if r > 0.997:
            body += " " + "L" * self.rng.randint(10000, 30000)
        elif r > 0.97:
            body += " " + "l" * self.rng.randint(500, 4000)
        return body

    def _pick_conv(self):
        return self.pool[self.rng.randrange(len(self.pool))]

    def _retire_check(self, c, conv):
        if self.conv_sent[conv] < self.conv_limit[conv] or conv not in self.pool:
            return
        self.pool[self.pool.index(conv)] = self._new_conv()
        self.stats["retired"] += 1
        self._send(c, {"op": "close", "conversation": conv}, "close", conv)

    # --- socket plumbing ---

    def _schedule(self, c, at):
        c.wake = at
        heapq.heappush(self.heap, (at, c.idx, at))

    def _set_mask(self, c):
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.wbuf else 0)
        if want != c.mask:
            self.sel.modify(c.sock, want, c)
            c.mask = want

    def _connect(self, c):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(self.d.socket)
        except (BlockingIOError, FileNotFoundError, ConnectionRefusedError, OSError):
            s.close()
            self.stats["connect_retries"] += 1
            return False
        c.sock, c.rbuf, c.wbuf, c.hold, c.mask = s, b"", bytearray(), None, selectors.EVENT_READ
        c.connects += 1
        self.stats["connects"] += 1
        self.sel.register(s, selectors.EVENT_READ, c)
        return True

    def _lost(self, c, why):
        """The connection is gone: every request without an answer is unknown."""
        if c.sock is None:
            return
        try:
            self.sel.unregister(c.sock)
        except (KeyError, ValueError):
            pass
        c.sock.close()
        c.sock = None
        self.stats["lost:" + why] += 1
        for r in c.pending:
            for e in r.entries:
                self.ledger.settle(e, "unknown")
            if r.conv is not None and r.kind != "close":
                self.conv_open[r.conv] -= 1
                self.conv_unknown.add(r.conv)
            self.stats["unanswered"] += 1
        c.pending.clear()
        c.hold = None
        c.wbuf = bytearray()
        self._schedule(c, time.time() + self.rng.uniform(0.05, 0.3))

    def _flush_out(self, c):
        while c.wbuf:
            try:
                n = c.sock.send(c.wbuf)
            except BlockingIOError:
                break
            except OSError:
                self._lost(c, "write")
                return
            del c.wbuf[:n]
        self._set_mask(c)

    def _send(self, c, req, kind, conv=None, entries=(), extra=None, flush=True):
        self.next_id += 1
        req["id"] = self.next_id
        r = Req(self.next_id, kind, conv, list(entries), self.tick(), extra)
        for e in r.entries:
            e.send = r.send
            self.ledger.add(e)
        c.pending.append(r)
        if conv is not None:
            self.conv_last[conv] = r.id
            if kind == "close":
                r.extra = self.conv_open[conv] == 0 and conv not in self.conv_unknown
            else:
                self.conv_open[conv] += 1
                self.closed_clean.pop(conv, None)
        if c.hold is not None:  # a split write is under way: finish it first
            c.wbuf += c.hold
            c.hold = None
        ascii_ = self.rng.random() < 0.5
        c.wbuf += json.dumps(req, ensure_ascii=ascii_).encode() + b"\n"
        self.stats["sent"] += 1
        self.stats["op:" + req["op"]] += 1
        if flush:
            self._flush_out(c)
        return r

    def _readable(self, c):
        try:
            data = c.sock.recv(1 << 18)
        except BlockingIOError:
            return
        except OSError:
            self._lost(c, "read")
            return
        if not data:
            self._lost(c, "eof")
            return
        c.rbuf += data
        if b"\n" not in data:
            return
        lines = c.rbuf.split(b"\n")
        c.rbuf = lines.pop()
        for line in lines:
            if c.sock is None:
                return
            self._answer(c, line)

    # --- requests ---

    def _contents(self, conv, role):
        """One string or a list (with blank strings the daemon drops); the ledger entries."""
        n = 1 if self.rng.random() < 0.7 else self.rng.randint(1, 3)
        texts = [self._text(role[0]) for _ in range(n)]
        entries = [Entry(t, conv, None, role, "add", 0) for t in texts]
        if n == 1 and self.rng.random() < 0.6:
            return texts[0], entries
        out = list(texts)
        if self.rng.random() < 0.3:
            out.insert(self.rng.randint(0, len(out)), self.rng.choice(BLANKS))
        return out, entries

    def _add_request(self, conv):
        op = self.rng.choice(ADD_OPS)
        if op == "add_message":
            role = self.rng.choice(("user", "assistant"))
        else:
            role = "user" if op == "add_user" else "assistant"
        contents, entries = self._contents(conv, role)
        req = {"op": op, "conversation": conv, "contents": contents}
        if op == "add_message":
            req["role"] = role
        if self.rng.random() < 0.1:
            req["metadata"] = {"timing": {"listenEnd": int(time.time() * 1000)},
                               "aux": {"n": self.text_no, "soak": True}}
        self.conv_sent[conv] += len(entries)
        self._use(conv)
        return req, entries

    def _add(self, c, conv, flush=True):
        req, entries = self._add_request(conv)
        r = self._send(c, req, "add", conv, entries, extra=[e.text for e in entries], flush=flush)
        for e in entries:
            e.req = r.id
        return r

    def _act(self, c):
        if len(c.pending) >= self.cfg.depth:
            self._schedule(c, time.time() + 0.01)
            return
        a = self.rng.choices(self.action_names, self.action_weights)[0]
        self.stats["act:" + a] += 1
        conv = self._pick_conv()
        if a == "add":
            self._add(c, conv)
        elif a == "burst":
            for _ in range(self.rng.randint(2, 8)):
                self._add(c, conv, flush=False)
            self._flush_out(c)
        elif a == "get_messages":
            self._send(c, {"op": "get_messages", "conversation": conv,
                           "format": self.rng.choice(FORMATS)}, "read", conv)
        elif a == "tmm_incremental":
            self._send(c, {"op": "to_messages_map", "conversation": conv,
                           "exclude_last": self.rng.random() < 0.5}, "read", conv)
        elif a == "verify":
            self._send(c, {"op": "to_messages_map", "conversation": conv,
                           "incremental": False}, "verify", conv)
        elif a == "summary":
            self._send(c, {"op": "get_summary_info", "conversation": conv}, "sinfo", conv)
        elif a == "set_metadata":
            mid = self.last_mid.get(conv)
            if mid is None:
                self._add(c, conv)
            else:
                aux = {"soak": self.event, "by": c.idx}
                if self.rng.random() < 0.3:
                    aux["n"] = None
                self._send(c, {"op": "set_metadata", "conversation": conv, "message_id": mid,
                               "aux": aux, "timing": {"playStart": int(time.time() * 1000)}},
                           "meta", conv)
        elif a == "describe":
            self._send(c, {"op": "describe", "conversation": conv}, "read", conv)
        elif a == "flush":
            if self.rng.random() < 0.8:
                self._send(c, {"op": "flush", "conversation": conv}, "flush", conv)
            else:
                self._send(c, {"op": "flush"}, "misc")
        elif a == "close":
            self._send(c, {"op": "close", "conversation": conv}, "close", conv)
        elif a == "misc":
            self._send(c, {"op": self.rng.choice(("ping", "stats", "list"))}, "misc")
        elif a == "split_write":
            # One add written in two parts a little apart.
            self._add(c, conv, flush=False)
            line = bytes(c.wbuf)
            cut = self.rng.randint(1, len(line) - 1)
            c.wbuf = bytearray(line[:cut])
            c.hold = line[cut:]
            self._flush_out(c)
            if c.sock is not None:
                self._schedule(c, time.time() + self.rng.uniform(0.002, 0.05))
            return
        elif a in ("drop_inflight", "half_line", "disconnect"):
            if a == "drop_inflight":
                for _ in range(self.rng.randint(1, 4)):
                    self._add(c, conv, flush=False)
                self._flush_out(c)
            elif a == "half_line":
                if self.rng.random() < 0.5:
                    self._add(c, conv, flush=False)
                text = self._text("h")
                e = Entry(text, conv, -1, "user", "add", self.tick())
                self.ledger.add(e)
                self.ledger.settle(e, "never")
                line = json.dumps({"op": "add_user", "conversation": conv,
                                   "contents": text}).encode()
                c.wbuf += line[:self.rng.randint(1, len(line) - 1)]
                self._flush_out(c)
            if c.sock is not None:
                self.stats["disconnects:" + a] += 1
                self._lost(c, "by-client")
            return
        self._retire_check(c, conv)
        if c.sock is not None:
            per_conn = self.cfg.rate / self.cfg.connections
            self._schedule(c, time.time() + self.rng.expovariate(per_conn))

    def _answer(self, c, line):
        try:
            r = json.loads(line)
        except ValueError:
            self.fail("client %d: not JSON: %r" % (c.idx, line[:200]))
            return
        ack = self.tick()
        self.stats["answers"] += 1
        if not c.pending:
            self.fail("client %d: an answer nobody asked for: %r" % (c.idx, line[:200]))
            return
        q = c.pending.popleft()
        if r.get("id") != q.id:
            self.fail("client %d: answer id %r, expected %r (order): %r" % (
                c.idx, r.get("id"), q.id, line[:200]))
            for e in q.entries:
                self.ledger.settle(e, "unknown")
            return
        ok = r.get("ok") is True
        if not ok:
            code = r.get("error", {}).get("code")
            self.errors[(q.kind, code)] += 1
        kind = q.kind
        if q.conv is not None:
            if kind != "close":
                self.conv_open[q.conv] -= 1
            elif ok and q.extra:
                # Only if nothing was sent on it after the close: a request from another
                # connection sent before this answer came may have reached the daemon after
                # the close, and any request reopens a closed conversation.
                if self.conv_last.get(q.conv) == q.id:
                    self.closed_clean[q.conv] = q.id
                else:
                    self.stats["close_overtaken"] += 1
        if kind == "add":
            self._answer_add(q, r, ok, ack)
        elif kind == "sinfo":
            if ok:
                info = r["result"]
                if info["ids"] and c.sock is not None:
                    texts = [self._text("S") for _ in range(self.rng.randint(1, 2))]
                    entries = [Entry(t, q.conv, None, "summary", "summary", 0) for t in texts]
                    req = {"op": "add_summary", "conversation": q.conv,
                           "contents": texts if len(texts) > 1 else texts[0],
                           "ids": info["ids"]}
                    if self.rng.random() < 0.8:
                        req["versions"] = info["versions"]
                    s = self._send(c, req, "summary", q.conv, entries)
                    for e in entries:
                        e.req = s.id
            else:
                self._not_found_ok(q, r)
        elif kind == "summary":
            if ok:
                m = r["result"]["message"]
                if m["message"]["role"] != "summary" or \
                        m["message"]["contents"] != [e.text for e in q.entries]:
                    self.fail("add_summary answered %r" % (m,))
                for e in q.entries:
                    self.ledger.settle(e, "acked", ack, m["id"])
            else:
                code = r["error"]["code"]
                for e in q.entries:
                    self.ledger.settle(e, "refused")
                if code != "conflict":
                    self.fail("add_summary on %s: %r" % (q.conv, r))
        elif kind == "verify":
            if ok:
                maps = r["result"]["messages"]
                self.stats["verified"] += 1
                for p in self.ledger.check(q.conv, maps, cutoff=q.send, where="live"):
                    self.fail(p)
                for p in shape_problems(q.conv, maps, where="live"):
                    self.fail(p)
            else:
                self._not_found_ok(q, r)
        elif kind in ("read", "flush", "close", "meta"):
            if not ok:
                self._not_found_ok(q, r)
        elif kind == "misc":
            if not ok:
                self.fail("%r" % (r,))

    def _answer_add(self, q, r, ok, ack):
        if not ok:
            for e in q.entries:
                self.ledger.settle(e, "refused")
            code = r.get("error", {}).get("code")
            if code != "unavailable":
                self.fail("add on %s refused: %r" % (q.conv, r))
            return
        m = r["result"]["message"]
        got = m["message"]["contents"]
        want = q.extra
        if got[-len(want):] != want or m["message"]["role"] != q.entries[0].role:
            self.fail("add on %s answered %r for %r" % (q.conv, m, want))
        for e in q.entries:
            self.ledger.settle(e, "acked", ack, m["id"])
        self.last_mid[q.conv] = m["id"]
        self.stats["acked_requests"] += 1

    def _not_found_ok(self, q, r):
        """not_found is right only for a conversation that nothing acknowledged created; so
        is unavailable, which a read of a conversation the local store does not hold answers
        while DynamoDB cannot be asked whether it holds it (protocol.md)."""
        code = r.get("error", {}).get("code")
        if code in ("not_found", "unavailable") and q.conv is not None and \
                not self.ledger.acked_before(q.conv, q.send):
            self.stats["answered_" + code] += 1
            return
        self.fail("%s on %s: %r" % (q.kind, q.conv, r))

    # --- the loop ---

    def _wake(self, c, now):
        if c.sock is None:
            if self._connect(c):
                self._schedule(c, now + self.rng.uniform(0, 0.02))
            else:
                self._schedule(c, now + self.rng.uniform(0.05, 0.2))
            return
        if c.hold is not None:
            c.wbuf += c.hold
            c.hold = None
            self._flush_out(c)
            if c.sock is not None:
                self._schedule(c, now + self.rng.expovariate(self.cfg.rate / self.cfg.connections))
            return
        self._act(c)

    def _poll(self, timeout):
        for key, mask in self.sel.select(timeout):
            c = key.data
            if c.sock is None:
                continue
            if mask & selectors.EVENT_READ:
                self._readable(c)
            if c.sock is not None and mask & selectors.EVENT_WRITE:
                self._flush_out(c)

    def run_traffic(self, until):
        """Traffic until the wall-clock time `until`."""
        now = time.time()
        self.heap = []
        for c in self.clients:
            self._schedule(c, now + self.rng.uniform(0, 0.2))
        next_sample = now
        while True:
            now = time.time()
            if now >= until:
                break
            if now >= next_sample:
                self._sample(now)
                next_sample = now + 1.0
            while self.heap and self.heap[0][0] <= now:
                _, idx, stamp = heapq.heappop(self.heap)
                c = self.clients[idx]
                if c.wake == stamp:
                    self._wake(c, now)
            timeout = 0.05
            if self.heap:
                timeout = max(0.0, min(timeout, self.heap[0][0] - time.time()))
            self._poll(timeout)

    def _sample(self, now):
        try:
            rss, hwm = rss_kib(self.d.proc.pid)
        except (OSError, KeyError):
            return
        self.rss_peak = max(self.rss_peak, rss)
        self.timeline.append((now, rss, self.stats["answers"], self.sink_state))

    def _release_holds(self):
        for c in self.clients:
            if c.hold is not None and c.sock is not None:
                c.wbuf += c.hold
                c.hold = None
                self._flush_out(c)

    def quiesce(self, timeout=60.0):
        """No new requests; waits for every answer; closes every client connection."""
        timeout *= self.cfg.timeout_scale
        deadline = time.time() + timeout
        while any(c.pending or c.hold is not None for c in self.clients):
            self._release_holds()
            if time.time() > deadline:
                n = sum(len(c.pending) for c in self.clients)
                self.fail("%d answers still missing %ss after the traffic stopped" % (n, timeout))
                break
            self._poll(0.05)
        for c in self.clients:
            if c.sock is not None:
                self._lost(c, "quiesce")

    # --- the sink flapping ---

    def _apply_mode(self, mode):
        p = self.proxy
        p.clear()
        if p.down:
            p.set_down(False)
        if mode == "refuse":
            p.set_down(True, mode="refuse")
        elif mode == "blackhole":
            p.set_down(True, mode="blackhole")
        elif mode in ("500", "503"):
            p.set_probability(mode, 0.5)
        elif mode == "throttle":
            p.set_probability("throttle", 0.8)
        elif mode == "unprocessed":
            p.set_probability("unprocessed", 0.6)
        elif mode == "drop":
            p.set_probability("drop", 0.4)
        elif mode == "slow":
            p.set_probability("slow", 0.5, ms=400)
        elif mode == "mixed":
            for f, pr in (("throttle", 0.15), ("500", 0.1), ("503", 0.05), ("unprocessed", 0.1),
                          ("drop", 0.05), ("refuse", 0.05), ("slow", 0.05), ("garbage", 0.05)):
                p.set_probability(f, pr, ms=200)
        self.sink_state = mode
        self.sink_modes[mode] += 1

    def _flapper(self, seed):
        rng = random.Random(seed)
        names = [m for m, _ in SINK_MODES]
        weights = [w for _, w in SINK_MODES]
        while not self.flap_stop.wait(rng.uniform(*self.cfg.flap)):
            with self.flap_lock:
                if self.flap_on:
                    self._apply_mode(rng.choices(names, weights)[0])

    def start_flapping(self):
        with self.flap_lock:
            self.flap_on = True
        if self.flap_thread is None:
            self.flap_thread = threading.Thread(target=self._flapper, args=(self.cfg.seed + 1,),
                                                daemon=True)
            self.flap_thread.start()

    def sink_healthy(self):
        with self.flap_lock:
            self.flap_on = False
            self._apply_mode("healthy")

    def stop_flapping(self):
        self.sink_healthy()
        self.flap_stop.set()
        if self.flap_thread:
            self.flap_thread.join(10)

    # --- blocking steps (the clients wait meanwhile) ---

    def admin(self):
        return conftest.Conn(self.d.socket, timeout=60 * self.cfg.timeout_scale)

    def drain(self, c):
        """Flushes everything and waits until the spool is empty and nothing is in flight."""
        c.ok({"op": "flush"})
        deadline = time.time() + self.cfg.drain_timeout
        while True:
            s = c.ok({"op": "stats"})
            if s["spool"]["items"] == 0 and s["sink"]["inflight"] == 0:
                return s
            if time.time() > deadline:
                raise SoakFailure("the spool did not drain in %ss: %r" % (
                    self.cfg.drain_timeout, s["spool"]))
            time.sleep(0.1)

    def close_all(self, c, timeout=120.0):
        """Closes every conversation in memory and waits until none is left."""
        timeout *= self.cfg.timeout_scale
        deadline = time.time() + timeout
        closed = 0
        while True:
            convs = c.ok({"op": "list"})["conversations"]
            if not convs:
                return closed
            for x in convs:
                c.ok({"op": "close", "conversation": x["conversation"]})
                closed += 1
            if time.time() > deadline:
                raise SoakFailure("%d conversations still in memory after closing them all"
                                  % len(convs))
            time.sleep(0.2)

    def settle_rss(self, label):
        """Waits a little and reads VmRSS three times, 0.5 s apart; keeps the median. With
        the trim probe on, then has the daemon call malloc_trim(0) (gdb) and reads it again
        as label + "_trimmed": what glibc keeps of freed memory shows as the difference."""
        time.sleep(1.0)
        vals = []
        for _ in range(3):
            vals.append(rss_kib(self.d.proc.pid)[0])
            time.sleep(0.5)
        v = sorted(vals)[1]
        self.rss[label] = v
        if self.cfg.trim_probe:
            t = malloc_trim(self.d.proc.pid)
            if t is not None:
                self.rss[label + "_trimmed"] = t
        return v

    def close_some(self, n=5, timeout=10.0):
        """Takes n created conversations out of the pool, waits until nothing is under way
        on them, and closes them (so that some closes are sure to precede the kill)."""
        timeout *= self.cfg.timeout_scale
        convs = [conv for conv in self.pool if conv in self.last_mid and
                 conv not in self.conv_unknown][:n]
        for conv in convs:
            self.pool[self.pool.index(conv)] = self._new_conv()
        deadline = time.time() + timeout
        while any(self.conv_open[conv] for conv in convs) and time.time() < deadline:
            self._release_holds()
            self._poll(0.02)
        c = self.admin()
        try:
            for conv in convs:
                if self.conv_open[conv] or conv in self.conv_unknown:
                    continue
                c.ok({"op": "close", "conversation": conv})
                self.closed_clean[conv] = "before the kill"
        finally:
            c.close()

    def kill_and_restart(self):
        self.close_some()
        self.kill_time = time.time()
        self.log("kill -9 of pid %d at %.1f s (%d answers so far)" % (
            self.d.proc.pid, time.time() - self.t0, self.stats["answers"]))
        kill_event = self.tick()
        self.rss["before_kill"] = rss_kib(self.d.proc.pid)[0]
        kill9(self.d)
        for c in self.clients:
            if c.sock is not None:
                self._lost(c, "kill")
        t = time.time()
        self.d.start()
        self.restart_s = time.time() - t
        self.log("restarted pid %d in %.2f s" % (self.d.proc.pid, self.restart_s))
        # Everything acknowledged before the kill is there at once after the restart.
        c = self.admin()
        n = 0
        try:
            listed = {x["conversation"] for x in c.ok({"op": "list"})["conversations"]}
            # persistence.md, promise 5: the conversations that were not closed are restored.
            back = sorted(conv for conv in self.closed_clean if conv in listed)
            self.stats["closed_before_kill"] = len(self.closed_clean)
            self.stats["closed_restored"] = len(back)
            if back:
                self.fail("%d of the %d conversations closed (and untouched since) before the "
                          "kill are restored as open at start, e.g. %s" % (
                              len(back), len(self.closed_clean), back[:3]))
            for conv in self.convs_used:
                if conv not in listed:
                    continue
                maps = c.ok({"op": "to_messages_map", "conversation": conv,
                             "incremental": False})["messages"]
                for p in self.ledger.check(conv, maps, cutoff=kill_event, where="restart"):
                    self.fail(p)
                n += 1
        finally:
            c.close()
        self.stats["checked_after_restart"] = n

    def baseline(self):
        # Sink first: a read held for a DynamoDB lookup answers sooner.
        self.sink_healthy()
        self.quiesce()
        c = self.admin()
        try:
            self.drain(c)
            self.stats["closed_at_baseline"] = self.close_all(c)
            self.drain(c)
        finally:
            c.close()
        v = self.settle_rss("baseline")
        self.log("baseline RSS %.1f MiB at %.1f s" % (v / 1024, time.time() - self.t0))

    def verify(self):
        """The final checks against the daemon and the table."""
        c = self.admin()
        views = {}
        try:
            st = self.drain(c)
            if st["sink"]["dead_lettered"]:
                self.fail("dead letters: %r" % st["sink"])
            self.final_stats = st
            for conv in self.convs_used:
                r = c.request({"op": "to_messages_map", "conversation": conv,
                               "incremental": False})
                if not r.get("ok"):
                    if r.get("error", {}).get("code") != "not_found" or \
                            self.ledger.acked_before(conv, INF):
                        self.fail("final read of %s: %r" % (conv, r))
                    continue
                maps = r["result"]["messages"]
                views[conv] = maps
                for p in self.ledger.check(conv, maps):
                    self.fail(p)
                for p in shape_problems(conv, maps):
                    self.fail(p)
                gm = c.ok({"op": "get_messages", "conversation": conv})
                view, summary = llm_view(maps)
                if gm["messages"] != view or gm["summary"] != summary:
                    self.fail("get_messages of %s is not the log after its last summary" % conv)
                # Closed right away: the reads restored the closed ones, and the memory
                # check wants the same working set as at the baseline.
                c.ok({"op": "close", "conversation": conv})
            self.drain(c)
        finally:
            c.close()
        items = ddb.scan_all(self.endpoint, self.table)
        by_conv = collections.defaultdict(list)
        for it in items:
            by_conv[it["conversation"]["S"]].append(it)
        for conv in by_conv:
            if conv not in views:
                self.fail("table: items of %s, which the daemon does not hold" % conv)
        for conv, maps in views.items():
            its = sorted(by_conv.get(conv, []), key=lambda it: it["sk"]["S"])
            sks = [it["sk"]["S"] for it in its]
            want = [sort_key(m) for m in maps]
            if sks != want:
                self.fail("table %s: sort keys differ: %d items, %d messages; first: %s" % (
                    conv, len(sks), len(want),
                    next(((a, b) for a, b in zip(sks, want) if a != b), None)))
                continue
            for it, m in zip(its, maps):
                v = int(it["version"]["N"])
                diff = av_diff({"M": {k: it[k] for k in it if k != "updated"}},
                               {"M": expected_item(conv, m, v)}, "%s/%s" % (conv, m["id"]))
                if diff:
                    self.fail("table: " + diff)
                elif v < merged_version(m):
                    self.fail("table %s/%s: version %d < %d merges + 1" % (
                        conv, m["id"], v, merged_version(m) - 1))
            tmaps = [item_to_map(it) for it in its]
            for p in self.ledger.check(conv, tmaps, where="table"):
                self.fail(p)
        self.stats["table_items"] = len(items)
        self.stats["conversations"] = len(views)
        self.stats["messages"] = sum(len(v) for v in views.values())

    def final_memory(self):
        c = self.admin()
        try:
            self.stats["closed_at_end"] = self.close_all(c)
            self.drain(c)
        finally:
            c.close()
        self.settle_rss("final")
        key = "" if self.cfg.rss_check == "raw" else "_trimmed"
        if "final" + key not in self.rss or "baseline" + key not in self.rss:
            raise SoakFailure("RSS after malloc_trim wanted, but gdb could not call it")
        base, v = self.rss["baseline" + key], self.rss["final" + key]
        self.rss_bound = base + max(self.cfg.rss_slack_mib * 1024, base * self.cfg.rss_slack_frac)
        self.rss_skipped = instrumented(self.d.proc.pid)
        self.rss_checked = self.rss_skipped is None
        if self.rss_checked and v > self.rss_bound:
            self.fail("RSS%s %.1f MiB after closing everything, baseline %.1f MiB, bound %.1f "
                      "MiB" % (" after malloc_trim(0)" if key else "", v / 1024, base / 1024,
                               self.rss_bound / 1024))

    def run(self):
        cfg = self.cfg
        self.log("soak: seed %d, %d connections, %d conversations at a time, %.0f s, "
                 "about %.0f requests/s wanted, daemon %s" % (
                     cfg.seed, cfg.connections, cfg.conversations, cfg.seconds, cfg.rate,
                     conftest.CONVOD))
        self.t0 = time.time()
        kill_at = self.t0 + cfg.seconds * self.rng.uniform(*cfg.kill_window)
        base_at = self.t0 + cfg.seconds * cfg.baseline_at
        end_at = self.t0 + cfg.seconds
        try:
            self.start_flapping()
            self.run_traffic(kill_at)
            self.kill_and_restart()
            # Warm-up: until the baseline's time, and at least a tenth of the run.
            self.run_traffic(max(base_at, time.time() + 0.1 * cfg.seconds))
            self.baseline()
            self.start_flapping()
            t = time.time()
            self.run_traffic(max(end_at, t + 0.3 * cfg.seconds * (1 - cfg.baseline_at)))
            self.stop_flapping()
            self.quiesce()
            self.traffic_s = time.time() - self.t0
            self.verify()
            self.final_memory()
        except SoakFailure as e:
            self.fail(str(e))
        except Exception:  # a broken harness or a daemon that would not restart
            self.fail("soak aborted:\n" + traceback.format_exc())
        finally:
            self.stop_flapping()
            for c in self.clients:
                if c.sock is not None:
                    self._lost(c, "end")
            self.sel.close()
        pid = self.d.proc.pid
        rc = self.d.stop(timeout=60 * cfg.timeout_scale)
        if rc != 0:
            self.fail("convod (pid %d) exited %s after SIGTERM" % (pid, rc))
        log = self.d.log()
        if "Sanitizer" in log or "runtime error:" in log:
            self.fail("sanitizer report in the daemon's log:\n" + log[-6000:])
        if self.proxy.errors:
            self.fail("fault proxy handler errors: %s" % self.proxy.errors[:2])
        self.elapsed = time.time() - self.t0
        self._coverage()
        return self

    def _coverage(self):
        """A soak that did not do what it claims fails too."""
        L, s, pc = self.ledger.counts, self.stats, self.proxy.counts
        want = [("contents acknowledged", L["acked"]),
                ("contents left unknown by a disconnect or the kill", L["unknown"]),
                ("half-sent lines", L["never"]),
                ("the kill -9 and restart", hasattr(self, "restart_s")),
                ("conversations checked after the restart", s["checked_after_restart"]),
                ("full reads checked during the run", s["verified"]),
                ("summaries added", sum(1 for e in self.ledger.entries.values()
                                        if e.kind == "summary" and e.state == "acked")),
                ("conversations checked at the end", s["conversations"]),
                ("sink faults injected", sum(pc.get(k, 0) for k in (
                    "throttle", "500", "503", "unprocessed", "drop", "refuse", "slow",
                    "garbage", "blackholed", "down")))]
        for what, n in want:
            if not n:
                self.fail("the soak did not exercise: " + what)

    # --- the report ---

    @property
    def ok(self):
        return self.nfail == 0

    def summary(self):
        s, L = self.stats, self.ledger.counts
        acts = ", ".join("%s %d" % (a, s["act:" + a]) for a in self.action_names)
        errs = ", ".join("%s/%s %d" % (k, c, n) for (k, c), n in sorted(self.errors.items()))
        lost = ", ".join("%s %d" % (k[5:], v) for k, v in sorted(s.items())
                         if k.startswith("lost:"))
        modes = ", ".join("%s %d" % (m, self.sink_modes[m]) for m, _ in SINK_MODES)
        pc = self.proxy.counts
        fs = getattr(self, "final_stats", {}).get("sink", {})
        R = self.rss
        base, fin = R.get("baseline"), R.get("final")
        lines = [
            "soak %s: seed %d, %d connections, %.0f s of traffic (%.0f s in all)" % (
                "PASSED" if self.ok else "FAILED", self.cfg.seed, self.cfg.connections,
                getattr(self, "traffic_s", 0), getattr(self, "elapsed", 0)),
            "requests: %d sent, %d answered (%.0f/s), %d left unanswered by a disconnect or "
            "the kill" % (s["sent"], s["answers"], s["answers"] / max(1e-9, getattr(
                self, "traffic_s", 1)), s["unanswered"]),
            "actions: " + acts,
            "errors answered: " + (errs or "none"),
            "connections: %d connects, %d connect retries; ended by: %s" % (
                s["connects"], s["connect_retries"], lost),
            "contents: %d sent, %d acknowledged, %d refused, %d unknown, %d in half-sent "
            "lines" % (L["sent"], L["acked"], L["refused"], L["unknown"], L["never"]),
            "conversations: %d used (%d retired), %d checked at the end with %d messages; "
            "%d checked right after the restart; %d full reads checked live; %d closed before "
            "the kill and untouched since, %d of them restored as open (%d closes not counted: "
            "another request on the conversation was sent before their answer)" % (
                len(self.convs_used), s["retired"], s["conversations"], s["messages"],
                s["checked_after_restart"], s["verified"], s["closed_before_kill"],
                s["closed_restored"], s["close_overtaken"]),
            "sink states: " + modes,
            "proxy: %d requests, %d forwarded; faults: %s" % (
                pc.get("requests", 0), pc.get("forwarded", 0), ", ".join(
                    "%s %d" % (k, pc[k]) for k in ("throttle", "500", "503", "unprocessed",
                                                   "drop", "refuse", "slow", "garbage",
                                                   "blackholed", "down") if pc.get(k))),
            "sink after restart: confirmed %s, retried %s, failures %s, unprocessed %s, "
            "dead letters %s; table holds %d items" % (
                fs.get("confirmed"), fs.get("retried"), fs.get("failures"),
                fs.get("unprocessed"), fs.get("dead_lettered"), s["table_items"]),
            "kill -9 at %s; restart took %.2f s" % (
                "%.1f s" % (self.kill_time - self.t0) if hasattr(self, "kill_time") else "-",
                getattr(self, "restart_s", 0)),
        ]
        if base and fin:
            lines.append(
                "memory (VmRSS): %.1f MiB before the kill; baseline %.1f MiB (after the "
                "restart, warm-up, closing everything); peak %.1f MiB; final %.1f MiB (after "
                "closing everything): %+.1f MiB (%+.1f%%)" % (
                    R.get("before_kill", 0) / 1024, base / 1024, self.rss_peak / 1024,
                    fin / 1024, (fin - base) / 1024, 100.0 * (fin - base) / base))
            if "final_trimmed" in R and "baseline_trimmed" in R:
                bt, ft = R["baseline_trimmed"], R["final_trimmed"]
                lines.append(
                    "memory after malloc_trim(0): baseline %.1f MiB, final %.1f MiB: %+.1f MiB "
                    "(glibc kept %.1f MiB of freed memory at the baseline, %.1f MiB at the "
                    "end)" % (bt / 1024, ft / 1024, (ft - bt) / 1024, (base - bt) / 1024,
                              (fin - ft) / 1024))
            if hasattr(self, "rss_bound"):
                lines.append("memory check: %s VmRSS within %.1f MiB (baseline + max(%.0f MiB, "
                             "%.0f%%)): %s" % (
                                 self.cfg.rss_check, self.rss_bound / 1024,
                                 self.cfg.rss_slack_mib, 100 * self.cfg.rss_slack_frac,
                                 "skipped (%s)" % self.rss_skipped if not self.rss_checked
                                 else "ok" if not any(f.startswith("RSS") for f in
                                                      self.failures) else "FAILED"))
        if self.timeline and self.timeline[-1][0] - self.t0 >= 120:
            marks, nxt = [], self.t0
            for t, rss, _, _ in self.timeline:
                if t >= nxt:
                    marks.append("%.0f" % (rss / 1024))
                    nxt += 60
            lines.append("VmRSS each minute of traffic (MiB): " + " ".join(marks))
        if self.failures:
            lines.append("failures (%d; first %d):" % (self.nfail, len(self.failures)))
            lines += ["  " + f for f in self.failures]
        return "\n".join(lines)


def run_soak(daemon, proxy, endpoint, table, cfg):
    """Runs the soak against `daemon` (a conftest.Daemon started with daemon_args(table) and
    ddb_env(proxy.url)), `proxy` (a FaultProxy in front of the dynalite at `endpoint`).
    Returns the Soak; .ok, .summary(). Stops the daemon at the end."""
    return Soak(daemon, proxy, endpoint, table, cfg).run()


# --- by hand -----------------------------------------------------------------------------


@contextlib.contextmanager
def dynalite_server():
    """The conftest fixture's dynalite, outside pytest."""
    gen = getattr(conftest.dynalite, "__wrapped__", conftest.dynalite)
    with contextlib.contextmanager(gen)() as endpoint:
        yield endpoint


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=None, help="traffic time (default 10)")
    ap.add_argument("--seconds", type=float, default=None, help="traffic time in seconds")
    ap.add_argument("--connections", type=int, default=200)
    ap.add_argument("--conversations", type=int, default=None,
                    help="conversations in use at a time (default 2 x connections)")
    ap.add_argument("--rate", type=float, default=2000.0,
                    help="requests per second wanted over all connections (default 2000)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--rss-slack-mib", type=float, default=8.0)
    ap.add_argument("--rss-slack-frac", type=float, default=0.10)
    ap.add_argument("--rss-check", choices=("raw", "trimmed"), default="raw",
                    help="compare VmRSS as it is (raw), or after the daemon was made to "
                    "call malloc_trim(0) through gdb (trimmed)")
    ap.add_argument("--trim-probe", action="store_true",
                    help="also report VmRSS after malloc_trim(0) (needs gdb)")
    ap.add_argument("--keep", action="store_true", help="keep the daemon's directory")
    a = ap.parse_args(argv)
    seconds = a.seconds if a.seconds is not None else 60.0 * (a.minutes if a.minutes else 10.0)
    cfg = Config(seconds=seconds, connections=a.connections, conversations=a.conversations,
                 rate=a.rate, seed=a.seed, rss_slack_mib=a.rss_slack_mib,
                 rss_slack_frac=a.rss_slack_frac, rss_check=a.rss_check,
                 trim_probe=a.trim_probe,
                 log=lambda m: print("[%s] %s" % (time.strftime("%H:%M:%S"), m), flush=True))
    try:
        dyn = dynalite_server()
        endpoint = dyn.__enter__()
    except BaseException as e:  # pytest.skip outside pytest: node or npm missing
        print("soak: cannot start dynalite: %s" % e, file=sys.stderr)
        return 2
    proxy = None
    d = None
    s = None
    try:
        table = "convod-soak-%s" % uuid.uuid4().hex[:12]
        ddb.create_table(endpoint, table)
        proxy = FaultProxy(endpoint, seed=cfg.seed).start()
        d = conftest.Daemon(daemon_args(table), ddb_env(proxy.url)).start()
        cfg.log("daemon pid %d, state %s, dynalite %s, proxy %s, table %s" % (
            d.proc.pid, d.state_dir, endpoint, proxy.url, table))
        s = run_soak(d, proxy, endpoint, table, cfg)
        print(s.summary(), flush=True)
        return 0 if s.ok else 1
    finally:
        if d is not None:
            if d.proc is not None and d.proc.poll() is None:
                d.stop(sig=signal.SIGKILL)
            if a.keep or (s is not None and not s.ok):
                print("soak: daemon directory kept: %s" % d.dir)
            else:
                d.cleanup()
        if proxy is not None:
            proxy.stop()
        dyn.__exit__(None, None, None)


if __name__ == "__main__":
    sys.exit(main())
