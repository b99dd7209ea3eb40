/* Counters for the `stats` op. */
#include "stats.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buf.h"

void stats_request(struct stats *s, enum op op, enum error_code code)
{
	s->requests_total++;
	if (op < OP_COUNT)
		s->requests_by_op[op]++;
	stats_error(s, op, code);
}

void stats_error(struct stats *s, enum op op, enum error_code code)
{
	if (code == ERR_OK || code > ERR_INTERNAL)
		return;
	s->errors_total++;
	s->errors_by_code[code]++;
	if (op < OP_COUNT)
		s->errors_by_op[op]++;
}

/* Sets key to v (taken) in o; false when o is NULL or the set failed. */
static bool put(json_t *o, const char *key, json_t *v)
{
	if (!o || !v) {
		json_decref(v);
		return false;
	}
	return json_object_set_new_nocheck(o, key, v) == 0;
}

static bool put_int(json_t *o, const char *key, uint64_t v)
{
	return put(o, key, json_integer((json_int_t)v));
}

json_t *stats_to_json(const struct stats *s, uint64_t now_mono_ms)
{
	json_t *res = json_object(), *by_op = json_object(), *by_code = json_object(),
	       *errs_by_op = json_object(), *time_by_op = json_object(), *conns = json_object(),
	       *reqs = json_object(), *errs = json_object(), *spool = json_object(),
	       *sink = json_object(), *lat = json_object();
	bool ok = res && by_op && by_code && errs_by_op && time_by_op && conns && reqs && errs &&
	          spool && sink && lat;

	for (int i = 0; ok && i < OP_COUNT; i++)
		ok = put_int(by_op, ops_name((enum op)i), s->requests_by_op[i]) &&
		     put_int(time_by_op, ops_name((enum op)i), s->time_ns_by_op[i]) &&
		     put_int(errs_by_op, ops_name((enum op)i), s->errors_by_op[i]);
	for (int i = ERR_PARSE_ERROR; ok && i <= ERR_INTERNAL; i++)
		ok = put_int(by_code, error_code_str((enum error_code)i), s->errors_by_code[i]);
	ok = ok && put_int(conns, "current", s->connections_current) &&
	     put_int(conns, "accepted", s->connections_accepted) &&
	     put_int(conns, "refused", s->connections_refused) &&
	     put_int(conns, "denied", s->connections_denied) &&
	     put_int(reqs, "total", s->requests_total) && put(reqs, "by_op", json_incref(by_op)) &&
	     put(reqs, "time_ns_by_op", json_incref(time_by_op)) &&
	     put_int(errs, "total", s->errors_total) &&
	     put(errs, "by_code", json_incref(by_code)) &&
	     put(errs, "by_op", json_incref(errs_by_op)) && put_int(spool, "items", 0) &&
	     put_int(spool, "bytes", 0) && put(spool, "oldest_pending_ms", json_null()) &&
	     put(sink, "kind", json_string("none")) && put_int(sink, "writes_sent", 0) &&
	     put_int(sink, "confirmed", 0) && put_int(sink, "retried", 0) &&
	     put_int(sink, "dead_lettered", 0) && put_int(sink, "failures", 0) &&
	     put_int(sink, "unprocessed", 0) && put_int(sink, "resent", 0) &&
	     put_int(sink, "repaired", 0) && put_int(sink, "repairs_waiting", 0) &&
	     put_int(sink, "repairs_dropped", 0) && put_int(sink, "answers_damaged", 0) &&
	     put_int(sink, "inflight", 0) && put(sink, "last_error", json_null()) &&
	     put(lat, "p50", json_null()) && put(lat, "p99", json_null()) &&
	     put(lat, "p999", json_null()) && put(sink, "latency_ms", json_incref(lat)) &&
	     put(res, "version", json_string(CONVOD_VERSION)) &&
	     put_int(res, "uptime_ms", now_mono_ms - s->started_mono_ms) &&
	     put(res, "connections", json_incref(conns)) &&
	     put_int(res, "conversations", s->conversations) &&
	     put_int(res, "messages", s->messages) && put(res, "requests", json_incref(reqs)) &&
	     put(res, "errors", json_incref(errs)) && put_int(res, "flushed", s->flushed) &&
	     put_int(res, "flushes_early", s->flushes_early) &&
	     put(res, "spool", json_incref(spool)) && put(res, "sink", json_incref(sink));
	json_decref(by_op);
	json_decref(by_code);
	json_decref(errs_by_op);
	json_decref(time_by_op);
	json_decref(conns);
	json_decref(reqs);
	json_decref(errs);
	json_decref(spool);
	json_decref(sink);
	json_decref(lat);
	if (!ok) {
		json_decref(res);
		return NULL;
	}
	return res;
}

/* The text being built, and whether any of it could not be added. */
struct pbuf {
	struct buf b;
	bool oom;
};

static void pbuf_put(struct pbuf *b, const char *p, size_t n)
{
	if (!b->oom && buf_append(&b->b, p, n) < 0)
		b->oom = true;
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
	    "convod_errors_by_op_total",
	    "convod_flushed",
	    "convod_flushes_early",
	    "convod_sink_writes_sent",
	    "convod_sink_confirmed",
	    "convod_sink_retried",
	    "convod_sink_failures",
	    "convod_sink_dead_lettered",
	    "convod_sink_unprocessed",
	    "convod_sink_resent",
	    "convod_sink_repaired",
	    "convod_sink_repairs_dropped",
	    "convod_sink_answers_damaged",
	    "convod_store_commits",
	    "convod_store_turns",
	    "convod_store_inline_commits",
	    "convod_store_records",
	    "convod_store_commit_ns",
	    "convod_store_fold_cycles",
	    "convod_store_fold_segments",
	    "convod_store_fold_records",
	    "convod_store_fold_ns",
	    "convod_store_cohort_waits",
	    "convod_store_cohort_short",
	    "convod_store_cohort_ns",
	    "convod_store_checkpoints",
	    "convod_store_catch_ups",
	    "convod_store_bound_waits",
	    "convod_store_checkpoint_ns",
	    "convod_store_wal_writebacks",
	    "convod_store_wal_syncs",
	    "convod_store_db_syncs",
	    "convod_store_commits_spoiled",
	    "convod_store_spoils_failed",
	    "convod_store_retry_moves",
	    "convod_store_retry_moved",
	    "convod_store_retry_parts",
	    "convod_store_retry_pauses",
	    "convod_store_retry_ns",
	};
	for (size_t i = 0; i < sizeof(counters) / sizeof(counters[0]); i++)
		if (strcmp(name, counters[i]) == 0)
			return true;
	return false;
}

static void prom_sample(struct pbuf *b, const char *name, const char *labels, const json_t *v)
{
	char line[512];
	int n;

	if (json_is_integer(v))
		n = snprintf(line, sizeof(line), "%s%s %lld\n", name, labels,
		             (long long)json_integer_value(v));
	else if (json_is_real(v))
		n = snprintf(line, sizeof(line), "%s%s %.17g\n", name, labels, json_real_value(v));
	else if (json_is_boolean(v)) /* a gauge of 1 or 0 */
		n = snprintf(line, sizeof(line), "%s%s %d\n", name, labels, json_is_true(v));
	else
		return;
	if (n > 0 && (size_t)n < sizeof(line))
		pbuf_put(b, line, (size_t)n);
}

static void prom_head(struct pbuf *b, const char *name)
{
	char line[256];
	int n = snprintf(line, sizeof(line), "# TYPE %s %s\n", name,
	                 prom_is_counter(name) ? "counter" : "gauge");
	if (n > 0 && (size_t)n < sizeof(line))
		pbuf_put(b, line, (size_t)n);
}

/* A map of name -> number becomes one metric with a label per key. */
static void prom_labelled(struct pbuf *b, const char *name, const char *label, const json_t *obj)
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

static void prom_walk(struct pbuf *b, const char *prefix, const json_t *obj)
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
		} else if (strcmp(name, "convod_errors_by_op") == 0) {
			prom_labelled(b, "convod_errors_by_op_total", "op", v);
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
		} else if (json_is_number(v) || json_is_boolean(v)) {
			prom_head(b, name);
			prom_sample(b, name, "", v);
		}
	}
}

char *stats_prometheus(const json_t *stats)
{
	struct pbuf b = {{NULL, 0, 0}, false};
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
		pbuf_put(&b, line, (size_t)n);
	prom_walk(&b, "convod", stats);
	pbuf_put(&b, "", 1);
	if (b.oom) {
		buf_free(&b.b);
		return NULL;
	}
	return buf_steal(&b.b, &len);
}
