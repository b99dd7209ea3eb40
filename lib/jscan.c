/* The reader of jscan.h: recursive descent over the text with a depth limit, no allocation.
 * Where jansson would refuse what RFC 8259 allows (integers beyond 64 bits, reals that
 * overflow a double), or its reading might differ from a plain one (escaped keys, which may
 * name another key once decoded), this reader refuses too, leaving the case to jansson. */
#include "jscan.h"

#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* jansson's own (JSON_PARSER_MAX_DEPTH): whatever it reads, this reads too, so that an id
 * is echoed as written however deep the rest of the request nests (64 used to give up on
 * it there, and an id beyond 64 bits came back as its tamed 1e300). A frame is small: the
 * loop's stack holds 2048 of them many times over. */
#define JSCAN_MAX_DEPTH 2048
#define JSCAN_MAX_INT_DIGITS 18 /* below 2^63 whatever the digits */
#define JSCAN_MAX_DECIMAL_EXP 300 /* digits + exponent: far from DBL_MAX's 308 */

struct scan {
	const char *p;
	size_t len, i;
	bool loose; /* numbers of any size, escaped keys at the top level (jscan_object_get) */
};

static int scan_value(struct scan *s, struct jscan_value *v, int depth);

static void skip_ws(struct scan *s)
{
	while (s->i < s->len) {
		char c = s->p[s->i];
		if (c != ' ' && c != '\t' && c != '\n' && c != '\r')
			break;
		s->i++;
	}
}

static int hex4(const char *p, unsigned *out)
{
	unsigned v = 0;
	for (int k = 0; k < 4; k++) {
		char c = p[k];
		v <<= 4;
		if (c >= '0' && c <= '9')
			v |= (unsigned)(c - '0');
		else if (c >= 'a' && c <= 'f')
			v |= (unsigned)(c - 'a' + 10);
		else if (c >= 'A' && c <= 'F')
			v |= (unsigned)(c - 'A' + 10);
		else
			return -EINVAL;
	}
	*out = v;
	return 0;
}

/* A \u escape at p (pointing at the 'u'), n bytes left: how many bytes it spans (5, or 11
 * for a surrogate pair) and its code point. 0 when jansson would refuse it. */
static size_t unicode_escape(const char *p, size_t n, unsigned *cp)
{
	unsigned hi, lo;

	if (n < 5 || hex4(p + 1, &hi) < 0)
		return 0;
	if (hi >= 0xdc00 && hi <= 0xdfff)
		return 0; /* a low surrogate first */
	if (hi < 0xd800 || hi > 0xdbff) {
		*cp = hi;
		return 5;
	}
	if (n < 11 || p[5] != '\\' || p[6] != 'u' || hex4(p + 7, &lo) < 0 || lo < 0xdc00 ||
	    lo > 0xdfff)
		return 0;
	*cp = 0x10000 + ((hi - 0xd800) << 10) + (lo - 0xdc00);
	return 11;
}

/* A string starting at the quote s->p[s->i]; v gets what is between the quotes. */
static int scan_string(struct scan *s, struct jscan_value *v)
{
	const unsigned char *p = (const unsigned char *)s->p;
	size_t i = s->i + 1, start = i, n = s->len;
	bool escaped = false;

	for (;;) {
		/* Plain ASCII runs: the usual content. */
		while (i < n && p[i] >= 0x20 && p[i] < 0x80 && p[i] != '"' && p[i] != '\\')
			i++;
		if (i >= n)
			return -EINVAL;
		if (p[i] == '"')
			break;
		if (p[i] < 0x20)
			return -EINVAL; /* a raw control character (jansson refuses it too) */
		if (p[i] >= 0x80) {
			size_t k = buf_utf8_len((const char *)p + i, n - i);
			if (!k)
				return -EINVAL;
			i += k;
			continue;
		}
		/* A backslash. */
		escaped = true;
		if (i + 1 >= n)
			return -EINVAL;
		switch (p[i + 1]) {
		case '"':
		case '\\':
		case '/':
		case 'b':
		case 'f':
		case 'n':
		case 'r':
		case 't':
			i += 2;
			break;
		case 'u': {
			unsigned cp;
			size_t k = unicode_escape((const char *)p + i + 1, n - i - 1, &cp);
			if (!k)
				return -EINVAL;
			i += 1 + k;
			break;
		}
		default:
			return -EINVAL;
		}
	}
	v->type = JSCAN_STRING;
	v->p = s->p + start;
	v->len = i - start;
	v->escaped = escaped;
	s->i = i + 1;
	return 0;
}

static bool is_digit(char c)
{
	return c >= '0' && c <= '9';
}

static int scan_number(struct scan *s, struct jscan_value *v)
{
	const char *p = s->p;
	size_t i = s->i, n = s->len, start = i, digits = 0;
	bool real = false;
	long exp = 0;

	if (p[i] == '-')
		i++;
	if (i >= n || !is_digit(p[i]))
		return -EINVAL;
	if (p[i] == '0') {
		i++;
		if (i < n && is_digit(p[i]))
			return -EINVAL;
		digits = 0;
	} else {
		while (i < n && is_digit(p[i])) {
			i++;
			digits++;
		}
	}
	if (i < n && p[i] == '.') {
		real = true;
		i++;
		if (i >= n || !is_digit(p[i]))
			return -EINVAL;
		while (i < n && is_digit(p[i]))
			i++;
	}
	if (i < n && (p[i] == 'e' || p[i] == 'E')) {
		bool neg = false;
		real = true;
		i++;
		if (i < n && (p[i] == '+' || p[i] == '-'))
			neg = p[i++] == '-';
		if (i >= n || !is_digit(p[i]))
			return -EINVAL;
		while (i < n && is_digit(p[i])) {
			if (exp < 100000)
				exp = exp * 10 + (p[i] - '0');
			i++;
		}
		if (neg)
			exp = -exp;
	}
	if (!s->loose &&
	    (real ? (long)digits + exp > JSCAN_MAX_DECIMAL_EXP : digits > JSCAN_MAX_INT_DIGITS))
		return -EINVAL; /* might be refused by jansson as too big */
	v->type = real ? JSCAN_REAL : JSCAN_INTEGER;
	v->p = p + start;
	v->len = i - start;
	v->escaped = false;
	s->i = i;
	return 0;
}

static int scan_literal(struct scan *s, struct jscan_value *v, const char *word, size_t wlen,
                        enum jscan_type type)
{
	if (s->len - s->i < wlen || memcmp(s->p + s->i, word, wlen) != 0)
		return -EINVAL;
	v->type = type;
	v->p = s->p + s->i;
	v->len = wlen;
	v->escaped = false;
	s->i += wlen;
	return 0;
}

/* An escaped key that may decode to a NUL byte, which jansson refuses in keys (a false
 * alarm for an escaped backslash before "u0000" only costs the fast path). */
static bool key_has_nul(const struct jscan_value *key)
{
	for (size_t i = 0; i + 6 <= key->len; i++)
		if (key->p[i] == '\\' && key->p[i + 1] == 'u' && key->p[i + 2] == '0' &&
		    key->p[i + 3] == '0' && key->p[i + 4] == '0' && key->p[i + 5] == '0')
			return true;
	return false;
}

/* An object or array at s->p[s->i]; members of an object go to out[0..max) when out is
 * given (the top level), counted in *count. */
static int scan_container(struct scan *s, struct jscan_value *v, int depth,
                          struct jscan_member *out, size_t max, size_t *count)
{
	bool object = s->p[s->i] == '{';
	char close = object ? '}' : ']';
	size_t start = s->i, k = 0;

	if (depth >= JSCAN_MAX_DEPTH)
		return -EINVAL;
	s->i++;
	skip_ws(s);
	if (s->i < s->len && s->p[s->i] == close) {
		s->i++;
		goto done;
	}
	for (;;) {
		struct jscan_value key, el;
		if (object) {
			if (s->i >= s->len || s->p[s->i] != '"' || scan_string(s, &key) < 0 ||
			    (key.escaped && !s->loose && (out || key_has_nul(&key))))
				return -EINVAL;
			skip_ws(s);
			if (s->i >= s->len || s->p[s->i] != ':')
				return -EINVAL;
			s->i++;
			skip_ws(s);
		}
		if (scan_value(s, &el, depth + 1) < 0)
			return -EINVAL;
		if (out && k < max) {
			out[k].key = key.p;
			out[k].key_len = key.len;
			out[k].value = el;
		}
		k++;
		skip_ws(s);
		if (s->i >= s->len)
			return -EINVAL;
		if (s->p[s->i] == close) {
			s->i++;
			break;
		}
		if (s->p[s->i] != ',')
			return -EINVAL;
		s->i++;
		skip_ws(s);
	}
done:
	if (count)
		*count = k;
	v->type = object ? JSCAN_OBJECT : JSCAN_ARRAY;
	v->p = s->p + start;
	v->len = s->i - start;
	v->escaped = false;
	return 0;
}

static int scan_value(struct scan *s, struct jscan_value *v, int depth)
{
	/* Every value is a level, a scalar too, as jansson counts them: 2048 empty containers
	 * pass, 2048 holding a scalar do not (jansson and this refuse the same lines). */
	if (s->i >= s->len || depth >= JSCAN_MAX_DEPTH)
		return -EINVAL;
	switch (s->p[s->i]) {
	case '"':
		return scan_string(s, v);
	case '{':
	case '[':
		return scan_container(s, v, depth, NULL, 0, NULL);
	case 't':
		return scan_literal(s, v, "true", 4, JSCAN_TRUE);
	case 'f':
		return scan_literal(s, v, "false", 5, JSCAN_FALSE);
	case 'n':
		return scan_literal(s, v, "null", 4, JSCAN_NULL);
	default:
		return scan_number(s, v);
	}
}

int jscan_object(const char *text, size_t len, struct jscan_member *members, size_t max,
                 size_t *n)
{
	struct scan s = {text, len, 0, false};
	struct jscan_value v;

	*n = 0;
	skip_ws(&s);
	if (s.i >= s.len || text[s.i] != '{')
		return -EINVAL;
	if (scan_container(&s, &v, 0, members, max, n) < 0) {
		*n = 0;
		return -EINVAL;
	}
	skip_ws(&s);
	if (s.i != s.len) {
		*n = 0;
		return -EINVAL;
	}
	return 0;
}

int jscan_value(const char *text, size_t len, struct jscan_value *v, size_t *end)
{
	struct scan s = {text, len, 0, false};

	if (scan_value(&s, v, 0) < 0)
		return -EINVAL;
	*end = s.i;
	return 0;
}

int jscan_array_next(const struct jscan_value *array, size_t *pos, struct jscan_value *el)
{
	struct scan s = {array->p, array->len, *pos ? *pos : 1, false};

	skip_ws(&s);
	if (s.i < s.len && s.p[s.i] == ',') {
		s.i++;
		skip_ws(&s);
	}
	if (s.i >= s.len || s.p[s.i] == ']')
		return 0;
	if (scan_value(&s, el, 1) < 0)
		return 0; /* not reached for a scanned array */
	*pos = s.i;
	return 1;
}

int jscan_string(const struct jscan_value *v, struct buf *b)
{
	const char *p = v->p;
	size_t n = v->len, i = 0;

	if (!v->escaped)
		return buf_append(b, p, n) < 0 ? -ENOMEM : 0;
	if (buf_reserve(b, n) < 0) /* decoding never grows the text */
		return -ENOMEM;
	while (i < n) {
		const char *bs = memchr(p + i, '\\', n - i);
		size_t run = bs ? (size_t)(bs - (p + i)) : n - i;
		char *o;
		unsigned cp;
		size_t k;

		memcpy(b->data + b->len, p + i, run);
		b->len += run;
		i += run;
		if (i >= n)
			break;
		o = b->data + b->len;
		switch (p[i + 1]) {
		case 'b':
			*o = '\b';
			break;
		case 'f':
			*o = '\f';
			break;
		case 'n':
			*o = '\n';
			break;
		case 'r':
			*o = '\r';
			break;
		case 't':
			*o = '\t';
			break;
		case 'u':
			k = unicode_escape(p + i + 1, n - i - 1, &cp);
			if (!k)
				return -EINVAL;
			i += 1 + k;
			/* UTF-8 is never longer than the escape it comes from (5 or 11 bytes). */
			if (cp < 0x80) {
				o[0] = (char)cp;
				b->len += 1;
			} else if (cp < 0x800) {
				o[0] = (char)(0xc0 | (cp >> 6));
				o[1] = (char)(0x80 | (cp & 0x3f));
				b->len += 2;
			} else if (cp < 0x10000) {
				o[0] = (char)(0xe0 | (cp >> 12));
				o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
				o[2] = (char)(0x80 | (cp & 0x3f));
				b->len += 3;
			} else {
				o[0] = (char)(0xf0 | (cp >> 18));
				o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
				o[2] = (char)(0x80 | ((cp >> 6) & 0x3f));
				o[3] = (char)(0x80 | (cp & 0x3f));
				b->len += 4;
			}
			continue;
		default: /* '"', '\\', '/' */
			*o = p[i + 1];
			break;
		}
		b->len += 1;
		i += 2;
	}
	return 0;
}

const struct jscan_member *jscan_find(const struct jscan_member *members, size_t n,
                                      const char *key, size_t len, bool *dup)
{
	const struct jscan_member *found = NULL;

	for (size_t i = 0; i < n; i++) {
		if (members[i].key_len == len && memcmp(members[i].key, key, len) == 0) {
			if (found && dup)
				*dup = true;
			found = &members[i];
		}
	}
	return found;
}

int jscan_value_loose(const char *text, size_t len, struct jscan_value *v, size_t *end)
{
	struct scan s = {text, len, 0, true};

	if (scan_value(&s, v, 0) < 0)
		return -EINVAL;
	*end = s.i;
	return 0;
}

int jscan_object_get(const char *text, size_t len, const char *key, size_t key_len,
                     struct jscan_value *out)
{
	struct scan s = {text, len, 0, true};
	struct buf name = {0};
	int found = 0;

	skip_ws(&s);
	if (s.i >= s.len || text[s.i] != '{')
		return -EINVAL;
	s.i++;
	skip_ws(&s);
	if (s.i < s.len && text[s.i] == '}')
		return 0;
	for (;;) {
		struct jscan_value k, v;
		bool match;

		if (s.i >= s.len || text[s.i] != '"' || scan_string(&s, &k) < 0)
			goto bad;
		skip_ws(&s);
		if (s.i >= s.len || text[s.i] != ':')
			goto bad;
		s.i++;
		skip_ws(&s);
		if (scan_value(&s, &v, 1) < 0)
			goto bad;
		if (k.escaped) {
			name.len = 0;
			if (jscan_string(&k, &name) < 0) {
				buf_free(&name);
				return -ENOMEM;
			}
			match = name.len == key_len && memcmp(name.data, key, key_len) == 0;
		} else {
			match = k.len == key_len && memcmp(k.p, key, key_len) == 0;
		}
		if (match) { /* jansson keeps the last one */
			*out = v;
			found = 1;
		}
		skip_ws(&s);
		if (s.i < s.len && text[s.i] == '}')
			break;
		if (s.i >= s.len || text[s.i] != ',')
			goto bad;
		s.i++;
		skip_ws(&s);
	}
	buf_free(&name);
	return found;
bad:
	buf_free(&name);
	return -EINVAL;
}

/* Whether jansson refuses the number p[0..n) (valid JSON): an integer outside json_int_t
 * (strtoll's ERANGE) or a real that strtod overflows. */
static int refused_number(const char *p, size_t n, bool *refused)
{
	static const char max_pos[] = "9223372036854775807", max_neg[] = "9223372036854775808";
	bool neg = p[0] == '-';
	const char *digits = p + neg;
	size_t nd = n - neg;
	char small[64], *copy = small;
	double d;

	if (!memchr(p, '.', n) && !memchr(p, 'e', n) && !memchr(p, 'E', n)) {
		*refused = nd > 19 || (nd == 19 && memcmp(digits, neg ? max_neg : max_pos, 19) > 0);
		return 0;
	}
	if (n >= sizeof(small) && !(copy = malloc(n + 1)))
		return -ENOMEM;
	memcpy(copy, p, n);
	copy[n] = '\0';
	errno = 0;
	d = strtod(copy, NULL);
	*refused = errno == ERANGE && (d == HUGE_VAL || d == -HUGE_VAL);
	if (copy != small)
		free(copy);
	return 0;
}

int jscan_tame_numbers(const char *text, size_t len, struct buf *out, size_t *n)
{
	size_t i = 0, copied = 0;

	*n = 0;
	while (i < len) {
		char c = text[i];
		if (c == '"') {
			for (i++; i < len && text[i] != '"'; i++)
				if (text[i] == '\\')
					i++;
			i++;
			continue;
		}
		if (c == '-' || is_digit(c)) {
			size_t j = i;
			struct scan s;
			struct jscan_value v;
			bool refused = false;

			while (j < len && (is_digit(text[j]) || text[j] == '-' || text[j] == '+' ||
			                   text[j] == '.' || text[j] == 'e' || text[j] == 'E'))
				j++;
			s = (struct scan){text + i, j - i, 0, true};
			if (scan_number(&s, &v) == 0 && s.i == j - i) {
				if (refused_number(text + i, j - i, &refused) < 0)
					return -ENOMEM;
			}
			if (refused) {
				(*n)++;
				if (out && (buf_append(out, text + copied, i - copied) < 0 ||
				            buf_append(out, c == '-' ? "-1e300" : "1e300",
				                       c == '-' ? 6 : 5) < 0))
					return -ENOMEM;
				copied = j;
			}
			i = j;
			continue;
		}
		i++;
	}
	if (out && *n && buf_append(out, text + copied, len - copied) < 0)
		return -ENOMEM;
	return 0;
}
