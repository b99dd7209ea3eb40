/* json-baseline: the floor convod is measured against. A stateless libuv server on a Unix
 * socket that parses each request line with jansson, drops it, and answers a fixed line; the
 * answers to one read are written with one write. */
#include "bench_linebuf.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <uv.h>

#define READ_CHUNK 65536

static const char reply_ok[] = "{\"ok\":true,\"result\":{}}\n";
static const char reply_parse_error[] =
    "{\"ok\":false,\"error\":{\"code\":\"parse_error\",\"message\":\"the line is not a JSON "
    "object\"}}\n";
static const char reply_too_large[] = "{\"ok\":false,\"error\":{\"code\":\"too_large\","
                                      "\"message\":\"the line is over the line limit\"}}\n";

struct server {
	uv_loop_t *loop;
	uv_pipe_t listener;
	uv_signal_t sigint;
	uv_signal_t sigterm;
	const char *path;
	size_t max_line;
	size_t max_output;
	struct client *clients;
	uint64_t requests;
	uint64_t accepted;
	bool listening;
	bool stopping;
};

struct client {
	uv_pipe_t pipe;
	struct server *s;
	struct client *prev;
	struct client *next;
	struct linebuf in;
	char *out; /* replies of the current read, handed to a write_req */
	size_t out_len;
	size_t out_cap;
	size_t queued; /* bytes handed to uv_write and not yet written */
	bool reading;
	bool eof;
	bool closing;
};

struct write_req {
	uv_write_t req;
	struct client *c;
	char *data; /* owned */
	size_t len;
};

static void client_close_cb(uv_handle_t *h)
{
	struct client *c = h->data;

	if (c->prev)
		c->prev->next = c->next;
	else
		c->s->clients = c->next;
	if (c->next)
		c->next->prev = c->prev;
	linebuf_free(&c->in);
	free(c->out);
	free(c);
}

static void client_close(struct client *c)
{
	if (c->closing)
		return;
	c->closing = true;
	uv_close((uv_handle_t *)&c->pipe, client_close_cb);
}

static int client_append(struct client *c, const char *data, size_t len)
{
	if (c->out_cap - c->out_len < len) {
		size_t cap = c->out_cap ? c->out_cap : 1024;
		char *p;

		while (cap - c->out_len < len)
			cap *= 2;
		p = realloc(c->out, cap);
		if (!p)
			return -ENOMEM;
		c->out = p;
		c->out_cap = cap;
	}
	memcpy(c->out + c->out_len, data, len);
	c->out_len += len;
	return 0;
}

static void alloc_cb(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
	struct client *c = h->data;
	char *area;
	size_t len;

	(void)suggested;
	if (linebuf_reserve(&c->in, READ_CHUNK, &area, &len) < 0) {
		*buf = uv_buf_init(NULL, 0);
		return;
	}
	*buf = uv_buf_init(area, (unsigned)(len > UINT_MAX ? UINT_MAX : len));
}

static void read_cb(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf);

static void write_cb(uv_write_t *req, int status)
{
	struct write_req *w = (struct write_req *)req;
	struct client *c = w->c;

	c->queued -= w->len;
	free(w->data);
	free(w);
	if (c->closing)
		return;
	if (status < 0) {
		client_close(c);
		return;
	}
	if (c->eof && c->queued == 0) {
		client_close(c);
		return;
	}
	if (!c->reading && !c->eof && c->queued <= c->s->max_output / 2) {
		if (uv_read_start((uv_stream_t *)&c->pipe, alloc_cb, read_cb) < 0) {
			client_close(c);
			return;
		}
		c->reading = true;
	}
}

/* Hands the replies gathered during one read to a single uv_write. */
static int client_flush(struct client *c)
{
	struct write_req *w;
	uv_buf_t buf;
	int r;

	if (c->out_len == 0)
		return 0;
	w = malloc(sizeof(*w));
	if (!w)
		return -ENOMEM;
	w->c = c;
	w->data = c->out;
	w->len = c->out_len;
	c->out = NULL;
	c->out_len = c->out_cap = 0;
	buf = uv_buf_init(w->data, (unsigned)w->len);
	r = uv_write(&w->req, (uv_stream_t *)&c->pipe, &buf, 1, write_cb);
	if (r < 0) {
		free(w->data);
		free(w);
		return r;
	}
	c->queued += w->len;
	if (c->queued > c->s->max_output && c->reading) {
		uv_read_stop((uv_stream_t *)&c->pipe);
		c->reading = false;
	}
	return 0;
}

static bool blank(const char *p, size_t n)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r')
			return false;
	return true;
}

static int handle_line(struct client *c, const char *line, size_t len)
{
	json_error_t err;
	json_t *root;
	bool ok;

	if (blank(line, len))
		return 0;
	c->s->requests++;
	root = json_loadb(line, len, 0, &err);
	ok = json_is_object(root);
	json_decref(root);
	if (ok)
		return client_append(c, reply_ok, sizeof(reply_ok) - 1);
	return client_append(c, reply_parse_error, sizeof(reply_parse_error) - 1);
}

static void read_cb(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
	struct client *c = st->data;
	enum linebuf_next r;
	const char *line;
	size_t len;

	(void)buf;
	if (c->closing)
		return;
	if (nread < 0) {
		/* the bytes after the last newline are an unfinished request: dropped */
		uv_read_stop(st);
		c->reading = false;
		c->eof = true;
		if (nread != UV_EOF || c->queued == 0)
			client_close(c);
		return;
	}
	linebuf_commit(&c->in, (size_t)nread);
	while ((r = linebuf_next(&c->in, &line, &len)) != LINEBUF_NEED_MORE) {
		int e;

		if (r == LINEBUF_TOO_LONG) {
			c->s->requests++;
			e = client_append(c, reply_too_large, sizeof(reply_too_large) - 1);
		} else {
			e = handle_line(c, line, len);
		}
		if (e < 0) {
			client_close(c);
			return;
		}
	}
	if (client_flush(c) < 0)
		client_close(c);
}

static void connection_cb(uv_stream_t *listener, int status)
{
	struct server *s = listener->data;
	struct client *c;

	if (status < 0) {
		fprintf(stderr, "json-baseline: accept: %s\n", uv_strerror(status));
		return;
	}
	c = calloc(1, sizeof(*c));
	if (!c)
		return;
	c->s = s;
	linebuf_init(&c->in, s->max_line);
	uv_pipe_init(s->loop, &c->pipe, 0);
	c->pipe.data = c;
	c->next = s->clients;
	if (s->clients)
		s->clients->prev = c;
	s->clients = c;
	if (uv_accept(listener, (uv_stream_t *)&c->pipe) < 0 ||
	    uv_read_start((uv_stream_t *)&c->pipe, alloc_cb, read_cb) < 0) {
		client_close(c);
		return;
	}
	c->reading = true;
	s->accepted++;
}

static void stop(struct server *s)
{
	if (s->stopping)
		return;
	s->stopping = true;
	if (s->listening)
		uv_close((uv_handle_t *)&s->listener, NULL);
	uv_close((uv_handle_t *)&s->sigint, NULL);
	uv_close((uv_handle_t *)&s->sigterm, NULL);
	for (struct client *c = s->clients; c; c = c->next)
		client_close(c);
}

static void signal_cb(uv_signal_t *h, int signum)
{
	(void)signum;
	stop(h->data);
}

static void usage(FILE *f)
{
	fprintf(f, "usage: json-baseline --socket PATH [--max-line-bytes N (1048576)]\n"
	           "                     [--max-output-bytes N (8388608)]\n");
}

static int parse_size(const char *s, size_t *out)
{
	char *end;
	unsigned long long v;

	if (!*s || *s == '-')
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || v < 1 || v > SIZE_MAX / 4)
		return -EINVAL;
	*out = (size_t)v;
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option opts[] = {
	    {"socket", required_argument, NULL, 's'},
	    {"max-line-bytes", required_argument, NULL, 'l'},
	    {"max-output-bytes", required_argument, NULL, 'o'},
	    {"help", no_argument, NULL, 'h'},
	    {NULL, 0, NULL, 0},
	};
	static struct server server;
	struct server *s = &server;
	bool bound = false;
	int ch, r, rc = 0;

	s->max_line = 1u << 20;
	s->max_output = 8u << 20;
	while ((ch = getopt_long(argc, argv, "", opts, NULL)) != -1) {
		switch (ch) {
		case 's':
			s->path = optarg;
			break;
		case 'l':
			if (parse_size(optarg, &s->max_line) < 0) {
				fprintf(stderr, "json-baseline: bad --max-line-bytes '%s'\n",
				        optarg);
				return 2;
			}
			break;
		case 'o':
			if (parse_size(optarg, &s->max_output) < 0) {
				fprintf(stderr, "json-baseline: bad --max-output-bytes '%s'\n",
				        optarg);
				return 2;
			}
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (!s->path || optind < argc) {
		usage(stderr);
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	s->loop = uv_default_loop();
	uv_signal_init(s->loop, &s->sigint);
	uv_signal_init(s->loop, &s->sigterm);
	s->sigint.data = s->sigterm.data = s;
	uv_signal_start(&s->sigint, signal_cb, SIGINT);
	uv_signal_start(&s->sigterm, signal_cb, SIGTERM);
	uv_pipe_init(s->loop, &s->listener, 0);
	s->listener.data = s;
	s->listening = true;
	r = uv_pipe_bind(&s->listener, s->path);
	if (r == 0) {
		bound = true;
		r = uv_listen((uv_stream_t *)&s->listener, SOMAXCONN, connection_cb);
	}
	if (r < 0) {
		fprintf(stderr, "json-baseline: listen on %s: %s\n", s->path, uv_strerror(r));
		rc = 1;
		stop(s);
	} else {
		fprintf(stderr, "json-baseline: listening on %s\n", s->path);
	}
	uv_run(s->loop, UV_RUN_DEFAULT);
	if (bound)
		unlink(s->path);
	if (rc == 0)
		fprintf(stderr, "json-baseline: %" PRIu64 " requests on %" PRIu64 " connections\n",
		        s->requests, s->accepted);
	uv_loop_close(s->loop);
	return rc;
}
