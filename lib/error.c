/* Request error codes and their wire names. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>

const char *error_code_str(enum error_code code)
{
	switch (code) {
	case ERR_OK:
		return "ok";
	case ERR_PARSE_ERROR:
		return "parse_error";
	case ERR_TOO_LARGE:
		return "too_large";
	case ERR_UNKNOWN_OP:
		return "unknown_op";
	case ERR_BAD_REQUEST:
		return "bad_request";
	case ERR_NOT_FOUND:
		return "not_found";
	case ERR_CONFLICT:
		return "conflict";
	case ERR_UNAVAILABLE:
		return "unavailable";
	case ERR_INTERNAL:
		return "internal";
	}
	return "internal";
}

enum error_code error_set(struct error *e, enum error_code code, const char *fmt, ...)
{
	if (e) {
		va_list ap;
		e->code = code;
		va_start(ap, fmt);
		vsnprintf(e->message, sizeof(e->message), fmt, ap);
		va_end(ap);
	}
	return code;
}
