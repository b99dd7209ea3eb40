/* The flusher: takes what the local store holds but DynamoDB has not confirmed (the spool)
 * and writes it with BatchWriteItem, on the daemon's loop. Without DynamoDB configured the
 * local store itself is the sink and nothing is sent (the embedded default).
 *
 * Entries are keyed by (conversation, sk). The item sent is built from the local store's
 * current row of that message (store_message_get), so a newer version spooled while an
 * older one is in flight is sent after it, never before: at most one write of a given
 * message is in flight.
 *
 * Outcomes are written to the store (store_spool_done, store_dead_letter) inside the open
 * transaction, which the sink opens with store_begin when none is: the daemon commits it at
 * the end of every loop turn, turns without client requests included (the sink writes from
 * ddbclient callbacks and its timer). The sink never commits. If that commit fails, the
 * spool rows stay and the writes are sent again after a restart (idempotent).
 *
 * Failures: HTTP 5xx, throttling, transport errors and timeouts, and 4xx answers not known
 * to be permanent are retried, each entry after a random delay in [0, min(retry_max_ms,
 * retry_base_ms * 2^(failures - 1))]; after a failed call, and until one succeeds, at most
 * one call is in flight and none starts before a backoff of its own. Credential errors
 * reread the AWS settings (at most once a second) and retry. A batch refused for good
 * (ddbitem_error_permanent) is sent again item by item; an item refused alone becomes a
 * dead letter. */
#ifndef CONVOD_SINK_H
#define CONVOD_SINK_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "awsconf.h"
#include "store.h"

struct sink_config {
	const char *table;      /* DynamoDB table (borrowed); NULL = the local store is the sink */
	uint64_t retry_base_ms; /* first backoff cap (100) */
	uint64_t retry_max_ms;  /* largest backoff cap (30000); full jitter below the cap */
	size_t batch_items;     /* items per BatchWriteItem, 1..25 (25) */
	size_t max_batches_inflight; /* concurrent BatchWriteItem calls (8) */
	size_t spool_max_items;      /* over it sink_full() is true (1000000) */
	uint32_t expires_days;       /* 0 = no expires attribute; else Unix s of the write + days */
	long connect_timeout_ms;     /* (3000) */
	long request_timeout_ms;     /* (10000) */
	bool ignore_crc32;           /* take answers that do not match x-amz-crc32 (false) */
};
void sink_config_defaults(struct sink_config *cfg);

struct sink;

/* Called when the last pending entry of a conversation is confirmed or dead-lettered (the
 * daemon drops a closed conversation from memory then). conv is borrowed. */
typedef void (*sink_settled_cb)(void *arg, const char *conv, size_t conv_len);

/* New sink on loop. store is borrowed and outlives the sink. aws: the AWS settings (borrowed
 * for the call; credentials copied); with cfg->table NULL it is ignored and may be NULL.
 * cfg is copied (cfg->table too). Without credentials the sink starts anyway (logged as an
 * error) and rereads the settings while writes wait. Loads nothing: the daemon calls
 * sink_enqueue for each spool row at start. The caller frees *out with sink_close. 0 or
 * -errno (-EINVAL for a bad table name or setting, no endpoint nor region) after logging
 * why. */
int sink_new(uv_loop_t *loop, struct store *store, const struct sink_config *cfg,
             const struct awsconf *aws, sink_settled_cb settled, void *settled_arg,
             struct sink **out);

/* True when DynamoDB is the sink (entries are sent); false for the embedded default. */
bool sink_remote(const struct sink *s);

/* A message version to send. The caller has written the spool row (store_spool_put) and
 * committed it: an entry may go out on the next pump (sink_kick, a completion or the
 * timer), so enqueue after the commit, then call sink_kick. Idempotent: a known key keeps
 * the larger version (one in flight is followed by the newer one). conv and sk are copied.
 * 0, -EINVAL (empty or over-long key, version 0), -ENOTSUP (local sink), -ESHUTDOWN
 * (sink_close was called; the spool row is sent by the next start) or -ENOMEM. */
int sink_enqueue(struct sink *s, const char *conv, size_t conv_len, const char *sk,
                 uint32_t version, int64_t enqueued_ms);
/* Starts sending what is ready (called after each store commit). Accepts NULL. */
void sink_kick(struct sink *s);

/* A commit failed: spool rows the sink may no longer hold are what it recorded there (a
 * confirmation, a dead letter: the spool row stays). The sink also notes its own failed
 * recordings. sink_resync then reads the spool again, and has the rows of the writes it
 * waits to look at again (repair_add in sink.c) written anew on the next loop turn, since
 * the failed commit may have held some. Accepts NULL. */
void sink_lost(struct sink *s);
/* Only a row the caller could not enqueue (out of memory): the spool is read again as
 * above; no commit failed. Accepts NULL. */
void sink_lost_row(struct sink *s);
/* Call when the store can be written (after a commit that succeeded, or while no commit
 * fails): if the sink lost rows, reads the spool again and enqueues every row (idempotent:
 * rows it holds keep their state; those it lost are sent again, which DynamoDB takes as the
 * same write). The read runs on the loop in slices of about 2 ms, one a loop turn, so that
 * a large spool holds neither the loop nor the store's writer for long; a new read starts
 * at most once a second and at most 1/50 of the time. 0 (nothing lost, or read again), 1
 * (lost: under way, or read later), -EIO (the read failed: tried again at a later call).
 * Accepts NULL. */
int sink_resync(struct sink *s);
/* Rows came back into the spool by other means (retry_dead_letters): the spool is read
 * again as by sink_resync, starting now whatever the last read cost (after the one under
 * way, if any). Accepts NULL. */
void sink_reread(struct sink *s);
/* The spool's rows and bytes as the daemon's start counted them (store_spool_stats, which
 * took took_ms). The statistics count the bytes again at most once a second and 1/50 of
 * the time: a spool of up to 8192 rows at once (and at the first stats, if it was that
 * small at start); a larger one in the background, in slices of the loop's time, the last
 * count standing meanwhile (this one, first, also for a spool that grew large before the
 * first stats). Accepts NULL. */
/* Queues the repairs the store holds from before this start (sink.c, repair_add): writes
 * that got no clear answer, looked at again when due. 0, or -errno (logged by the store). */
int sink_load_repairs(struct sink *s);
void sink_spool_counted(struct sink *s, uint64_t items, uint64_t bytes, uint64_t took_ms);

/* Entries of that conversation not yet confirmed or dead-lettered (0 for a local sink). */
size_t sink_pending(const struct sink *s, const char *conv, size_t conv_len);
/* Spool entries in memory at or over spool_max_items: mutating requests get unavailable.
 * The limit is for the daemon to check; sink_enqueue still takes what is spooled. */
bool sink_full(const struct sink *s);
/* Entries not yet confirmed, over every conversation. */
size_t sink_depth(const struct sink *s);

/* The "spool" and "sink" objects of the stats result (see proto/protocol.md):
 *   spool {items, bytes, oldest_pending_ms (null when empty)}: items and age from memory,
 *     bytes from store_spool_stats, rescanned at most once a second (and at most 2% of the
 *     time when the scan is slow);
 *   sink {kind ("dynamodb" or "local"), writes_sent, confirmed, retried, failures,
 *     dead_lettered, unprocessed, resent, last_error, latency_ms {p50, p99, p999} over the last
 *     4096 calls (null before the first), inflight (BatchWriteItem calls)}; all 0/null for
 *     a local sink. New references, NULL on ENOMEM. */
json_t *sink_stats_spool(struct sink *s);
json_t *sink_stats_sink(struct sink *s);

/* Rereads the AWS settings (credentials) and uses them for the next requests (awsconf_load;
 * blocking reads of the small credentials and config files). 0 (also for a local sink),
 * -ENOKEY (no credentials found) or another -errno of awsconf_load; the old ones stay. */
int sink_reload_credentials(struct sink *s);

/* Applies the settings a reload may change: retry_base_ms, retry_max_ms, batch_items,
 * spool_max_items and expires_days of cfg (the others are fixed at sink_new and ignored).
 * Entries already waiting keep the delay they drew; new backoffs and batches follow the new
 * caps. 0 (also for NULL s), or -EINVAL (out of range, as for sink_new) changing nothing. */
int sink_reconfigure(struct sink *s, const struct sink_config *cfg);

/* Restoring a conversation from DynamoDB: Query on the partition, every page, then
 * cb(arg, 0, items) with the items as a JSON array (borrowed during the callback) in sort-key
 * order, or cb(arg, -errno, NULL) on failure: -EIO or -ETIMEDOUT (still failing after 4
 * retries, or an unreadable answer), -EACCES (credentials), -EINVAL (refused for good),
 * -EFBIG (over 4 Mi items), -ECANCELED (the sink closed). cb always runs on a later loop
 * turn, exactly once when this returns 0. 0, -EINVAL, -ENOTSUP (local sink), -ESHUTDOWN
 * (closing) or -ENOMEM. */
typedef void (*sink_query_cb)(void *arg, int status, const json_t *items);
int sink_query(struct sink *s, const char *conv, size_t conv_len, sink_query_cb cb, void *arg);

/* Stops: keeps sending for up to deadline_ms while entries remain (nothing new is taken),
 * then cancels what is in flight (it stays in the spool for the next start), ends pending
 * queries and table creation with -ECANCELED, closes every handle and calls on_closed(arg)
 * from a close callback after freeing s. A second call with deadline_ms 0 ends a drain in
 * progress at once (its other arguments are ignored); any other second call does nothing.
 * Accepts NULL (then on_closed is not called). */
void sink_close(struct sink *s, uint64_t deadline_ms, void (*on_closed)(void *arg), void *arg);

/* Creates the table (CreateTable, on-demand) and waits until it is ACTIVE (DescribeTable
 * every 100 ms, up to 60 s); for development setups (`convod --create-table`). Then
 * done(arg, status) on a later turn: 0, -EEXIST (already there, which is fine; it was waited
 * for too), -ETIMEDOUT or -errno as for sink_query. Returns 0 when started, -EINVAL,
 * -ENOTSUP (local sink), -ESHUTDOWN or -ENOMEM. */
int sink_create_table(struct sink *s, void (*done)(void *arg, int status), void *arg);

#endif
