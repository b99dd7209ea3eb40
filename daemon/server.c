/* Unix-socket server: accept, framing, backpressure, per-turn commit and writes. */
#include "server.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "framer.h"
#include "log.h"

#define READ_CHUNK 65536
#define STOP_DEADLINE_MS 10000
#define STOP_GRACE_MS 1000    /* after it, for the answers of requests that waited for DynamoDB */
#define LISTEN_FDS_START 3    /* SD_LISTEN_FDS_START: the first passed socket */
#define PEER_GROUPS_MAX 65536 /* NGROUPS_MAX on Linux */

/* out[0..end) may go out once transaction seq is written (the group commit runs on the
 * store's writer thread: answers wait for it, reads too, since they may show what it
 * writes). */
struct hold {
	uint64_t seq;
	size_t end;
};

/* An ok answer out[start..end) that depends on transaction seq (0: the turn's, not yet
 * submitted): it becomes `unavailable` if that commit fails. epoch is the dispatcher's
 * failure count when it was made: a failure found in the middle of a turn (by the flush
 * timer's commit, or retry_dead_letters') undoes only what came before it, and the answers
 * made after it depend on later commits, not on the failed one. */
struct dep {
	uint64_t seq, epoch;
	uint64_t sub; /* the dispatcher's nsubmits when it was made (dispatch_seq_after) */
	uint64_t shows; /* a read's of a change submitted before it: that transaction (else 0) */
	size_t start, end;
	enum op op; /* the request's, for the error count if its answer becomes unavailable */
};

struct conn {
	uv_pipe_t pipe;
	struct server *srv;
	struct framer fr;
	struct buf out; /* answers not yet handed to the socket: held ones, then the turn's */
	size_t queued;  /* bytes handed to uv_write and not yet written */
	struct hold *holds; /* in order */
	size_t nholds, capholds;
	struct dep *deps; /* in order */
	size_t ndeps, capdeps;
	struct conn *next, *prev;
	struct conn *next_dirty, *next_held;
	bool dirty;   /* on srv->dirty */
	bool on_held; /* on srv->held */
	bool reading; /* uv_read_start is in effect */
	bool paused;  /* over max_output_bytes: neither read nor served */
	bool eof;     /* the client closed its side: answer what is left, then close */
	bool drained; /* at stop: what it sent before is read (conn_drain_socket) */
	size_t stop_left; /* at stop: bytes of its socket's queue at the signal not yet read */
	bool closing; /* uv_close called */
	char *held;   /* a line waiting for a restore from DynamoDB (owned) */
	size_t held_len;
};

struct write_req {
	uv_write_t req;
	struct conn *c;
	char *data;
	size_t len;
};

static void conn_close(struct conn *c);
static void conn_serve(struct conn *c);
static void server_maybe_stopped(struct server *s);
static void on_connection(uv_stream_t *ls, int status);

/* File descriptors kept for the daemon's own use beyond its connections: the store's files
 * (two SQLite connections and the checkpoint thread's WAL), the listener, libuv's own, the
 * flusher's sockets to DynamoDB, the journal, and the one a refusal is answered on. */
#define SERVER_FD_RESERVE 64
/* A connection whose descriptor leaves fewer than this many below the open-file limit is
 * refused (on_connection): room for the flusher's sockets and SQLite's files. */
#define SERVER_FD_HEADROOM 16

static void conn_mark_dirty(struct conn *c)
{
	if (c->dirty || c->out.len == 0)
		return;
	c->dirty = true;
	c->next_dirty = c->srv->dirty;
	c->srv->dirty = c;
}

static size_t conn_backlog(const struct conn *c)
{
	return c->queued + c->out.len;
}

static void on_closed(uv_handle_t *h)
{
	struct conn *c = h->data;
	struct server *s = c->srv;

	if (c->prev)
		c->prev->next = c->next;
	else
		s->conns = c->next;
	if (c->next)
		c->next->prev = c->prev;
	/* Closed while its turn was deferred (one more poll before the commit, at durability
	 * process or machine): off the turn's list, which the next loop turn walks. It was
	 * left on it, freed (heap-use-after-free in server_turn, found by a socket fuzzer). */
	if (c->dirty) {
		struct conn **pp = &s->dirty;
		while (*pp && *pp != c)
			pp = &(*pp)->next_dirty;
		if (*pp)
			*pp = c->next_dirty;
	}
	/* Still waiting for a commit: off that list too (it lives across loop turns). */
	if (c->on_held) {
		struct conn **pp = &s->held;
		while (*pp && *pp != c)
			pp = &(*pp)->next_held;
		if (*pp)
			*pp = c->next_held;
	}
	s->nconns--;
	s->dispatch->stats.connections_current = s->nconns;
	framer_free(&c->fr);
	buf_free(&c->out);
	free(c->holds);
	free(c->deps);
	if (!s->spare && !s->stopping)
		s->spare = c; /* the one on_connection took when memory ran out */
	else
		free(c);
	if (s->stopping)
		server_maybe_stopped(s);
	else if (s->accept_waiting && s->spare) {
		/* A connection libuv holds for us, and the listener it stopped, wait for it. */
		s->accept_waiting = false;
		on_connection((uv_stream_t *)&s->listener, 0);
	}
}

static void conn_close(struct conn *c)
{
	if (c->closing)
		return;
	c->closing = true;
	buf_free(&c->out);
	c->nholds = c->ndeps = 0;
	if (c->held) {
		dispatch_cancel_wait(c->srv->dispatch, c);
		free(c->held);
		c->held = NULL;
	}
	/* Pending writes complete with UV_ECANCELED before on_closed runs. */
	uv_close((uv_handle_t *)&c->pipe, on_closed);
}

static void conn_drain_socket(struct conn *c);

/* The client has nothing more to say and everything has been answered: close. At a stop,
 * "nothing more" is what it sent before: its socket read to the end (drained). */
static void conn_close_if_done(struct conn *c)
{
	if (c->closing || !(c->eof || c->srv->stopping))
		return;
	if (!c->eof && !c->drained)
		return;
	if (conn_backlog(c) == 0 && !c->held && !(c->paused && framer_pending(&c->fr) > 0))
		conn_close(c);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *b)
{
	struct conn *c = h->data;
	char *p;
	size_t n;

	(void)suggested;
	if (framer_reserve(&c->fr, READ_CHUNK, &p, &n) < 0) {
		b->base = NULL;
		b->len = 0;
		return;
	}
	b->base = p;
	b->len = n;
}

static void conn_read_stop(struct conn *c)
{
	if (c->reading) {
		uv_read_stop((uv_stream_t *)&c->pipe);
		c->reading = false;
	}
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *b);

static void conn_read_start(struct conn *c)
{
	if (c->reading || c->paused || c->held || c->eof || c->closing || c->srv->stopping)
		return;
	if (uv_read_start((uv_stream_t *)&c->pipe, on_alloc, on_read) == 0)
		c->reading = true;
	else
		conn_close(c);
}

/* No memory to write an answer (not even the fixed error), or to rewrite a failed commit's
 * answers: the client would wait for an answer that never comes (its connection is read
 * on, and answers go out in order), so it is dropped, its unwritten answers with it; a
 * client that loses its connection knows to retry. */
static void conn_answer_lost(struct conn *c)
{
	log_msg(LOG_ERROR, "server", "out of memory writing an answer; closing the connection");
	conn_close(c);
}

/* dispatch_line, remembering a dependent answer. */
static enum dispatch_result conn_dispatch(struct conn *c, const char *line, size_t len,
                                          enum dispatch_remote remote)
{
	struct dispatch *d = c->srv->dispatch;
	size_t start = c->out.len;
	enum dispatch_result r = dispatch_line(d, line, len, &c->out, c, remote);

	if (r == DISPATCH_LOST) {
		conn_answer_lost(c);
		return DISPATCH_DONE;
	}
	if (d->answer_dependent && c->out.len > start) {
		if (c->ndeps == c->capdeps) {
			size_t ncap = c->capdeps ? 2 * c->capdeps : 8;
			struct dep *p = realloc(c->deps, ncap * sizeof(*p));
			if (!p) {
				/* Cannot track it: the answer would go out even if its commit
				 * failed. Nothing safe is left but to drop the client. */
				log_msg(LOG_ERROR, "server", "out of memory; closing a connection");
				conn_close(c);
				return DISPATCH_DONE;
			}
			c->deps = p;
			c->capdeps = ncap;
		}
		c->deps[c->ndeps].seq = 0;
		c->deps[c->ndeps].epoch = d->failures;
		c->deps[c->ndeps].sub = d->nsubmits;
		c->deps[c->ndeps].shows = d->answer_shows;
		c->deps[c->ndeps].start = start;
		c->deps[c->ndeps].end = c->out.len;
		c->deps[c->ndeps].op = d->answer_op;
		c->ndeps++;
	}
	return r;
}

/* Answers buffered complete lines until none is left or the output limit is reached. */
static void conn_serve(struct conn *c)
{
	struct dispatch *d = c->srv->dispatch;
	size_t limit = c->srv->cfg->max_output_bytes;

	while (!c->closing && !c->held) {
		const char *line;
		size_t len;
		enum framer_event ev;

		if (conn_backlog(c) > limit) {
			c->paused = true;
			conn_read_stop(c);
			break;
		}
		ev = framer_next(&c->fr, &line, &len);
		if (ev == FRAMER_NONE)
			break;
		if (ev == FRAMER_TOO_LARGE) {
			if (dispatch_too_large_line(d, &c->out) == DISPATCH_LOST) {
				conn_answer_lost(c);
				return;
			}
		} else if (conn_dispatch(c, line, len, DISPATCH_REMOTE_CHECK) == DISPATCH_WAIT) {
			/* Keep the line; the answers after it wait for it (in order). */
			c->held = malloc(len ? len : 1);
			if (!c->held) {
				dispatch_cancel_wait(d, c);
				conn_close(c);
				return;
			}
			memcpy(c->held, line, len);
			c->held_len = len;
			conn_read_stop(c);
		}
	}
	conn_mark_dirty(c);
}

/* A restore the held line waited for is over: answer it, then go on. */
static void on_restore_ready(void *waiter, enum dispatch_remote outcome)
{
	struct conn *c = waiter;
	char *line = c->held;

	c->held = NULL;
	if (c->closing) {
		free(line);
		return;
	}
	conn_dispatch(c, line, c->held_len, outcome);
	free(line);
	conn_serve(c);
	if (!c->held) {
		if (c->srv->stopping)
			conn_drain_socket(c); /* what was sent after the held line */
		if (c->eof || c->srv->stopping) {
			if (!c->paused && !c->held) {
				framer_free(&c->fr);
				framer_init(&c->fr, c->srv->cfg->max_line_bytes);
			}
			conn_close_if_done(c);
		} else {
			conn_read_start(c);
		}
	}
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *b)
{
	struct conn *c = st->data;

	(void)b;
	if (nread > 0) {
		framer_commit(&c->fr, (size_t)nread);
		conn_serve(c);
		return;
	}
	if (nread == 0)
		return;
	conn_read_stop(c);
	if (nread == UV_EOF) {
		/* Answer every complete line; an unfinished one is discarded. */
		c->eof = true;
		conn_serve(c);
		if (!c->paused && !c->held) {
			framer_free(&c->fr);
			framer_init(&c->fr, c->srv->cfg->max_line_bytes);
		}
		conn_close_if_done(c);
		return;
	}
	if (nread == UV_ENOBUFS)
		log_msg(LOG_WARN, "server", "out of memory reading a request; closing connection");
	conn_close(c);
}

/* A paused connection whose backlog went down to half the limit is served and read again. */
static void conn_resume(struct conn *c)
{
	if (!c->paused || conn_backlog(c) > c->srv->cfg->max_output_bytes / 2)
		return;
	c->paused = false;
	conn_serve(c);
	if (c->srv->stopping)
		conn_drain_socket(c); /* the rest of what was sent before the stop */
	if (!c->paused && !c->held && (c->eof || c->srv->stopping) && framer_pending(&c->fr) > 0) {
		/* Only an unfinished line is left: discard it. */
		framer_free(&c->fr);
		framer_init(&c->fr, c->srv->cfg->max_line_bytes);
	}
	conn_read_start(c);
}

static void on_written(uv_write_t *req, int status)
{
	struct write_req *w = (struct write_req *)req;
	struct conn *c = w->c;

	c->queued -= w->len;
	free(w->data);
	free(w);
	if (status < 0) {
		if (status != UV_ECANCELED)
			conn_close(c);
		return;
	}
	if (c->closing)
		return;
	conn_resume(c);
	conn_close_if_done(c);
}

/* Writes out[0..n) and keeps the rest of out for later. Most answers fit the socket's
 * buffer: uv_try_write sends them without a request, a copy or a POLLOUT watcher (which
 * libuv would otherwise arm and disarm, an epoll_ctl per answer). What the socket does not
 * take goes to uv_write in a buffer of its own. */
static void conn_write_prefix(struct conn *c, size_t n)
{
	struct write_req *w;
	size_t done = 0;
	uv_buf_t b;

	if (c->closing || n == 0)
		return;
	if (c->queued == 0) {
		int r;
		b = uv_buf_init(c->out.data, (unsigned int)n);
		r = uv_try_write((uv_stream_t *)&c->pipe, &b, 1);
		if (r < 0 && r != UV_EAGAIN && r != UV_ENOSYS) {
			conn_close(c);
			return;
		}
		if (r > 0)
			done = (size_t)r;
	}
	if (done < n) {
		w = malloc(sizeof(*w));
		if (!w || !(w->data = malloc(n - done))) {
			free(w);
			conn_close(c);
			return;
		}
		memcpy(w->data, c->out.data + done, n - done);
		w->c = c;
		w->len = n - done;
		c->queued += w->len;
		b = uv_buf_init(w->data, (unsigned int)w->len);
		if (uv_write(&w->req, (uv_stream_t *)&c->pipe, &b, 1, on_written) < 0) {
			c->queued -= w->len;
			free(w->data);
			free(w);
			conn_close(c);
			return;
		}
	}
	buf_consume(&c->out, n);
	/* What was held before n went out with it; the rest moves to the front. */
	{
		size_t k = 0;
		for (size_t i = 0; i < c->nholds; i++)
			if (c->holds[i].end > n) {
				c->holds[k] = c->holds[i];
				c->holds[k++].end -= n;
			}
		c->nholds = k;
		k = 0;
		for (size_t i = 0; i < c->ndeps; i++)
			if (c->deps[i].start >= n) {
				c->deps[k] = c->deps[i];
				c->deps[k].start -= n;
				c->deps[k++].end -= n;
			}
		c->ndeps = k;
	}
}

/* Writes what is not held. */
static void conn_flush(struct conn *c)
{
	conn_write_prefix(c, c->nholds ? 0 : c->out.len);
}

/* Holds out[0..end) until transaction seq is written (holds stay in the order of their
 * seqs: behind a later one, it waits for that one). */
static void conn_hold_to(struct conn *c, uint64_t seq, size_t end)
{
	struct server *s = c->srv;

	if (c->nholds && c->holds[c->nholds - 1].seq >= seq) {
		if (end > c->holds[c->nholds - 1].end)
			c->holds[c->nholds - 1].end = end;
	} else {
		if (c->nholds == c->capholds) {
			size_t ncap = c->capholds ? 2 * c->capholds : 4;
			struct hold *p = realloc(c->holds, ncap * sizeof(*p));
			if (!p) {
				log_msg(LOG_ERROR, "server", "out of memory; closing a connection");
				conn_close(c);
				return;
			}
			c->holds = p;
			c->capholds = ncap;
		}
		c->holds[c->nholds].seq = seq;
		c->holds[c->nholds].end = end;
		c->nholds++;
	}
	if (!c->on_held) {
		c->on_held = true;
		c->next_held = s->held;
		s->held = c;
	}
}

/* Holds what the connection has not written until transaction seq is. */
static void conn_hold(struct conn *c, uint64_t seq)
{
	conn_hold_to(c, seq, c->out.len);
}

/* Turns every dependent answer of c not written yet that was made before the last failure
 * (its commit failed, or was void) into `unavailable`, and lets everything go but what the
 * answers made since then wait for. An answer of the turn under way whose change a commit
 * took before the failed one (the flush timer's, retry_dead_letters') is written: it stands. */
static void conn_fail_deps(struct conn *c)
{
	struct dispatch *d = c->srv->dispatch;
	struct buf fresh = {NULL, 0, 0};
	size_t pos = 0, k = 0;
	uint64_t wait = 0;

	if (c->closing)
		return;
	if (c->ndeps) {
		int rc = 0;
		for (size_t i = 0; i < c->ndeps && !rc; i++) {
			struct dep dp = c->deps[i];
			uint64_t seq = dp.seq     ? dp.seq
			               : dp.shows ? dp.shows
			                          : dispatch_seq_after(d, dp.sub);
			if ((rc = buf_append(&fresh, c->out.data + pos, dp.start - pos)) != 0)
				break;
			pos = dp.end;
			if (seq && seq != DISPATCH_SEQ_VOID && seq <= d->committed) {
				rc = buf_append(&fresh, c->out.data + dp.start, dp.end - dp.start);
			} else if (dp.epoch == d->failures) {
				/* Made after the failure: it stands, and still waits for its
				 * commit. */
				size_t start = fresh.len;
				rc = buf_append(&fresh, c->out.data + dp.start, dp.end - dp.start);
				dp.start = start;
				dp.end = fresh.len;
				c->deps[k++] = dp;
				if (dp.seq > wait) /* (never void: see server_turn) */
					wait = dp.seq;
			} else {
				rc = dispatch_fail_answer(d, &fresh, c->out.data + dp.start,
				                          dp.end - dp.start, dp.op);
			}
		}
		if (!rc)
			rc = buf_append(&fresh, c->out.data + pos, c->out.len - pos);
		if (rc) {
			/* No memory for the answers as they must now read: giving the rest
			 * would skip some, so none are given (conn_answer_lost). */
			buf_free(&fresh);
			conn_answer_lost(c);
			return;
		}
		buf_free(&c->out);
		c->out = fresh;
	}
	c->ndeps = k;
	c->nholds = 0;
	/* server_turn holds those of the turn under way (seq 0); one submitted already holds
	 * everything up to here until it is written. */
	if (wait)
		conn_hold(c, wait);
	conn_mark_dirty(c);
}

static void server_release(struct server *s);

/* After a failed commit, once what was written before it is released: every connection's
 * dependent answers not yet written depended on a failed or void transaction. */
static void server_failed(struct server *s)
{
	s->failures_seen = s->dispatch->failures;
	for (struct conn *c = s->held; c; c = c->next_held)
		c->on_held = false;
	s->held = NULL;
	for (struct conn *c = s->conns; c; c = c->next)
		conn_fail_deps(c);
}

/* End of a loop turn: one commit for every mutation of the turn, then the answers. */
static void server_turn(struct server *s)
{
	struct conn *c, *next;

	/* A connection written at once has no write callback to resume it: it is resumed
	 * here, and what it answers then is committed and written in the next round, before
	 * the loop may block in poll. Each round serves lines already read, so this ends. */
	do {
		uint64_t hold;

		if (dispatch_pending_commit(s->dispatch))
			dispatch_commit(s->dispatch, false);
		if (s->dispatch->failures != s->failures_seen) {
			server_release(s);
			server_failed(s);
		}
		hold = dispatch_hold(s->dispatch);
		for (c = s->dirty, s->dirty = NULL; c; c = next) {
			next = c->next_dirty;
			c->dirty = false;
			c->next_dirty = NULL;
			/* The turn's dependent answers depend on the transaction handed over first
			 * after each was made: mostly the one just submitted, but the flush timer
			 * or a retry_dead_letters may have committed part of the turn before. A
			 * read of a change submitted before the turn depends on that one.
			 * Each is held for its own (one written already too, when something is
			 * held after it: it goes out at the next release): were it held for a
			 * later one, that one's failure would turn it into `unavailable` though
			 * it is written. */
			size_t first = c->ndeps;
			while (first > 0 && !c->deps[first - 1].seq)
				first--;
			for (size_t i = first; i < c->ndeps; i++) {
				struct dep *dp = &c->deps[i];
				uint64_t seq = dp->shows ? dp->shows
				                         : dispatch_seq_after(s->dispatch, dp->sub);
				/* (A void one was failed above, when the failure was taken.) */
				dp->seq = seq && seq != DISPATCH_SEQ_VOID ? seq : hold;
				if (dp->seq &&
				    (hold || c->nholds || dp->seq > s->dispatch->committed))
					conn_hold_to(c, dp->seq, dp->end);
			}
			if (hold)
				conn_hold(c, hold);
			else if (c->nholds) /* behind what is still held */
				conn_hold(c, c->holds[c->nholds - 1].seq);
			conn_flush(c);
			if (!c->closing && c->queued == 0 && !c->nholds)
				conn_resume(c);
			conn_close_if_done(c);
		}
	} while (s->dirty);
	/* Every answer made so far knows its transaction (a connection that answers is
	 * dirty until the loop above took it). */
	dispatch_turn_done(s->dispatch);
}

/* Writes what waited for transactions up to d->committed. */
static void server_release(struct server *s)
{
	struct dispatch *d = s->dispatch;
	struct conn *c, *next;

	for (c = s->held, s->held = NULL; c; c = next) {
		size_t n = 0, k = 0, j = 0;
		next = c->next_held;
		c->next_held = NULL;
		c->on_held = false;
		if (c->closing)
			continue;
		while (k < c->nholds && c->holds[k].seq <= d->committed)
			n = c->holds[k++].end;
		/* The released answers are written: nothing of them can fail any more. */
		for (size_t i = 0; i < c->ndeps; i++)
			if (c->deps[i].start >= n)
				c->deps[j++] = c->deps[i];
		c->ndeps = j;
		memmove(c->holds, c->holds + k, (c->nholds - k) * sizeof(*c->holds));
		c->nholds -= k;
		if (c->nholds) {
			c->on_held = true;
			c->next_held = s->held;
			s->held = c;
		}
		conn_write_prefix(c, n);
		if (!c->closing && c->queued == 0 && !c->nholds)
			conn_resume(c);
		conn_close_if_done(c);
	}
}

void server_progress(struct server *s)
{
	struct dispatch *d = s->dispatch;
	bool ok = dispatch_progress(d);

	/* What was written before a failure is answered as written; what depended on the
	 * failed transactions (everything after the last one written) becomes unavailable. */
	server_release(s);
	if (!ok || d->failures != s->failures_seen)
		server_failed(s);
	server_turn(s);
}

static void on_one_more_poll(uv_idle_t *h)
{
	(void)h;
}

/* A turn whose answers wait for a commit to the store (durability process or machine) first
 * polls once more, without blocking: the requests that arrived while it was served join
 * the commit (33 requests a commit instead of 28 at 50 connections). In paired runs, 50
 * connections without pipelining, process: p99.9 9.8-15.4 -> 5.4-9.1 ms in all 8 pairs
 * (6 of 5 s, 2 of 20 s), p99 1.91 -> 1.80 ms and req/s 79k -> 81k (means of the 5 s runs,
 * within the noise); machine, 4 pairs: req/s +4%, p99 4.2 -> 3.8 ms. At one connection the
 * extra poll is lost in the noise (p50 46-70 us either way). Memory only or at durability
 * none nothing waits for a commit, and a turn is answered at once. While the idle handle
 * runs, the turn is deferred. Tried and not taken: polling again for as long as a poll
 * brought requests, up to 8 polls: 41 records a commit instead of 34, but the polls ate
 * the saving (8 paired runs at process, 4 s: loop CPU a request 6.15 -> 6.10 us, lower in
 * 5; req/s 156k -> 157k). */
static bool turn_deferred(const struct server *s)
{
	return uv_is_active((const uv_handle_t *)&s->one_more_poll);
}

static void on_turn(uv_check_t *h)
{
	struct server *s = h->data;

	if (turn_deferred(s)) {
		uv_idle_stop(&s->one_more_poll);
	} else if (!s->stopping && s->dispatch->store && s->cfg->durability != DURABILITY_NONE &&
	           dispatch_pending_commit(s->dispatch)) {
		uv_idle_start(&s->one_more_poll, on_one_more_poll);
		return;
	}
	server_turn(s);
}

/* Answers made in the pending or timer phase (a write completing un-pauses a connection)
 * must not wait in the out buffer while the loop blocks in poll. A deferred turn waits for
 * its poll, which does not block. */
static void on_before_poll(uv_prepare_t *h)
{
	struct server *s = h->data;

	if (!turn_deferred(s))
		server_turn(s);
}

/* The connections the open-file limit leaves room for, with max_connections of want: the
 * soft limit is raised towards want + SERVER_FD_RESERVE (as far as the hard limit allows),
 * and a warning says when that is still short. Past that number accept() would fail with
 * EMFILE, and libuv then accepts and closes the waiting connections without a word to
 * anyone; below it a client is refused with an answer that says why. */
static size_t fd_conn_limit(size_t want)
{
	struct rlimit rl;
	rlim_t need = want > (size_t)-1 - SERVER_FD_RESERVE ? RLIM_INFINITY
	                                                    : (rlim_t)(want + SERVER_FD_RESERVE);
	size_t room;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY)
		return want;
	if (rl.rlim_cur < need) {
		struct rlimit up = rl;
		up.rlim_cur =
		    rl.rlim_max == RLIM_INFINITY || rl.rlim_max > need ? need : rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &up) == 0)
			rl = up;
	}
	if (rl.rlim_cur == RLIM_INFINITY || rl.rlim_cur >= need)
		return want;
	room = rl.rlim_cur > 2 * SERVER_FD_RESERVE ? (size_t)rl.rlim_cur - SERVER_FD_RESERVE
	                                           : (size_t)rl.rlim_cur / 2;
	if (room < 1)
		room = 1;
	if (room >= want)
		return want; /* short of the reserve, yet room enough for every connection */
	log_msg(LOG_WARN, "server",
	        "the open-file limit (%llu, hard %llu) leaves room for %zu connections: "
	        "max-connections %zu cannot be reached; further clients are refused (raise "
	        "LimitNOFILE or ulimit -n)",
	        (unsigned long long)rl.rlim_cur, (unsigned long long)rl.rlim_max, room, want);
	return room;
}

/* The connection limit in force: max-connections, or fewer when the open-file limit says
 * so (worked out again after a reload changed max-connections). */
static size_t conn_limit(struct server *s)
{
	if (s->fd_limit_for != s->cfg->max_connections) {
		s->fd_limit_for = s->cfg->max_connections;
		s->fd_conns = fd_conn_limit(s->cfg->max_connections);
	}
	return s->fd_conns < s->cfg->max_connections ? s->fd_conns : s->cfg->max_connections;
}

static void discard_input(int fd);

/* Answers `unavailable` (why: what is over its limit) on c (its socket fd) and closes. */
static void refuse(struct server *s, struct conn *c, int fd, const char *why)
{
	char msg[160];
	int n = snprintf(msg, sizeof(msg),
	                 "{\"ok\":false,\"error\":{\"code\":\"unavailable\",\"message\":\"%s; "
	                 "retry later\"}}\n",
	                 why);
	uv_buf_t b = uv_buf_init(msg, n > 0 && (size_t)n < sizeof(msg) ? (unsigned int)n : 0);

	/* Best effort: a fresh socket's buffer takes one short line. */
	discard_input(fd);
	uv_try_write((uv_stream_t *)&c->pipe, &b, 1);
	s->dispatch->stats.connections_refused++;
	conn_close(c);
}

static bool gid_listed(const struct config *cfg, gid_t gid)
{
	for (size_t i = 0; i < cfg->nallow_gids; i++)
		if (cfg->allow_gids[i] == gid)
			return true;
	return false;
}

/* Is one of the peer's supplementary groups (as they were at connect time) allowed?
 * Kernels without SO_PEERGROUPS (before 4.13): only the primary group counts. */
static bool peer_groups_allowed(const struct config *cfg, int fd)
{
	gid_t small[64], *groups = small;
	socklen_t len = sizeof(small);
	bool ok = false;

	if (getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0) {
		if (errno != ERANGE || len == 0 || len > PEER_GROUPS_MAX * sizeof(gid_t))
			return false;
		groups = malloc(len);
		if (!groups || getsockopt(fd, SOL_SOCKET, SO_PEERGROUPS, groups, &len) < 0)
			goto out;
	}
	for (size_t i = 0; i < len / sizeof(gid_t) && !ok; i++)
		ok = gid_listed(cfg, groups[i]);
out:
	if (groups != small)
		free(groups);
	return ok;
}

/* The allow-list: only what is listed (uid 0 included). Unknown credentials are refused. */
static bool peer_allowed(const struct server *s, int fd, struct ucred *cr)
{
	const struct config *cfg = s->cfg;
	socklen_t len = sizeof(*cr);

	cr->pid = 0;
	cr->uid = (uid_t)-1;
	cr->gid = (gid_t)-1;
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, cr, &len) < 0) {
		log_msg(LOG_WARN, "server", "SO_PEERCRED: %s", strerror(errno));
		return false;
	}
	if (config_peer_allowed(cfg, cr->uid, cr->gid))
		return true;
	return cfg->nallow_gids > 0 && peer_groups_allowed(cfg, fd);
}

/* Reads (and drops) what the client already sent, so that closing does not turn the
 * error line into a reset: a Unix socket closed over unread data resets its peer. */
static void discard_input(int fd)
{
	char scratch[4096];
	for (int i = 0; i < 16; i++)
		if (recv(fd, scratch, sizeof(scratch), MSG_DONTWAIT) <= 0)
			break;
}

static void deny(struct server *s, struct conn *c, int fd, const struct ucred *cr)
{
	char msg[200];
	int n = snprintf(msg, sizeof(msg),
	                 "{\"ok\":false,\"error\":{\"code\":\"unavailable\",\"message\":"
	                 "\"permission denied: uid %u is not allowed to use this daemon\"}}\n",
	                 (unsigned int)cr->uid);
	uv_buf_t b = uv_buf_init(msg, (unsigned int)n);

	log_msg(LOG_WARN, "server",
	        "refused connection from pid %ld uid %u gid %u: not in the "
	        "allow-list",
	        (long)cr->pid, (unsigned int)cr->uid, (unsigned int)cr->gid);
	discard_input(fd);
	uv_try_write((uv_stream_t *)&c->pipe, &b, 1);
	s->dispatch->stats.connections_denied++;
	conn_close(c);
}

/* Is fd within SERVER_FD_HEADROOM of the open-file limit (*limit)? A new descriptor is the
 * lowest free one, so its number counts those open. The limit is read again each time: it
 * may have been lowered while the daemon runs (prlimit), or the daemon's own files may
 * have grown past SERVER_FD_RESERVE, and then the connection limit worked out at the start
 * no longer keeps accept() from failing with EMFILE, where libuv accepts and closes the
 * waiting connections without a word and without calling back. */
static bool fd_near_limit(int fd, unsigned long long *limit)
{
	struct rlimit rl;

	if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == RLIM_INFINITY ||
	    (rlim_t)fd + SERVER_FD_HEADROOM < rl.rlim_cur)
		return false;
	*limit = (unsigned long long)rl.rlim_cur;
	return true;
}

static void on_connection(uv_stream_t *ls, int status)
{
	struct server *s = ls->data;
	struct conn *c;
	bool no_memory = false;
	unsigned long long limit;
	uv_os_fd_t fd;
	char why[96];

	if (status < 0) {
		log_msg(LOG_WARN, "server", "accept: %s", uv_strerror(status));
		return;
	}
	c = calloc(1, sizeof(*c));
	if (!c) {
		/* A connection left unaccepted stops libuv from watching the listener until
		 * uv_accept is called: the daemon would never accept anyone again. It is taken
		 * into the spare and refused; when the spare is out (its connection not closed
		 * yet), it waits in libuv until that close gives the spare back (on_closed). */
		if (!s->spare) {
			log_msg(LOG_ERROR, "server",
			        "out of memory accepting a connection; it waits for the last one "
			        "refused");
			s->accept_waiting = true;
			return;
		}
		log_msg(LOG_ERROR, "server", "out of memory accepting a connection; refusing it");
		c = s->spare;
		s->spare = NULL;
		memset(c, 0, sizeof(*c));
		no_memory = true;
	}
	c->srv = s;
	framer_init(&c->fr, s->cfg->max_line_bytes);
	if (uv_pipe_init(s->loop, &c->pipe, 0) < 0) {
		free(c);
		return;
	}
	c->pipe.data = c;
	c->next = s->conns;
	if (s->conns)
		s->conns->prev = c;
	s->conns = c;
	s->nconns++;
	if (uv_accept(ls, (uv_stream_t *)&c->pipe) < 0 ||
	    uv_fileno((uv_handle_t *)&c->pipe, &fd) < 0) {
		conn_close(c);
		return;
	}
	if (no_memory) {
		refuse(s, c, fd, "out of memory");
		return;
	}
	if (fd_near_limit(fd, &limit)) {
		snprintf(why, sizeof(why), "out of file descriptors (open-file limit %llu)", limit);
		log_msg(LOG_WARN, "server", "refusing a connection: %s", why);
		refuse(s, c, fd, why);
		return;
	}
	if (s->cfg->nallow_uids > 0 || s->cfg->nallow_gids > 0) {
		struct ucred cr;
		if (!peer_allowed(s, fd, &cr)) {
			deny(s, c, fd, &cr);
			return;
		}
	}
	if (s->nconns > conn_limit(s)) {
		snprintf(why, sizeof(why), "too many connections (limit %zu)", conn_limit(s));
		refuse(s, c, fd, why);
		return;
	}
	s->dispatch->stats.connections_accepted++;
	s->dispatch->stats.connections_current = s->nconns;
	conn_read_start(c);
}

/* The socket's directory must exist: uv_pipe_bind reports a missing one as EACCES. */
static int socket_dir_check(const char *path)
{
	const char *slash = strrchr(path, '/');
	char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
	struct stat st;

	if (!slash)
		return 0; /* the working directory */
	if (slash == path)
		return 0; /* "/" */
	if ((size_t)(slash - path) >= sizeof(dir))
		return -ENAMETOOLONG;
	memcpy(dir, path, (size_t)(slash - path));
	dir[slash - path] = '\0';
	if (stat(dir, &st) < 0) {
		int e = errno;
		log_msg(LOG_ERROR, "server", "cannot use %s: its directory %s: %s", path, dir,
		        strerror(e));
		return -e;
	}
	if (!S_ISDIR(st.st_mode)) {
		log_msg(LOG_ERROR, "server", "cannot use %s: %s is not a directory", path, dir);
		return -ENOTDIR;
	}
	return 0;
}

/* Whether another daemon accepts connections on the socket file at path: 1, 0, or -errno
 * when that cannot be told (no socket to try it with). */
static int socket_live(const char *path)
{
	struct sockaddr_un sa;
	int fd, rc;

	if (strlen(path) >= sizeof(sa.sun_path))
		return -ENAMETOOLONG;
	memset(&sa, 0, sizeof(sa));
	sa.sun_family = AF_UNIX;
	strcpy(sa.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -errno;
	rc = connect(fd, (struct sockaddr *)&sa, sizeof(sa));
	close(fd);
	return rc == 0;
}

/* What is at the socket path: -errno after logging why it cannot be used (its directory
 * missing, a file that is not a socket, another daemon listening on it), 0 nothing, 1 a
 * stale socket file. Changes nothing. */
static int socket_path_state(const char *path)
{
	struct stat st;
	int rc;

	if ((rc = socket_dir_check(path)) < 0)
		return rc;
	if (lstat(path, &st) < 0)
		return errno == ENOENT ? 0 : -errno;
	if (!S_ISSOCK(st.st_mode)) {
		log_msg(LOG_ERROR, "server", "%s exists and is not a socket; not replacing it",
		        path);
		return -EEXIST;
	}
	if ((rc = socket_live(path)) < 0)
		return rc;
	if (rc == 1) {
		log_msg(LOG_ERROR, "server", "another daemon is listening on %s", path);
		return -EADDRINUSE;
	}
	return 1;
}

int server_check_path(const struct config *cfg)
{
	int rc = socket_path_state(cfg->socket_path);
	return rc < 0 ? rc : 0;
}

/* Replaces a stale socket file; refuses a live socket or a file that is not a socket. */
static int prepare_socket_path(const char *path)
{
	int rc = socket_path_state(path);

	if (rc <= 0)
		return rc;
	log_msg(LOG_INFO, "server", "replacing stale socket %s", path);
	if (unlink(path) < 0 && errno != ENOENT)
		return -errno;
	return 0;
}

/* "path", "@abstract" or "unnamed" for the socket's own address. */
static void socket_describe(int fd, char *out, size_t size)
{
	struct sockaddr_un sa;
	socklen_t len = sizeof(sa);
	size_t n;

	memset(&sa, 0, sizeof(sa));
	if (getsockname(fd, (struct sockaddr *)&sa, &len) < 0 ||
	    len <= offsetof(struct sockaddr_un, sun_path)) {
		snprintf(out, size, "an unnamed socket");
		return;
	}
	n = len - offsetof(struct sockaddr_un, sun_path);
	if (sa.sun_path[0] == '\0')
		snprintf(out, size, "@%.*s", (int)(n - 1), sa.sun_path + 1);
	else
		snprintf(out, size, "%.*s", (int)strnlen(sa.sun_path, n), sa.sun_path);
}

/* fd must be a listening Unix stream socket: anything else is a unit misconfiguration. */
static int activation_check(int fd)
{
	int type = 0, listening = 0, domain = 0;
	socklen_t len = sizeof(int);
	struct stat st;

	if (fstat(fd, &st) < 0)
		return -errno;
	if (!S_ISSOCK(st.st_mode))
		return -ENOTSOCK;
	if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &domain, &len) < 0)
		return -errno;
	len = sizeof(int);
	if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) < 0)
		return -errno;
	len = sizeof(int);
	if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) < 0)
		return -errno;
	if (domain != AF_UNIX || type != SOCK_STREAM)
		return -EAFNOSUPPORT;
	if (!listening)
		return -EINVAL;
	return 0;
}

static int parse_positive_long(const char *str, long *out)
{
	char *end = NULL;
	long v;

	if (!str || *str < '0' || *str > '9')
		return -EINVAL;
	errno = 0;
	v = strtol(str, &end, 10);
	if (errno || *end)
		return -EINVAL;
	*out = v;
	return 0;
}

int server_take_activation(int *out)
{
	const char *pid_s = getenv("LISTEN_PID"), *fds_s = getenv("LISTEN_FDS");
	long pid, n;
	int rc = 0;

	*out = -1;
	if (!pid_s || !fds_s)
		goto out;
	if (parse_positive_long(pid_s, &pid) < 0 || pid != (long)getpid()) {
		log_msg(LOG_DEBUG, "server",
		        "LISTEN_PID=%s is not this process: ignoring LISTEN_FDS", pid_s);
		goto out;
	}
	if (parse_positive_long(fds_s, &n) < 0 || n > 1024) {
		log_msg(LOG_ERROR, "server", "socket activation: LISTEN_FDS=%s is not a count",
		        fds_s);
		rc = -EINVAL;
		goto out;
	}
	if (n == 0)
		goto out;
	for (long i = 1; i < n; i++) {
		log_msg(LOG_WARN, "server",
		        "socket activation: ignoring (closing) passed fd %ld; only the first "
		        "socket is used",
		        LISTEN_FDS_START + i);
		close((int)(LISTEN_FDS_START + i));
	}
	rc = activation_check(LISTEN_FDS_START);
	if (rc < 0) {
		log_msg(
		    LOG_ERROR, "server",
		    "socket activation: fd %d is not a listening Unix stream socket (%s); check "
		    "the socket unit (ListenStream= with a path)",
		    LISTEN_FDS_START, strerror(-rc));
		close(LISTEN_FDS_START);
		goto out;
	}
	if (fcntl(LISTEN_FDS_START, F_SETFD, FD_CLOEXEC) < 0 ||
	    fcntl(LISTEN_FDS_START, F_SETFL, fcntl(LISTEN_FDS_START, F_GETFL) | O_NONBLOCK) < 0) {
		rc = -errno;
		log_msg(LOG_ERROR, "server", "socket activation: fd %d: %s", LISTEN_FDS_START,
		        strerror(-rc));
		close(LISTEN_FDS_START);
		goto out;
	}
	*out = LISTEN_FDS_START;
out:
	/* Never inherited by anything this process starts. */
	unsetenv("LISTEN_PID");
	unsetenv("LISTEN_FDS");
	unsetenv("LISTEN_FDNAMES");
	return rc;
}

/* The passed socket: already bound and listening; the file is systemd's, not ours. */
static int listen_activated(struct server *s, int fd)
{
	char where[sizeof(((struct sockaddr_un *)0)->sun_path) + 2];
	int rc;

	socket_describe(fd, where, sizeof(where));
	uv_pipe_init(s->loop, &s->listener, 0);
	s->listener.data = s;
	rc = uv_pipe_open(&s->listener, fd);
	if (rc < 0)
		close(fd);
	/* listen() again only sets the backlog; the kernel caps it at net.core.somaxconn. */
	if (rc == 0)
		rc = uv_listen((uv_stream_t *)&s->listener, SOMAXCONN, on_connection);
	if (rc < 0) {
		log_msg(LOG_ERROR, "server", "cannot listen on the passed socket %s: %s", where,
		        uv_strerror(rc));
		uv_close((uv_handle_t *)&s->listener, NULL);
		return rc;
	}
	s->activated = true;
	log_msg(LOG_INFO, "server",
	        "listening on %s (socket activation: passed by the service "
	        "manager)",
	        where);
	return 0;
}

static int listen_path(struct server *s)
{
	const struct config *cfg = s->cfg;
	mode_t old_mask;
	int rc;

	rc = prepare_socket_path(cfg->socket_path);
	if (rc < 0) {
		log_msg(LOG_ERROR, "server", "cannot use %s: %s", cfg->socket_path, strerror(-rc));
		return rc;
	}
	uv_pipe_init(s->loop, &s->listener, 0);
	s->listener.data = s;
	/* Create the file with no access for others from the start, then set 0660 exactly. */
	old_mask = umask(0177);
	rc = uv_pipe_bind(&s->listener, cfg->socket_path);
	umask(old_mask);
	if (rc == 0) {
		s->socket_created = true;
		if (chmod(cfg->socket_path, 0660) < 0)
			rc = -errno;
	}
	if (rc == 0)
		rc = uv_listen((uv_stream_t *)&s->listener, 511, on_connection);
	if (rc < 0) {
		log_msg(LOG_ERROR, "server", "cannot listen on %s: %s", cfg->socket_path,
		        uv_strerror(rc));
		if (s->socket_created)
			unlink(cfg->socket_path);
		s->socket_created = false;
		uv_close((uv_handle_t *)&s->listener, NULL);
		return rc;
	}
	log_msg(LOG_INFO, "server", "listening on %s (created by convod)", cfg->socket_path);
	return 0;
}

int server_start(struct server *s, uv_loop_t *loop, const struct config *cfg,
                 struct dispatch *dispatch, int listen_fd)
{
	int rc;

	memset(s, 0, sizeof(*s));
	s->loop = loop;
	s->cfg = cfg;
	s->dispatch = dispatch;
	dispatch->on_ready = on_restore_ready;
	if (!(s->spare = calloc(1, sizeof(*s->spare)))) {
		if (listen_fd >= 0)
			close(listen_fd);
		log_msg(LOG_ERROR, "server", "out of memory");
		return -ENOMEM;
	}
	rc = listen_fd >= 0 ? listen_activated(s, listen_fd) : listen_path(s);
	if (rc < 0) {
		free(s->spare);
		s->spare = NULL;
		return rc;
	}
	s->listening = true;
	conn_limit(s); /* the open-file limit raised, or its warning, at the start */
	uv_check_init(loop, &s->turn);
	s->turn.data = s;
	uv_check_start(&s->turn, on_turn);
	uv_prepare_init(loop, &s->turn_before_poll);
	s->turn_before_poll.data = s;
	uv_prepare_start(&s->turn_before_poll, on_before_poll);
	uv_idle_init(loop, &s->one_more_poll);
	s->one_more_poll.data = s;
	uv_timer_init(loop, &s->deadline);
	s->deadline.data = s;
	if (cfg->nallow_uids > 0 || cfg->nallow_gids > 0)
		log_msg(LOG_INFO, "server",
		        "allow-list: %zu uid(s), %zu gid(s); others are refused", cfg->nallow_uids,
		        cfg->nallow_gids);
	return 0;
}

static void on_handle_closed(uv_handle_t *h)
{
	struct server *s = h->data;
	if (--s->handles_open == 0 && s->on_stopped)
		s->on_stopped(s);
}

static void server_maybe_stopped(struct server *s)
{
	if (s->nconns > 0 || !s->stopping || uv_is_closing((uv_handle_t *)&s->deadline))
		return;
	free(s->spare);
	s->spare = NULL;
	s->handles_open = 4;
	uv_close((uv_handle_t *)&s->turn, on_handle_closed);
	uv_close((uv_handle_t *)&s->turn_before_poll, on_handle_closed);
	uv_close((uv_handle_t *)&s->one_more_poll, on_handle_closed);
	uv_close((uv_handle_t *)&s->deadline, on_handle_closed);
}

static void on_deadline(uv_timer_t *t)
{
	struct server *s = t->data;
	size_t n;

	/* Requests still waiting for DynamoDB (a lookup retried for longer than the deadline)
	 * would hold their connections' answers, and those of every line after them, until
	 * the close: they are answered as if DynamoDB had failed, and what they held goes
	 * out, for STOP_GRACE_MS more at most. A second signal closes at once. */
	if (!s->waits_failed) {
		s->waits_failed = true;
		if ((n = dispatch_stop_waiting(s->dispatch)) > 0) {
			log_msg(
			    LOG_WARN, "server",
			    "stop deadline reached; %zu requests waiting for DynamoDB answered as "
			    "if it failed",
			    n);
			uv_timer_start(&s->deadline, on_deadline, STOP_GRACE_MS, 0);
			return;
		}
	}
	log_msg(LOG_WARN, "server", "stop deadline reached; closing %zu connections", s->nconns);
	for (struct conn *c = s->conns; c; c = c->next)
		conn_close(c);
}

/* At stop: what the client sent before the signal is in the socket's receive queue. Read it
 * (without blocking) and answer every complete line, so no request already sent is dropped
 * and the close does not reset the connection over unread data: now, and again each time
 * the connection, paused for its unread answers or waiting for a restore, goes on. */
static void conn_drain_socket(struct conn *c)
{
	uv_os_fd_t fd;

	if (c->closing || c->eof || c->drained || uv_fileno((uv_handle_t *)&c->pipe, &fd) < 0)
		return;
	while (!c->paused && !c->held && !c->closing) {
		char *p;
		size_t n;
		ssize_t got;

		if (c->stop_left == 0) {
			c->drained = true; /* what comes after the signal is not read */
			break;
		}
		if (framer_reserve(&c->fr, READ_CHUNK, &p, &n) < 0) {
			c->drained = true; /* no memory to read it: given up */
			break;
		}
		got = recv(fd, p, n < c->stop_left ? n : c->stop_left, MSG_DONTWAIT);
		if (got > 0) {
			c->stop_left -= (size_t)got;
			framer_commit(&c->fr, (size_t)got);
			conn_serve(c);
			continue;
		}
		if (got == 0)
			c->eof = true;
		else if (errno == EAGAIN || errno == EWOULDBLOCK)
			c->drained = true;
		else if (errno == EINTR)
			continue;
		else
			c->eof = true; /* a reset: nothing more will come */
		break;
	}
}

void server_stop(struct server *s, void (*on_stopped)(struct server *s))
{
	struct conn *c, *next;

	if (s->stopping) {
		s->waits_failed = true; /* a second signal: close now */
		on_deadline(&s->deadline);
		return;
	}
	s->stopping = true;
	s->on_stopped = on_stopped;
	if (s->listening) {
		uv_close((uv_handle_t *)&s->listener, NULL);
		s->listening = false;
		if (s->socket_created)
			unlink(s->cfg->socket_path);
	}
	uv_timer_start(&s->deadline, on_deadline, STOP_DEADLINE_MS, 0);
	for (c = s->conns; c; c = next) {
		uv_os_fd_t fd;
		int queued = 0;
		next = c->next;
		conn_read_stop(c);
		/* What it sent before the signal: the bytes in its socket's queue now. A client
		 * that goes on sending cannot hold the stop. */
		c->stop_left = uv_fileno((uv_handle_t *)&c->pipe, &fd) == 0 &&
		                       ioctl(fd, FIONREAD, &queued) == 0 && queued >= 0
		                   ? (size_t)queued
		                   : SIZE_MAX;
		conn_drain_socket(c);
		/* An unfinished line will never be finished now. */
		if (!c->paused && !c->held) {
			framer_free(&c->fr);
			framer_init(&c->fr, s->cfg->max_line_bytes);
		}
		conn_close_if_done(c);
	}
	server_maybe_stopped(s);
}
