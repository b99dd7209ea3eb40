/* DynamoDB over HTTP on the libuv loop: curl's multi interface tells us which sockets to
 * watch (one uv_poll each) and when to wake it (one uv_timer); we feed the events back with
 * curl_multi_socket_action and hand finished transfers to their callbacks. Easy handles are
 * kept in a small pool; connections stay in the multi handle's cache between requests. */
#include "ddbclient.h"

#include <curl/curl.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "crc32.h"
#include "sigv4.h"

#ifndef CONVOD_VERSION
#define CONVOD_VERSION "0"
#endif

#define CONTENT_TYPE "application/x-amz-json-1.0"
#define TARGET_PREFIX "DynamoDB_20120810."
#define SERVICE "dynamodb"
#define POOL_MIN 8
#define KEEP_BUFFER_BYTES 65536 /* a pooled request keeps at most this much of its buffers */
#define SOCK_SPARES(max_conns) ((size_t)(max_conns) + 2) /* and a connection being replaced */

struct request {
	struct ddbclient *client;
	CURL *easy;
	struct curl_slist *headers;
	char *body; /* what curl sends; ours until the transfer is removed */
	size_t body_len, body_cap;
	char *resp; /* the answer, always NUL-terminated when non-NULL */
	size_t resp_len, resp_cap;
	bool resp_too_large;
	bool has_crc32; /* the answer carried x-amz-crc32 (a number) */
	bool crc32_twice; /* and another, different one: it cannot match both */
	uint32_t crc32;   /* the value */
	uint32_t resp_crc32; /* the CRC-32 of resp so far, kept as it comes (on_write) */
	char request_id[DDBCLIENT_REQUEST_ID_MAX + 1];
	char errbuf[CURL_ERROR_SIZE];
	char operation[DDBCLIENT_OPERATION_MAX + 1];
	ddbclient_cb cb;
	void *arg;
	uint64_t start_ns;
	struct request *next, *prev; /* in flight (doubly linked) or idle (next only) */
};

/* One socket curl wants watched. Freed in its close callback only. */
struct sock {
	uv_poll_t poll;
	curl_socket_t fd;
	struct ddbclient *client;
	struct sock *next, *prev;
	bool closing;
};

struct ddbclient {
	uv_loop_t *loop;
	CURLM *multi;
	uv_timer_t timer;
	char *url, *host, *region;
	char *key_id, *secret, *token; /* token NULL without a session token */
	long connect_timeout_ms, timeout_ms;
	size_t max_inflight, max_request_bytes, max_response_bytes, pool_max;
	bool ignore_crc32;
	struct request *inflight;
	size_t ninflight;
	struct request *idle;
	size_t nidle;
	struct sock *socks;
	/* Closed socks kept for the next sockets, SOCK_SPARES of them allocated up front: a
	 * failed allocation in on_curl_socket makes libcurl 7.88 abort every transfer, and
	 * some then never end or crash it (test_sink.py's allocation test found both). */
	struct sock *spare_socks;
	size_t handles; /* uv handles not closed yet: the timer and every sock */
	bool closing;
	void (*on_closed)(void *arg);
	void *on_closed_arg;
};

static bool global_ready;

int ddbclient_global_init(void)
{
	if (global_ready)
		return 0;
	if (curl_global_init(CURL_GLOBAL_DEFAULT) != CURLE_OK)
		return -EIO;
	global_ready = true;
	return 0;
}

void ddbclient_global_cleanup(void)
{
	if (!global_ready)
		return;
	curl_global_cleanup();
	global_ready = false;
}

void ddbclient_options_defaults(struct ddbclient_options *o)
{
	memset(o, 0, sizeof(*o));
	o->connect_timeout_ms = 3000;
	o->timeout_ms = 10000;
	o->max_host_connections = 8;
	o->max_inflight = 256;
	o->max_request_bytes = 16u << 20;
	o->max_response_bytes = 16u << 20;
}

/* free() that first wipes what may be a secret. */
static void free_secret(char *s)
{
	if (s) {
		volatile char *p = s;
		while (*p)
			*p++ = '\0';
	}
	free(s);
}

/* A header value must not break the header block. */
static bool header_safe(const char *s)
{
	return s && s[0] && !strpbrk(s, "\r\n");
}

/* http(s)://authority with nothing after it but an optional "/", since we sign path "/". */
static bool url_valid(const char *url)
{
	const char *a, *end;

	if (!header_safe(url))
		return false;
	if (strncasecmp(url, "https://", 8) == 0)
		a = url + 8;
	else if (strncasecmp(url, "http://", 7) == 0)
		a = url + 7;
	else
		return false;
	end = a + strcspn(a, "/?#");
	return end > a && (end[0] == '\0' || strcmp(end, "/") == 0);
}

/* ---- libuv side ---------------------------------------------------------------------- */

static void socks_free(struct sock *s)
{
	while (s) {
		struct sock *next = s->next;
		free(s);
		s = next;
	}
}

static void client_maybe_closed(struct ddbclient *c)
{
	void (*cb)(void *);
	void *arg;

	if (!c->closing || c->handles > 0)
		return;
	cb = c->on_closed;
	arg = c->on_closed_arg;
	socks_free(c->spare_socks);
	free(c->url);
	free(c->host);
	free(c->region);
	free(c->key_id);
	free_secret(c->secret);
	free_secret(c->token);
	free(c);
	if (cb)
		cb(arg);
}

static void on_sock_closed(uv_handle_t *h)
{
	struct sock *s = h->data;
	struct ddbclient *c = s->client;

	if (s->prev)
		s->prev->next = s->next;
	else
		c->socks = s->next;
	if (s->next)
		s->next->prev = s->prev;
	s->next = c->spare_socks;
	c->spare_socks = s;
	c->handles--;
	client_maybe_closed(c);
}

static void sock_close(struct sock *s)
{
	if (s->closing)
		return;
	s->closing = true;
	uv_close((uv_handle_t *)&s->poll, on_sock_closed);
}

static void on_timer_closed(uv_handle_t *h)
{
	struct ddbclient *c = h->data;

	c->handles--;
	client_maybe_closed(c);
}

/* ---- requests ------------------------------------------------------------------------ */

static void request_destroy(struct request *r)
{
	if (!r)
		return;
	if (r->easy)
		curl_easy_cleanup(r->easy);
	curl_slist_free_all(r->headers);
	free(r->body);
	free(r->resp);
	free(r);
}

static size_t on_write(char *data, size_t size, size_t nmemb, void *userp)
{
	struct request *r = userp;
	size_t n = size * nmemb, need;

	if (n > r->client->max_response_bytes - r->resp_len) {
		r->resp_too_large = true;
		return 0; /* aborts the transfer with CURLE_WRITE_ERROR */
	}
	need = r->resp_len + n + 1;
	if (need > r->resp_cap) {
		size_t cap = r->resp_cap ? r->resp_cap : 4096;
		char *p;
		while (cap < need)
			cap *= 2;
		p = realloc(r->resp, cap);
		if (!p)
			return 0;
		r->resp = p;
		r->resp_cap = cap;
	}
	memcpy(r->resp + r->resp_len, data, n);
	r->resp_len += n;
	/* A piece at a time, so that a 1 MB answer does not hold the loop at its end. */
	if (!r->client->ignore_crc32)
		r->resp_crc32 = crc32_update(r->resp_crc32, data, n);
	r->resp[r->resp_len] = '\0';
	return n;
}

/* x-amz-crc32: DynamoDB's CRC-32 of the answer's body, in decimal. Anything else (no
 * digits, more than 32 bits) is no checksum: the answer is taken unchecked. Two different
 * numbers (the header twice) contradict each other: the answer is not believed. */
static void take_crc32(struct request *r, const char *v, size_t len)
{
	uint64_t x = 0;
	size_t i = 0, digits;

	while (i < len && (v[i] == ' ' || v[i] == '\t'))
		i++;
	for (digits = i; i < len && v[i] >= '0' && v[i] <= '9'; i++)
		if ((x = x * 10 + (uint64_t)(v[i] - '0')) > UINT32_MAX)
			return;
	if (i == digits)
		return; /* empty, or the first line of a folded header: no checksum */
	for (; i < len; i++)
		if (v[i] != ' ' && v[i] != '\t' && v[i] != '\r' && v[i] != '\n')
			return;
	if (r->has_crc32 && r->crc32 != (uint32_t)x)
		r->crc32_twice = true;
	r->crc32 = (uint32_t)x;
	r->has_crc32 = true;
}

static size_t on_header(char *data, size_t size, size_t nitems, void *userp)
{
	static const char name[] = "x-amzn-requestid:", crc[] = "x-amz-crc32:";
	struct request *r = userp;
	size_t n = size * nitems, len;
	const char *v;

	if (n >= 5 && memcmp(data, "HTTP/", 5) == 0) {
		/* A new response (after a 100 Continue, say). */
		r->request_id[0] = '\0';
		r->has_crc32 = r->crc32_twice = false;
		return n;
	}
	if (n > sizeof(crc) - 1 && strncasecmp(data, crc, sizeof(crc) - 1) == 0) {
		take_crc32(r, data + sizeof(crc) - 1, n - (sizeof(crc) - 1));
		return n;
	}
	if (n < sizeof(name) - 1 || strncasecmp(data, name, sizeof(name) - 1) != 0)
		return n;
	v = data + sizeof(name) - 1;
	len = n - (sizeof(name) - 1);
	while (len > 0 && (*v == ' ' || *v == '\t')) {
		v++;
		len--;
	}
	while (len > 0 && (v[len - 1] == '\r' || v[len - 1] == '\n' || v[len - 1] == ' ' ||
	                   v[len - 1] == '\t'))
		len--;
	if (len > DDBCLIENT_REQUEST_ID_MAX)
		len = DDBCLIENT_REQUEST_ID_MAX;
	memcpy(r->request_id, v, len);
	r->request_id[len] = '\0';
	return n;
}

/* A request with an easy handle set up with everything that stays the same between
 * requests; NULL on allocation failure. */
static struct request *request_new(struct ddbclient *c)
{
	struct request *r = calloc(1, sizeof(*r));
	CURL *e;
	bool ok;

	if (!r)
		return NULL;
	r->client = c;
	r->easy = e = curl_easy_init();
	if (!e)
		goto fail;
	ok = curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_URL, c->url) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_POST, 1L) == CURLE_OK &&
#if LIBCURL_VERSION_NUM >= 0x075500
	     curl_easy_setopt(e, CURLOPT_PROTOCOLS_STR, "http,https") == CURLE_OK &&
#else
	     curl_easy_setopt(e, CURLOPT_PROTOCOLS, (long)(CURLPROTO_HTTP | CURLPROTO_HTTPS)) ==
	         CURLE_OK &&
#endif
	     curl_easy_setopt(e, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, c->connect_timeout_ms) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, c->timeout_ms) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_USERAGENT, "convod/" CONVOD_VERSION) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_write) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_WRITEDATA, r) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_HEADERDATA, r) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_ERRORBUFFER, r->errbuf) == CURLE_OK &&
	     curl_easy_setopt(e, CURLOPT_PRIVATE, r) == CURLE_OK;
	if (!ok)
		goto fail;
	return r;
fail:
	request_destroy(r);
	return NULL;
}

/* Back to the pool after its callback, or freed when the pool is full or the client is
 * closing. The handle is no longer in the multi. */
static void request_recycle(struct ddbclient *c, struct request *r)
{
	curl_easy_setopt(r->easy, CURLOPT_HTTPHEADER, NULL);
	curl_slist_free_all(r->headers);
	r->headers = NULL;
	if (c->closing || c->nidle >= c->pool_max) {
		request_destroy(r);
		return;
	}
	if (r->resp_cap > KEEP_BUFFER_BYTES) {
		free(r->resp);
		r->resp = NULL;
		r->resp_cap = 0;
	}
	if (r->body_cap > KEEP_BUFFER_BYTES) {
		free(r->body);
		r->body = NULL;
		r->body_cap = 0;
	}
	r->cb = NULL;
	r->arg = NULL;
	r->prev = NULL;
	r->next = c->idle;
	c->idle = r;
	c->nidle++;
}

static void inflight_unlink(struct ddbclient *c, struct request *r)
{
	if (r->prev)
		r->prev->next = r->next;
	else
		c->inflight = r->next;
	if (r->next)
		r->next->prev = r->prev;
	r->next = r->prev = NULL;
	c->ninflight--;
}

/* Runs the callback of a request taken out of the multi and out of the in-flight list,
 * then recycles it. */
static void request_finish(struct ddbclient *c, struct request *r, CURLcode code, bool canceled)
{
	struct ddbclient_result res;
	char toobig[96];
	long status = 0, conns = 0;
	curl_off_t up = 0;

	memset(&res, 0, sizeof(res));
	res.operation = r->operation;
	res.error = "";
	if (canceled) {
		res.canceled = true;
		res.error = "canceled: client closed";
	} else if (code == CURLE_OK) {
		if (curl_easy_getinfo(r->easy, CURLINFO_RESPONSE_CODE, &status) != CURLE_OK ||
		    status <= 0) {
			status = 0;
			res.error = "no HTTP status";
		}
		res.status = status;
	} else if (r->resp_too_large) {
		snprintf(toobig, sizeof(toobig), "response larger than %zu bytes",
		         c->max_response_bytes);
		res.error = toobig;
	} else {
		res.error = r->errbuf[0] ? r->errbuf : curl_easy_strerror(code);
		res.timed_out = code == CURLE_OPERATION_TIMEDOUT;
	}
	if (curl_easy_getinfo(r->easy, CURLINFO_SIZE_UPLOAD_T, &up) == CURLE_OK && up > 0)
		res.uploaded = (uint64_t)up;
	/* The whole body left: the server may have acted on it, answer or not. */
	res.sent = !canceled && (res.status != 0 || res.uploaded >= r->body_len);
	if (res.status != 0 && r->has_crc32 && !c->ignore_crc32 &&
	    (r->crc32_twice || r->resp_crc32 != r->crc32)) {
		/* Damaged on the way (a middlebox, a bad link): what it says cannot be trusted,
		 * so it is as if no answer came (the request left whole), and the caller tries
		 * again as it would after a broken connection. The AWS SDKs do the same. */
		res.status = 0;
		res.damaged = true;
		res.error = "answer damaged on the way: its body does not match x-amz-crc32";
	}
	if (curl_easy_getinfo(r->easy, CURLINFO_NUM_CONNECTS, &conns) == CURLE_OK)
		res.new_connections = conns;
	res.body = r->resp && r->resp_len ? r->resp : "";
	res.body_len = r->resp_len;
	res.request_id = r->request_id;
	res.elapsed_ms = (uv_hrtime() - r->start_ns) / 1000000u;
	r->cb(&res, r->arg);
	request_recycle(c, r);
}

/* Hands every finished transfer to its callback. Stops when a callback closes the client,
 * whose multi handle is gone then. */
static void check_multi_info(struct ddbclient *c)
{
	CURLMsg *msg;
	int left;

	while (!c->closing && (msg = curl_multi_info_read(c->multi, &left))) {
		struct request *r;
		CURLcode code;
		char *priv = NULL;

		if (msg->msg != CURLMSG_DONE)
			continue;
		code = msg->data.result; /* msg dies with the removal below */
		if (curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, &priv) != CURLE_OK ||
		    !priv)
			continue; /* not ours: cannot happen */
		r = (struct request *)(void *)priv;
		curl_multi_remove_handle(c->multi, r->easy);
		inflight_unlink(c, r);
		request_finish(c, r, code, false);
	}
}

static void on_poll(uv_poll_t *h, int status, int events)
{
	struct sock *s = h->data;
	struct ddbclient *c = s->client;
	int flags = 0, running;

	if (status < 0)
		flags = CURL_CSELECT_ERR;
	if (events & UV_READABLE)
		flags |= CURL_CSELECT_IN;
	if (events & UV_WRITABLE)
		flags |= CURL_CSELECT_OUT;
	curl_multi_socket_action(c->multi, s->fd, flags, &running);
	check_multi_info(c);
}

static void on_timer(uv_timer_t *h)
{
	struct ddbclient *c = h->data;
	int running;

	curl_multi_socket_action(c->multi, CURL_SOCKET_TIMEOUT, 0, &running);
	check_multi_info(c);
}

/* CURLMOPT_SOCKETFUNCTION: start, change or stop watching one socket. */
static int on_curl_socket(CURL *easy, curl_socket_t fd, int what, void *userp, void *socketp)
{
	struct ddbclient *c = userp;
	struct sock *s = socketp;
	int events = 0;

	if (what == CURL_POLL_REMOVE) {
		if (s) {
			sock_close(s);
			if (!c->closing)
				curl_multi_assign(c->multi, fd, NULL);
		}
		return 0;
	}
	if (c->closing)
		return -1;
	if (!s) {
		if (c->spare_socks) {
			s = c->spare_socks;
			c->spare_socks = s->next;
			memset(s, 0, sizeof(*s));
		} else if (!(s = calloc(1, sizeof(*s)))) {
			return -1;
		}
		if (uv_poll_init_socket(c->loop, &s->poll, fd) < 0) {
			free(s);
			return -1;
		}
		s->poll.data = s;
		s->fd = fd;
		s->client = c;
		s->next = c->socks;
		if (c->socks)
			c->socks->prev = s;
		c->socks = s;
		c->handles++;
		if (curl_multi_assign(c->multi, fd, s) != CURLM_OK) {
			sock_close(s);
			return -1;
		}
	}
	if (what & CURL_POLL_IN)
		events |= UV_READABLE;
	if (what & CURL_POLL_OUT)
		events |= UV_WRITABLE;
	if (uv_poll_start(&s->poll, events, on_poll) < 0)
		return -1;
	return 0;
}

/* CURLMOPT_TIMERFUNCTION: when curl wants on_timer; never calls curl back from here. */
static int on_curl_timer(CURLM *multi, long timeout_ms, void *userp)
{
	struct ddbclient *c = userp;

	if (c->closing || timeout_ms < 0) {
		uv_timer_stop(&c->timer);
		return 0;
	}
	return uv_timer_start(&c->timer, on_timer, (uint64_t)timeout_ms, 0) < 0 ? -1 : 0;
}

/* ---- API ----------------------------------------------------------------------------- */

int ddbclient_new(uv_loop_t *loop, const struct ddbclient_options *o, struct ddbclient **out)
{
	struct ddbclient *c = NULL;
	bool ok;

	if (!loop || !o || !out || !url_valid(o->endpoint_url) || !header_safe(o->host) ||
	    !header_safe(o->region) || strchr(o->region, '/') || o->connect_timeout_ms <= 0 ||
	    o->timeout_ms <= 0 || o->max_host_connections <= 0 || o->max_inflight == 0 ||
	    o->max_request_bytes == 0 || o->max_response_bytes == 0)
		return -EINVAL;
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->loop = loop;
	c->connect_timeout_ms = o->connect_timeout_ms;
	c->timeout_ms = o->timeout_ms;
	c->max_inflight = o->max_inflight;
	c->max_request_bytes = o->max_request_bytes;
	c->max_response_bytes = o->max_response_bytes;
	c->ignore_crc32 = o->ignore_crc32;
	c->pool_max =
	    (size_t)o->max_host_connections > POOL_MIN ? (size_t)o->max_host_connections : POOL_MIN;
	c->url = strdup(o->endpoint_url);
	c->host = strdup(o->host);
	c->region = strdup(o->region);
	c->multi = curl_multi_init();
	if (!c->url || !c->host || !c->region || !c->multi)
		goto fail;
	for (size_t i = 0; i < SOCK_SPARES(o->max_host_connections); i++) {
		struct sock *s = calloc(1, sizeof(*s));
		if (!s)
			goto fail;
		s->next = c->spare_socks;
		c->spare_socks = s;
	}
	ok = curl_multi_setopt(c->multi, CURLMOPT_SOCKETFUNCTION, on_curl_socket) == CURLM_OK &&
	     curl_multi_setopt(c->multi, CURLMOPT_SOCKETDATA, c) == CURLM_OK &&
	     curl_multi_setopt(c->multi, CURLMOPT_TIMERFUNCTION, on_curl_timer) == CURLM_OK &&
	     curl_multi_setopt(c->multi, CURLMOPT_TIMERDATA, c) == CURLM_OK &&
	     curl_multi_setopt(c->multi, CURLMOPT_MAX_HOST_CONNECTIONS, o->max_host_connections) ==
	         CURLM_OK &&
	     curl_multi_setopt(c->multi, CURLMOPT_MAXCONNECTS, o->max_host_connections) == CURLM_OK;
	if (!ok || uv_timer_init(loop, &c->timer) < 0)
		goto fail;
	c->timer.data = c;
	c->handles = 1;
	*out = c;
	return 0;
fail:
	if (c->multi)
		curl_multi_cleanup(c->multi);
	socks_free(c->spare_socks);
	free(c->url);
	free(c->host);
	free(c->region);
	free(c);
	return -ENOMEM;
}

int ddbclient_set_credentials(struct ddbclient *c, const char *access_key_id,
                              const char *secret_access_key, const char *session_token)
{
	char *id = NULL, *secret = NULL, *token = NULL;

	if (!c || !header_safe(access_key_id) || !header_safe(secret_access_key) ||
	    strchr(access_key_id, '/') ||
	    (session_token && session_token[0] && !header_safe(session_token)))
		return -EINVAL;
	id = strdup(access_key_id);
	secret = strdup(secret_access_key);
	if (session_token && session_token[0])
		token = strdup(session_token);
	if (!id || !secret || (session_token && session_token[0] && !token)) {
		free(id);
		free_secret(secret);
		free_secret(token);
		return -ENOMEM;
	}
	free(c->key_id);
	free_secret(c->secret);
	free_secret(c->token);
	c->key_id = id;
	c->secret = secret;
	c->token = token;
	return 0;
}

static bool operation_valid(const char *op)
{
	size_t n = op ? strlen(op) : 0;

	if (n == 0 || n > DDBCLIENT_OPERATION_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!((op[i] >= 'A' && op[i] <= 'Z') || (op[i] >= 'a' && op[i] <= 'z')))
			return false;
	return true;
}

/* Signs the request's body and builds its header list. 0, -EINVAL or -ENOMEM. */
static int request_sign(struct ddbclient *c, struct request *r, size_t len)
{
	char target[sizeof(TARGET_PREFIX) + DDBCLIENT_OPERATION_MAX];
	char *line = NULL;
	const struct sigv4_header h[] = {
	    {"host", c->host},
	    {"content-type", CONTENT_TYPE},
	    {"x-amz-target", target},
	};
	struct sigv4_request req = {
	    .method = "POST",
	    .path = "/",
	    .headers = h,
	    .nheaders = sizeof(h) / sizeof(h[0]),
	    .body = r->body,
	    .body_len = len,
	};
	const struct sigv4_credentials cred = {
	    .access_key_id = c->key_id,
	    .secret_access_key = c->secret,
	    .session_token = c->token,
	    .region = c->region,
	    .service = SERVICE,
	};
	struct sigv4_result sig;
	struct curl_slist *list = NULL, *l;
	struct timespec now;
	size_t line_size;
	int rc;

	memset(&sig, 0, sizeof(sig));
	snprintf(target, sizeof(target), TARGET_PREFIX "%s", r->operation);
	clock_gettime(CLOCK_REALTIME, &now);
	rc = sigv4_sign(&req, &cred, (int64_t)now.tv_sec, &sig);
	if (rc < 0)
		goto out;
	line_size = strlen(c->host) + strlen(sig.authorization) +
	            (c->token ? strlen(c->token) : 0) + sizeof(target) + 64;
	line = malloc(line_size);
	rc = -ENOMEM;
	if (!line)
		goto out;
#define ADD(...)                                                                                   \
	do {                                                                                       \
		snprintf(line, line_size, __VA_ARGS__);                                            \
		if (!(l = curl_slist_append(list, line)))                                          \
			goto out;                                                                  \
		list = l;                                                                          \
	} while (0)
	ADD("Host: %s", c->host);
	ADD("Content-Type: %s", CONTENT_TYPE);
	ADD("X-Amz-Target: %s", target);
	if (sig.send_amz_date)
		ADD("X-Amz-Date: %s", sig.amz_date);
	if (sig.send_security_token)
		ADD("X-Amz-Security-Token: %s", c->token);
	ADD("Authorization: %s", sig.authorization);
	ADD("Expect:"); /* no 100-continue round trip before a large body */
#undef ADD
	curl_slist_free_all(r->headers);
	r->headers = list;
	list = NULL;
	rc = 0;
out:
	if (line) {
		memset(line, 0, line_size); /* it held the session token */
		free(line);
	}
	curl_slist_free_all(list);
	sigv4_result_clear(&sig);
	return rc;
}

int ddbclient_call(struct ddbclient *c, const char *operation, const void *body, size_t len,
                   ddbclient_cb cb, void *arg)
{
	struct request *r = NULL;
	int rc;

	if (!c || !cb || !operation_valid(operation) || (!body && len > 0))
		return -EINVAL;
	if (c->closing)
		return -ESHUTDOWN;
	if (!c->key_id || !c->secret)
		return -ENOKEY;
	if (len > c->max_request_bytes)
		return -EMSGSIZE;
	if (c->ninflight >= c->max_inflight)
		return -EBUSY;

	if (c->idle) {
		r = c->idle;
		c->idle = r->next;
		c->nidle--;
		r->next = NULL;
	} else if (!(r = request_new(c))) {
		return -ENOMEM;
	}
	if (len + 1 > r->body_cap) {
		char *p = realloc(r->body, len + 1);
		rc = -ENOMEM;
		if (!p)
			goto fail;
		r->body = p;
		r->body_cap = len + 1;
	}
	if (len)
		memcpy(r->body, body, len);
	r->body[len] = '\0';
	r->body_len = len;
	snprintf(r->operation, sizeof(r->operation), "%s", operation);
	r->resp_len = 0;
	if (r->resp)
		r->resp[0] = '\0';
	r->resp_too_large = false;
	r->has_crc32 = r->crc32_twice = false;
	r->resp_crc32 = 0;
	r->request_id[0] = '\0';
	r->errbuf[0] = '\0';
	r->cb = cb;
	r->arg = arg;
	rc = request_sign(c, r, len);
	if (rc < 0)
		goto fail;
	rc = -ENOMEM;
	if (curl_easy_setopt(r->easy, CURLOPT_HTTPHEADER, r->headers) != CURLE_OK ||
	    curl_easy_setopt(r->easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)len) != CURLE_OK ||
	    curl_easy_setopt(r->easy, CURLOPT_POSTFIELDS, r->body) != CURLE_OK)
		goto fail;
	r->start_ns = uv_hrtime();
	if (curl_multi_add_handle(c->multi, r->easy) != CURLM_OK)
		goto fail;
	r->prev = NULL;
	r->next = c->inflight;
	if (c->inflight)
		c->inflight->prev = r;
	c->inflight = r;
	c->ninflight++;
	return 0;
fail:
	request_recycle(c, r);
	return rc;
}

size_t ddbclient_inflight(const struct ddbclient *c)
{
	return c ? c->ninflight : 0;
}

void ddbclient_close(struct ddbclient *c, void (*on_closed)(void *arg), void *arg)
{
	struct request *r;
	struct sock *s;

	if (!c || c->closing)
		return;
	c->closing = true;
	c->on_closed = on_closed;
	c->on_closed_arg = arg;
	uv_timer_stop(&c->timer);
	while ((r = c->inflight)) {
		curl_multi_remove_handle(c->multi, r->easy);
		inflight_unlink(c, r);
		request_finish(c, r, CURLE_OK, true);
	}
	while ((r = c->idle)) {
		c->idle = r->next;
		request_destroy(r);
	}
	c->nidle = 0;
	curl_multi_cleanup(c->multi); /* closes the cached connections */
	c->multi = NULL;
	for (s = c->socks; s; s = s->next)
		sock_close(s);
	uv_close((uv_handle_t *)&c->timer, on_timer_closed);
}
