/* A JSON reader that builds nothing: it checks that a text is one JSON object and lists its
 * members as spans of the text, for the requests that are read most (add_*) and for answers
 * in the load generator. It accepts a subset of what jansson accepts, and never more: a
 * text it accepts, jansson reads to the same values. Anything it does not accept (invalid
 * JSON, but also numbers jansson might refuse as too big, deep nesting, escaped keys) is
 * for the caller to hand to jansson, which then gives the authoritative answer or error. */
#ifndef CONVOD_JSCAN_H
#define CONVOD_JSCAN_H

#include <stdbool.h>
#include <stddef.h>

#include "buf.h"

enum jscan_type {
	JSCAN_NULL = 0,
	JSCAN_FALSE,
	JSCAN_TRUE,
	JSCAN_INTEGER, /* at most 18 digits: fits json_int_t */
	JSCAN_REAL,
	JSCAN_STRING,
	JSCAN_ARRAY,
	JSCAN_OBJECT,
};

/* A value inside the scanned text (borrowed from it). */
struct jscan_value {
	const char *p; /* the value's text; for a string, what is between its quotes */
	size_t len;
	enum jscan_type type;
	bool escaped; /* a string holding backslash escapes: decode it with jscan_string */
};

struct jscan_member {
	/* Between the quotes; never escaped: a member whose key holds an escape is refused
	 * (it might name another member once decoded). Keys nested deeper may hold escapes. */
	const char *key;
	size_t key_len;
	struct jscan_value value;
};

/* Scans text[0..len) as one JSON object, optionally surrounded by JSON white space. The
 * first max members go to members[] in text order; *n is the count of all of them.
 * 0, or -EINVAL when the text is not accepted (see above). */
int jscan_object(const char *text, size_t len, struct jscan_member *members, size_t max,
                 size_t *n);

/* Scans the one JSON value at text[0..len) (no white space before it) and sets *end to the
 * offset just after it. 0 or -EINVAL. */
int jscan_value(const char *text, size_t len, struct jscan_value *v, size_t *end);

/* The elements of an array value (as scanned, so valid): *pos starts at 0; each call
 * stores the next element in *el and returns 1, then 0 at the end. */
int jscan_array_next(const struct jscan_value *array, size_t *pos, struct jscan_value *el);

/* Appends the decoded bytes of a string value to b. 0, -ENOMEM, or -EINVAL for an escape
 * jansson would refuse (a lone surrogate). */
int jscan_string(const struct jscan_value *v, struct buf *b);

/* The member named key (unescaped, len bytes) among members[0..n), or NULL; *dup is set
 * when the key appears more than once (jansson keeps the last one). */
const struct jscan_member *jscan_find(const struct jscan_member *members, size_t n,
                                      const char *key, size_t len, bool *dup);

/* jscan_value, but numbers of any size are accepted (jansson may refuse some): for text
 * jansson has read once (the daemon's own answers, or a request whose numbers were tamed). */
int jscan_value_loose(const char *text, size_t len, struct jscan_value *v, size_t *end);

/* The value of the member named key (len bytes, unescaped) of the JSON object text[0..len)
 * (surrounding white space allowed), looked for at the top level only, escaped keys
 * decoded, numbers of any size: 1 and *v (the last such member, as jansson keeps), 0 when
 * there is none, -EINVAL when the text is not such an object, -ENOMEM. */
int jscan_object_get(const char *text, size_t len, const char *key, size_t key_len,
                     struct jscan_value *v);

/* Numbers that RFC 8259 allows and jansson refuses: integers outside 64 bits, reals beyond
 * a double's range. Counts them in text[0..len) (outside strings) in *n and, when out is
 * given and *n > 0, appends to it a copy of the text with each replaced by 1e300 (-1e300
 * when negative), which jansson reads. Only what scans as a JSON number is replaced, so a
 * text that was not JSON stays so. 0 or -ENOMEM. */
int jscan_tame_numbers(const char *text, size_t len, struct buf *out, size_t *n);

#endif
