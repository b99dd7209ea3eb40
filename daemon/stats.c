/* Counters for the `stats` op. */
#include "stats.h"

void stats_request(struct stats *s, enum op op, enum error_code code)
{
	s->requests_total++;
	if (op < OP_COUNT)
		s->requests_by_op[op]++;
	if (code != ERR_OK && code <= ERR_INTERNAL) {
		s->errors_total++;
		s->errors_by_code[code]++;
	}
}

json_t *stats_to_json(const struct stats *s, uint64_t now_ms)
{
	json_t *by_op = json_object(), *by_code = json_object();

	for (int i = 0; i < OP_COUNT; i++)
		json_object_set_new(by_op, ops_name((enum op)i),
				    json_integer((json_int_t)s->requests_by_op[i]));
	for (int i = ERR_PARSE_ERROR; i <= ERR_INTERNAL; i++)
		json_object_set_new(by_code, error_code_str((enum error_code)i),
				    json_integer((json_int_t)s->errors_by_code[i]));
	return json_pack(
		"{s:s, s:I, s:{s:I, s:I, s:I}, s:I, s:I, s:{s:I, s:o}, s:{s:I, s:o},"
		" s:I, s:{s:I, s:I, s:n}, s:{s:s, s:I, s:I, s:I, s:I, s:I, s:n, s:{s:n, s:n, s:n}}}",
		"version", CONVOD_VERSION, "uptime_ms", (json_int_t)(now_ms - s->started_ms),
		"connections", "current", (json_int_t)s->connections_current, "accepted",
		(json_int_t)s->connections_accepted, "refused", (json_int_t)s->connections_refused,
		"conversations", (json_int_t)s->conversations, "messages", (json_int_t)s->messages,
		"requests", "total", (json_int_t)s->requests_total, "by_op", by_op, "errors",
		"total", (json_int_t)s->errors_total, "by_code", by_code, "flushed",
		(json_int_t)s->flushed, "spool", "items",
		(json_int_t)0, "bytes", (json_int_t)0, "oldest_pending_ms", "sink", "kind", "none",
		"writes_sent", (json_int_t)0, "confirmed", (json_int_t)0, "retried",
		(json_int_t)0, "dead_lettered", (json_int_t)0, "failures", (json_int_t)0,
		"last_error", "latency_ms", "p50", "p99", "p999");
}
