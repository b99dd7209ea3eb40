/* Request dispatch: envelope checks in protocol order, conversation lookup, op, answer. */
#include "dispatch.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "log.h"
#include "ops.h"

int64_t dispatch_now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int dispatch_init(struct dispatch *d, const struct config *cfg)
{
	uint8_t seed[48];
	size_t got = 0;

	memset(d, 0, sizeof(*d));
	d->cfg = cfg;
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
	d->stats.started_ms = (uint64_t)dispatch_now_ms();
	return 0;
}

void dispatch_free(struct dispatch *d)
{
	registry_free(&d->reg);
}

int dispatch_commit(struct dispatch *d)
{
	d->changed = false;
	return 0;
}

/* Writes {"id":ID,"ok":false,"error":{...}}; id may be NULL (left out). */
static void answer_error(struct dispatch *d, struct buf *out, const json_t *id, enum op op,
			 const struct error *err)
{
	json_t *e = json_pack("{s:{s:s, s:s}}", "error", "code", error_code_str(err->code),
			      "message", err->message);
	size_t mark = out->len;

	stats_request(&d->stats, op, err->code);
	if (!e)
		goto oom;
	if (buf_append(out, "{", 1) < 0)
		goto oom;
	if (id && (buf_append(out, "\"id\":", 5) < 0 || buf_append_json(out, id) < 0 ||
		   buf_append(out, ",", 1) < 0))
		goto oom;
	if (buf_append(out, "\"ok\":false,", 11) < 0)
		goto oom;
	/* The error object's text without its outer braces. */
	{
		size_t before = out->len;
		if (buf_append_json(out, e) < 0)
			goto oom;
		memmove(out->data + before, out->data + before + 1, out->len - before - 1);
		out->len -= 1;
		if (buf_append(out, "\n", 1) < 0)
			goto oom;
	}
	json_decref(e);
	return;
oom:
	json_decref(e);
	out->len = mark;
	{
		static const char fixed[] =
			"{\"ok\":false,\"error\":{\"code\":\"internal\",\"message\":\"out of memory\"}}\n";
		buf_append(out, fixed, sizeof(fixed) - 1);
	}
}

/* Writes {"id":ID,"ok":true,"result":RESULT}; takes the reference to result. */
static void answer_ok(struct dispatch *d, struct buf *out, const json_t *id, enum op op,
		      json_t *result)
{
	size_t mark = out->len;
	struct error err;

	if (!result)
		goto oom;
	if (buf_append(out, "{", 1) < 0)
		goto oom;
	if (id && (buf_append(out, "\"id\":", 5) < 0 || buf_append_json(out, id) < 0 ||
		   buf_append(out, ",", 1) < 0))
		goto oom;
	if (buf_append(out, "\"ok\":true,\"result\":", 19) < 0 || buf_append_json(out, result) < 0 ||
	    buf_append(out, "}\n", 2) < 0)
		goto oom;
	json_decref(result);
	stats_request(&d->stats, op, ERR_OK);
	return;
oom:
	json_decref(result);
	out->len = mark;
	error_set(&err, ERR_INTERNAL, "out of memory while writing the answer");
	answer_error(d, out, id, op, &err);
}

void dispatch_too_large_line(struct dispatch *d, struct buf *out)
{
	struct error err;
	error_set(&err, ERR_TOO_LARGE, "request line longer than %zu bytes; discarded",
		  d->cfg->max_line_bytes);
	answer_error(d, out, NULL, OP_UNKNOWN, &err);
}

static bool is_blank(const char *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r' && p[i] != '\n')
			return false;
	return true;
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

static void sink_take_noop(void *arg, const struct message *m, size_t index)
{
	(void)arg;
	(void)m;
	(void)index;
}

/* Hands everything pending of c, last message included, to the sink. */
static size_t flush_one(struct dispatch *d, struct convo *c)
{
	size_t n = convo_take(c, CONSUMER_SINK, false, sink_take_noop, NULL);
	d->stats.flushed += n;
	return n;
}

struct flush_all_ctx {
	struct dispatch *d;
	size_t n;
};

static void flush_each(void *arg, struct convo *c)
{
	struct flush_all_ctx *ctx = arg;
	ctx->n += flush_one(ctx->d, c);
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
		json_t *item = json_pack("{s:s%, s:I, s:I}", "conversation", c->id, c->id_len,
					 "messages", (json_int_t)c->nlog, "updated",
					 (json_int_t)c->updated_ms);
		if (!item || json_array_append_new(arr, item) < 0)
			goto out;
	}
	res = json_pack("{s:O}", "conversations", arr);
out:
	free(ctx.v);
	json_decref(arr);
	return res;
}

void dispatch_line(struct dispatch *d, const char *line, size_t len, struct buf *out)
{
	json_t *req = NULL, *result = NULL;
	const json_t *id = NULL, *opv;
	json_error_t jerr;
	struct error err = {ERR_OK, ""}, err2 = {ERR_OK, ""};
	enum op op = OP_UNKNOWN;
	const char *cid = NULL;
	size_t cid_len = 0;
	struct convo *c = NULL;
	bool created = false, changed = false;
	enum error_code code, code2;
	struct convo_env env;

	if (is_blank(line, len))
		return;
	req = json_loadb(line, len, JSON_ALLOW_NUL, &jerr);
	if (!req) {
		error_set(&err, ERR_PARSE_ERROR, "invalid JSON at column %d: %s", jerr.column,
			  jerr.text);
		goto fail;
	}
	if (!json_is_object(req)) {
		error_set(&err, ERR_PARSE_ERROR, "expected a JSON object");
		goto fail;
	}
	id = json_object_get(req, "id");

	/* Protocol order: too_large, unknown_op, bad_request, not_found, ... */
	opv = json_object_get(req, "op");
	if (opv && json_is_string(opv))
		op = ops_lookup(json_string_value(opv));
	code = check_conversation(d, req, ops_needs_conversation(op), &cid, &cid_len, &err);
	if (code == ERR_TOO_LARGE)
		goto fail;
	if (!opv || !json_is_string(opv)) {
		error_set(&err, ERR_BAD_REQUEST, "op: required string");
		goto fail;
	}
	if (op == OP_UNKNOWN) {
		error_set(&err, ERR_UNKNOWN_OP, "op: no such operation '%s'",
			  json_string_value(opv));
		goto fail;
	}
	code2 = ops_check(op, req, &err2);
	if (code2 != ERR_OK && (code == ERR_OK || code2 < code)) {
		err = err2;
		code = code2;
	}
	if (code != ERR_OK)
		goto fail;

	switch (op) {
	case OP_PING:
		result = json_pack("{s:b, s:s, s:i}", "pong", 1, "version", CONVOD_VERSION,
				   "protocol", 1);
		goto ok;
	case OP_STATS:
		d->stats.conversations = d->reg.count;
		d->stats.messages = 0;
		registry_each(&d->reg, count_messages, &d->stats.messages);
		result = stats_to_json(&d->stats, (uint64_t)dispatch_now_ms());
		goto ok;
	case OP_LIST:
		result = list_result(d);
		goto ok;
	case OP_FLUSH:
		if (!cid) {
			struct flush_all_ctx ctx = {d, 0};
			registry_each(&d->reg, flush_each, &ctx);
			result = json_pack("{s:I}", "flushed", (json_int_t)ctx.n);
			goto ok;
		}
		break;
	default:
		break;
	}

	c = registry_get(&d->reg, cid, cid_len);
	if (!c) {
		if (!ops_creates(op)) {
			error_set(&err, ERR_NOT_FOUND, "conversation: no conversation '%.*s'",
				  (int)(cid_len > 64 ? 64 : cid_len), cid);
			goto fail;
		}
		if (d->reg.count >= d->cfg->max_conversations) {
			error_set(&err, ERR_UNAVAILABLE,
				  "too many conversations in memory (limit %zu); retry later",
				  d->cfg->max_conversations);
			goto fail;
		}
		c = convo_new(cid, cid_len);
		if (!c) {
			error_set(&err, ERR_INTERNAL, "out of memory");
			goto fail;
		}
		created = true;
	}

	if (op == OP_FLUSH || op == OP_CLOSE) {
		size_t n = flush_one(d, c);
		if (op == OP_CLOSE) {
			/* Memory only: nothing else holds it, so it is gone for good. */
			convo_free(registry_take(&d->reg, cid, cid_len));
			c = NULL;
			d->changed = true;
		}
		result = json_pack("{s:I}", "flushed", (json_int_t)n);
		goto ok;
	}

	env.ulid = &d->ulid;
	env.now_ms = dispatch_now_ms();
	env.limits.max_messages = d->cfg->max_messages;
	env.limits.max_bytes = d->cfg->max_conversation_bytes;
	code = ops_run(op, c, &env, req, &result, &changed, &err);
	if (code != ERR_OK) {
		if (created)
			convo_free(c);
		c = NULL;
		goto fail;
	}
	if (created && registry_put(&d->reg, c) < 0) {
		convo_free(c);
		json_decref(result);
		result = NULL;
		error_set(&err, ERR_INTERNAL, "out of memory");
		goto fail;
	}
	if (changed)
		d->changed = true;
ok:
	answer_ok(d, out, id, op, result);
	json_decref(req);
	return;
fail:
	if (err.code == ERR_INTERNAL)
		log_msg(LOG_ERROR, "dispatch", "internal error: %s", err.message);
	answer_error(d, out, id, op, &err);
	json_decref(req);
}
