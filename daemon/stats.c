/* Counters for the `stats` op. */
#include "stats.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buf.h"

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
	json_t *by_op = json_object(), *by_code = json_object(), *time_by_op = json_object();

	for (int i = 0; i < OP_COUNT; i++) {
		json_object_set_new(by_op, ops_name((enum op)i),
		                    json_integer((json_int_t)s->requests_by_op[i]));
		json_object_set_new(time_by_op, ops_name((enum op)i),
		                    json_integer((json_int_t)s->time_ns_by_op[i]));
	}
	for (int i = ERR_PARSE_ERROR; i <= ERR_INTERNAL; i++)
		json_object_set_new(by_code, error_code_str((enum error_code)i),
		                    json_integer((json_int_t)s->errors_by_code[i]));
	return json_pack(
	    "{s:s, s:I, s:{s:I, s:I, s:I, s:I}, s:I, s:I, s:{s:I, s:o, s:o}, s:{s:I, s:o},"
	    " s:I, s:{s:I, s:I, s:n}, s:{s:s, s:I, s:I, s:I, s:I, s:I, s:n, s:{s:n, s:n, s:n}}}",
	    "version", CONVOD_VERSION, "uptime_ms", (json_int_t)(now_ms - s->started_ms),
	    "connections", "current", (json_int_t)s->connections_current, "accepted",
	    (json_int_t)s->connections_accepted, "refused", (json_int_t)s->connections_refused,
	    "denied", (json_int_t)s->connections_denied,
	    "conversations", (json_int_t)s->conversations, "messages", (json_int_t)s->messages,
	    "requests", "total", (json_int_t)s->requests_total, "by_op", by_op, "time_ns_by_op",
	    time_by_op, "errors", "total",
	    (json_int_t)s->errors_total, "by_code", by_code, "flushed", (json_int_t)s->flushed,
	    "spool", "items", (json_int_t)0, "bytes", (json_int_t)0, "oldest_pending_ms", "sink",
	    "kind", "none", "writes_sent", (json_int_t)0, "confirmed", (json_int_t)0, "retried",
	    (json_int_t)0, "dead_lettered", (json_int_t)0, "failures", (json_int_t)0, "last_error",
	    "latency_ms", "p50", "p99", "p999");
}

/* Counters only grow; everything else is a gauge. */
static bool prom_is_counter(const char *name)
{
	static const char *const counters[] = {
	    "convod_connections_accepted",
	    "convod_connections_refused",
	    "convod_connections_denied",
	    "convod_requests_total",
	    "convod_errors_total",
	    "convod_requests_by_op_total",
	    "convod_requests_time_ns_by_op_total",
	    "convod_errors_by_code_total",
	    "convod_flushed",
	    "convod_sink_writes_sent",
	    "convod_sink_confirmed",
	    "convod_sink_retried",
	    "convod_sink_failures",
	    "convod_sink_dead_lettered",
	    "convod_sink_unprocessed",
	};
	for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++)
		if (strcmp(name, counters[i]) == 0)
			return true;
	return false;
}

static void prom_sample(struct buf *b, const char *name, const char *labels, const json_t *v)
{
	char line[512];
	int n;

	if (json_is_integer(v))
		n = snprintf(line, sizeof(line), "%s%s %lld\n", name, labels,
		             (long long)json_integer_value(v));
	else if (json_is_real(v))
		n = snprintf(line, sizeof(line), "%s%s %.17g\n", name, labels, json_real_value(v));
	else
		return;
	if (n > 0 && (size_t)n < sizeof(line))
		buf_append(b, line, (size_t)n);
}

static void prom_head(struct buf *b, const char *name)
{
	char line[256];
	int n = snprintf(line, sizeof(line), "# TYPE %s %s\n", name,
	                 prom_is_counter(name) ? "counter" : "gauge");
	if (n > 0 && (size_t)n < sizeof(line))
		buf_append(b, line, (size_t)n);
}

/* A map of name -> number becomes one metric with a label per key. */
static void prom_labelled(struct buf *b, const char *name, const char *label, const json_t *obj)
{
	const char *key;
	json_t *v;

	prom_head(b, name);
	json_object_foreach((json_t *)obj, key, v)
	{
		char labels[160];
		snprintf(labels, sizeof(labels), "{%s=\"%s\"}", label, key);
		prom_sample(b, name, labels, v);
	}
}

static void prom_walk(struct buf *b, const char *prefix, const json_t *obj)
{
	const char *key;
	json_t *v;

	json_object_foreach((json_t *)obj, key, v)
	{
		char name[160];
		snprintf(name, sizeof(name), "%s_%s", prefix, key);
		if (strcmp(name, "convod_requests_by_op") == 0) {
			prom_labelled(b, "convod_requests_by_op_total", "op", v);
		} else if (strcmp(name, "convod_requests_time_ns_by_op") == 0) {
			prom_labelled(b, "convod_requests_time_ns_by_op_total", "op", v);
		} else if (strcmp(name, "convod_errors_by_code") == 0) {
			prom_labelled(b, "convod_errors_by_code_total", "code", v);
		} else if (strcmp(name, "convod_sink_latency_ms") == 0) {
			static const char *const q[][2] = {
			    {"p50", "0.5"}, {"p99", "0.99"}, {"p999", "0.999"}};
			prom_head(b, name);
			for (size_t i = 0; i < 3; i++) {
				char labels[40];
				snprintf(labels, sizeof(labels), "{quantile=\"%s\"}", q[i][1]);
				prom_sample(b, name, labels, json_object_get(v, q[i][0]));
			}
		} else if (json_is_object(v)) {
			prom_walk(b, name, v);
		} else if (json_is_number(v)) {
			prom_head(b, name);
			prom_sample(b, name, "", v);
		}
	}
}

char *stats_prometheus(const json_t *stats)
{
	struct buf b = {NULL, 0, 0};
	const json_t *version = json_object_get(stats, "version");
	const json_t *kind = json_object_get(json_object_get(stats, "sink"), "kind");
	char line[256];
	size_t len;
	int n;

	n = snprintf(line, sizeof(line),
	             "# TYPE convod_info gauge\nconvod_info{version=\"%s\",sink=\"%s\"} 1\n",
	             json_is_string(version) ? json_string_value(version) : "",
	             json_is_string(kind) ? json_string_value(kind) : "");
	if (n > 0 && (size_t)n < sizeof(line))
		buf_append(&b, line, (size_t)n);
	prom_walk(&b, "convod", stats);
	if (buf_append(&b, "", 1) < 0) {
		buf_free(&b);
		return NULL;
	}
	return buf_steal(&b, &len);
}
