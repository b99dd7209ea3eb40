/* From one request line to one response line: parse, check the envelope, find, restore or
 * create the conversation, run the op, write the answer. Also the group commit of each
 * loop turn (every change of the turn in one store transaction before any answer is
 * written) and the flusher's snapshots into the spool. No sockets and no timers here: the
 * server hands lines in and calls dispatch_commit at the end of the turn; main.c runs the
 * flush timer. */
#ifndef CONVOD_DISPATCH_H
#define CONVOD_DISPATCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "buf.h"
#include "config.h"
#include "registry.h"
#include "sink.h"
#include "stats.h"
#include "store.h"
#include "ulid.h"

#define DISPATCH_SEQ_VOID UINT64_MAX /* dispatch_seq_after: a transaction a failure voided */

/* A spool row written in a transaction, handed to the sink once it is committed. */
struct spool_entry {
	char *conv; /* owned */
	size_t conv_len;
	char sk[MESSAGE_SK_MAX + 1];
	uint32_t version;
	int64_t at_ms;
	uint64_t seq; /* its transaction; 0 while the turn's is open */
	size_t map_bytes; /* the message map's size, as its row records it */
	/* Its row was in a failed commit at durability none: the next commit writes it again
	 * (the flush that took it was answered ok). */
	bool put_again;
};

/* A conversation closed in transaction seq: it leaves memory once that is written. */
struct closing {
	char *conv; /* owned */
	size_t conv_len;
	uint64_t seq;
};

/* How a request may look for a conversation the daemon does not hold in DynamoDB. */
enum dispatch_remote {
	DISPATCH_REMOTE_CHECK = 0, /* query DynamoDB (the request waits) */
	DISPATCH_REMOTE_ABSENT,    /* already queried: not there */
	DISPATCH_REMOTE_FAILED,    /* already queried: DynamoDB could not be reached */
};

/* The outcome of dispatch_line. */
enum dispatch_result {
	DISPATCH_DONE = 0, /* answered into out (or a blank line) */
	DISPATCH_WAIT,     /* waiting for a restore from DynamoDB: hold the line, serve nothing
	                    * more on that connection until the ready callback, then dispatch the
	                    * same line again with the remote outcome it gives */
	DISPATCH_LOST,     /* handled, but out had no room left for its answer (memory ran out,
	                    * even for the fixed error): the client would wait for it forever, so
	                    * the caller drops the connection */
};

/* Called when a restore the waiter waited for is over. */
typedef void (*dispatch_ready_cb)(void *waiter, enum dispatch_remote outcome);

struct restore_wait;

struct dispatch {
	const struct config *cfg; /* borrowed */
	size_t dropped_since_trim; /* conversations freed since main last ran malloc_trim */
	uint64_t submitted_at_tick; /* d->submitted at the last flush tick */
	int64_t purge_due_ms;       /* when the next retention purge is due */
	/* The retention purge runs: DynamoDB holds what it removes (the sink is remote). With
	 * the local store as the sink it holds the only copy, and nothing is deleted
	 * (semantics.md); test_dispatch sets it to stage the purge without DynamoDB. */
	bool purge_local;
	bool idle_done;             /* nothing submitted since the store was told it is idle */
	struct registry reg;
	struct stats stats;
	struct ulid_gen ulid;
	struct store *store;      /* borrowed; NULL when memory only */
	struct sink *sink;        /* borrowed; NULL when memory only */
	bool remote;              /* the sink sends to DynamoDB */
	bool changed;             /* something to commit this turn */
	int tx_error;             /* a store write of this turn failed: the commit must fail */
	struct convo *store_dirty; /* changed since the last successful commit */
	struct convo *sink_dirty;  /* with messages the flusher has not taken (remote only) */
	struct convo *marks_dirty; /* whose client marks moved since stored (persist_marks) */
	/* Changes for the sink since the last flush tick; at DISPATCH_FLUSH_SOON_CHANGES
	 * flush_soon(flush_soon_arg) is called (main: the tick runs at once). */
	size_t sink_changes;
	void (*flush_soon)(void *arg);
	void *flush_soon_arg;
	struct spool_entry *spooled;
	size_t nspooled, capspooled;
	struct closing *closing;
	size_t nclosing, capclosing;
	uint64_t submitted;       /* the last transaction handed to the store's writer */
	/* Transactions handed over so far, and the seqs of those handed over since the last
	 * dispatch_turn_done (the n-th at submit_seqs[n - submits_base]): an answer made after
	 * n were is in the next one (dispatch_seq_after). */
	uint64_t nsubmits, submits_base;
	uint64_t *submit_seqs;
	size_t submit_cap;
	uint64_t committed;       /* the last one written (answers up to it may go out) */
	uint64_t failures;        /* commits failed so far (the server compares) */
	const char *fail_why;     /* the last failure, for the answers it turns into errors */
	bool answer_dependent;    /* the answer dispatch_line wrote depends on the commit */
	uint64_t answer_shows;    /* a dependent read's: the transaction holding what it shows,
	                           * submitted before it (0: this turn's) */
	enum op answer_op;        /* the op of the request dispatch_line answered last */
	bool store_failing;       /* the last commit failed (logged once until it recovers) */
	/* Conversations that could not be read back after a failed commit left memory: with
	 * DynamoDB as the sink, the flush tick reads the open ones again (dispatch.c). */
	bool reread_open;
	struct restore_wait *restores; /* restores from DynamoDB (and create_table) in progress */
	/* retry_dead_letters moves the dead letters in parts, each a transaction of its own:
	 * retry_soon(retry_soon_arg) asks main to call dispatch_retry_step once a loop turn
	 * (NULL: the whole move at once, in the request). */
	void (*retry_soon)(void *arg);
	void *retry_soon_arg;
	struct restore_wait *retry_wait; /* the move under way (its waiters), or NULL */
	bool lookups_off; /* dispatch_stop_waiting was called: DynamoDB is not asked any more */
	int64_t retry_upto;              /* its last dead letter's seq (-1 until the first part) */
	size_t retry_moved, retry_parts; /* by the move under way so far */
	size_t retry_pauses, retry_waits; /* its waits for the checkpoint thread: all, in a row */
	uint64_t retry_ns;               /* the loop's time in its parts */
	size_t retry_result;             /* what the last move ended with moved: its answer */
	/* The moves ended since start, at once or in parts, and what they did (stats'
	 * store.retry adds the move under way). */
	struct {
		uint64_t moves, moved, parts, pauses, ns;
	} retry_ended;
	dispatch_ready_cb on_ready;
	struct buf scratch;       /* decoded request strings of the fast path */
	bool no_fast_path;        /* read every request with jansson (tests compare both) */
};

/* The transaction that holds the changes made after the n-th handed over (n from
 * d->nsubmits then, and not before the last dispatch_turn_done): its seq, DISPATCH_SEQ_VOID
 * when it failed or a failure voided it, or 0 when it is not handed over yet (or could not
 * be recorded for want of memory). A turn is mostly one transaction, but the flush timer
 * commits a turn whose answers wait for one more poll, and so do retry_dead_letters' move
 * before its parts and a retry_dead_letters done at once (no waiter): the answers made
 * before such a commit must wait for it, not for the turn's last. */
uint64_t dispatch_seq_after(const struct dispatch *d, uint64_t n);
/* The server knows the transaction of every answer made so far: dispatch_seq_after is not
 * asked about them again, and their seqs are forgotten. */
void dispatch_turn_done(struct dispatch *d);

/* Seeds the id generator and hash key from the kernel's randomness. store and sink may be
 * NULL (memory only). 0 or -errno. */
int dispatch_init(struct dispatch *d, const struct config *cfg, struct store *store,
		  struct sink *sink);
/* Frees every conversation and the turn's bookkeeping. */
void dispatch_free(struct dispatch *d);

/* Loads every conversation the store holds open (restart) and hands the spool to the sink.
 * 0 or -errno after logging. */
int dispatch_restore(struct dispatch *d);

/* Answers one request line (without its terminator) into out, and sets d->answer_dependent
 * when the answer depends on the turn's commit. Blank lines produce no
 * answer. Never fails: an allocation failure becomes an `internal` answer. With DynamoDB
 * configured, a request naming a conversation that neither memory nor the local store
 * holds returns DISPATCH_WAIT (remote = DISPATCH_REMOTE_CHECK) while it is looked up;
 * waiter identifies the caller to on_ready. */
enum dispatch_result dispatch_line(struct dispatch *d, const char *line, size_t len,
				   struct buf *out, void *waiter, enum dispatch_remote remote);

/* retry_dead_letters moves at most this many dead letters a transaction, and goes on for
 * about this long a loop turn. */
#define DISPATCH_RETRY_PART 256
#define DISPATCH_RETRY_SLICE_NS 2000000
/* It waits for the checkpoint thread at most this many times in a row, 2 ms each. */
#define DISPATCH_RETRY_WAITS_MAX 100

enum dispatch_retry {
	DISPATCH_RETRY_DONE = 0, /* no move under way (any more) */
	DISPATCH_RETRY_MORE,     /* call again at the next loop turn */
	DISPATCH_RETRY_WAIT,     /* paused for the checkpoint thread: call again in a while */
};
/* Parts of retry_dead_letters' move, for about 2 ms. */
enum dispatch_retry dispatch_retry_step(struct dispatch *d);
/* The daemon stops: a move under way ends where it is (its waiters are gone). */
void dispatch_retry_stop(struct dispatch *d);

/* The waiter went away (its connection closed): it is not called back. */
void dispatch_cancel_wait(struct dispatch *d, void *waiter);
/* The stop's deadline came with requests still waiting for DynamoDB (a lookup, create_table;
 * not a retry_dead_letters move): each waiter is called back now as if DynamoDB had failed,
 * and later requests do not look it up either. The lookups themselves end with the sink.
 * Returns how many waiters were called back. */
size_t dispatch_stop_waiting(struct dispatch *d);

/* Answers a line that went over --max-line-bytes: DISPATCH_DONE, or DISPATCH_LOST when out
 * had no room for the answer. */
enum dispatch_result dispatch_too_large_line(struct dispatch *d, struct buf *out);

/* The group commit: hands what changed this turn to the store's writer (with durability
 * none only when force is set: the flush timer), and returns at once. The answers written
 * since the last call wait for it (dispatch_hold) and go out once dispatch_progress says it
 * is written. DISPATCH_COMMIT_FAILED: the turn could not be handed over (out of memory):
 * it is undone, as after a failed commit (dispatch_progress), at once. */
enum dispatch_commit_result {
	DISPATCH_COMMIT_NONE = 0,  /* nothing to write */
	DISPATCH_COMMIT_SUBMITTED, /* handed over */
	DISPATCH_COMMIT_FAILED,    /* d->failures grew: see dispatch_progress */
};
enum dispatch_commit_result dispatch_commit(struct dispatch *d, bool force);

/* True when the turn has something for dispatch_commit (the server skips it otherwise). */
bool dispatch_pending_commit(const struct dispatch *d);

/* The transaction that answers written now must wait for: the last one submitted while it
 * is not written, else 0 (they may go out at once). */
uint64_t dispatch_hold(const struct dispatch *d);

/* After the store's writer woke the loop: takes what it finished (d->committed; spool rows
 * go to the sink, closed conversations leave memory). Returns false after a failed commit,
 * having put memory back as the store holds it (every transaction after the last one written
 * is void, the open one too) and counted it in d->failures: every answer made before then
 * that depends on a transaction after d->committed must then become `unavailable`
 * (dispatch_fail_answer). Answers made after it (the rest of a turn in which the failure
 * was found) depend on later commits. */
bool dispatch_progress(struct dispatch *d);

/* Waits until the writer has written everything submitted, then dispatch_progress. 0 or the
 * store's error. For the stop, before the sink drains. */
int dispatch_sync(struct dispatch *d);

/* Appends to `to` the `unavailable` answer that replaces the ok answer answer[0..len) to a
 * request of op (d->answer_op when it was made) after a failed commit (the request's id
 * kept). 0, or -ENOMEM with `to` unchanged. */
int dispatch_fail_answer(struct dispatch *d, struct buf *to, const char *answer, size_t len,
                         enum op op);

/* The flush timer: takes each conversation's new messages into the spool (the last one too
 * once the conversation is idle, or when all is set), commits, and purges closed
 * conversations past their retention now and then. */
void dispatch_flush_tick(struct dispatch *d, bool all);

/* The sink confirmed the last pending write of a conversation (sink_settled_cb). */
void dispatch_settled(void *arg, const char *conv, size_t conv_len);

/* Wall-clock Unix milliseconds. */
int64_t dispatch_now_ms(void);

#endif
