/* Request error codes of protocol v1 and a carrier for the human-readable message.
 * The enum order is the precedence order of protocol.md: when a request has several
 * problems, the lowest non-zero code wins. */
#ifndef CONVO_ERROR_H
#define CONVO_ERROR_H

enum error_code {
	ERR_OK = 0,
	ERR_PARSE_ERROR,
	ERR_TOO_LARGE,
	ERR_UNKNOWN_OP,
	ERR_BAD_REQUEST,
	ERR_NOT_FOUND,
	ERR_CONFLICT,
	ERR_UNAVAILABLE,
	ERR_INTERNAL,
};

/* A failed request: its code and a message naming the field and what was expected. */
struct error {
	enum error_code code;
	char message[256];
};

/* Wire name of a code ("bad_request", ...); a static string, never NULL. */
const char *error_code_str(enum error_code code);

/* Fills e (may be NULL) with code and a printf-style message; returns code, so callers
 * can write `return error_set(e, ERR_BAD_REQUEST, "contents: expected ...");`. */
enum error_code error_set(struct error *e, enum error_code code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

#endif
