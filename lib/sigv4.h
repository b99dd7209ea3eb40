/* AWS Signature Version 4 (Authorization header form) as a pure function of a request,
 * credentials and a time: canonical request, string to sign, signature, header value.
 * Follows the rules for every service but S3: the URI path is normalized (dot segments
 * removed, duplicate slashes collapsed) and each byte of it outside the unreserved set,
 * '%' included, is percent-encoded once more. */
#ifndef CONVO_SIGV4_H
#define CONVO_SIGV4_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SIGV4_MAX_HEADERS 64
#define SIGV4_AMZ_DATE_LEN 16 /* "YYYYMMDDTHHMMSSZ" */
#define SIGV4_SIGNATURE_LEN 64

/* One header to sign, borrowed. A value holding line breaks (an obs-folded header) counts
 * as one value per line, joined with ',' like repeated headers. */
struct sigv4_header {
	const char *name;
	const char *value;
};

/* The request to sign; every pointer is borrowed for the duration of the call. */
struct sigv4_request {
	const char *method; /* "POST" */
	const char *path;   /* as sent on the wire, without the query; NULL or "" = "/" */
	const char *query;  /* what follows '?' on the wire; NULL or "" = none */
	const struct sigv4_header *headers; /* all headers to sign; "host" is required */
	size_t nheaders;                    /* at most SIGV4_MAX_HEADERS */
	const void *body;                   /* may be NULL when body_len is 0 */
	size_t body_len;
};

/* Borrowed. region and service must be non-empty and hold no '/'. */
struct sigv4_credentials {
	const char *access_key_id;
	const char *secret_access_key;
	const char *session_token; /* NULL for long-term credentials */
	const char *region;
	const char *service; /* "dynamodb" */
};

/* What sigv4_sign produces. The strings are owned by the result (sigv4_result_clear). */
struct sigv4_result {
	char *canonical_request;
	char *string_to_sign;
	char *authorization;                     /* value of the Authorization header */
	char signature[SIGV4_SIGNATURE_LEN + 1]; /* lower-case hex */
	char amz_date[SIGV4_AMZ_DATE_LEN + 1];   /* value of the X-Amz-Date header */
	/* The signer signed these although the request's headers lacked them, so the caller
	 * must send them: "X-Amz-Date: amz_date" and "X-Amz-Security-Token: session_token". */
	bool send_amz_date;
	bool send_security_token;
};

/* Signs req with cred at now_s (Unix seconds, 1970..9999). A request may carry its own
 * x-amz-date (must match now_s) and x-amz-security-token (must match cred's token when one
 * is given; signed as is otherwise). Fills *out (caller frees with sigv4_result_clear;
 * untouched on failure). 0, -EINVAL (a missing or malformed field, no host header, a
 * mismatching x-amz-date or token, too many headers) or -ENOMEM. */
int sigv4_sign(const struct sigv4_request *req, const struct sigv4_credentials *cred, int64_t now_s,
               struct sigv4_result *out);

/* Frees the strings of r and zeroes it; accepts NULL and a zeroed or cleared result. */
void sigv4_result_clear(struct sigv4_result *r);

#endif
