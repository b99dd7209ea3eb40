/* Asynchronous DynamoDB client on the daemon's libuv loop: signed JSON-protocol POSTs sent
 * through libcurl's multi interface, whose sockets and timer are driven by uv_poll and
 * uv_timer. No threads; nothing here blocks the loop. Connections are kept alive and
 * reused. */
#ifndef CONVOD_DDBCLIENT_H
#define CONVOD_DDBCLIENT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#define DDBCLIENT_OPERATION_MAX 63 /* bytes of an operation name ("BatchWriteItem") */
#define DDBCLIENT_REQUEST_ID_MAX 127

struct ddbclient;

/* Settings of a client. Strings are borrowed for the duration of ddbclient_new, which
 * copies them. ddbclient_options_defaults fills every number. */
struct ddbclient_options {
	const char *endpoint_url;  /* "https://dynamodb.eu-west-1.amazonaws.com", "http://..." */
	const char *host;          /* Host header value, as awsconf_host gives it */
	const char *region;        /* signing region, as awsconf_signing_region gives it */
	long connect_timeout_ms;   /* CURLOPT_CONNECTTIMEOUT_MS (3000) */
	long timeout_ms;           /* CURLOPT_TIMEOUT_MS: the whole request, queueing included
	                            * (10000) */
	long max_host_connections; /* CURLMOPT_MAX_HOST_CONNECTIONS; more requests wait (8) */
	size_t max_inflight;       /* ddbclient_call refuses more with -EBUSY (256) */
	size_t max_request_bytes; /* ddbclient_call refuses a bigger body with -EMSGSIZE (16 MiB) */
	size_t max_response_bytes; /* a bigger answer fails the request (16 MiB) */
	bool ignore_crc32;         /* take answers whose body does not match x-amz-crc32 */
};

/* What a request came to, passed to its callback. Every pointer is borrowed and valid only
 * while the callback runs. */
struct ddbclient_result {
	const char *operation; /* "BatchWriteItem" */
	long status;           /* HTTP status; 0 when the transport failed or was canceled */
	const char *error;     /* why the transport failed ("" when status != 0) */
	bool timed_out;        /* the transport failed on a connect or request timeout */
	bool canceled;         /* ddbclient_close ended the request; status is 0 */
	bool sent;             /* the whole request left (the server may have acted on it) */
	bool damaged;          /* an answer came whose body did not match its x-amz-crc32
	                        * (or that carried two different ones): status is 0, as if
	                        * none had come; body and request_id are still that answer's,
	                        * for the log only */
	uint64_t uploaded;     /* bytes of the body that left */
	const char *body;      /* the answer, NUL-terminated ("" when none) */
	size_t body_len;
	const char *request_id; /* x-amzn-RequestId ("" when none) */
	uint64_t elapsed_ms;    /* from ddbclient_call to completion */
	long new_connections;   /* connections this request had to open (0 = a reused one) */
};

typedef void (*ddbclient_cb)(const struct ddbclient_result *res, void *arg);

/* Must run once before any client exists, before other threads start (curl_global_init).
 * Later calls do nothing. 0 or -EIO. */
int ddbclient_global_init(void);

/* Undoes ddbclient_global_init once every client is closed (for clean leak checks). */
void ddbclient_global_cleanup(void);

/* Fills o with the defaults above and no endpoint. */
void ddbclient_options_defaults(struct ddbclient_options *o);

/* New client on loop; the caller ends it with ddbclient_close (never freed otherwise).
 * Requests cannot be sent before ddbclient_set_credentials. 0, -EINVAL (a missing or
 * malformed option) or -ENOMEM. */
int ddbclient_new(uv_loop_t *loop, const struct ddbclient_options *o, struct ddbclient **out);

/* Copies the credentials for the requests sent from now on (those in flight keep their
 * signature); session_token may be NULL. The old secret is wiped. On failure the previous
 * credentials stay. 0, -EINVAL or -ENOMEM. */
int ddbclient_set_credentials(struct ddbclient *c, const char *access_key_id,
                              const char *secret_access_key, const char *session_token);

/* Sends POST / with X-Amz-Target: DynamoDB_20120810.<operation> and the JSON body
 * body[0..len) (copied), signed for service "dynamodb". cb(res, arg) runs exactly once, on
 * a later turn of the loop (or from ddbclient_close, canceled), and only when this returns
 * 0. 0, -EINVAL (operation not 1 to DDBCLIENT_OPERATION_MAX letters, NULL cb),
 * -ENOKEY (no credentials), -EMSGSIZE, -EBUSY (max_inflight reached), -ESHUTDOWN (closing)
 * or -ENOMEM. */
int ddbclient_call(struct ddbclient *c, const char *operation, const void *body, size_t len,
                   ddbclient_cb cb, void *arg);

/* Requests sent and not yet completed. */
size_t ddbclient_inflight(const struct ddbclient *c);

/* Cancels every request in flight (their callbacks run before this returns, canceled),
 * closes connections and handles, then calls on_closed(arg) from a close callback once all
 * are closed, after freeing c. c must not be used after this call; a second call, from a
 * callback, does nothing. Accepts NULL (on_closed is then not called). */
void ddbclient_close(struct ddbclient *c, void (*on_closed)(void *arg), void *arg);

#endif
