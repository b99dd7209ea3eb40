/* Counters the daemon exposes through the `stats` op. */
#ifndef CONVOD_STATS_H
#define CONVOD_STATS_H

#include <jansson.h>
#include <stdint.h>

#include "error.h"
#include "ops.h"

struct stats {
	uint64_t started_mono_ms; /* the monotonic clock (mono_ns) at the start, in ms: uptime
	                           * does not move when the wall clock is set */
	uint64_t connections_current;
	uint64_t connections_accepted;
	uint64_t connections_refused;
	uint64_t connections_denied; /* refused by the uid/gid allow-list */
	uint64_t requests_total;
	uint64_t requests_by_op[OP_COUNT];
	uint64_t time_ns_by_op[OP_COUNT]; /* daemon time from a line to its queued answer */
	uint64_t errors_total;
	uint64_t errors_by_code[ERR_INTERNAL + 1];
	uint64_t errors_by_op[OP_COUNT];
	uint64_t messages;        /* messages in memory, over every conversation */
	uint64_t conversations;   /* conversations in memory */
	uint64_t flushed;         /* messages handed to the sink */
	uint64_t flushes_early;   /* flush ticks run before their interval: enough was pending */
};

/* Counts one answered request: op (OP_UNKNOWN for unreadable lines) and its code. */
void stats_request(struct stats *s, enum op op, enum error_code code);

/* Counts an error of op with code (nothing for ERR_OK), not a request: stats_request's
 * error part, and on its own for an answer that a failed commit turned into an error after
 * its request was counted. */
void stats_error(struct stats *s, enum op op, enum error_code code);

/* The `stats` result object (see proto/protocol.md for the names); now_mono_ms is
 * mono_ns() in ms. New reference. */
json_t *stats_to_json(const struct stats *s, uint64_t now_mono_ms);

/* The stats object (as built for the `stats` op, spool and sink included) in Prometheus'
 * text exposition format, metric names prefixed "convod_". Newly allocated (free()), NULL
 * on ENOMEM. */
char *stats_prometheus(const json_t *stats);

#endif
