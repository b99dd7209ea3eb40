/* Request dispatch: envelope checks in protocol order, conversation lookup, op, answer. */
#include "dispatch.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "ddbitem.h"
#include "jscan.h"
#include "log.h"
#include "monoclock.h"
#include "ops.h"

#define DISPATCH_PURGE_FIRST_MS 60000   /* the first retention purge after the start */
#define DISPATCH_PURGE_EVERY_MS 3600000 /* and the next ones */
/* persistence.md: the flusher runs every flush interval, "or sooner when enough is
 * pending": this many changes to send since the last tick (ten rounds of full batches at
 * the default 25 items and 8 in flight) ask for a tick now (dispatch.flush_soon). */
#define DISPATCH_FLUSH_SOON_CHANGES 2000

int64_t dispatch_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

enum {
	FLAG_STORE_DIRTY = 1u << 0, /* on d->store_dirty */
	FLAG_SINK_DIRTY = 1u << 1,  /* on d->sink_dirty */
	FLAG_CLOSING = 1u << 2,     /* closed: dropped from memory once the sink confirmed all */
	FLAG_FROM_REMOTE = 1u << 3, /* restored from DynamoDB: stored as confirmed there */
	FLAG_MARKS_DIRTY = 1u << 5, /* on d->marks_dirty: the client's marks moved since stored */
	FLAG_DATA_DIRTY = 1u << 6,  /* a change a read shows, for the open transaction */
	/* Its conversations row is committed and open: a turn writes only its messages (the
	 * row's updated time may lag; loading takes the newest of the messages' own). Saves a
	 * page of the conversations table per conversation and turn. */
	FLAG_ROW_OPEN = 1u << 4,
};

int dispatch_init(struct dispatch *d, const struct config *cfg, struct store *store,
                  struct sink *sink)
{
	uint8_t seed[48];
	size_t got = 0;

	memset(d, 0, sizeof(*d));
	d->cfg = cfg;
	d->store = store;
	d->sink = sink;
	d->remote = sink && sink_remote(sink);
	d->purge_local = d->remote;
	while (got < sizeof(seed)) {
		ssize_t n = getrandom(seed + got, sizeof(seed) - got, 0);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			return -errno;
		}
		got += (size_t)n;
	}
	ulid_gen_init(&d->ulid, seed);
	registry_init(&d->reg, seed + 32);
	d->stats.started_mono_ms = mono_ns() / 1000000;
	d->purge_due_ms = dispatch_now_ms() + DISPATCH_PURGE_FIRST_MS;
	return 0;
}

static void spooled_clear(struct dispatch *d)
{
	for (size_t i = 0; i < d->nspooled; i++)
		free(d->spooled[i].conv);
	d->nspooled = 0;
}

static void closing_clear(struct dispatch *d)
{
	for (size_t i = 0; i < d->nclosing; i++)
		free(d->closing[i].conv);
	d->nclosing = 0;
}

void dispatch_free(struct dispatch *d)
{
	buf_free(&d->scratch);
	spooled_clear(d);
	free(d->spooled);
	closing_clear(d);
	free(d->closing);
	free(d->submit_seqs);
	registry_free(&d->reg);
}

/* The dirty lists. A conversation is on the store list until a commit succeeds and on the
 * sink list while the flusher has something to take from it. */
/* c goes into the next commit, which need not come before this turn's answers: its row is
 * written open (store_put_conversation, as FLAG_ROW_OPEN is clear) by the next turn that
 * commits anyway, or by the flush tick. */
static void mark_row_reopen(struct dispatch *d, struct convo *c)
{
	if (!d->store || (c->daemon_flags & FLAG_STORE_DIRTY))
		return;
	c->daemon_flags |= FLAG_STORE_DIRTY;
	c->daemon_next_store = d->store_dirty;
	d->store_dirty = c;
}

/* c's row is to be written open, in this turn's commit: no change a read shows. */
static void mark_row_change(struct dispatch *d, struct convo *c)
{
	d->changed = true;
	mark_row_reopen(d, c);
}

static void mark_store_dirty(struct dispatch *d, struct convo *c)
{
	mark_row_change(d, c);
	if (d->store)
		c->daemon_flags |= FLAG_DATA_DIRTY;
}

static void mark_sink_dirty(struct dispatch *d, struct convo *c)
{
	if (!d->remote)
		return;
	if (++d->sink_changes == DISPATCH_FLUSH_SOON_CHANGES && d->flush_soon)
		d->flush_soon(d->flush_soon_arg);
	if (c->daemon_flags & FLAG_SINK_DIRTY)
		return;
	c->daemon_flags |= FLAG_SINK_DIRTY;
	c->daemon_prev_sink = NULL;
	c->daemon_next_sink = d->sink_dirty;
	if (d->sink_dirty)
		d->sink_dirty->daemon_prev_sink = c;
	d->sink_dirty = c;
}

/* A request changed c: it goes on the flusher's list, and its idle time starts over on the
 * monotonic clock (dispatch_flush_tick). */
static void mark_sink_changed(struct dispatch *d, struct convo *c)
{
	if (!d->remote)
		return;
	c->daemon_changed_mono_ms = (int64_t)(mono_ns() / 1000000);
	mark_sink_dirty(d, c);
}

static void unmark_sink_dirty(struct dispatch *d, struct convo *c)
{
	if (!(c->daemon_flags & FLAG_SINK_DIRTY))
		return;
	if (c->daemon_prev_sink)
		c->daemon_prev_sink->daemon_next_sink = c->daemon_next_sink;
	else
		d->sink_dirty = c->daemon_next_sink;
	if (c->daemon_next_sink)
		c->daemon_next_sink->daemon_prev_sink = c->daemon_prev_sink;
	c->daemon_next_sink = c->daemon_prev_sink = NULL;
	c->daemon_flags &= ~(unsigned int)FLAG_SINK_DIRTY;
}

/* True if some message of c has not been taken by the sink. */
static bool sink_has_pending(const struct convo *c)
{
	for (size_t i = c->scan_from[CONSUMER_SINK]; i < c->nlog; i++)
		if (convo_pending(c->log[i], CONSUMER_SINK))
			return true;
	return false;
}

/* The client's marks (what incremental to_messages_map has returned) are part of each
 * message's record in the store, written when the message changes. A call that moved them
 * puts the conversation on d->marks_dirty, from index `from` on; the flush tick (and close,
 * and the stop) writes those messages again (persist_marks), so that a restart or a
 * restore after close goes on where the client was. Not in the call's own commit: its answer
 * is on its way first, so a crash re-sends messages (the client can tell them by id)
 * rather than losing them, and a client polling to_messages_map costs no write per call. */
static void mark_marks_dirty(struct dispatch *d, struct convo *c, size_t from)
{
	if (!d->store)
		return;
	if (c->daemon_flags & FLAG_MARKS_DIRTY) {
		if (from < c->daemon_marks_from)
			c->daemon_marks_from = from;
		return;
	}
	c->daemon_flags |= FLAG_MARKS_DIRTY;
	c->daemon_marks_from = from;
	c->daemon_prev_marks = NULL;
	c->daemon_next_marks = d->marks_dirty;
	if (d->marks_dirty)
		d->marks_dirty->daemon_prev_marks = c;
	d->marks_dirty = c;
}

static void unmark_marks_dirty(struct dispatch *d, struct convo *c)
{
	if (!(c->daemon_flags & FLAG_MARKS_DIRTY))
		return;
	c->daemon_flags &= ~(unsigned int)FLAG_MARKS_DIRTY;
	if (c->daemon_prev_marks)
		c->daemon_prev_marks->daemon_next_marks = c->daemon_next_marks;
	else
		d->marks_dirty = c->daemon_next_marks;
	if (c->daemon_next_marks)
		c->daemon_next_marks->daemon_prev_marks = c->daemon_prev_marks;
	c->daemon_next_marks = c->daemon_prev_marks = NULL;
}

/* Has the group commit write again the messages whose client marks moved (their records
 * carry the marks). */
static void persist_marks(struct dispatch *d, struct convo *c)
{
	size_t lo = c->nlog;

	if (!(c->daemon_flags & FLAG_MARKS_DIRTY))
		return;
	for (size_t i = c->daemon_marks_from; i < c->nlog; i++) {
		struct message *m = c->log[i];
		if (m->seen[CONSUMER_CLIENT] == m->version &&
		    m->seen[CONSUMER_STORE] == m->version) {
			m->seen[CONSUMER_STORE] = 0;
			if (lo == c->nlog)
				lo = i;
		}
	}
	unmark_marks_dirty(d, c);
	if (lo < c->nlog) {
		if (c->scan_from[CONSUMER_STORE] > lo)
			c->scan_from[CONSUMER_STORE] = lo;
		mark_store_dirty(d, c);
	}
}

/* Removes c from the registry and the lists, and frees it. */
static void drop_conversation(struct dispatch *d, struct convo *c)
{
	d->dropped_since_trim++;
	unmark_sink_dirty(d, c);
	unmark_marks_dirty(d, c);
	convo_free(registry_take(&d->reg, c->id, c->id_len));
}

static int ensure_tx(struct dispatch *d)
{
	int rc;
	if (!d->store)
		return 0;
	if (store_in_transaction(d->store))
		return 0;
	rc = store_begin(d->store);
	if (rc < 0 && !d->tx_error)
		d->tx_error = rc;
	return rc;
}

struct take_ctx {
	struct dispatch *d;
	struct convo *c;
	int64_t now_ms;
};

static void store_take_cb(void *arg, const struct message *m, size_t index)
{
	struct take_ctx *t = arg;
	int rc;

	(void)index;
	if (t->d->tx_error)
		return;
	rc = store_put_message(t->d->store, t->c->id, t->c->id_len, m);
	if (rc == 0 && (t->c->daemon_flags & FLAG_FROM_REMOTE) &&
	    m->seen[CONSUMER_SINK] == m->version) {
		/* DynamoDB already holds this version: record it as confirmed, so a restart
		 * does not send it again. */
		char sk[MESSAGE_SK_MAX + 1];
		message_sort_key(m, sk);
		rc = store_spool_done(t->d->store, t->c->id, t->c->id_len, sk, m->version);
	}
	if (rc < 0)
		t->d->tx_error = rc;
}

static void spool_take_cb(void *arg, const struct message *m, size_t index)
{
	struct take_ctx *t = arg;
	struct dispatch *d = t->d;
	struct spool_entry *e;
	int rc;

	(void)index;
	d->stats.flushed++;
	if (!d->remote || d->tx_error)
		return;
	if (d->nspooled == d->capspooled) {
		size_t ncap = d->capspooled ? 2 * d->capspooled : 256;
		struct spool_entry *p = realloc(d->spooled, ncap * sizeof(*p));
		if (!p) {
			d->tx_error = -ENOMEM;
			return;
		}
		d->spooled = p;
		d->capspooled = ncap;
	}
	e = &d->spooled[d->nspooled];
	message_sort_key(m, e->sk);
	e->conv = malloc(t->c->id_len + 1);
	if (!e->conv) {
		d->tx_error = -ENOMEM;
		return;
	}
	memcpy(e->conv, t->c->id, t->c->id_len + 1);
	e->conv_len = t->c->id_len;
	e->version = m->version;
	e->at_ms = t->now_ms;
	e->seq = 0; /* this turn's: set when it is submitted */
	e->put_again = false;
	d->scratch.len = 0;
	if (message_write_map(&d->scratch, m) < 0) {
		free(e->conv);
		d->tx_error = -ENOMEM;
		return;
	}
	e->map_bytes = d->scratch.len;
	rc = store_spool_put(d->store, e->conv, e->conv_len, e->sk, e->version, e->map_bytes,
	                     e->at_ms);
	if (rc < 0) {
		free(e->conv);
		d->tx_error = rc;
		return;
	}
	d->nspooled++;
}

/* The flusher's snapshot of c into the spool: new or changed messages, the last one only
 * when include_last. Returns how many were taken. */
static size_t sink_take(struct dispatch *d, struct convo *c, bool include_last)
{
	struct take_ctx t = {d, c, dispatch_now_ms()};
	size_t from = c->scan_from[CONSUMER_SINK], n;

	if (d->remote && ensure_tx(d) < 0)
		return 0;
	n = convo_take(c, CONSUMER_SINK, !include_last, spool_take_cb, &t);
	if (n)
		d->changed = true;
	/* Taken with no spool row to show for it (the transaction failed already): this turn's
	 * commit fails, and commit_failed reads the conversation back from the store. At
	 * durability none it keeps memory instead: the take is undone here (a message taken
	 * before at the same version is sent again, which is harmless). */
	if (n && d->remote && d->tx_error) {
		c->daemon_flags |= FLAG_STORE_DIRTY;
		if (d->cfg->durability == DURABILITY_NONE) {
			for (size_t i = from; i < c->nlog; i++)
				c->log[i]->seen[CONSUMER_SINK] = 0;
			c->scan_from[CONSUMER_SINK] = from;
		}
	}
	if (d->remote) {
		if (sink_has_pending(c))
			mark_sink_dirty(d, c);
		else
			unmark_sink_dirty(d, c);
	}
	return n;
}

/* With the local store as the sink, what the store holds is what the sink has: nothing
 * of a loaded conversation is left to take. */
static void loaded_from_store(struct dispatch *d, struct convo *c)
{
	if (d->remote)
		return;
	for (size_t i = 0; i < c->nlog; i++)
		c->log[i]->seen[CONSUMER_SINK] = c->log[i]->version;
	c->scan_from[CONSUMER_SINK] = c->nlog;
}

struct revert_ctx {
	uint64_t after;
	struct convo *list; /* linked on daemon_next_store: the store list is void anyway */
};

static void revert_collect(void *arg, struct convo *c)
{
	struct revert_ctx *r = arg;
	if (!(c->daemon_flags & FLAG_STORE_DIRTY) && c->daemon_store_seq <= r->after)
		return;
	c->daemon_next_store = r->list;
	r->list = c;
}

/* A message's mark stamp (stamp_marks), kept in 48 bits so that struct message does not
 * grow: at a million commits a second they last nine years; beyond, a stamp reads as
 * written, which keeps the mark. */
static uint64_t mark_stamp(const struct message *m)
{
	return (uint64_t)m->daemon_mark_hi << 32 | m->daemon_mark_lo;
}

static void mark_stamp_set(struct message *m, uint64_t seq)
{
	if (seq >> 48)
		seq = 0;
	m->daemon_mark_hi = (uint16_t)(seq >> 32);
	m->daemon_mark_lo = (uint32_t)seq;
}

/* The store's copy of the client's marks is as old as the last flush tick (persist_marks):
 * fresh, c read back from it after a failed commit, takes over c's marks of the versions it
 * holds, unless a read whose answer the failure turns into `unavailable` moved them (stamped
 * with a transaction after the last one written, after). Otherwise an incremental
 * to_messages_map returned again what an ok answer had returned, or never what a failed
 * one had shown. Returns the index of the first message whose mark moved (fresh->nlog:
 * none), for persist_marks to write. */
static size_t carry_marks(const struct convo *c, struct convo *fresh, uint64_t after)
{
	size_t from = fresh->nlog, j = 0;

	for (size_t i = 0; i < fresh->nlog; i++) {
		struct message *f = fresh->log[i];
		const struct message *m;
		size_t k = j;

		/* Both logs are in the same order; the memory copy may hold more. */
		while (k < c->nlog && strcmp(c->log[k]->id, f->id) != 0)
			k++;
		if (k == c->nlog)
			continue;
		j = k + 1;
		m = c->log[k];
		if (f->seen[CONSUMER_CLIENT] != f->version &&
		    m->seen[CONSUMER_CLIENT] == f->version && mark_stamp(m) <= after) {
			f->seen[CONSUMER_CLIENT] = f->version;
			if (from == fresh->nlog)
				from = i;
		}
	}
	return from;
}

/* After a failed commit: the store holds everything up to the transaction committed last
 * (after); every conversation changed since (in a transaction submitted later, or in the
 * open one) is made to match it again: read back, or, when it cannot be read (no memory, an
 * I/O error), dropped from memory, so that its next request reads it again. (It used to
 * keep the changes the failed answers said were not made, and the sink marks of a flush
 * with no spool row behind them.) With DynamoDB as the sink, the flush tick then reads the
 * open ones back, so that what they hold unsent is taken (reread_open). Allocates
 * nothing. */
static void revert_to_store(struct dispatch *d, uint64_t after)
{
	struct revert_ctx r = {after, NULL};
	struct convo *c, *next;
	size_t unread = 0;
	int unread_rc = 0;

	registry_each(&d->reg, revert_collect, &r);
	d->store_dirty = NULL;
	for (c = r.list; c; c = next) {
		struct convo *fresh = NULL;
		size_t marks_from;
		int rc;

		next = c->daemon_next_store;
		c->daemon_flags &= ~(unsigned int)(FLAG_STORE_DIRTY | FLAG_DATA_DIRTY);
		c->daemon_next_store = NULL;
		rc = store_load_conversation(d->store, c->id, c->id_len, &fresh);
		if (rc < 0) {
			/* -ENOENT: created after the last commit. */
			if (rc != -ENOENT) {
				unread++;
				unread_rc = rc;
			}
			drop_conversation(d, c);
			continue;
		}
		loaded_from_store(d, fresh);
		marks_from = carry_marks(c, fresh, after);
		unmark_sink_dirty(d, c);
		unmark_marks_dirty(d, c);
		convo_free(registry_take(&d->reg, c->id, c->id_len));
		if (registry_put(&d->reg, fresh) < 0) {
			convo_free(fresh);
			unread++;
			unread_rc = -ENOMEM;
			continue;
		}
		if (marks_from < fresh->nlog)
			mark_marks_dirty(d, fresh, marks_from);
		if (sink_has_pending(fresh))
			mark_sink_dirty(d, fresh);
	}
	if (unread) {
		log_msg(LOG_ERROR, "store",
		        "%zu conversation%s could not be read back after the failed commit (%s); "
		        "read again when next asked for",
		        unread, unread == 1 ? "" : "s", strerror(-unread_rc));
		if (d->remote)
			d->reread_open = true;
	}
}

/* After a failed commit at durability none: its changes were answered ok before it was
 * tried, so memory keeps them (persistence.md: none loses what a crash takes, not what a
 * full disk refuses). Every conversation it or the open transaction wrote goes into the
 * next commit again, whole (which of its messages the void transactions held is not
 * known), with its row; the flush tick tries again. */
static void keep_for_retry(struct dispatch *d, uint64_t after)
{
	struct revert_ctx r = {after, NULL};
	struct convo *c, *next;

	registry_each(&d->reg, revert_collect, &r);
	d->store_dirty = NULL;
	for (c = r.list; c; c = next) {
		next = c->daemon_next_store;
		c->daemon_next_store = NULL;
		c->daemon_flags &= ~(unsigned int)(FLAG_STORE_DIRTY | FLAG_ROW_OPEN);
		for (size_t i = 0; i < c->nlog; i++)
			c->log[i]->seen[CONSUMER_STORE] = 0;
		c->scan_from[CONSUMER_STORE] = 0;
		mark_store_dirty(d, c);
	}
}

/* Makes msg valid UTF-8 in place: a message may quote request bytes, or be cut by the
 * fixed-size buffer in the middle of a character. Invalid or cut sequences become '?'. */
static void utf8_sanitize(char *msg)
{
	size_t n = strlen(msg);

	for (size_t i = 0; i < n;) {
		size_t k = (unsigned char)msg[i] < 0x80 ? 1 : buf_utf8_len(msg + i, n - i);
		if (k == 0) {
			msg[i++] = '?';
			continue;
		}
		i += k;
	}
}

/* The rest of an error answer after its "{" and id: "ok":false, the error object and the
 * line's end. Written without jansson (no allocation but the buffer's own growth), so that
 * a daemon out of memory still gets its error out when the buffer has room. The message
 * is cleaned of invalid UTF-8 first, as answers are. 0 or -ENOMEM (out partly written:
 * callers put its length back). */
static int append_error(struct buf *out, const struct error *err)
{
	static const char head[] = "\"ok\":false,\"error\":{\"code\":\"";
	static const char mid[] = "\",\"message\":";
	struct error clean = *err;
	const char *code = error_code_str(clean.code);

	utf8_sanitize(clean.message);
	return buf_append(out, head, sizeof(head) - 1) < 0 ||
	               buf_append(out, code, strlen(code)) < 0 ||
	               buf_append(out, mid, sizeof(mid) - 1) < 0 ||
	               buf_append_jstring(out, clean.message, strlen(clean.message)) < 0 ||
	               buf_append(out, "}}\n", 3) < 0
	           ? -ENOMEM
	           : 0;
}

/* Copies the "id":ID, member that opens an answer written by answer_open, if any: the
 * request's id as it was echoed. */
static int answer_copy_id(struct buf *to, const char *answer, size_t len)
{
	static const char head[] = "{\"id\":";
	struct jscan_value v;
	size_t end;

	if (len < sizeof(head) - 1 || memcmp(answer, head, sizeof(head) - 1) != 0)
		return 0;
	answer += sizeof(head) - 1;
	len -= sizeof(head) - 1;
	if (jscan_value(answer, len, &v, &end) == 0 &&
	    (buf_append(to, "\"id\":", 5) < 0 || buf_append(to, answer, end) < 0 ||
	     buf_append(to, ",", 1) < 0))
		return -ENOMEM;
	return 0;
}

int dispatch_fail_answer(struct dispatch *d, struct buf *to, const char *answer, size_t len,
                         enum op op)
{
	size_t mark = to->len;
	struct error err;
	int rc;

	error_set(&err, ERR_UNAVAILABLE, "%s; nothing was changed, retry later",
	          d->fail_why ? d->fail_why : "the local store cannot be written");
	stats_error(&d->stats, op, ERR_UNAVAILABLE);
	/* The same envelope as answer_error, without counting a request. */
	rc = buf_append(to, "{", 1) < 0 || answer_copy_id(to, answer, len) < 0 ||
	             append_error(to, &err) < 0
	         ? -ENOMEM
	         : 0;
	if (rc < 0)
		to->len = mark;
	return rc;
}

/* What the transactions up to d->committed finished: their spool rows go to the sink, and
 * the conversations they closed leave memory once the sink is done with them. Run on
 * every advance of d->committed, a failed commit's included: dispatch_progress sees no
 * advance after it. */
static void hand_over_committed(struct dispatch *d)
{
	size_t k = 0;

	/* Spool rows written now: the sink may send them. */
	for (size_t i = 0; i < d->nspooled; i++) {
		struct spool_entry *e = &d->spooled[i];
		if (!e->seq || e->seq > d->committed) {
			d->spooled[k++] = *e;
			continue;
		}
		/* Not taken (the sink is closing, or closed): sent by the next start. */
		if (d->sink && sink_enqueue(d->sink, e->conv, e->conv_len, e->sk, e->version,
		                            e->at_ms) == -ENOMEM) {
			log_msg(LOG_ERROR, "sink",
			        "out of memory queueing a write; it stays in the spool");
			sink_lost_row(d->sink);
		}
		free(e->conv);
	}
	d->nspooled = k;
	/* Closed conversations whose close is written leave memory, once the sink is done. */
	k = 0;
	for (size_t i = 0; i < d->nclosing; i++) {
		struct closing *e = &d->closing[i];
		struct convo *c;
		if (e->seq > d->committed) {
			d->closing[k++] = *e;
			continue;
		}
		c = registry_get(&d->reg, e->conv, e->conv_len);
		if (c && (c->daemon_flags & FLAG_CLOSING) && c->daemon_store_seq <= d->committed &&
		    !(c->daemon_flags & FLAG_STORE_DIRTY) &&
		    (!d->remote || sink_pending(d->sink, c->id, c->id_len) == 0))
			drop_conversation(d, c);
		free(e->conv);
	}
	d->nclosing = k;
}

/* A commit failed (rc): put memory back as the store holds it (at durability none, keep it
 * and write it again: keep_for_retry), void what was taken after it, and tell the server
 * (d->failures). */
static void commit_failed(struct dispatch *d, int rc)
{
	bool none = d->cfg->durability == DURABILITY_NONE;
	struct store_progress p;
	size_t k = 0;

	d->fail_why = rc == -ENOSPC ? "the local store is full (disk full)"
	                            : "the local store cannot be written";
	if (!d->store_failing)
		log_msg(LOG_ERROR, "store", "commit failed: %s (%s); %s", d->fail_why,
		        strerror(-rc),
		        none ? "changes kept in memory, written again at the next flush tick"
		             : "answering unavailable");
	d->store_failing = true;
	d->failures++;
	d->tx_error = 0;
	/* Confirmations or dead letters the sink recorded in it are lost with it: their spool
	 * rows stay, and the sink reads them again once commits succeed (sink_resync). */
	sink_lost(d->sink);
	store_rollback(d->store);
	store_progress(d->store, &p);
	/* The flusher's takes into void spool rows moved their messages' sink marks: those
	 * conversations are read back from the store too, so that the messages are taken
	 * again. (They used to stay taken, in no spool row: nothing sent them before a
	 * restart.) At durability none, where memory is kept, the rows are written again
	 * instead (below). */
	for (size_t i = 0; i < d->nspooled && !none; i++) {
		struct spool_entry *e = &d->spooled[i];
		struct convo *c;
		if ((!e->seq || e->seq > p.committed) &&
		    (c = registry_get(&d->reg, e->conv, e->conv_len)))
			c->daemon_flags |= FLAG_STORE_DIRTY;
	}
	if (none)
		keep_for_retry(d, p.committed);
	else
		revert_to_store(d, p.committed);
	/* The transactions after the last one written are void: what their answers wait for
	 * will never be written. */
	for (uint64_t n = d->submits_base; n < d->nsubmits && n - d->submits_base < d->submit_cap;
	     n++)
		if (d->submit_seqs[n - d->submits_base] > p.committed)
			d->submit_seqs[n - d->submits_base] = DISPATCH_SEQ_VOID;
	for (size_t i = 0; i < d->nspooled; i++) {
		struct spool_entry *e = &d->spooled[i];
		if (e->seq && e->seq <= p.committed) {
			d->spooled[k++] = *e;
		} else if (none) {
			e->seq = 0;
			e->put_again = true;
			d->spooled[k++] = *e;
		} else {
			free(e->conv);
		}
	}
	d->nspooled = k;
	k = 0;
	for (size_t i = 0; i < d->nclosing; i++) {
		if (d->closing[i].seq <= p.committed)
			d->closing[k++] = d->closing[i];
		else
			free(d->closing[i].conv);
	}
	d->nclosing = k;
	d->committed = d->submitted = p.committed;
	/* Transactions written before the failed one and not yet seen by dispatch_progress
	 * (which now sees no advance) are finished here. */
	hand_over_committed(d);
	sink_kick(d->sink);
	store_failure_ack(d->store);
}

/* Remembers that c was closed in transaction seq: it leaves memory once that is written
 * and the sink confirmed everything of it. */
static void closing_add(struct dispatch *d, struct convo *c, uint64_t seq)
{
	struct closing *e;

	if (d->nclosing == d->capclosing) {
		size_t ncap = d->capclosing ? 2 * d->capclosing : 16;
		struct closing *p = realloc(d->closing, ncap * sizeof(*p));
		if (!p)
			return; /* it stays in memory, closed; a later request reopens it */
		d->closing = p;
		d->capclosing = ncap;
	}
	e = &d->closing[d->nclosing];
	if (!(e->conv = malloc(c->id_len ? c->id_len : 1)))
		return;
	memcpy(e->conv, c->id, c->id_len);
	e->conv_len = c->id_len;
	e->seq = seq;
	d->nclosing++;
}

/* Records the seq of the transaction just handed over (dispatch_seq_after). Without memory
 * for it, the answers made before it fall back on the turn's last transaction. */
static void submit_record(struct dispatch *d, uint64_t seq)
{
	size_t i = (size_t)(d->nsubmits++ - d->submits_base);

	if (i >= d->submit_cap) {
		size_t ncap = d->submit_cap ? 2 * d->submit_cap : 16;
		uint64_t *p =
		    i == d->submit_cap ? realloc(d->submit_seqs, ncap * sizeof(*p)) : NULL;
		if (!p)
			return;
		d->submit_seqs = p;
		d->submit_cap = ncap;
	}
	d->submit_seqs[i] = seq;
}

enum dispatch_commit_result dispatch_commit(struct dispatch *d, bool force)
{
	struct convo *c, *next;
	uint64_t seq = 0;
	int rc = 0;

	if (!d->store) {
		d->changed = false;
		return DISPATCH_COMMIT_NONE;
	}
	if (d->cfg->durability == DURABILITY_NONE && !force && !d->tx_error) {
		/* Answers go out now; the flush timer writes and commits. */
		d->changed = false;
		return DISPATCH_COMMIT_NONE;
	}
	if (d->changed || d->store_dirty)
		ensure_tx(d);
	for (size_t i = 0; i < d->nspooled && !d->tx_error; i++) {
		struct spool_entry *e = &d->spooled[i];
		if (e->put_again && ensure_tx(d) == 0 &&
		    (rc = store_spool_put(d->store, e->conv, e->conv_len, e->sk, e->version,
		                          e->map_bytes, e->at_ms)) < 0)
			d->tx_error = rc;
		e->put_again = false;
	}
	for (c = d->store_dirty; c && !d->tx_error; c = c->daemon_next_store) {
		struct take_ctx t = {d, c, 0};
		convo_take(c, CONSUMER_STORE, false, store_take_cb, &t);
		if (!d->tx_error && !(c->daemon_flags & FLAG_ROW_OPEN) &&
		    (rc = store_put_conversation(d->store, c)) < 0)
			d->tx_error = rc;
		/* The row's upsert reopens it (closed = 0): a conversation closed in this
		 * turn is marked closed again after it. */
		if (!d->tx_error && (c->daemon_flags & FLAG_CLOSING) &&
		    (rc = store_set_closed(d->store, c->id, c->id_len, dispatch_now_ms())) < 0)
			d->tx_error = rc;
	}
	d->changed = false;
	if (!store_in_transaction(d->store) && !d->tx_error)
		return DISPATCH_COMMIT_NONE;
	rc = d->tx_error;
	if (!rc)
		rc = store_submit(d->store, &seq);
	if (rc < 0) {
		/* Nothing of this turn reached the writer: let it finish what it has, so that
		 * the store holds everything before this turn, then undo the turn. */
		store_rollback(d->store);
		store_sync(d->store);
		commit_failed(d, rc);
		return DISPATCH_COMMIT_FAILED;
	}
	d->submitted = seq;
	submit_record(d, seq);
	for (size_t i = 0; i < d->nspooled; i++)
		if (!d->spooled[i].seq)
			d->spooled[i].seq = seq;
	for (c = d->store_dirty; c; c = c->daemon_next_store) {
		c->daemon_store_seq = seq;
		if (c->daemon_flags & FLAG_DATA_DIRTY)
			c->daemon_data_seq = seq;
	}
	for (c = d->store_dirty, d->store_dirty = NULL; c; c = next) {
		next = c->daemon_next_store;
		c->daemon_next_store = NULL;
		c->daemon_flags &=
		    ~(unsigned int)(FLAG_STORE_DIRTY | FLAG_DATA_DIRTY | FLAG_FROM_REMOTE);
		if (c->daemon_flags & FLAG_CLOSING) {
			c->daemon_flags &= ~(unsigned int)FLAG_ROW_OPEN;
			closing_add(d, c, seq);
		} else {
			c->daemon_flags |= FLAG_ROW_OPEN;
		}
	}
	/* Written already when the loop wrote it itself (durability process). */
	dispatch_progress(d);
	return DISPATCH_COMMIT_SUBMITTED;
}

uint64_t dispatch_seq_after(const struct dispatch *d, uint64_t n)
{
	if (n >= d->nsubmits || n < d->submits_base || n - d->submits_base >= d->submit_cap)
		return 0;
	return d->submit_seqs[n - d->submits_base];
}

void dispatch_turn_done(struct dispatch *d)
{
	d->submits_base = d->nsubmits;
}

uint64_t dispatch_hold(const struct dispatch *d)
{
	if (!d->store || d->cfg->durability == DURABILITY_NONE || d->submitted <= d->committed)
		return 0;
	return d->submitted;
}

bool dispatch_progress(struct dispatch *d)
{
	struct store_progress p;

	if (!d->store)
		return true;
	store_progress(d->store, &p);
	if (p.failed) {
		commit_failed(d, p.error);
		return false;
	}
	if (p.committed <= d->committed)
		return true;
	d->committed = p.committed;
	if (d->store_failing)
		log_msg(LOG_INFO, "store", "commits succeed again");
	d->store_failing = false;
	hand_over_committed(d);
	if (d->sink) {
		sink_resync(d->sink); /* a commit succeeded: what the sink lost is read again */
		sink_kick(d->sink);
	}
	return true;
}

int dispatch_sync(struct dispatch *d)
{
	int rc;

	if (!d->store)
		return 0;
	rc = store_sync(d->store);
	dispatch_progress(d);
	return rc;
}

bool dispatch_pending_commit(const struct dispatch *d)
{
	if (d->changed || d->tx_error)
		return true;
	return d->store && d->cfg->durability != DURABILITY_NONE && store_in_transaction(d->store);
}

void dispatch_settled(void *arg, const char *conv, size_t conv_len)
{
	struct dispatch *d = arg;
	struct convo *c = registry_get(&d->reg, conv, conv_len);

	if (c && (c->daemon_flags & FLAG_CLOSING) && !(c->daemon_flags & FLAG_STORE_DIRTY) &&
	    c->daemon_store_seq <= d->committed && !sink_has_pending(c))
		drop_conversation(d, c);
}

static int restore_one(void *arg, struct convo *c)
{
	struct dispatch *d = arg;
	loaded_from_store(d, c);
	c->daemon_flags |= FLAG_ROW_OPEN; /* store_load_open loads only open rows */
	if (registry_put(&d->reg, c) < 0) {
		convo_free(c);
		return -ENOMEM;
	}
	if (sink_has_pending(c))
		mark_sink_dirty(d, c);
	return 0;
}

/* The flush tick's reread passes over the conversations in memory (memory's copy is as new
 * or newer) without reading them: after a failed read-back, the few it dropped are what it
 * looks for (it read every open conversation, a stall of about a second at 100,000). */
static bool in_memory(void *arg, const char *id, size_t len)
{
	struct dispatch *d = arg;
	return registry_get(&d->reg, id, len) != NULL;
}

/* The flush tick's read of an open conversation not in memory (in_memory passed it): it
 * comes back when it holds something the sink has not taken. */
static int reread_one(void *arg, struct convo *c)
{
	struct dispatch *d = arg;

	loaded_from_store(d, c);
	if (!sink_has_pending(c)) {
		convo_free(c);
		return 0;
	}
	return restore_one(d, c);
}

static void reopen_row(void *arg, struct convo *c)
{
	struct dispatch *d = arg;
	if (!(c->daemon_flags & (FLAG_ROW_OPEN | FLAG_CLOSING)))
		mark_row_reopen(d, c);
}

/* Whether every conversation in memory that is not closing has its row committed open, so
 * that the retention purge cannot remove one in use. One whose reopening a failed commit
 * undid (revert_to_store reads it back as the store holds it) is marked for the next
 * commit, and the purge waits for that. */
static bool rows_open(struct dispatch *d)
{
	registry_each(&d->reg, reopen_row, d);
	return !d->store_dirty;
}

void dispatch_flush_tick(struct dispatch *d, bool all)
{
	int64_t now = dispatch_now_ms();
	struct convo *c, *next;
	bool quiet;

	if (d->sink_changes >= DISPATCH_FLUSH_SOON_CHANGES)
		d->stats.flushes_early++;
	d->sink_changes = 0;
	/* Conversations dropped after a failed commit: what they hold unsent is taken below.
	 * A read that fails is tried again next tick. */
	if (d->reread_open && store_load_open_except(d->store, in_memory, reread_one, d) == 0) {
		d->reread_open = false;
		log_msg(LOG_INFO, "store",
		        "conversations not read back after a failed commit are "
		        "read again");
	}
	/* Idle by the wall clock (updated_ms, what the items carry) or, for a change made since
	 * the start, by the monotonic one: a wall clock set back (NTP, a resumed VM) must not
	 * hold the last message back for as long as it went back. Set forward, it flushes the
	 * last message early, which a later merge writes again at a higher version. */
	int64_t now_mono = (int64_t)(mono_ns() / 1000000), idle = (int64_t)d->cfg->idle_ms;
	for (c = d->sink_dirty; c; c = next) {
		next = c->daemon_next_sink;
		sink_take(d, c,
		          all || now - c->updated_ms >= idle ||
		              (c->daemon_changed_mono_ms &&
		               now_mono - c->daemon_changed_mono_ms >= idle));
	}
	for (c = d->marks_dirty; c; c = next) {
		next = c->daemon_next_marks;
		persist_marks(d, c);
	}
	dispatch_commit(d, true);
	/* A quiet daemon commits nothing: what the sink lost is read again here, while no
	 * commit fails. */
	if (!d->store_failing)
		sink_resync(d->sink);
	/* Nothing committed for a whole tick: let the store fold what it holds in memory and
	 * give the memory back (once per quiet spell). */
	quiet = d->submitted == d->submitted_at_tick && d->store && !store_in_transaction(d->store);
	if (quiet && !d->idle_done)
		store_idle(d->store);
	d->idle_done = quiet;
	d->submitted_at_tick = d->submitted;
	/* The retention purge, about hourly: it folds every pending record first and is waited
	 * for, so it runs in a quiet tick, unless it is an hour overdue. */
	if (d->store && d->purge_local && d->cfg->closed_retention_days && now >= d->purge_due_ms &&
	    (quiet || now >= d->purge_due_ms + DISPATCH_PURGE_EVERY_MS) &&
	    !store_in_transaction(d->store) && rows_open(d)) {
		size_t removed = 0;
		int64_t before = now - (int64_t)d->cfg->closed_retention_days * 86400000;
		d->purge_due_ms = now + DISPATCH_PURGE_EVERY_MS;
		if (store_purge_closed(d->store, before, &removed) == 0 && removed)
			log_msg(LOG_INFO, "store",
			        "removed %zu closed conversations past retention", removed);
	}
}

static int spool_one(void *arg, int64_t seq, const char *conv, size_t conv_len, const char *sk,
                     uint32_t version, int64_t enqueued_ms)
{
	struct dispatch *d = arg;
	(void)seq;
	return sink_enqueue(d->sink, conv, conv_len, sk, version, enqueued_ms);
}

/* The `store` object of the stats result: null without a local store; NULL on ENOMEM. */
static json_t *store_stats_json(struct dispatch *d)
{
	struct store_stats st;
	json_t *fold, *cohort, *retry, *res;
	bool moving;

	if (!d->store)
		return json_null();
	store_stats(d->store, &st);
	/* The move under way counts as it goes, so that its progress shows. */
	moving = d->retry_wait != NULL;
	retry =
	    json_pack("{s:b, s:I, s:I, s:I, s:I, s:I}", "running", moving, "moves",
	              (json_int_t)d->retry_ended.moves, "moved",
	              (json_int_t)(d->retry_ended.moved + (moving ? d->retry_moved : 0)), "parts",
	              (json_int_t)(d->retry_ended.parts + (moving ? d->retry_parts : 0)), "pauses",
	              (json_int_t)(d->retry_ended.pauses + (moving ? d->retry_pauses : 0)), "ns",
	              (json_int_t)(d->retry_ended.ns + (moving ? d->retry_ns : 0)));
	if (!retry)
		return NULL;
	fold =
	    json_pack("{s:I, s:I, s:I, s:I, s:I}", "cycles", (json_int_t)st.fold_cycles, "segments",
	              (json_int_t)st.fold_segments, "records", (json_int_t)st.fold_records, "ns",
	              (json_int_t)st.fold_ns, "dead_batches", (json_int_t)st.dead_batches);
	cohort = json_pack("{s:I, s:I, s:I}", "waits", (json_int_t)st.cohort_waits, "short",
	                   (json_int_t)st.cohort_short, "ns", (json_int_t)st.cohort_ns);
	if (!fold || !cohort) {
		json_decref(fold);
		json_decref(cohort);
		json_decref(retry);
		return NULL;
	}
	/* O, not o: whether a failed json_pack frees what o hands it depends on the version. */
	res = json_pack(
	    "{s:s, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:O, s:O, s:I, s:I, s:I, s:I, s:I, "
	    "s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:I, s:O}",
	    "durability", store_durability_str(d->cfg->durability), "commits",
	    (json_int_t)st.commits, "turns", (json_int_t)st.turns, "inline_commits",
	    (json_int_t)st.inline_commits, "records", (json_int_t)st.records, "commit_ns",
	    (json_int_t)st.commit_ns, "commit_max_ns", (json_int_t)st.commit_max_ns,
	    "pending_records", (json_int_t)st.pending, "fold", fold, "cohort", cohort,
	    "checkpoints", (json_int_t)st.checkpoints, "catch_ups", (json_int_t)st.catch_ups,
	    "bound_waits", (json_int_t)st.bound_waits, "checkpoint_ns",
	    (json_int_t)st.checkpoint_ns, "wal_writebacks", (json_int_t)st.wal_writebacks,
	    "wal_pages", (json_int_t)st.wal_pages, "wal_syncs", (json_int_t)st.wal_syncs,
	    "db_syncs", (json_int_t)st.db_syncs, "commits_spoiled", (json_int_t)st.commits_spoiled,
	    "spoils_failed", (json_int_t)st.spoils_failed, "wal_commits_dropped",
	    (json_int_t)st.wal_commits_dropped, "db_bytes", (json_int_t)st.db_bytes, "wal_bytes",
	    (json_int_t)st.wal_bytes, "retry", retry);
	json_decref(retry);
	json_decref(cohort);
	json_decref(fold);
	return res;
}

int dispatch_restore(struct dispatch *d)
{
	uint64_t items = 0, bytes = 0, t0;
	int64_t oldest = 0;
	int rc;

	if (!d->store)
		return 0;
	rc = store_load_open(d->store, restore_one, d);
	if (rc < 0) {
		log_msg(LOG_ERROR, "store", "cannot restore conversations: %s", strerror(-rc));
		return rc;
	}
	/* The statistics start from this count of the spool's bytes. */
	t0 = uv_hrtime();
	if (store_spool_stats(d->store, &items, &bytes, &oldest) == 0)
		sink_spool_counted(d->sink, items, bytes, (uv_hrtime() - t0) / 1000000u);
	/* Writes without a clear answer before the stop, looked at again when due (one whose
	 * message the spool holds too goes out through its spool row then). */
	if (d->remote && (rc = sink_load_repairs(d->sink)) < 0) {
		log_msg(LOG_ERROR, "store", "cannot read the repairs table: %s", strerror(-rc));
		return rc;
	}
	if (items) {
		if (d->remote) {
			rc = store_spool_each(d->store, 0, spool_one, d);
			if (rc < 0) {
				log_msg(LOG_ERROR, "store", "cannot read the spool: %s",
				        strerror(-rc));
				return rc;
			}
			/* Nothing else may commit soon: start sending now. */
			sink_kick(d->sink);
		} else {
			log_msg(LOG_WARN, "store",
			        "%llu spool rows wait for DynamoDB, which is not configured now",
			        (unsigned long long)items);
		}
	}
	log_msg(LOG_INFO, "store", "restored %zu conversations; %llu writes pending", d->reg.count,
	        (unsigned long long)items);
	if (d->reg.count > d->cfg->max_conversations)
		log_msg(
		    LOG_WARN, "store",
		    "%zu open conversations restored, more than max-conversations %llu: all are "
		    "served, and no new one is created until close brings them under it",
		    d->reg.count, (unsigned long long)d->cfg->max_conversations);
	return 0;
}

/* The answer just written is an ok answer that the commit must confirm (it is turned into
 * `unavailable` if the commit fails): the server reads d->answer_dependent. */
static void mark_answer(struct dispatch *d)
{
	if (d->store && d->cfg->durability != DURABILITY_NONE)
		d->answer_dependent = true;
}

/* An ok read of c shows it as memory holds it: a change not yet written (this turn's, or
 * in a transaction submitted and not yet written) is undone if its commit fails, and so
 * must be the answer that showed it (protocol.md: a failed commit replaces the ok answers
 * of its turn). It used to go out, showing what the store then did not hold. A row only
 * written open again (a closed conversation read) is no change a read shows. */
static void mark_read(struct dispatch *d, const struct convo *c)
{
	if (!c)
		return;
	if (c->daemon_flags & FLAG_DATA_DIRTY) {
		mark_answer(d);
	} else if (c->daemon_data_seq > d->committed) {
		/* It shows a change submitted before this turn: its answer stands or falls with
		 * that transaction. It was bound to the turn's, so that a read of a change that
		 * was written failed with an unrelated change of a later transaction. */
		mark_answer(d);
		d->answer_shows = c->daemon_data_seq;
	}
}

/* The transaction that must be written for the answer of a read of c to stand (mark_read):
 * the one holding c's last change, or the next to be submitted for a change of this turn; 0
 * when its answer is not held. */
static uint64_t read_seq(const struct dispatch *d, const struct convo *c)
{
	struct store_progress p;

	if (!d->store || d->cfg->durability == DURABILITY_NONE)
		return 0;
	if (c->daemon_flags & FLAG_DATA_DIRTY) {
		/* Only the loop submits, and its next submit carries this turn's changes. */
		store_progress(d->store, &p);
		return p.submitted + 1;
	}
	return c->daemon_data_seq > d->committed ? c->daemon_data_seq : 0;
}

/* Before a to_messages_map of c: the messages an incremental call would mark are stamped
 * with the transaction its answer waits for, so that a failed commit keeps the marks of
 * the answers that stand and undoes those of the answers it turns into `unavailable`
 * (carry_marks). A read with nothing to wait for stamps nothing: a stamp it leaves on a
 * message it takes is of a transaction written already, which keeps the mark. */
static void stamp_marks(const struct dispatch *d, struct convo *c)
{
	uint64_t seq = read_seq(d, c);

	if (!seq)
		return;
	for (size_t i = c->scan_from[CONSUMER_CLIENT]; i < c->nlog; i++)
		if (convo_pending(c->log[i], CONSUMER_CLIENT))
			mark_stamp_set(c->log[i], seq);
}

/* A request's id as its answer echoes it: its text as the request wrote it (raw), or
 * jansson's writing of the value. */
struct reqid {
	const json_t *json;
	const char *raw;
	size_t raw_len;
};

/* "id":ID, for an answer, when id is given. 0 or -ENOMEM. */
static int append_id(struct buf *out, const struct reqid *id)
{
	if (!id)
		return 0;
	if (buf_append(out, "\"id\":", 5) < 0)
		return -ENOMEM;
	if ((id->raw ? buf_append(out, id->raw, id->raw_len) : buf_append_json(out, id->json)) < 0)
		return -ENOMEM;
	return buf_append(out, ",", 1) < 0 ? -ENOMEM : 0;
}

/* Writes {"id":ID,"ok":false,"error":{...}}; id may be NULL (left out). */
static void answer_error(struct dispatch *d, struct buf *out, const struct reqid *id, enum op op,
                         const struct error *err)
{
	size_t mark = out->len;

	stats_request(&d->stats, op, err->code);
	if (buf_append(out, "{", 1) == 0 && append_id(out, id) == 0 && append_error(out, err) == 0)
		return;
	{
		static const char fixed[] = "\"ok\":false,\"error\":{\"code\":\"internal\","
		                            "\"message\":\"out of memory\"}}\n";
		/* Short of memory: a fixed text, with the id when it still fits (the client
		 * matches answers by it), else without. */
		out->len = mark;
		if (buf_append(out, "{", 1) == 0 && append_id(out, id) == 0 &&
		    buf_append(out, fixed, sizeof(fixed) - 1) == 0)
			return;
		out->len = mark;
		if (buf_append(out, "{", 1) == 0 && buf_append(out, fixed, sizeof(fixed) - 1) == 0)
			return;
		out->len = mark; /* nothing fits: dispatch_line reports the line lost */
	}
}

/* Writes the head of an ok answer, {"id":ID,"ok":true,"result": (id left out when NULL),
 * and reserves room for a short tail. flush, close and retry_dead_letters, whose result is
 * a count made by the change itself, call it before the change, so that nothing can fail
 * after it. 0 or -ENOMEM (out unchanged). */
static int answer_open(struct buf *out, const struct reqid *id)
{
	size_t start = out->len;

	if (buf_append(out, "{", 1) < 0 || append_id(out, id) < 0 ||
	    buf_append(out, "\"ok\":true,\"result\":", 19) < 0 || buf_reserve(out, 64) < 0) {
		out->len = start;
		return -ENOMEM;
	}
	return 0;
}

/* Writes {"id":ID,"ok":true,"result":RESULT}; takes the reference to result. */
static void answer_ok(struct dispatch *d, struct buf *out, const struct reqid *id, enum op op,
                      json_t *result)
{
	size_t mark = out->len;
	struct error err;

	if (!result || answer_open(out, id) < 0 || buf_append_json(out, result) < 0 ||
	    buf_append(out, "}\n", 2) < 0) {
		json_decref(result);
		out->len = mark;
		error_set(&err, ERR_INTERNAL, "out of memory while writing the answer");
		answer_error(d, out, id, op, &err);
		return;
	}
	json_decref(result);
	stats_request(&d->stats, op, ERR_OK);
}

struct emit_ctx {
	struct dispatch *d;
	struct buf *out;
	const struct reqid *id;
	enum op op;
	size_t start; /* where the answer begins in out */
};

/* ops_emit_fn: the ok answer, written while the op can still be undone. */
static int emit_answer(void *arg, const json_t *result, ops_write_fn write, const void *wctx)
{
	struct emit_ctx *e = arg;
	struct buf *out = e->out;

	if (answer_open(out, e->id) < 0 ||
	    (result ? buf_append_json(out, result) : write(out, wctx)) < 0 ||
	    buf_append(out, "}\n", 2) < 0) {
		out->len = e->start;
		return -ENOMEM;
	}
	stats_request(&e->d->stats, e->op, ERR_OK);
	return 0;
}

/* The tail after answer_open: {"key":n}}\n, within the room reserved (key is short). */
static void answer_count(struct dispatch *d, struct buf *out, size_t start, enum op op,
                         const char *key, size_t n)
{
	char tail[64];
	int k = snprintf(tail, sizeof(tail), "{\"%s\":%zu}}\n", key, n);

	if (k > 0 && (size_t)k < sizeof(tail))
		buf_append(out, tail, (size_t)k);
	stats_request(&d->stats, op, ERR_OK);
	mark_answer(d);
}

enum dispatch_result dispatch_too_large_line(struct dispatch *d, struct buf *out)
{
	size_t start = out->len;
	struct error err;

	error_set(&err, ERR_TOO_LARGE, "request line longer than %zu bytes; discarded",
	          d->cfg->max_line_bytes);
	answer_error(d, out, NULL, OP_UNKNOWN, &err);
	return out->len == start ? DISPATCH_LOST : DISPATCH_DONE;
}

/* A blank line (protocol.md: empty or only white space, any of Unicode's; valid UTF-8). */
static bool is_blank(const char *p, size_t n)
{
	return n == 0 || ((unsigned char)p[0] != '{' && ops_text_blank(p, n));
}

/* The conversation id: 1..max bytes, no C0/C1 control characters or DEL. */
static enum error_code check_conversation(const struct dispatch *d, const json_t *req,
                                          bool required, const char **id, size_t *len,
                                          struct error *err)
{
	const json_t *v = json_object_get(req, "conversation");
	const unsigned char *s;
	size_t n;

	*id = NULL;
	*len = 0;
	if (!v) {
		if (required)
			return error_set(err, ERR_BAD_REQUEST, "conversation: required string");
		return ERR_OK;
	}
	if (!json_is_string(v))
		return error_set(err, ERR_BAD_REQUEST, "conversation: expected a string");
	s = (const unsigned char *)json_string_value(v);
	n = json_string_length(v);
	if (n > d->cfg->max_conversation_id_bytes)
		return error_set(err, ERR_TOO_LARGE, "conversation: longer than %zu bytes",
		                 d->cfg->max_conversation_id_bytes);
	if (n == 0)
		return error_set(err, ERR_BAD_REQUEST, "conversation: expected 1 to %zu bytes",
		                 d->cfg->max_conversation_id_bytes);
	for (size_t i = 0; i < n; i++) {
		if (s[i] < 0x20 || s[i] == 0x7f || (s[i] == 0xc2 && i + 1 < n && s[i + 1] < 0xa0))
			return error_set(err, ERR_BAD_REQUEST,
			                 "conversation: control characters are not allowed");
	}
	*id = (const char *)s;
	*len = n;
	return ERR_OK;
}

static void count_messages(void *arg, struct convo *c)
{
	*(uint64_t *)arg += c->nlog;
}

struct flush_all_ctx {
	struct dispatch *d;
	size_t n;
};

static void flush_each(void *arg, struct convo *c)
{
	struct flush_all_ctx *ctx = arg;
	ctx->n += sink_take(ctx->d, c, true);
}

static int cmp_convo(const void *a, const void *b)
{
	const struct convo *x = *(const struct convo *const *)a;
	const struct convo *y = *(const struct convo *const *)b;
	size_t n = x->id_len < y->id_len ? x->id_len : y->id_len;
	int r = memcmp(x->id, y->id, n);
	if (r)
		return r;
	return x->id_len < y->id_len ? -1 : x->id_len > y->id_len;
}

struct list_ctx {
	struct convo **v;
	size_t n;
};

static void list_each(void *arg, struct convo *c)
{
	struct list_ctx *ctx = arg;
	ctx->v[ctx->n++] = c;
}

static json_t *list_result(struct dispatch *d)
{
	struct list_ctx ctx = {NULL, 0};
	json_t *arr = json_array(), *res = NULL;

	if (!arr)
		return NULL;
	if (d->reg.count) {
		ctx.v = malloc(d->reg.count * sizeof(*ctx.v));
		if (!ctx.v)
			goto out;
		registry_each(&d->reg, list_each, &ctx);
		qsort(ctx.v, ctx.n, sizeof(*ctx.v), cmp_convo);
	}
	for (size_t i = 0; i < ctx.n; i++) {
		struct convo *c = ctx.v[i];
		json_t *item =
		    json_pack("{s:s%, s:I, s:I}", "conversation", c->id, c->id_len, "messages",
		              (json_int_t)c->nlog, "updated", (json_int_t)c->updated_ms);
		if (!item || json_array_append_new(arr, item) < 0)
			goto out;
	}
	res = json_pack("{s:O}", "conversations", arr);
out:
	free(ctx.v);
	json_decref(arr);
	return res;
}

struct restore_wait {
	struct dispatch *d;
	char *conv; /* owned */
	size_t conv_len;
	void **waiters; /* NULL entries were canceled */
	size_t nwaiters, cap;
	struct restore_wait *next;
};

static struct restore_wait *restore_find(struct dispatch *d, const char *conv, size_t len)
{
	for (struct restore_wait *r = d->restores; r; r = r->next)
		if (r->conv_len == len && memcmp(r->conv, conv, len) == 0)
			return r;
	return NULL;
}

static int restore_add_waiter(struct restore_wait *r, void *waiter)
{
	if (r->nwaiters == r->cap) {
		size_t ncap = r->cap ? 2 * r->cap : 4;
		void **p = realloc(r->waiters, ncap * sizeof(*p));
		if (!p)
			return -ENOMEM;
		r->waiters = p;
		r->cap = ncap;
	}
	r->waiters[r->nwaiters++] = waiter;
	return 0;
}

void dispatch_cancel_wait(struct dispatch *d, void *waiter)
{
	for (struct restore_wait *r = d->restores; r; r = r->next)
		for (size_t i = 0; i < r->nwaiters; i++)
			if (r->waiters[i] == waiter)
				r->waiters[i] = NULL;
}

size_t dispatch_stop_waiting(struct dispatch *d)
{
	size_t n = 0;

	d->lookups_off = true;
	/* A waiter called back goes on with its connection's later lines, which may join a
	 * wait no more (lookups_off) but may end one (a restore of its own conversation): the
	 * walk starts over after each call. */
	for (bool again = true; again;) {
		again = false;
		for (struct restore_wait *r = d->restores; r && !again; r = r->next) {
			if (r == d->retry_wait)
				continue;
			for (size_t i = 0; i < r->nwaiters; i++) {
				void *w = r->waiters[i];
				if (!w)
					continue;
				r->waiters[i] = NULL;
				n++;
				if (d->on_ready)
					d->on_ready(w, DISPATCH_REMOTE_FAILED);
				again = true;
				break;
			}
		}
	}
	return n;
}

/* A wait is over: unlink it, call every waiter still there back, free it. */
static void restore_finish(struct restore_wait *r, enum dispatch_remote outcome)
{
	struct dispatch *d = r->d;
	struct restore_wait **pp;

	for (pp = &d->restores; *pp; pp = &(*pp)->next)
		if (*pp == r) {
			*pp = r->next;
			break;
		}
	for (size_t i = 0; i < r->nwaiters; i++)
		if (r->waiters[i] && d->on_ready)
			d->on_ready(r->waiters[i], outcome);
	free(r->waiters);
	free(r->conv);
	free(r);
}

/* Builds a conversation from DynamoDB items (sort-key order). NULL when they do not make a
 * valid log (logged). */
static struct convo *convo_from_items(const char *conv, size_t len, const json_t *items)
{
	struct convo *c = convo_new(conv, len);
	struct error err = {ERR_OK, ""};
	const json_t *item;
	size_t i;

	if (!c)
		return NULL;
	json_array_foreach(items, i, item)
	{
		json_t *map = NULL;
		uint32_t version = 0;
		int64_t updated = 0;
		struct message *m = NULL;

		if (ddbitem_to_map(item, NULL, &map, &version, &updated, &err) != ERR_OK ||
		    message_from_map(map, version, &m, &err) != ERR_OK) {
			json_decref(map);
			goto bad;
		}
		json_decref(map);
		m->updated_ms = updated;
		/* Already in DynamoDB; not yet in the local store. */
		m->seen[CONSUMER_SINK] = version;
		m->seen[CONSUMER_STORE] = 0;
		if (convo_restore_append(c, m) < 0)
			goto bad;
	}
	if (convo_restore_finish(c, &err) != ERR_OK)
		goto bad;
	return c;
bad:
	log_msg(LOG_ERROR, "sink", "conversation %.*s from DynamoDB is not valid: %s",
	        (int)(len > 64 ? 64 : len), conv, err.message);
	convo_free(c);
	return NULL;
}

/* Whether remote, a conversation built from DynamoDB's items, is to be taken instead of the
 * local store's copy of it: that copy is missing (or cannot be read), or DynamoDB holds it
 * whole (every message, at its version or a newer one) and more (a message it lacks, or a
 * newer version of one). A copy with nothing left to send is in DynamoDB whole, unless
 * items expired there: then DynamoDB's log is not taken, even when it went on (logged), as
 * the store would keep the messages it lacks and give them back at the next start. */
static bool remote_ahead(struct dispatch *d, const struct convo *remote)
{
	struct convo *local = NULL;
	bool ahead = false, lacks = false;

	if (!d->store || store_load_conversation(d->store, remote->id, remote->id_len, &local) < 0)
		return true;
	for (size_t i = 0; i < local->nlog && !lacks; i++) {
		const struct message *m = local->log[i];
		long k = convo_find(remote, m->id, strlen(m->id));
		lacks = k < 0 || remote->log[k]->version < m->version;
		ahead = ahead || (k >= 0 && remote->log[k]->version > m->version);
	}
	ahead = !lacks && (ahead || remote->nlog > local->nlog);
	if (lacks && remote->nlog > 0)
		log_msg(LOG_WARN, "sink",
		        "conversation %.*s: DynamoDB lacks messages or versions of the local copy "
		        "(expired items, a dead-lettered change); "
		        "the local copy is used",
		        (int)(remote->id_len > 64 ? 64 : remote->id_len), remote->id);
	convo_free(local);
	return ahead;
}

static void on_restore_query(void *arg, int status, const json_t *items)
{
	struct restore_wait *r = arg;
	struct dispatch *d = r->d;
	enum dispatch_remote outcome = DISPATCH_REMOTE_ABSENT;

	if (status < 0) {
		outcome = DISPATCH_REMOTE_FAILED;
		log_msg(LOG_WARN, "sink", "cannot look up conversation %.*s in DynamoDB: %s",
		        (int)(r->conv_len > 64 ? 64 : r->conv_len), r->conv, strerror(-status));
	} else if (items && json_array_size(items) > 0 &&
	           !registry_get(&d->reg, r->conv, r->conv_len)) {
		struct convo *c = d->reg.count < d->cfg->max_conversations
		                      ? convo_from_items(r->conv, r->conv_len, items)
		                      : NULL;
		if (!c) {
			outcome = DISPATCH_REMOTE_FAILED;
		} else if (!remote_ahead(d, c)) {
			/* The waiters go on with the local store's copy. */
			convo_free(c);
		} else if (registry_put(&d->reg, c) < 0) {
			convo_free(c);
			outcome = DISPATCH_REMOTE_FAILED;
		} else {
			log_msg(LOG_INFO, "sink", "restored %.*s from DynamoDB (%zu messages)",
			        (int)(r->conv_len > 64 ? 64 : r->conv_len), r->conv, c->nlog);
			c->daemon_flags |= FLAG_FROM_REMOTE;
			/* Kept locally by the next commit; what reads show is DynamoDB's. */
			mark_row_change(d, c);
		}
	}
	restore_finish(r, outcome);
}

/* Starts (or joins) the wait named key[0..len): start begins the work, whose completion
 * calls restore_finish. 0 or -errno (nothing is left behind then). */
static int wait_join(struct dispatch *d, const char *key, size_t len, void *waiter,
                     int (*start)(struct dispatch *d, struct restore_wait *r))
{
	struct restore_wait *r = restore_find(d, key, len);
	int rc;

	if (r)
		return restore_add_waiter(r, waiter);
	r = calloc(1, sizeof(*r));
	if (!r)
		return -ENOMEM;
	r->d = d;
	r->conv = malloc(len + 1);
	if (!r->conv || restore_add_waiter(r, waiter) < 0) {
		rc = -ENOMEM;
		goto fail;
	}
	memcpy(r->conv, key, len);
	r->conv[len] = '\0';
	r->conv_len = len;
	rc = start(d, r);
	if (rc < 0)
		goto fail;
	r->next = d->restores;
	d->restores = r;
	return 0;
fail:
	free(r->waiters);
	free(r->conv);
	free(r);
	return rc;
}

static int start_query(struct dispatch *d, struct restore_wait *r)
{
	return sink_query(d->sink, r->conv, r->conv_len, on_restore_query, r);
}

/* Starts (or joins) the lookup of conv in DynamoDB. 0 or -errno. */
static int restore_start(struct dispatch *d, const char *conv, size_t len, void *waiter)
{
	return wait_join(d, conv, len, waiter, start_query);
}

/* create_table waits like a restore, under a key no conversation id can be (ids hold no
 * control characters). */
static const char table_wait_key[] = "\001create_table";

static void on_table_created(void *arg, int status)
{
	struct restore_wait *r = arg;
	struct dispatch *d = r->d;
	enum dispatch_remote outcome =
	    status == 0 || status == -EEXIST ? DISPATCH_REMOTE_ABSENT : DISPATCH_REMOTE_FAILED;

	if (outcome == DISPATCH_REMOTE_FAILED)
		log_msg(LOG_ERROR, "sink", "cannot create table %s: %s", d->cfg->dynamodb_table,
		        strerror(-status));
	restore_finish(r, outcome);
}

static int start_create_table(struct dispatch *d, struct restore_wait *r)
{
	return sink_create_table(d->sink, on_table_created, r);
}

static int table_create_start(struct dispatch *d, void *waiter)
{
	return wait_join(d, table_wait_key, sizeof(table_wait_key) - 1, waiter, start_create_table);
}

/* retry_dead_letters waits like a restore too, under another such key. */
static const char retry_wait_key[] = "\001retry_dead_letters";

static int start_retry(struct dispatch *d, struct restore_wait *r)
{
	d->retry_wait = r;
	d->retry_upto = -1;
	d->retry_moved = d->retry_parts = d->retry_pauses = d->retry_waits = 0;
	d->retry_ns = 0;
	d->retry_soon(d->retry_soon_arg);
	return 0;
}

static void retry_finish(struct dispatch *d, enum dispatch_remote outcome, bool reread)
{
	struct restore_wait *r = d->retry_wait;

	d->retry_wait = NULL;
	d->retry_result = d->retry_moved;
	d->retry_ended.moves++;
	d->retry_ended.moved += d->retry_moved;
	d->retry_ended.parts += d->retry_parts;
	d->retry_ended.pauses += d->retry_pauses;
	d->retry_ended.ns += d->retry_ns;
	if (d->retry_parts > 1)
		log_msg(LOG_INFO, "store",
		        "retry_dead_letters moved %zu dead letters back to the spool in %zu parts "
		        "(%llu ms on the loop, %zu pauses for the checkpoint thread)%s",
		        d->retry_moved, d->retry_parts, (unsigned long long)(d->retry_ns / 1000000),
		        d->retry_pauses, outcome == DISPATCH_REMOTE_FAILED ? ", then stopped" : "");
	/* The rows are back in the spool (new ones, or a higher version of rows it held):
	 * the sink reads it again, in slices, from now (at a stop, at the next start). */
	if (reread && d->retry_moved && d->remote && d->sink)
		sink_reread(d->sink);
	restore_finish(r, outcome);
}

enum dispatch_retry dispatch_retry_step(struct dispatch *d)
{
	uint64_t t0 = mono_ns(), elapsed = 0;
	bool more = d->retry_wait != NULL, first = true;
	int rc = 0;

	/* Parts of DISPATCH_RETRY_PART rows for about DISPATCH_RETRY_SLICE_NS. */
	while (more && elapsed < DISPATCH_RETRY_SLICE_NS) {
		size_t n = 0;
		/* The move writes about a WAL page a row (the dead letters' index), faster
		 * than the checkpoint thread copies: past its threshold it waits for it, so
		 * that a part's commit does not reach the WAL's bound and wait there (135 ms
		 * once in a million rows without this); but not for ever (a failing one). */
		if (d->retry_waits < DISPATCH_RETRY_WAITS_MAX &&
		    store_checkpoint_behind(d->store)) {
			d->retry_ns += elapsed;
			d->retry_pauses++;
			d->retry_waits++;
			return DISPATCH_RETRY_WAIT;
		}
		d->retry_waits = 0;
		/* A part is a transaction of its own: what is open (a turn waiting for one
		 * more poll, confirmations the sink recorded) is committed first, as a flush
		 * tick would. */
		if (first && (d->changed || store_in_transaction(d->store)) &&
		    dispatch_commit(d, true) == DISPATCH_COMMIT_FAILED)
			rc = -EIO;
		first = false;
		if (rc == 0) {
			rc = store_dead_letters_retry_part(d->store, dispatch_now_ms(),
			                                   &d->retry_upto, DISPATCH_RETRY_PART, &n,
			                                   &more);
			d->retry_parts++;
		}
		d->retry_moved += n;
		elapsed = mono_ns() - t0;
		if (rc < 0)
			break;
	}
	if (!d->retry_wait)
		return DISPATCH_RETRY_DONE;
	d->retry_ns += elapsed;
	if (rc < 0)
		log_msg(LOG_ERROR, "store", "retry_dead_letters: cannot move dead letters: %s",
		        strerror(-rc));
	if (rc < 0 || !more) {
		retry_finish(d, rc < 0 ? DISPATCH_REMOTE_FAILED : DISPATCH_REMOTE_ABSENT, true);
		/* Its answer went out, and the connection's next line may be another
		 * retry_dead_letters, started meanwhile: it is stepped on, not dropped (its
		 * client waited for ever, and every later one joined it). */
		return d->retry_wait ? DISPATCH_RETRY_MORE : DISPATCH_RETRY_DONE;
	}
	return DISPATCH_RETRY_MORE;
}

void dispatch_retry_stop(struct dispatch *d)
{
	if (d->retry_wait)
		retry_finish(d, DISPATCH_REMOTE_FAILED, false);
}

enum find_result { FIND_OK, FIND_WAIT, FIND_FAIL };

/* The conversation cid names, for op: in memory, else loaded from the local store, else
 * looked up in DynamoDB (FIND_WAIT: the request waits, see dispatch_line), else created
 * empty when op creates conversations (*created; the caller registers or frees it).
 * FIND_FAIL fills err. */
static enum find_result find_convo(struct dispatch *d, enum op op, const char *cid,
                                   size_t cid_len, void *waiter, enum dispatch_remote remote,
                                   struct convo **out, bool *created, struct error *err)
{
	struct convo *c = registry_get(&d->reg, cid, cid_len);

	*out = NULL;
	*created = false;
	if (!c && d->store) {
		int rc = store_load_conversation(d->store, cid, cid_len, &c);
		/* The conversation may have moved to another host since it was closed here, and
		 * gone on there: with DynamoDB configured, and nothing of this copy left to send
		 * (else it is the newer one), DynamoDB is asked first. Its copy is taken when it
		 * is ahead of this one (on_restore_query); otherwise, or when it cannot be asked,
		 * the request comes back here and this copy is used. */
		if (rc == 0 && d->remote && remote == DISPATCH_REMOTE_CHECK && waiter &&
		    !d->lookups_off && !sink_has_pending(c) &&
		    restore_start(d, cid, cid_len, waiter) == 0) {
			convo_free(c);
			return FIND_WAIT;
		}
		if (rc == 0) {
			loaded_from_store(d, c);
			if (d->reg.count >= d->cfg->max_conversations) {
				convo_free(c);
				error_set(err, ERR_UNAVAILABLE,
				          "too many conversations in memory (limit %zu); retry later",
				          d->cfg->max_conversations);
				return FIND_FAIL;
			}
			if (registry_put(&d->reg, c) < 0) {
				convo_free(c);
				error_set(err, ERR_INTERNAL, "out of memory");
				return FIND_FAIL;
			}
			/* Named again, a closed conversation is open again for good, whatever the
			 * request (a read too): the next commit reopens its row, so that the next
			 * start restores it and the retention purge leaves it alone. A read does
			 * not wait for that commit (nor fail with it on a full disk). */
			mark_row_reopen(d, c);
			if (sink_has_pending(c))
				mark_sink_dirty(d, c);
		} else if (rc == -ENOMEM) {
			/* As everywhere else on the request path: the store is not at fault. */
			error_set(err, ERR_INTERNAL, "out of memory");
			return FIND_FAIL;
		} else if (rc != -ENOENT) {
			error_set(err, ERR_UNAVAILABLE,
			          "conversation: cannot be read from the local store; retry later");
			return FIND_FAIL;
		} else {
			c = NULL;
		}
	}
	if (!c && d->remote && remote == DISPATCH_REMOTE_CHECK && waiter) {
		if (!d->lookups_off && restore_start(d, cid, cid_len, waiter) == 0)
			return FIND_WAIT;
		remote = DISPATCH_REMOTE_FAILED;
	}
	if (!c && remote == DISPATCH_REMOTE_FAILED && !ops_creates(op)) {
		/* It may exist in DynamoDB: not_found would be a guess. A new conversation is
		 * created all the same (availability first; see proto/protocol.md). */
		error_set(err, ERR_UNAVAILABLE,
		          "conversation: cannot be looked up in DynamoDB now; retry later");
		return FIND_FAIL;
	}
	if (c && (c->daemon_flags & FLAG_CLOSING) && op != OP_CLOSE) {
		/* Used again before it left memory: it is open again. */
		c->daemon_flags &= ~(unsigned int)FLAG_CLOSING;
		mark_row_change(d, c);
	}
	if (!c) {
		if (!ops_creates(op)) {
			error_set(err, ERR_NOT_FOUND, "conversation: no conversation '%.*s'",
			          (int)(cid_len > 64 ? 64 : cid_len), cid);
			return FIND_FAIL;
		}
		if (d->reg.count >= d->cfg->max_conversations) {
			error_set(err, ERR_UNAVAILABLE,
			          "too many conversations in memory (limit %zu); retry later",
			          d->cfg->max_conversations);
			return FIND_FAIL;
		}
		c = convo_new(cid, cid_len);
		if (!c) {
			error_set(err, ERR_INTERNAL, "out of memory");
			return FIND_FAIL;
		}
		*created = true;
	}
	*out = c;
	return FIND_OK;
}

/* What an op runs with: the id generator, the time, the limits. */
static void env_of(struct dispatch *d, struct convo_env *env)
{
	env->ulid = &d->ulid;
	env->now_ms = dispatch_now_ms();
	env->limits.max_messages = d->cfg->max_messages;
	env->limits.max_bytes = d->cfg->max_conversation_bytes;
}

/* The fast path: add_user, add_assistant and add_message without metadata, the bulk of the
 * traffic, and the reads a voice front-end makes every turn (get_messages,
 * to_messages_map), read with jscan instead of jansson (no tree, no allocation) and
 * answered without a result tree. It handles only requests that will succeed as far as
 * can be told before running them: anything else, and any error while running, returns
 * false before anything is answered, and dispatch_one reads the line again and gives the
 * same answer it always gave (the op had changed nothing). */
#define FAST_MEMBERS 12
#define FAST_TEXTS 16

static bool fast_plain(const struct jscan_member *m, const char *s, size_t n)
{
	return m && m->value.type == JSCAN_STRING && !m->value.escaped && m->value.len == n &&
	       memcmp(m->value.p, s, n) == 0;
}

/* What the fast path read of every request: the op, its conversation and its id. */
struct fast_req {
	const struct jscan_member *mem;
	size_t n;
	enum op op;
	const char *conv;
	size_t conv_len;
	struct reqid id; /* raw: the id's JSON text, echoed as written; NULL: none */
	bool dup;        /* a member the path looked up appears twice */
};

/* The conversation found or made for a fast request, registered when new; false when the
 * slow path must answer (or *res says to wait). */
static bool fast_convo(struct dispatch *d, const struct fast_req *f, void *waiter,
                       enum dispatch_remote remote, enum dispatch_result *res, struct convo **c,
                       bool *created)
{
	struct error err;

	switch (find_convo(d, f->op, f->conv, f->conv_len, waiter, remote, c, created, &err)) {
	case FIND_OK:
		break;
	case FIND_WAIT:
		*res = DISPATCH_WAIT;
		*c = NULL;
		return true;
	case FIND_FAIL:
		return false;
	}
	/* The slow path refuses a change while the spool is full. */
	if ((ops_mutates(f->op) && d->sink && sink_full(d->sink)) ||
	    (*created && registry_put(&d->reg, *c) < 0)) {
		if (*created)
			convo_free(*c);
		return false;
	}
	return true;
}

/* get_messages (format given plainly) and to_messages_map (booleans). */
static bool fast_read(struct dispatch *d, const struct fast_req *f, struct buf *out, void *waiter,
                      enum dispatch_remote remote, enum dispatch_result *res)
{
	struct ops_read_args args = {RENDER_META, true, true};
	struct convo *c = NULL;
	struct error err;
	bool created = false, dup = f->dup;

	if (f->op == OP_GET_MESSAGES) {
		const struct jscan_member *m = jscan_find(f->mem, f->n, "format", 6, &dup);
		if (m) {
			int fmt;
			char name[16];
			if (m->value.type != JSCAN_STRING || m->value.escaped ||
			    m->value.len >= sizeof(name))
				return false;
			memcpy(name, m->value.p, m->value.len);
			name[m->value.len] = '\0';
			if ((fmt = convo_render_format(name)) < 0)
				return false;
			args.format = (enum render_format)fmt;
		}
	} else {
		const struct jscan_member *inc = jscan_find(f->mem, f->n, "incremental", 11, &dup);
		const struct jscan_member *ex = jscan_find(f->mem, f->n, "exclude_last", 12, &dup);
		if ((inc && inc->value.type != JSCAN_TRUE && inc->value.type != JSCAN_FALSE) ||
		    (ex && ex->value.type != JSCAN_TRUE && ex->value.type != JSCAN_FALSE))
			return false;
		args.incremental = !inc || inc->value.type == JSCAN_TRUE;
		args.exclude_last = !ex || ex->value.type == JSCAN_TRUE;
	}
	if (dup || !fast_convo(d, f, waiter, remote, res, &c, &created))
		return false;
	if (!c)
		return true; /* waiting */
	{
		struct emit_ctx ec = {d, out, f->id.raw ? &f->id : NULL, f->op, out->len};
		uint64_t takes = c->client_takes;
		size_t from = c->scan_from[CONSUMER_CLIENT];
		if (f->op == OP_TO_MESSAGES_MAP && args.incremental)
			stamp_marks(d, c);
		if (ops_read_direct(f->op, c, &args, emit_answer, &ec, &err) != ERR_OK) {
			if (created)
				drop_conversation(d, c);
			return false;
		}
		if (c->client_takes != takes)
			mark_marks_dirty(d, c, from);
		mark_read(d, c);
	}
	*res = DISPATCH_DONE;
	return true;
}

/* add_user, add_assistant and add_message without metadata, contents as strings. */
static bool fast_add(struct dispatch *d, const struct fast_req *f, struct buf *out, void *waiter,
                     enum dispatch_remote remote, enum dispatch_result *res)
{
	const struct jscan_member *mcontents, *mrole;
	const char *texts[FAST_TEXTS];
	size_t lens[FAST_TEXTS], offs[FAST_TEXTS], ntexts = 0;
	struct ops_add_args args;
	bool dup = f->dup, created = false, changed = false, any = false;
	struct convo *c = NULL;
	struct convo_env env;
	struct error err;

	args.role = f->op == OP_ADD_ASSISTANT ? ROLE_ASSISTANT : ROLE_USER;
	if (f->op == OP_ADD_MESSAGE) {
		mrole = jscan_find(f->mem, f->n, "role", 4, &dup);
		if (fast_plain(mrole, "assistant", 9))
			args.role = ROLE_ASSISTANT;
		else if (!fast_plain(mrole, "user", 4))
			return false;
	}
	if (jscan_find(f->mem, f->n, "metadata", 8, &dup))
		return false;
	mcontents = jscan_find(f->mem, f->n, "contents", 8, &dup);
	if (dup || !mcontents)
		return false;

	/* The contents, decoded into the scratch buffer when escaped. */
	d->scratch.len = 0;
	if (mcontents->value.type == JSCAN_STRING) {
		offs[0] = 0;
		if (jscan_string(&mcontents->value, &d->scratch) < 0)
			return false;
		lens[0] = d->scratch.len;
		ntexts = 1;
	} else if (mcontents->value.type == JSCAN_ARRAY) {
		struct jscan_value el;
		size_t pos = 0;
		while (jscan_array_next(&mcontents->value, &pos, &el)) {
			if (el.type != JSCAN_STRING || ntexts == FAST_TEXTS)
				return false;
			offs[ntexts] = d->scratch.len;
			if (jscan_string(&el, &d->scratch) < 0)
				return false;
			lens[ntexts] = d->scratch.len - offs[ntexts];
			ntexts++;
		}
	} else {
		return false;
	}
	for (size_t i = 0; i < ntexts; i++) {
		texts[i] = d->scratch.data ? d->scratch.data + offs[i] : "";
		any = any || !ops_text_blank(texts[i], lens[i]);
	}
	if (!any || !fast_convo(d, f, waiter, remote, res, &c, &created))
		return false;
	if (!c)
		return true; /* waiting */
	env_of(d, &env);
	args.texts = texts;
	args.lens = lens;
	args.ntexts = ntexts;
	{
		struct emit_ctx ec = {d, out, f->id.raw ? &f->id : NULL, f->op, out->len};
		if (ops_add_direct(c, &env, &args, emit_answer, &ec, &changed, &err) != ERR_OK) {
			if (created)
				drop_conversation(d, c);
			return false;
		}
		if (changed) {
			mark_store_dirty(d, c);
			mark_sink_changed(d, c);
			mark_answer(d);
		}
	}
	*res = DISPATCH_DONE;
	return true;
}

static bool dispatch_fast(struct dispatch *d, const char *line, size_t len, struct buf *out,
                          void *waiter, enum dispatch_remote remote, enum op *opp,
                          enum dispatch_result *res)
{
	struct jscan_member mem[FAST_MEMBERS];
	const struct jscan_member *mop, *mconv, *mid;
	struct fast_req f = {mem, 0, OP_UNKNOWN, NULL, 0, {NULL, NULL, 0}, false};

	if (jscan_object(line, len, mem, FAST_MEMBERS, &f.n) < 0 || f.n > FAST_MEMBERS)
		return false;
	mop = jscan_find(mem, f.n, "op", 2, &f.dup);
	if (fast_plain(mop, "add_user", 8))
		f.op = OP_ADD_USER;
	else if (fast_plain(mop, "add_assistant", 13))
		f.op = OP_ADD_ASSISTANT;
	else if (fast_plain(mop, "add_message", 11))
		f.op = OP_ADD_MESSAGE;
	else if (fast_plain(mop, "get_messages", 12))
		f.op = OP_GET_MESSAGES;
	else if (fast_plain(mop, "to_messages_map", 15))
		f.op = OP_TO_MESSAGES_MAP;
	else
		return false;
	mconv = jscan_find(mem, f.n, "conversation", 12, &f.dup);
	mid = jscan_find(mem, f.n, "id", 2, &f.dup);
	if (!mconv || mconv->value.type != JSCAN_STRING || mconv->value.escaped ||
	    mconv->value.len == 0 || mconv->value.len > d->cfg->max_conversation_id_bytes)
		return false;
	for (size_t i = 0; i < mconv->value.len; i++) {
		unsigned char ch = (unsigned char)mconv->value.p[i];
		if (ch < 0x20 || ch == 0x7f ||
		    (ch == 0xc2 && i + 1 < mconv->value.len &&
		     (unsigned char)mconv->value.p[i + 1] < 0xa0))
			return false;
	}
	f.conv = mconv->value.p;
	f.conv_len = mconv->value.len;
	if (mid) {
		/* Echoed as written where jansson would write it back the same. */
		const struct jscan_value *v = &mid->value;
		if (v->type == JSCAN_STRING && !v->escaped) {
			f.id.raw = v->p - 1;
			f.id.raw_len = v->len + 2;
		} else if (v->type == JSCAN_NULL || v->type == JSCAN_TRUE ||
		           v->type == JSCAN_FALSE ||
		           (v->type == JSCAN_INTEGER && !(v->len == 2 && v->p[0] == '-'))) {
			f.id.raw = v->p;
			f.id.raw_len = v->len;
		} else {
			return false;
		}
	}
	*opp = f.op;
	if (f.op == OP_GET_MESSAGES || f.op == OP_TO_MESSAGES_MAP)
		return fast_read(d, &f, out, waiter, remote, res);
	return fast_add(d, &f, out, waiter, remote, res);
}

/* jansson's reading of a request; NULL with *oom when an allocation failed in it (jansson
 * may then have dropped a byte or called this a syntax error: nothing is to be run). */
static json_t *load_request(const char *text, size_t len, json_error_t *jerr, bool *oom)
{
	json_t *req;

	ops_json_alloc_reset();
	req = json_loadb(text, len, JSON_ALLOW_NUL, jerr);
	if ((*oom = ops_json_alloc_failed())) {
		json_decref(req);
		req = NULL;
	}
	return req;
}

/* Whether the value v (a span of a request line) holds a number jansson refuses. */
static bool tamed_in(const struct jscan_value *v)
{
	size_t n = 0;
	return jscan_tame_numbers(v->p, v->len, NULL, &n) == 0 && n > 0;
}

static enum dispatch_result dispatch_one(struct dispatch *d, const char *line, size_t len,
                                         struct buf *out, void *waiter,
                                         enum dispatch_remote remote, enum op *opp)
{
	json_t *req = NULL, *result = NULL;
	const json_t *id = NULL, *opv;
	struct reqid rid = {NULL, NULL, 0}, *idp = NULL;
	size_t ntamed = 0;
	bool oom = false;
	json_error_t jerr;
	struct error err = {ERR_OK, ""}, err2 = {ERR_OK, ""};
	enum op op = OP_UNKNOWN;
	const char *cid = NULL;
	size_t cid_len = 0;
	struct convo *c = NULL;
	bool created = false, changed = false;
	enum error_code code = ERR_OK, code2;
	struct convo_env env;

	if (is_blank(line, len))
		return DISPATCH_DONE;
	if (!d->no_fast_path) {
		enum dispatch_result res;
		if (dispatch_fast(d, line, len, out, waiter, remote, opp, &res))
			return res;
	}
	/* A raw NUL byte is never JSON (in a string too, a control character must be escaped),
	 * but jansson's reader drops one right after a number or a literal (and ran
	 * {"op":"ping","id":1<NUL>}); found by a socket fuzzer. */
	const char *nul = memchr(line, '\0', len);
	if (nul) {
		error_set(&err, ERR_PARSE_ERROR, "invalid JSON at byte %zu: a NUL byte",
		          (size_t)(nul - line) + 1);
		goto fail;
	}
	req = load_request(line, len, &jerr, &oom);
	if (!req && !oom) {
		/* Valid JSON that jansson refuses for numbers it cannot hold: read again with
		 * those numbers tamed (jscan_tame_numbers). They may be in the id (echoed as
		 * written), in fields the op ignores, or where a field holds them (refused
		 * below, or out of range for its check); the line's own error stands otherwise. */
		struct buf tamed = {0};
		json_error_t jerr2;
		if (jscan_tame_numbers(line, len, &tamed, &ntamed) < 0)
			oom = true;
		else if (ntamed > 0 && !(req = load_request(tamed.data, tamed.len, &jerr2, &oom)) &&
		         !oom) {
			/* Not only the numbers: the rest's error (its column would be the tamed
			 * text's). */
			buf_free(&tamed);
			error_set(&err, ERR_PARSE_ERROR, "invalid JSON: %s", jerr2.text);
			goto fail;
		}
		buf_free(&tamed);
	}
	if (oom) {
		error_set(&err, ERR_INTERNAL, "out of memory while reading the request");
		goto fail;
	}
	if (!req) {
		error_set(&err, ERR_PARSE_ERROR, "invalid JSON at column %d: %s", jerr.column,
		          jerr.text);
		goto fail;
	}
	if (!json_is_object(req)) {
		error_set(&err, ERR_PARSE_ERROR, "expected a JSON object");
		goto fail;
	}
	if ((id = json_object_get(req, "id"))) {
		/* Echoed as written where jansson would write it otherwise: a real (0.1 as
		 * 0.10000000000000001), an integer 0 (which may have been -0), an id holding a
		 * tamed number (1e300). Other integers it writes back the same: no second look at
		 * the line for them, the usual ids. */
		struct jscan_value v;
		bool rewritten =
		    json_is_real(id) || (json_is_integer(id) && json_integer_value(id) == 0);
		rid.json = id;
		if ((rewritten || ntamed > 0) && jscan_object_get(line, len, "id", 2, &v) == 1 &&
		    (rewritten || tamed_in(&v))) {
			rid.raw = v.type == JSCAN_STRING ? v.p - 1 : v.p;
			rid.raw_len = v.type == JSCAN_STRING ? v.len + 2 : v.len;
		}
		idp = &rid;
	}

	/* Protocol order: too_large, unknown_op, bad_request, not_found, ... */
	opv = json_object_get(req, "op");
	if (opv && json_is_string(opv))
		op = ops_lookup(json_string_value(opv), json_string_length(opv));
	*opp = op;
	if (ops_takes_conversation(op))
		code = check_conversation(d, req, ops_needs_conversation(op), &cid, &cid_len, &err);
	if (code == ERR_TOO_LARGE)
		goto fail;
	if (!opv || !json_is_string(opv)) {
		error_set(&err, ERR_BAD_REQUEST, "op: required string");
		goto fail;
	}
	if (op == OP_UNKNOWN) {
		if (strlen(json_string_value(opv)) != json_string_length(opv))
			error_set(&err, ERR_UNKNOWN_OP,
			          "op: no such operation ('%s' and a NUL character)",
			          json_string_value(opv));
		else
			error_set(&err, ERR_UNKNOWN_OP, "op: no such operation '%s'",
			          json_string_value(opv));
		goto fail;
	}
	code2 = ops_check(op, req, &err2);
	if (code2 != ERR_OK && (code == ERR_OK || code2 < code)) {
		err = err2;
		code = code2;
	}
	/* Such a number, tamed to 1e300, is also out of DynamoDB's range: the message says what
	 * it really is. */
	if (ntamed > 0 && (code == ERR_OK || ERR_BAD_REQUEST < code ||
	                   (code == ERR_BAD_REQUEST && strstr(err.message, MESSAGE_AUX_RANGE)))) {
		/* A value the conversation would keep (aux, metadata) cannot hold such numbers:
		 * taming them would change what is stored. */
		const char *field = op == OP_SET_METADATA ? "aux"
		                    : ops_creates(op)     ? "metadata"
		                                          : NULL;
		struct jscan_value v;
		if (field && jscan_object_get(line, len, field, strlen(field), &v) == 1 &&
		    tamed_in(&v)) {
			code =
			    error_set(&err, ERR_BAD_REQUEST,
			              "%s: holds a number out of range (integers must fit 64 bits, "
			              "reals a double)",
			              field);
		}
	}
	if (code != ERR_OK)
		goto fail;

	switch (op) {
	case OP_STATS: {
		const json_t *f = json_object_get(req, "format");
		if (f &&
		    (!json_is_string(f) || strlen(json_string_value(f)) != json_string_length(f) ||
		     (strcmp(json_string_value(f), "json") != 0 &&
		      strcmp(json_string_value(f), "prometheus") != 0))) {
			error_set(&err, ERR_BAD_REQUEST,
			          "format: expected \"json\" or \"prometheus\"");
			goto fail;
		}
		break;
	}
	case OP_DEAD_LETTERS: {
		const json_t *l = json_object_get(req, "limit");
		int64_t limit;
		if (l && !message_json_whole(l, 1, 100000, &limit)) {
			error_set(&err, ERR_BAD_REQUEST,
			          "limit: expected an integer from 1 to 100000");
			goto fail;
		}
		break;
	}
	default:
		break;
	}

	switch (op) {
	case OP_DEAD_LETTERS: {
		const json_t *l = json_object_get(req, "limit");
		int64_t limit = 100;
		json_t *list = NULL;
		if (!d->store) {
			result = json_pack("{s:[]}", "dead_letters");
			goto ok;
		}
		if (l)
			message_json_whole(l, 1, 100000, &limit); /* checked above */
		if (store_dead_letters(d->store, (size_t)limit, &list) < 0) {
			error_set(&err, ERR_UNAVAILABLE,
			          "the local store cannot be read; retry later");
			goto fail;
		}
		result = json_pack("{s:o}", "dead_letters", list);
		goto ok;
	}
	case OP_RETRY_DEAD_LETTERS: {
		size_t n = 0, start = out->len;
		if (remote == DISPATCH_REMOTE_FAILED) {
			error_set(&err, ERR_UNAVAILABLE,
			          "the local store cannot be written; retry later");
			goto fail;
		}
		/* Moved in parts between the turns (start_retry); the answer waits for the
		 * last, and a retry asked meanwhile joins it. */
		if (remote == DISPATCH_REMOTE_CHECK && d->store && d->retry_soon && waiter &&
		    wait_join(d, retry_wait_key, sizeof(retry_wait_key) - 1, waiter, start_retry) ==
		        0) {
			json_decref(req);
			return DISPATCH_WAIT;
		}
		if (answer_open(out, idp) < 0)
			goto oom;
		if (remote == DISPATCH_REMOTE_ABSENT) {
			n = d->retry_result;
		} else if (d->store) {
			int rc = 0;
			/* The turn so far first (a transaction of its own), then the retry,
			 * waited for: the count is what it moved. */
			if (dispatch_commit(d, true) == DISPATCH_COMMIT_FAILED)
				rc = -EIO;
			if (rc == 0) {
				uint64_t t0 = mono_ns();
				rc = store_dead_letters_retry(d->store, dispatch_now_ms(), &n);
				d->retry_ended.moves++;
				d->retry_ended.parts++;
				d->retry_ended.moved += n;
				d->retry_ended.ns += mono_ns() - t0;
			}
			if (rc < 0) {
				out->len = start;
				error_set(&err, ERR_UNAVAILABLE,
				          "the local store cannot be written; retry later");
				goto fail;
			}
			/* The rows are back in the spool (new ones, or a higher version of
			 * rows it held): the sink reads it again, in slices, from now. */
			if (n && d->remote)
				sink_reread(d->sink);
		}
		answer_count(d, out, start, op, "retried", n);
		json_decref(req);
		return DISPATCH_DONE;
	}
	case OP_CREATE_TABLE:
		if (!d->remote) {
			error_set(&err, ERR_BAD_REQUEST,
			          "op: create_table needs DynamoDB configured (AWS_REGION or an "
			          "endpoint)");
			goto fail;
		}
		if (remote == DISPATCH_REMOTE_CHECK) {
			if (waiter && table_create_start(d, waiter) == 0) {
				json_decref(req);
				return DISPATCH_WAIT;
			}
			remote = DISPATCH_REMOTE_FAILED;
		}
		if (remote == DISPATCH_REMOTE_FAILED) {
			error_set(&err, ERR_UNAVAILABLE,
			          "the table could not be created; see the log");
			goto fail;
		}
		result = json_pack("{s:s, s:b}", "table", d->cfg->dynamodb_table, "ready", 1);
		goto ok;
	case OP_PING:
		result = json_pack("{s:b, s:s, s:i}", "pong", 1, "version", CONVOD_VERSION,
		                   "protocol", 1);
		goto ok;
	case OP_STATS:
		d->stats.conversations = d->reg.count;
		d->stats.messages = 0;
		registry_each(&d->reg, count_messages, &d->stats.messages);
		result = stats_to_json(&d->stats, mono_ns() / 1000000);
		if (result && d->sink) {
			json_t *sp = sink_stats_spool(d->sink), *sk = sink_stats_sink(d->sink);
			if (!sp || !sk || json_object_set_new(result, "spool", sp) < 0 ||
			    json_object_set_new(result, "sink", sk) < 0) {
				if (!sp || !sk) {
					json_decref(sp);
					json_decref(sk);
				}
				json_decref(result);
				result = NULL;
			}
		}
		if (result && json_object_set_new(result, "store", store_stats_json(d)) < 0) {
			json_decref(result);
			result = NULL;
		}
		{
			const json_t *f = json_object_get(req, "format");
			if (result && f && strcmp(json_string_value(f), "prometheus") == 0) {
				char *text = stats_prometheus(result);
				json_decref(result);
				result = text ? json_pack("{s:s, s:s}", "format", "prometheus",
				                          "text", text)
				              : NULL;
				free(text);
			}
		}
		goto ok;
	case OP_LIST:
		result = list_result(d);
		/* It may show a conversation created (or a count changed) by a change not yet
		 * written: then it stands or falls with that commit, like a read of it. */
		if (d->changed || d->store_dirty || d->submitted > d->committed)
			mark_answer(d);
		goto ok;
	case OP_FLUSH:
		if (!cid) {
			struct flush_all_ctx ctx = {d, 0};
			size_t start = out->len;
			if (answer_open(out, idp) < 0)
				goto oom;
			registry_each(&d->reg, flush_each, &ctx);
			answer_count(d, out, start, op, "flushed", ctx.n);
			json_decref(req);
			return DISPATCH_DONE;
		}
		break;
	default:
		break;
	}

	switch (find_convo(d, op, cid, cid_len, waiter, remote, &c, &created, &err)) {
	case FIND_OK:
		break;
	case FIND_WAIT:
		json_decref(req);
		return DISPATCH_WAIT;
	case FIND_FAIL:
		goto fail;
	}

	if (op == OP_FLUSH || op == OP_CLOSE) {
		size_t start = out->len, n;
		if (answer_open(out, idp) < 0)
			goto oom;
		n = sink_take(d, c, true);
		if (op == OP_CLOSE) {
			if (!d->store) {
				/* Memory only: nothing else holds it, so it is gone for good. */
				drop_conversation(d, c);
			} else {
				int rc;
				persist_marks(d, c); /* written with the close, below */
				rc = ensure_tx(d);
				if (rc == 0)
					rc = store_set_closed(d->store, c->id, c->id_len,
					                      dispatch_now_ms());
				if (rc < 0 && !d->tx_error)
					d->tx_error = rc;
				c->daemon_flags |= FLAG_CLOSING;
				/* Dropped after the commit, once the sink confirmed everything. */
				mark_store_dirty(d, c);
			}
			c = NULL;
		}
		answer_count(d, out, start, op, "flushed", n);
		json_decref(req);
		return DISPATCH_DONE;
	}

	if (d->sink && ops_mutates(op) && sink_full(d->sink)) {
		error_set(&err, ERR_UNAVAILABLE,
		          "the spool holds %zu unsent writes (limit %zu); retry later",
		          sink_depth(d->sink), d->cfg->spool_max_items);
		if (created)
			convo_free(c);
		goto fail;
	}

	env_of(d, &env);
	/* A new conversation is registered first: nothing may fail once the answer is out. */
	if (created && registry_put(&d->reg, c) < 0) {
		convo_free(c);
		error_set(&err, ERR_INTERNAL, "out of memory");
		goto fail;
	}
	{
		struct emit_ctx ec = {d, out, idp, op, out->len};
		uint64_t takes = c->client_takes;
		size_t from = c->scan_from[CONSUMER_CLIENT];
		if (op == OP_TO_MESSAGES_MAP)
			stamp_marks(d, c);
		code = ops_run_emit(op, c, &env, req, emit_answer, &ec, &changed, &err);
		if (code != ERR_OK) {
			if (created)
				drop_conversation(d, c);
			c = NULL;
			goto fail;
		}
		if (c->client_takes != takes)
			mark_marks_dirty(d, c, from);
		if (changed) {
			mark_store_dirty(d, c);
			mark_sink_changed(d, c);
			mark_answer(d);
		} else {
			mark_read(d, c);
		}
	}
	json_decref(req);
	return DISPATCH_DONE;
ok:
	answer_ok(d, out, idp, op, result);
	json_decref(req);
	return DISPATCH_DONE;
oom:
	error_set(&err, ERR_INTERNAL, "out of memory");
fail:
	if (err.code == ERR_INTERNAL)
		log_msg(LOG_ERROR, "dispatch", "internal error: %s", err.message);
	answer_error(d, out, idp, op, &err);
	json_decref(req);
	return DISPATCH_DONE;
}

enum dispatch_result dispatch_line(struct dispatch *d, const char *line, size_t len,
                                   struct buf *out, void *waiter, enum dispatch_remote remote)
{
	enum op op = OP_UNKNOWN;
	uint64_t t0 = mono_ns();
	size_t start = out->len;
	enum dispatch_result r;

	d->answer_dependent = false;
	d->answer_shows = 0;
	r = dispatch_one(d, line, len, out, waiter, remote, &op);
	d->answer_op = op;
	if (r == DISPATCH_DONE && out->len == start && !is_blank(line, len))
		r = DISPATCH_LOST;

	d->stats.time_ns_by_op[op] += mono_ns() - t0;
	return r;
}
