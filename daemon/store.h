/* The local store: one SQLite database (WAL) in the state directory holding every
 * conversation's messages (their current version, as message maps), which conversations
 * are closed, the spool of writes the DynamoDB sink has not confirmed yet, the versions it
 * confirmed, and the dead letters. The daemon writes one transaction per loop turn (group
 * commit). */
#ifndef CONVOD_STORE_H
#define CONVOD_STORE_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "convo.h"
#include "message.h"

enum durability { DURABILITY_NONE = 0, DURABILITY_PROCESS, DURABILITY_MACHINE };

/* Parses "none", "process", "machine". 0 or -EINVAL. */
int store_durability_parse(const char *s, enum durability *out);
const char *store_durability_str(enum durability d);

struct store;

/* Opens or creates DIR/convod.db: WAL journal, synchronous=NORMAL (none, process) or FULL
 * (machine), schema created, checked or upgraded (from schema 1 and 2), PRAGMA quick_check
 * passed, and the message records a crash left in the journal folded. On failure returns
 * -errno (-EIO for a corrupt or foreign file) and writes one sentence for the operator to
 * errbuf, naming the file and what is wrong. Caller frees *out with store_close. */
int store_open(const char *dir, enum durability durability, struct store **out, char *errbuf,
               size_t errlen);
/* Accepts NULL; rolls back an open transaction and folds every pending record (so that the
 * next start has nothing to fold). */
void store_close(struct store *s);

/* Caps the database file at about max_bytes (0 = no cap beyond SQLite's own); a write that
 * would grow it further fails like a full disk, with -ENOSPC. The cap is never below the
 * current size. 0 or -EIO. */
int store_set_size_limit(struct store *s, uint64_t max_bytes);

/* For tests: the pending records that start a fold cycle (default 32768; at least 1). */
void store_set_fold_records(struct store *s, size_t n);
/* For tests: whether the writer folds while it has no job (default on). Off, the fold runs
 * only in commits once four cycles' worth of records is pending, and at store_idle and
 * close. */
void store_set_idle_fold(struct store *s, bool on);
/* For tests: while fail is set, setting synchronous=FULL back at durability machine (after
 * a fold's own transaction at NORMAL, and at the start of the next transaction when that
 * failed) fails as if SQLite refused it. Returns how many times it failed since the last
 * call. */
unsigned store_fail_sync_full(struct store *s, bool fail);
/* For tests: the WAL sizes in pages that start a round of the checkpoint thread (default
 * 16000) and past which the writer waits for it and checkpoints itself (32000; not below
 * the first: equal, the thread is never asked), and the frames a round may leave behind
 * for the next commit to copy (256; 0 keeps the default). */
void store_set_wal_pages(struct store *s, int checkpoint, int hard, int catch_up);
/* For tests: after how many pages of WAL growth the checkpoint thread starts the WAL's
 * writeback at durability process (1024; 0: never). */
void store_set_wal_writeback(struct store *s, int pages);
/* For tests: how long after a commit at durability machine the writer may wait for the next
 * cohort (cohort_wait in store.c; 400 us). */
void store_set_cohort_wait(struct store *s, uint64_t ns);
/* For tests: holds the checkpoint thread before its next round, as a disk too slow for it
 * would (a round asked meanwhile stays asked), or lets it go on. */
void store_hold_checkpoints(struct store *s, bool hold);

/* One transaction per loop turn, written by the store's writer thread. store_begin opens
 * it (0, or -EINVAL when one is open already); the writes below record into it; nothing is
 * written before it is handed over. store_rollback forgets it.
 *
 * store_submit hands it to the writer and returns at once with its sequence number (1, 2,
 * ...); the writer writes what is queued in one SQLite transaction with a step of the fold
 * (a few conversations' segments), in order, and calls wake(arg) after each such commit or
 * failure (from its own thread: uv_async_send is fine). store_progress says what is done:
 * everything up to committed is written. After a failure (failed set, error -ENOSPC for a
 * full disk or -EIO), every transaction submitted and not yet written is void: the caller
 * puts memory back as the store holds it, then calls store_failure_ack, and what it submits
 * after that is written again. store_submit returns 0, -EINVAL (none open), or the error of
 * a write that failed while recording (-ENOMEM; rolled back).
 *
 * store_commit hands it over and waits for it: 0, or -ENOSPC / -EIO / -ENOMEM after
 * everything of it was rolled back (and the failure acknowledged). store_sync waits until
 * everything submitted before is written (0 or the error). */
int store_begin(struct store *s);
int store_submit(struct store *s, uint64_t *seq);
int store_commit(struct store *s);
int store_sync(struct store *s);
struct store_progress {
	uint64_t submitted; /* the last seq handed over */
	uint64_t committed; /* the last seq written */
	bool failed;
	int error;
};
void store_set_wake(struct store *s, void (*wake)(void *arg), void *arg);
void store_progress(struct store *s, struct store_progress *p);
void store_failure_ack(struct store *s);
/* The WAL is past the size at which it is copied back, and the checkpoint thread is at it:
 * bulk work that can wait (retry_dead_letters' move) lets it catch up first, instead of
 * growing the WAL to its hard bound, where a commit waits for the copy. */
bool store_checkpoint_behind(struct store *s);
/* Checkpoints run since store_open: the background thread's rounds (the WAL copied back
 * into the database file once it holds STORE_CHECKPOINT_PAGES; commits never wait for
 * them) and the writer's own when the WAL reached its bound. */
uint64_t store_checkpoints(struct store *s);

/* What the store has done since store_open, for the `stats` op (proto/protocol.md). Safe
 * from the loop at any time: counters are read without waiting for the writer. */
struct store_stats {
	uint64_t commits;        /* transactions that wrote the loop's turns (group commits) */
	uint64_t turns;          /* loop turns they held (turns / commits: the group size) */
	uint64_t inline_commits; /* commits the loop wrote itself (durability process) */
	uint64_t records;        /* message records committed */
	uint64_t commit_ns;      /* time writing those commits, the sync included */
	uint64_t commit_max_ns;  /* the longest one */
	uint64_t pending;        /* records committed, not yet folded into segments */
	uint64_t fold_cycles;    /* fold cycles ended */
	uint64_t fold_segments;  /* segment rows written */
	uint64_t fold_records;   /* records in them */
	uint64_t fold_ns;        /* time in fold steps of their own (steps inside a commit
	                          * count in commit_ns) */
	uint64_t dead_batches;   /* journal rows whose records are all folded, not deleted yet */
	uint64_t checkpoints;    /* as store_checkpoints */
	uint64_t catch_ups;      /* of them, a commit's copy of what the thread's last round
	                          * left behind, so that the WAL starts over */
	uint64_t bound_waits;    /* and the writer's own, holding commits, at the WAL's bound */
	uint64_t checkpoint_ns;  /* time in them */
	uint64_t wal_writebacks; /* durability process: the WAL's writebacks the checkpoint
	                          * thread started ahead of the syncs that need them */
	uint64_t wal_pages;      /* pages in the WAL after the last commit */
	uint64_t wal_syncs;      /* syncs of the WAL file that succeeded (at machine one a
	                          * commit; at process only those of checkpoints) */
	uint64_t db_syncs;       /* and of the database file (checkpoints') */
	uint64_t commits_spoiled; /* durability machine: commits whose sync failed, spoiled in
	                           * the WAL so that a crash cannot bring them back (walvfs.h) */
	uint64_t spoils_failed;   /* and those whose spoiling failed too (logged: a crash before
	                           * the next commit would bring them back) */
	uint64_t wal_commits_dropped; /* at this start: intact commits SQLite's recovery dropped
	                               * after a WAL frame not as written (walcheck.h; logged) */
	uint64_t cohort_waits;   /* durability machine: times the writer waited after a commit
	                          * for the requests its answers released (cohort_wait) */
	uint64_t cohort_short;   /* of them, those that ended at the deadline short of it */
	uint64_t cohort_ns;      /* time in them */
	uint64_t db_bytes;       /* size of the database file and of its WAL now */
	uint64_t wal_bytes;
};
void store_stats(struct store *s, struct store_stats *out);
void store_rollback(struct store *s); /* no-op outside a transaction */
/* True between store_begin and the commit or rollback. */
bool store_in_transaction(const struct store *s);
/* Rows of messages to look at again (store_repair_put) the open transaction writes, new
 * ones or ones written before again: lost with it if it fails, unless an earlier commit
 * wrote them. 0 outside a transaction. */
size_t store_repairs_in_transaction(const struct store *s);

/* Inside a transaction: each records a write of it. 0, -ENOMEM (the transaction then
 * fails), or -EINVAL outside a transaction or for an argument that cannot be stored. After
 * one write failed, the next ones of the same transaction return the same error. */

/* Stores this version of message m of conversation conv (key: conversation, sort key of
 * ddbitem_sort_key semantics: the id, or for a summary the last summarized id + "~" + id):
 * its message map, version, updated_ms and the version the client's incremental
 * to_messages_map has seen (m->seen[CONSUMER_CLIENT]). A later version replaces it. */
int store_put_message(struct store *s, const char *conv, size_t conv_len, const struct message *m);
/* Upserts the conversation row: updated = c->updated_ms, closed = 0. Needed to create or
 * reopen the row; while it is open, writing only messages is enough, since loading takes
 * the newest of the row's and the messages' updated times. */
int store_put_conversation(struct store *s, const struct convo *c);
/* Marks the conversation closed at closed_ms (kept for the retention period; a
 * closed_ms below 1 counts as 1, since 0 means open). No-op for an unknown conversation. */
int store_set_closed(struct store *s, const char *conv, size_t conv_len, int64_t closed_ms);
/* Records that version of message sk must reach the sink: a spool row (conversation, sk)
 * whose version becomes the larger of the stored one and this one; map_bytes (the size of
 * that version's message map) counts in store_spool_stats. */
int store_spool_put(struct store *s, const char *conv, size_t conv_len, const char *sk,
                    uint32_t version, size_t map_bytes, int64_t now_ms);
/* The sink confirmed that version: deletes the spool row if its version <= version, and
 * remembers the confirmed version on the message row. */
int store_spool_done(struct store *s, const char *conv, size_t conv_len, const char *sk,
                     uint32_t version);
/* A write the sink refused for good: the spool row moves to the dead letters with the item
 * (JSON text, may be NULL) and the error. As with store_spool_done, a spool row holding a
 * newer version than the refused one stays, since that version has not been tried. */
int store_dead_letter(struct store *s, const char *conv, size_t conv_len, const char *sk,
                      uint32_t version, const char *item_json, const char *error, int64_t now_ms);
/* The sink's write of version of (conv, sk) got no clear answer and may land late: a row
 * to look at it again at due_ms (Unix ms), kept until store_repair_done, so that a restart
 * looks at it too (sink.c, repair_add). */
int store_repair_put(struct store *s, const char *conv, size_t conv_len, const char *sk,
                     uint32_t version, int64_t due_ms);
int store_repair_done(struct store *s, const char *conv, size_t conv_len, const char *sk,
                      uint32_t version);

/* Reads: what is committed (never the open transaction), between two of the writer's
 * transactions. */

/* Rebuilds a conversation from its rows (log order = sort-key order, positions recomputed
 * by convo_restore_finish). Each message gets seen[CONSUMER_STORE] = its version,
 * seen[CONSUMER_CLIENT] = the stored client version, seen[CONSUMER_SINK] = its version
 * when the sink confirmed it or the spool holds it at that version, else the confirmed
 * version (so the flusher takes it again). Caller frees *out. 0, -ENOENT (no such
 * conversation), -EIO (unreadable rows; logged). A closed conversation loads too and is
 * marked open again by the caller's next store_put_conversation. */
int store_load_conversation(struct store *s, const char *conv, size_t conv_len, struct convo **out);
/* Calls fn for every conversation not closed, in id order, loaded as above; fn takes
 * ownership of c and returns 0 to go on or a negative errno to stop (returned). 0, -EIO
 * (logged, naming the conversation) or -ENOMEM. fn runs while the store reads: it must not
 * call store_load_open or store_load_conversation, and should not write. */
int store_load_open(struct store *s, int (*fn)(void *arg, struct convo *c), void *arg);
/* The same, but a conversation for whose id skip returns true is passed over before it is
 * read (its row's id only is looked at): a walk for the few conversations a caller lacks
 * costs their reading, not everyone's. id is valid during the call only. */
int store_load_open_except(struct store *s, bool (*skip)(void *arg, const char *id, size_t len),
                           int (*fn)(void *arg, struct convo *c), void *arg);
/* Calls fn for every spool row after after_seq (0: all) in the order they were first
 * spooled (enqueued_ms is the first time; a row's version may have grown since); seq is the
 * row's place in that order, to go on after it in a later call. conv and sk are valid during
 * the call only. fn returns 0 to go on, or anything else to stop: a negative errno, or a
 * positive value to pause (a caller reading the spool in slices). Returns what fn stopped
 * with, else 0 at the end, or -EIO. Each call is a read of its own: nothing stays open
 * between two calls, and rows written in between are seen if they come after. */
int store_spool_each(struct store *s, int64_t after_seq,
                     int (*fn)(void *arg, int64_t seq, const char *conv, size_t conv_len,
                               const char *sk, uint32_t version, int64_t enqueued_ms),
                     void *arg);
/* Calls fn for every repairs row (store_repair_put), by due time; fn returns 0 to go on or
 * a negative errno to stop (returned). 0, -EIO (a bad row, logged) or what fn returned. */
int store_repair_each(struct store *s,
                      int (*fn)(void *arg, const char *conv, size_t conv_len, const char *sk,
                                uint32_t version, int64_t due_ms),
                      void *arg);
/* The stored map, version and updated time of one message (for sending messages whose
 * conversation is not in memory). 0 or -ENOENT / -EIO. Caller owns *map. */
int store_message_get(struct store *s, const char *conv, size_t conv_len, const char *sk,
                      json_t **map, uint32_t *version, int64_t *updated_ms);
/* The spool's rows after after_seq, at most limit of them, in the order of store_spool_each:
 * how many (*rows), the sum of their stored maps' bytes, and the seq of the last one
 * (*last_seq, after_seq if none): a count of the spool in slices. 0 or -EIO. */
int store_spool_bytes(struct store *s, int64_t after_seq, size_t limit, size_t *rows,
                      uint64_t *bytes, int64_t *last_seq);
/* Spool depth: rows, sum of the stored maps' bytes, oldest enqueue time (0 if none).
 * Scans the spool: call it for stats, not per request. 0 or -EIO. */
int store_spool_stats(struct store *s, uint64_t *items, uint64_t *bytes, int64_t *oldest_ms);
/* Dead letters as a JSON array [{"conversation","sk","version","error","at"}]: the newest
 * limit ones, oldest first. Caller owns *out. 0, -EIO or -ENOMEM. */
int store_dead_letters(struct store *s, size_t limit, json_t **out);
/* Moves every dead letter back to the spool (for a retry); several of one message become
 * one spool row with the highest version. *n = dead letters moved. Outside a transaction
 * only (-EINVAL inside one): a transaction of its own, after what was submitted before,
 * waited for. 0, -ENOSPC or -EIO. */
int store_dead_letters_retry(struct store *s, int64_t now_ms, size_t *n);
/* One part of a retry, in a transaction of its own (as store_dead_letters_retry): the oldest
 * max_rows dead letters (0: all) among those whose seq is at most *upto, which is first the
 * newest seq there is (< 0 asks for it; written back). Messages with dead letters on both
 * sides of a part's end get one spool row all the same, while the flusher has not read it
 * (the spool row takes the higher version). *more: some are left for the next part. */
int store_dead_letters_retry_part(struct store *s, int64_t now_ms, int64_t *upto, size_t max_rows,
                                  size_t *n, bool *more);
/* Deletes conversations closed before before_ms that have no spool row, with their
 * messages (dead letters stay). *removed = conversations deleted. Outside a transaction
 * only (-EINVAL inside one): after what was submitted before, it folds every pending
 * record, in transactions of its own, then deletes in one, and is waited for. 0, -ENOSPC or
 * -EIO. */
int store_purge_closed(struct store *s, int64_t before_ms, size_t *removed);

/* For an idle daemon: frees the open transaction's buffers, and has the writer fold every
 * pending record (in short transactions of its own, between jobs), then free the memory
 * that held them and SQLite's page cache, and have the WAL checkpointed (not waited for; a
 * fold that fails is tried again later). Outside a transaction only. 0 or -EINVAL. */
int store_idle(struct store *s);

#endif
