/* DynamoDB item codec: message maps to items and back, AttributeValue JSON, DynamoDB's
 * size and nesting rules, and the bodies of BatchWriteItem, Query and CreateTable. */
#include "ddbitem.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buf.h"
#include "ops.h"

/* Recursion bound for values of any origin; far above what DynamoDB stores, so it only
 * stops a hostile input from exhausting the stack. */
#define NEST_GUARD 256
#define NUMBER_TEXT_MAX 48

static enum error_code oom(struct error *err)
{
	return error_set(err, ERR_INTERNAL, "out of memory");
}

/* Prefixes err's message with where (for errors raised deep inside a value). */
static enum error_code prefix_error(struct error *err, enum error_code code, const char *where)
{
	if (err && code != ERR_OK && code != ERR_INTERNAL) {
		char tmp[sizeof(err->message)];
		memcpy(tmp, err->message, sizeof(tmp));
		error_set(err, code, "%s: %s", where, tmp);
	}
	return code;
}

/* Length of a key met by json_object_foreach (keys may hold NUL bytes). */
static size_t key_len(const char *key)
{
	return json_object_iter_key_len(json_object_key_to_iter(key));
}

/* {tag: val}; steals val (also on failure); NULL on allocation failure. */
static json_t *tagged(const char *tag, json_t *val)
{
	json_t *o;
	if (!val)
		return NULL;
	o = json_object();
	if (!o) {
		json_decref(val);
		return NULL;
	}
	if (json_object_set_new(o, tag, val) != 0) {
		json_decref(o);
		return NULL;
	}
	return o;
}

/* ---- numbers ---- */

/* The N text of a JSON number. A real gets the shortest text that reads back as the same
 * double, with ".0" added when that text looks like an integer. */
static enum error_code number_text(const json_t *v, char buf[NUMBER_TEXT_MAX], struct error *err)
{
	double d, a;
	int prec, exp10;
	char *e;
	if (json_is_integer(v)) {
		snprintf(buf, NUMBER_TEXT_MAX, "%" JSON_INTEGER_FORMAT, json_integer_value(v));
		return ERR_OK;
	}
	d = json_real_value(v);
	a = fabs(d);
	/* DynamoDB's range: 1E-130 to 9.9999999999999999999999999999999999999E+125 */
	if (!isfinite(d) || a >= 1e126 || (a != 0 && a < 1e-130))
		return error_set(err, ERR_BAD_REQUEST,
		                 "number %.17g is outside DynamoDB's range (1e-130 to 1e126)", d);
	for (prec = 1; prec <= 17; prec++) {
		snprintf(buf, NUMBER_TEXT_MAX, "%.*g", prec, d);
		if (strtod(buf, NULL) == d)
			break;
	}
	/* %g turns 100 into 1e+02 at one digit: below 1e17 plain digits read better */
	e = strchr(buf, 'e');
	if (e && (exp10 = atoi(e + 1)) >= prec && exp10 < 17) {
		char plain[NUMBER_TEXT_MAX];
		snprintf(plain, sizeof(plain), "%.*g", exp10 + 1, d);
		if (strtod(plain, NULL) == d)
			memcpy(buf, plain, sizeof(plain));
	}
	if (!strpbrk(buf, ".eE"))
		strcat(buf, ".0");
	return ERR_OK;
}

/* Checks N text: -?digits[.digits][(e|E)[+-]digits], at least one mantissa digit (".5" and
 * "5." allowed). *integer tells whether it is a plain -?digits. */
static bool number_syntax(const char *s, bool *integer)
{
	size_t mantissa = 0;
	bool plain = true;
	if (*s == '-')
		s++;
	while (*s >= '0' && *s <= '9') {
		s++;
		mantissa++;
	}
	if (*s == '.') {
		plain = false;
		s++;
		while (*s >= '0' && *s <= '9') {
			s++;
			mantissa++;
		}
	}
	if (mantissa == 0)
		return false;
	if (*s == 'e' || *s == 'E') {
		size_t exp = 0;
		plain = false;
		s++;
		if (*s == '+' || *s == '-')
			s++;
		while (*s >= '0' && *s <= '9') {
			s++;
			exp++;
		}
		if (exp == 0)
			return false;
	}
	*integer = plain;
	return *s == '\0';
}

static json_t *number_json(const char *s, struct error *err)
{
	bool integer = false;
	double d;
	if (!number_syntax(s, &integer)) {
		error_set(err, ERR_BAD_REQUEST, "N \"%.40s\" is not a number", s);
		return NULL;
	}
	if (integer) {
		char *end;
		long long ll;
		errno = 0;
		ll = strtoll(s, &end, 10);
		if (errno == 0 && *end == '\0') {
			json_t *j = json_integer((json_int_t)ll);
			if (!j)
				oom(err);
			return j;
		}
	}
	d = strtod(s, NULL);
	if (!isfinite(d)) {
		error_set(err, ERR_BAD_REQUEST, "N \"%.40s\" does not fit a double", s);
		return NULL;
	}
	json_t *j = json_real(d);
	if (!j)
		oom(err);
	return j;
}

/* floor(v / 2), for negative v too */
static long floor_half(long v)
{
	return v >= 0 ? v / 2 : -((1 - v) / 2);
}

/* Bytes DynamoDB counts for N text (valid for number_syntax): its significant digits
 * (leading and trailing zeros trimmed) as base-100 digits aligned on the decimal point,
 * plus one, plus one more when it is negative; zero is one byte. So 12 and 0.15 take 2
 * bytes, 120, 1.5 and -1 take 3. The Developer Guide only says "approximately one byte per
 * two significant digits, plus one", which undercounts those: an item it said fitted was
 * then refused by DynamoDB as too large. The alignment is what dynalite, whose sizes were
 * taken from DynamoDB's answers, counts. Only the exponent's parity moves the alignment. */
static size_t number_size(const char *s)
{
	bool neg = *s == '-', seen = false;
	long intdigits = 0, pos = 0, hi = 0, lo = 0, odd = 0;
	const char *p = s + neg;

	for (const char *q = p; *q >= '0' && *q <= '9'; q++)
		intdigits++;
	for (; *p && *p != 'e' && *p != 'E'; p++) {
		long power;
		if (*p == '.')
			continue;
		power = intdigits - 1 - pos++;
		if (*p != '0') {
			if (!seen)
				hi = power;
			seen = true;
			lo = power;
		}
	}
	if (!seen)
		return 1;
	if (*p) /* the exponent, whose last character is a digit */
		odd = (p[strlen(p) - 1] - '0') & 1;
	return (size_t)(floor_half(hi + odd) - floor_half(lo + odd) + 1) + 1 + (neg ? 1 : 0);
}

/* ---- JSON <-> AttributeValue ---- */

static enum error_code from_json(const json_t *v, int level, json_t **out, struct error *err)
{
	char num[NUMBER_TEXT_MAX];
	json_t *c = NULL, *r = NULL;
	enum error_code rc;

	*out = NULL;
	if (level > NEST_GUARD)
		return error_set(err, ERR_BAD_REQUEST, "nested deeper than %d levels", NEST_GUARD);
	switch (json_typeof(v)) {
	case JSON_OBJECT: {
		const char *key;
		json_t *val;
		c = json_object();
		if (!c)
			return oom(err);
		json_object_foreach((json_t *)v, key, val)
		{
			json_t *a;
			rc = from_json(val, level + 1, &a, err);
			if (rc != ERR_OK) {
				json_decref(c);
				return rc;
			}
			if (json_object_setn_new(c, key, key_len(key), a) != 0) {
				json_decref(c);
				return oom(err);
			}
		}
		r = tagged("M", c);
		break;
	}
	case JSON_ARRAY: {
		size_t i;
		json_t *val;
		c = json_array();
		if (!c)
			return oom(err);
		json_array_foreach(v, i, val)
		{
			json_t *a;
			rc = from_json(val, level + 1, &a, err);
			if (rc != ERR_OK) {
				json_decref(c);
				return rc;
			}
			if (json_array_append_new(c, a) != 0) {
				json_decref(c);
				return oom(err);
			}
		}
		r = tagged("L", c);
		break;
	}
	case JSON_STRING:
		r = tagged("S", json_stringn_nocheck(json_string_value(v), json_string_length(v)));
		break;
	case JSON_INTEGER:
	case JSON_REAL:
		rc = number_text(v, num, err);
		if (rc != ERR_OK)
			return rc;
		r = tagged("N", json_string(num));
		break;
	case JSON_TRUE:
	case JSON_FALSE:
		r = tagged("BOOL", json_boolean(json_is_true(v)));
		break;
	case JSON_NULL:
		r = tagged("NULL", json_true());
		break;
	}
	if (!r)
		return oom(err);
	*out = r;
	return ERR_OK;
}

enum error_code ddbitem_attr_from_json(const json_t *v, json_t **out, struct error *err)
{
	if (!v || !out)
		return error_set(err, ERR_BAD_REQUEST, "no value");
	return from_json(v, 1, out, err);
}

/* The one (tag, value) pair of an AttributeValue; false if av is not an object of exactly
 * one member. */
static bool av_parts(const json_t *av, const char **tag, json_t **val)
{
	void *it;
	if (!json_is_object(av) || json_object_size(av) != 1)
		return false;
	it = json_object_iter((json_t *)av);
	*tag = json_object_iter_key(it);
	*val = json_object_iter_value(it);
	return true;
}

static enum error_code to_json(const json_t *av, int level, json_t **out, struct error *err)
{
	const char *tag;
	json_t *val, *r = NULL;
	enum error_code rc;

	*out = NULL;
	if (level > NEST_GUARD)
		return error_set(err, ERR_BAD_REQUEST, "nested deeper than %d levels", NEST_GUARD);
	if (!av_parts(av, &tag, &val))
		return error_set(err, ERR_BAD_REQUEST,
		                 "an AttributeValue must be an object of one member");
	if (strcmp(tag, "S") == 0) {
		if (!json_is_string(val))
			return error_set(err, ERR_BAD_REQUEST, "S: expected a string");
		r = json_stringn_nocheck(json_string_value(val), json_string_length(val));
	} else if (strcmp(tag, "N") == 0) {
		if (!json_is_string(val))
			return error_set(err, ERR_BAD_REQUEST, "N: expected a string");
		r = number_json(json_string_value(val), err);
		if (!r)
			return err ? err->code : ERR_BAD_REQUEST;
	} else if (strcmp(tag, "BOOL") == 0) {
		if (!json_is_boolean(val))
			return error_set(err, ERR_BAD_REQUEST, "BOOL: expected true or false");
		r = json_boolean(json_is_true(val));
	} else if (strcmp(tag, "NULL") == 0) {
		if (!json_is_true(val))
			return error_set(err, ERR_BAD_REQUEST, "NULL: expected true");
		r = json_null();
	} else if (strcmp(tag, "L") == 0) {
		size_t i;
		json_t *e;
		if (!json_is_array(val))
			return error_set(err, ERR_BAD_REQUEST, "L: expected an array");
		r = json_array();
		if (!r)
			return oom(err);
		json_array_foreach(val, i, e)
		{
			json_t *j;
			rc = to_json(e, level + 1, &j, err);
			if (rc != ERR_OK) {
				json_decref(r);
				return rc;
			}
			if (json_array_append_new(r, j) != 0) {
				json_decref(r);
				return oom(err);
			}
		}
	} else if (strcmp(tag, "M") == 0) {
		const char *key;
		json_t *e;
		if (!json_is_object(val))
			return error_set(err, ERR_BAD_REQUEST, "M: expected an object");
		r = json_object();
		if (!r)
			return oom(err);
		json_object_foreach(val, key, e)
		{
			json_t *j;
			rc = to_json(e, level + 1, &j, err);
			if (rc != ERR_OK) {
				json_decref(r);
				return rc;
			}
			if (json_object_setn_new(r, key, key_len(key), j) != 0) {
				json_decref(r);
				return oom(err);
			}
		}
	} else {
		return error_set(err, ERR_BAD_REQUEST, "unsupported AttributeValue type \"%.16s\"",
		                 tag);
	}
	if (!r)
		return oom(err);
	*out = r;
	return ERR_OK;
}

enum error_code ddbitem_attr_to_json(const json_t *av, json_t **out, struct error *err)
{
	if (!av || !out)
		return error_set(err, ERR_BAD_REQUEST, "no AttributeValue");
	return to_json(av, 1, out, err);
}

/* ---- size and depth ---- */

/* Bytes of base64 text once decoded; false if it is not base64's shape. */
static bool base64_size(const char *s, size_t len, size_t *out)
{
	size_t pad = 0;
	if (len % 4 != 0)
		return false;
	if (len >= 1 && s[len - 1] == '=')
		pad++;
	if (len >= 2 && s[len - 2] == '=')
		pad++;
	*out = len / 4 * 3 - pad;
	return true;
}

/* Size of one AttributeValue without its name. The rules are those of the DynamoDB
 * Developer Guide, "DynamoDB item sizes and formats" (CapacityUnitCalculations.html):
 * a String counts its UTF-8 bytes; a Number one byte per base-100 digit plus one (see
 * number_size); a Binary its raw bytes; Null and Boolean
 * one byte; a List or Map 3 bytes of overhead plus the sizes of its elements, each element
 * one byte more, and a Map element also the UTF-8 bytes of its name. Sets are never
 * written by this codec and are refused. */
static int av_size(const json_t *av, int level, size_t *size)
{
	const char *tag;
	json_t *val;
	size_t total = 0, part;

	if (level > NEST_GUARD || !av_parts(av, &tag, &val))
		return -EINVAL;
	if (strcmp(tag, "S") == 0 && json_is_string(val)) {
		total = json_string_length(val);
	} else if (strcmp(tag, "N") == 0 && json_is_string(val)) {
		bool integer;
		if (!number_syntax(json_string_value(val), &integer))
			return -EINVAL;
		total = number_size(json_string_value(val));
	} else if (strcmp(tag, "B") == 0 && json_is_string(val)) {
		if (!base64_size(json_string_value(val), json_string_length(val), &total))
			return -EINVAL;
	} else if ((strcmp(tag, "BOOL") == 0 && json_is_boolean(val)) ||
	           (strcmp(tag, "NULL") == 0 && json_is_true(val))) {
		total = 1;
	} else if (strcmp(tag, "L") == 0 && json_is_array(val)) {
		size_t i;
		json_t *e;
		total = 3;
		json_array_foreach(val, i, e)
		{
			if (av_size(e, level + 1, &part) != 0)
				return -EINVAL;
			total += 1 + part;
		}
	} else if (strcmp(tag, "M") == 0 && json_is_object(val)) {
		const char *key;
		json_t *e;
		total = 3;
		json_object_foreach(val, key, e)
		{
			if (av_size(e, level + 1, &part) != 0)
				return -EINVAL;
			total += 1 + key_len(key) + part;
		}
	} else {
		return -EINVAL;
	}
	*size = total;
	return 0;
}

int ddbitem_size(const json_t *item, size_t *size)
{
	const char *name;
	json_t *av;
	size_t total = 0, part;
	if (!json_is_object(item) || !size)
		return -EINVAL;
	json_object_foreach((json_t *)item, name, av)
	{
		if (av_size(av, 1, &part) != 0)
			return -EINVAL;
		total += key_len(name) + part;
	}
	*size = total;
	return 0;
}

static int av_depth(const json_t *av, int level, int *depth)
{
	const char *tag;
	json_t *val, *e;
	int deepest = 1, d;

	if (level > NEST_GUARD || !av_parts(av, &tag, &val))
		return -EINVAL;
	if (strcmp(tag, "L") == 0 || strcmp(tag, "M") == 0) {
		/* an empty container counts as if it held a scalar: DynamoDB's exact rule for
		 * it is not documented, and refusing one level early is the safe side */
		deepest = 2;
		if (json_is_array(val)) {
			size_t i;
			json_array_foreach(val, i, e)
			{
				if (av_depth(e, level + 1, &d) != 0)
					return -EINVAL;
				if (d + 1 > deepest)
					deepest = d + 1;
			}
		} else if (json_is_object(val)) {
			const char *key;
			json_object_foreach(val, key, e)
			{
				if (av_depth(e, level + 1, &d) != 0)
					return -EINVAL;
				if (d + 1 > deepest)
					deepest = d + 1;
			}
		} else {
			return -EINVAL;
		}
	}
	*depth = deepest;
	return 0;
}

int ddbitem_depth(const json_t *item, int *depth)
{
	const char *name;
	json_t *av;
	int deepest = 0, d;
	if (!json_is_object(item) || !depth)
		return -EINVAL;
	json_object_foreach((json_t *)item, name, av)
	{
		if (av_depth(av, 1, &d) != 0)
			return -EINVAL;
		if (d > deepest)
			deepest = d;
	}
	*depth = deepest;
	return 0;
}

/* ---- message maps ---- */

/* The parts of a valid message map, borrowed. */
struct map_parts {
	const char *id;
	const char *role;
	const json_t *contents;
	const json_t *metadata; /* NULL when absent; the four below are NULL when absent */
	const json_t *attribute;
	const json_t *summary_ids;
	const json_t *timing;
	const json_t *aux;
};

/* The shape of a message id as far as the sort key needs it: a ULID is 26 characters of
 * Crockford base32, all of which sort below '~'. */
static bool id_ok(const json_t *v)
{
	const char *s = json_string_value(v);
	if (!s || json_string_length(v) != ULID_LEN)
		return false;
	for (size_t i = 0; i < ULID_LEN; i++)
		if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'A' && s[i] <= 'Z')))
			return false;
	return true;
}

static bool string_array(const json_t *a)
{
	size_t i;
	json_t *e;
	if (!json_is_array(a))
		return false;
	json_array_foreach(a, i, e) if (!json_is_string(e)) return false;
	return true;
}

static enum error_code unknown_field(const json_t *obj, const char *const *known, const char *where,
                                     struct error *err)
{
	const char *key;
	json_t *v;
	json_object_foreach((json_t *)obj, key, v)
	{
		bool ok = false;
		for (const char *const *k = known; *k; k++)
			if (strcmp(key, *k) == 0 && strlen(key) == key_len(key))
				ok = true;
		if (!ok)
			return error_set(err, ERR_BAD_REQUEST, "%sunknown field \"%.40s\"", where,
			                 key);
	}
	return ERR_OK;
}

static enum error_code map_parse(const json_t *map, struct map_parts *p, struct error *err)
{
	static const char *const map_keys[] = {"id", "message", "metadata", NULL};
	static const char *const message_keys[] = {"role", "contents", NULL};
	static const char *const metadata_keys[] = {"attribute", "summaryIds", "timing", "aux",
	                                            NULL};
	const json_t *message, *v;
	const char *key;
	enum error_code rc;

	memset(p, 0, sizeof(*p));
	if (!json_is_object(map))
		return error_set(err, ERR_BAD_REQUEST, "message map: expected an object");
	rc = unknown_field(map, map_keys, "message map: ", err);
	if (rc != ERR_OK)
		return rc;
	if (!id_ok(json_object_get(map, "id")))
		return error_set(err, ERR_BAD_REQUEST, "id: expected a ULID");
	p->id = json_string_value(json_object_get(map, "id"));
	message = json_object_get(map, "message");
	if (!json_is_object(message))
		return error_set(err, ERR_BAD_REQUEST, "message: expected an object");
	rc = unknown_field(message, message_keys, "message: ", err);
	if (rc != ERR_OK)
		return rc;
	p->role = json_string_value(json_object_get(message, "role"));
	if (!p->role || (strcmp(p->role, "user") != 0 && strcmp(p->role, "assistant") != 0 &&
	                 strcmp(p->role, "summary") != 0))
		return error_set(err, ERR_BAD_REQUEST,
		                 "message.role: expected user, assistant or summary");
	p->contents = json_object_get(message, "contents");
	if (!string_array(p->contents))
		return error_set(err, ERR_BAD_REQUEST,
		                 "message.contents: expected an array of strings");
	p->metadata = json_object_get(map, "metadata");
	if (!p->metadata)
		return ERR_OK;
	if (!json_is_object(p->metadata))
		return error_set(err, ERR_BAD_REQUEST, "metadata: expected an object");
	rc = unknown_field(p->metadata, metadata_keys, "metadata: ", err);
	if (rc != ERR_OK)
		return rc;
	p->attribute = json_object_get(p->metadata, "attribute");
	if (p->attribute && !string_array(p->attribute))
		return error_set(err, ERR_BAD_REQUEST,
		                 "metadata.attribute: expected an array of strings");
	p->summary_ids = json_object_get(p->metadata, "summaryIds");
	if (p->summary_ids && !string_array(p->summary_ids))
		return error_set(err, ERR_BAD_REQUEST,
		                 "metadata.summaryIds: expected an array of strings");
	p->timing = json_object_get(p->metadata, "timing");
	if (p->timing) {
		if (!json_is_object(p->timing))
			return error_set(err, ERR_BAD_REQUEST,
			                 "metadata.timing: expected an object");
		json_object_foreach((json_t *)p->timing, key, v)
		{
			if (!json_is_integer(v) || json_integer_value(v) < 0)
				return error_set(err, ERR_BAD_REQUEST,
				                 "metadata.timing.%.40s: expected an integer >= 0",
				                 key);
		}
	}
	p->aux = json_object_get(p->metadata, "aux");
	if (p->aux && !json_is_object(p->aux))
		return error_set(err, ERR_BAD_REQUEST, "metadata.aux: expected an object");
	return ERR_OK;
}

static enum error_code sort_key_of(const struct map_parts *p, char out[DDBITEM_SK_MAX + 1],
                                   struct error *err)
{
	if (strcmp(p->role, "summary") == 0) {
		size_t n = p->summary_ids ? json_array_size(p->summary_ids) : 0;
		const json_t *last = n ? json_array_get(p->summary_ids, n - 1) : NULL;
		if (!id_ok(last))
			return error_set(err, ERR_BAD_REQUEST,
			                 "metadata.summaryIds: a summary needs the ids it "
			                 "summarizes, the last one a ULID");
		snprintf(out, DDBITEM_SK_MAX + 1, "%s~%s", json_string_value(last), p->id);
	} else {
		snprintf(out, DDBITEM_SK_MAX + 1, "%s", p->id);
	}
	return ERR_OK;
}

enum error_code ddbitem_sort_key(const json_t *map, char out[DDBITEM_SK_MAX + 1], struct error *err)
{
	struct map_parts p;
	enum error_code rc = map_parse(map, &p, err);
	if (rc != ERR_OK)
		return rc;
	return sort_key_of(&p, out, err);
}

static enum error_code conversation_ok(const char *conversation, struct error *err)
{
	if (!conversation || !*conversation)
		return error_set(err, ERR_BAD_REQUEST, "conversation: expected a non-empty id");
	if (strlen(conversation) > DDBITEM_PARTITION_KEY_MAX)
		return error_set(err, ERR_TOO_LARGE,
		                 "conversation: DynamoDB keys hold at most %d bytes",
		                 DDBITEM_PARTITION_KEY_MAX);
	/* Checked without allocating: a refused allocation is not invalid UTF-8 (it was, when
	 * json_string's NULL said both, and a write dead-lettered for want of memory). */
	if (!buf_utf8_valid(conversation, strlen(conversation)))
		return error_set(err, ERR_BAD_REQUEST, "conversation: expected UTF-8");
	return ERR_OK;
}

/* Sets obj[name] to the AttributeValue of v; where names v in error messages. */
static enum error_code set_attr(json_t *obj, const char *name, const json_t *v, const char *where,
                                struct error *err)
{
	json_t *a;
	enum error_code rc = ddbitem_attr_from_json(v, &a, err);
	if (rc != ERR_OK)
		return prefix_error(err, rc, where);
	if (json_object_set_new(obj, name, a) != 0)
		return oom(err);
	return ERR_OK;
}

static enum error_code set_tagged(json_t *obj, const char *name, const char *tag, json_t *val,
                                  struct error *err)
{
	json_t *a = tagged(tag, val);
	if (!a || json_object_set_new(obj, name, a) != 0)
		return oom(err);
	return ERR_OK;
}

static enum error_code set_number(json_t *obj, const char *name, int64_t n, struct error *err)
{
	char buf[NUMBER_TEXT_MAX];
	snprintf(buf, sizeof(buf), "%" PRId64, n);
	return set_tagged(obj, name, "N", json_string(buf), err);
}

enum error_code ddbitem_from_map(const char *conversation, const json_t *map, uint32_t version,
                                 int64_t updated_ms, int64_t expires_s, json_t **item,
                                 struct error *err)
{
	struct map_parts p;
	char sk[DDBITEM_SK_MAX + 1];
	json_t *it = NULL, *message = NULL, *metadata = NULL;
	enum error_code rc;

	if (!item)
		return error_set(err, ERR_BAD_REQUEST, "no output");
	*item = NULL;
	rc = conversation_ok(conversation, err);
	if (rc == ERR_OK)
		rc = map_parse(map, &p, err);
	if (rc == ERR_OK)
		rc = sort_key_of(&p, sk, err);
	if (rc != ERR_OK)
		return rc;
	if (version == 0)
		return error_set(err, ERR_BAD_REQUEST, "version: expected at least 1");
	if (updated_ms < 0)
		return error_set(err, ERR_BAD_REQUEST, "updated: expected Unix ms >= 0");

	it = json_object();
	message = json_object();
	if (!it || !message) {
		rc = oom(err);
		goto out;
	}
	if ((rc = set_tagged(it, "conversation", "S", json_string_nocheck(conversation), err)) ||
	    (rc = set_tagged(it, "sk", "S", json_string_nocheck(sk), err)) ||
	    (rc = set_tagged(it, "id", "S", json_string_nocheck(p.id), err)) ||
	    (rc = set_tagged(message, "role", "S", json_string_nocheck(p.role), err)) ||
	    (rc = set_attr(message, "contents", p.contents, "message.contents", err)))
		goto out;
	rc = set_tagged(it, "message", "M", message, err);
	message = NULL; /* stolen */
	if (rc)
		goto out;
	if (p.metadata) {
		metadata = json_object();
		if (!metadata) {
			rc = oom(err);
			goto out;
		}
		if ((p.attribute && (rc = set_attr(metadata, "attribute", p.attribute,
		                                   "metadata.attribute", err))) ||
		    (p.summary_ids && (rc = set_attr(metadata, "summaryIds", p.summary_ids,
		                                     "metadata.summaryIds", err))) ||
		    (p.timing &&
		     (rc = set_attr(metadata, "timing", p.timing, "metadata.timing", err))) ||
		    (p.aux && (rc = set_attr(metadata, "aux", p.aux, "metadata.aux", err))))
			goto out;
		rc = set_tagged(it, "metadata", "M", metadata, err);
		metadata = NULL;
		if (rc)
			goto out;
	}
	if ((rc = set_number(it, "version", version, err)) ||
	    (rc = set_number(it, "updated", updated_ms, err)) ||
	    (expires_s > 0 && (rc = set_number(it, "expires", expires_s, err))))
		goto out;
	*item = it;
	it = NULL;
out:
	json_decref(it);
	json_decref(message);
	json_decref(metadata);
	return rc;
}

/* obj[name] when it is {tag: value}: the value, else NULL. */
static json_t *typed(const json_t *obj, const char *name, const char *tag)
{
	const char *t;
	json_t *v;
	if (!av_parts(json_object_get(obj, name), &t, &v) || strcmp(t, tag) != 0)
		return NULL;
	return v;
}

/* Converts obj[name] (an AttributeValue) and stores it in dst under name. */
static enum error_code copy_attr(json_t *dst, const json_t *obj, const char *name,
                                 const char *where, struct error *err)
{
	json_t *j;
	enum error_code rc = ddbitem_attr_to_json(json_object_get(obj, name), &j, err);
	if (rc != ERR_OK)
		return prefix_error(err, rc, where);
	if (json_object_set_new(dst, name, j) != 0)
		return oom(err);
	return ERR_OK;
}

/* An N attribute of integer value in [min, max]. */
static enum error_code item_integer(const json_t *item, const char *name, int64_t min, int64_t max,
                                    int64_t *out, struct error *err)
{
	json_t *n = typed(item, name, "N"), *j;
	if (!json_is_string(n))
		return error_set(err, ERR_BAD_REQUEST, "item.%s: expected an N", name);
	j = number_json(json_string_value(n), err);
	if (!j)
		return prefix_error(err, err ? err->code : ERR_BAD_REQUEST, name);
	if (!json_is_integer(j) || json_integer_value(j) < min || json_integer_value(j) > max) {
		json_decref(j);
		return error_set(err, ERR_BAD_REQUEST,
		                 "item.%s: expected an integer in [%" PRId64 ", %" PRId64 "]", name,
		                 min, max);
	}
	*out = json_integer_value(j);
	json_decref(j);
	return ERR_OK;
}

enum error_code ddbitem_to_map(const json_t *item, const char **conversation, json_t **map,
                               uint32_t *version, int64_t *updated_ms, struct error *err)
{
	static const char *const message_keys[] = {"role", "contents", NULL};
	static const char *const metadata_keys[] = {"attribute", "summaryIds", "timing", "aux",
	                                            NULL};
	const char *conv, *sk;
	json_t *m = NULL, *message = NULL, *metadata = NULL, *src_message, *src_metadata, *id;
	struct map_parts p;
	char expected_sk[DDBITEM_SK_MAX + 1];
	int64_t ver = 0, upd = 0;
	enum error_code rc;

	if (!json_is_object(item))
		return error_set(err, ERR_BAD_REQUEST, "item: expected an object");
	if (ddbitem_key(item, &conv, &sk) != 0)
		return error_set(err, ERR_BAD_REQUEST, "item: no conversation and sk strings");
	id = typed(item, "id", "S");
	src_message = typed(item, "message", "M");
	if (!json_is_string(id) || !json_is_object(src_message))
		return error_set(err, ERR_BAD_REQUEST, "item: expected id (S) and message (M)");
	rc = item_integer(item, "version", 1, UINT32_MAX, &ver, err);
	if (rc == ERR_OK)
		rc = item_integer(item, "updated", 0, INT64_MAX, &upd, err);
	if (rc == ERR_OK)
		rc = unknown_field(src_message, message_keys, "item.message: ", err);
	if (rc != ERR_OK)
		return rc;

	m = json_object();
	message = json_object();
	if (!m || !message ||
	    json_object_set_new(
	        m, "id", json_stringn_nocheck(json_string_value(id), json_string_length(id)))) {
		rc = oom(err);
		goto out;
	}
	if ((rc = copy_attr(message, src_message, "role", "item.message.role", err)) ||
	    (rc = copy_attr(message, src_message, "contents", "item.message.contents", err)))
		goto out;
	rc = json_object_set_new(m, "message", message) ? oom(err) : ERR_OK;
	message = NULL;
	if (rc)
		goto out;
	if (json_object_get(item, "metadata")) {
		src_metadata = typed(item, "metadata", "M");
		if (!json_is_object(src_metadata)) {
			rc = error_set(err, ERR_BAD_REQUEST, "item.metadata: expected an M");
			goto out;
		}
		rc = unknown_field(src_metadata, metadata_keys, "item.metadata: ", err);
		if (rc)
			goto out;
		metadata = json_object();
		if (!metadata) {
			rc = oom(err);
			goto out;
		}
		/* in the order of message maps, whatever order the item has */
		for (const char *const *k = metadata_keys; *k; k++) {
			if (json_object_get(src_metadata, *k) &&
			    (rc = copy_attr(metadata, src_metadata, *k, "item.metadata", err)))
				goto out;
		}
		rc = json_object_set_new(m, "metadata", metadata) ? oom(err) : ERR_OK;
		metadata = NULL;
		if (rc)
			goto out;
	}
	/* what comes back must be a map the codec could have written, under the same key */
	rc = map_parse(m, &p, err);
	if (rc == ERR_OK)
		rc = sort_key_of(&p, expected_sk, err);
	if (rc != ERR_OK) {
		prefix_error(err, rc, "item");
		goto out;
	}
	if (strcmp(sk, expected_sk) != 0) {
		rc = error_set(err, ERR_BAD_REQUEST,
		               "item: sk \"%.60s\" does not match the message", sk);
		goto out;
	}
	if (conversation)
		*conversation = conv;
	if (version)
		*version = (uint32_t)ver;
	if (updated_ms)
		*updated_ms = upd;
	if (map) {
		*map = m;
		m = NULL;
	}
	rc = ERR_OK;
out:
	json_decref(m);
	json_decref(message);
	json_decref(metadata);
	return rc;
}

int ddbitem_key(const json_t *item, const char **conversation, const char **sk)
{
	json_t *c = typed(item, "conversation", "S"), *s = typed(item, "sk", "S");
	if (!json_is_string(c) || !json_is_string(s) || json_string_length(c) == 0 ||
	    json_string_length(s) == 0)
		return -EINVAL;
	if (conversation)
		*conversation = json_string_value(c);
	if (sk)
		*sk = json_string_value(s);
	return 0;
}

enum error_code ddbitem_check(const json_t *map, const char *conversation, struct error *err)
{
	const json_t *contents;
	size_t i, text = 0, size = 0;
	json_t *e, *item = NULL;
	int depth = 0;
	enum error_code rc = conversation_ok(conversation, err);

	if (rc != ERR_OK)
		return rc;
	/* a message far over the limit is refused before a copy of it is built */
	contents = json_object_get(json_object_get(map, "message"), "contents");
	json_array_foreach(contents, i, e) text += json_string_length(e);
	if (text > DDBITEM_MAX_BYTES)
		return error_set(err, ERR_TOO_LARGE,
		                 "message: %zu bytes of contents, over DynamoDB's item limit of "
		                 "%d bytes",
		                 text, DDBITEM_MAX_BYTES);
	/* the largest values these numbers can take, so that later changes never grow the
	 * item past what was checked here */
	rc = ddbitem_from_map(conversation, map, UINT32_MAX, INT64_MAX, INT64_MAX, &item, err);
	if (rc != ERR_OK)
		return rc;
	if (ddbitem_depth(item, &depth) != 0 || ddbitem_size(item, &size) != 0) {
		rc = error_set(err, ERR_INTERNAL, "item: cannot measure");
	} else if (depth > DDBITEM_MAX_DEPTH) {
		rc = error_set(err, ERR_TOO_LARGE,
		               "metadata.aux: nested %d levels deep in the DynamoDB item, over "
		               "DynamoDB's limit of %d",
		               depth, DDBITEM_MAX_DEPTH);
	} else if (size > DDBITEM_MAX_BYTES) {
		rc = error_set(err, ERR_TOO_LARGE,
		               "message: its DynamoDB item would take %zu bytes, over the limit of "
		               "%d bytes",
		               size, DDBITEM_MAX_BYTES);
	}
	json_decref(item);
	return rc;
}

/* ---- requests and answers ---- */

bool ddbitem_table_name_valid(const char *table)
{
	size_t n = table ? strlen(table) : 0;
	if (n < 3 || n > 255)
		return false;
	for (size_t i = 0; i < n; i++) {
		char c = table[i];
		if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
		      c == '_' || c == '-' || c == '.'))
			return false;
	}
	return true;
}

static enum error_code table_ok(const char *table, struct error *err)
{
	if (!ddbitem_table_name_valid(table))
		return error_set(err, ERR_BAD_REQUEST,
		                 "table: expected 3 to 255 of A-Z a-z 0-9 _ - .");
	return ERR_OK;
}

enum error_code ddbitem_batch_write_request(const char *table, json_t *const *items, size_t n,
                                            json_t **out, struct error *err)
{
	json_t *body = NULL, *list = NULL, *req;
	enum error_code rc = table_ok(table, err);

	if (rc != ERR_OK)
		return rc;
	if (!out || !items || n == 0 || n > DDBITEM_BATCH_MAX)
		return error_set(err, ERR_BAD_REQUEST, "batch: expected 1 to %d items",
		                 DDBITEM_BATCH_MAX);
	*out = NULL;
	for (size_t i = 0; i < n; i++) {
		const char *ci, *si, *cj, *sj;
		if (!json_is_object(items[i]) || ddbitem_key(items[i], &ci, &si) != 0)
			return error_set(err, ERR_BAD_REQUEST, "batch: item %zu has no key", i);
		for (size_t j = 0; j < i; j++) {
			ddbitem_key(items[j], &cj, &sj);
			if (strcmp(ci, cj) == 0 && strcmp(si, sj) == 0)
				return error_set(err, ERR_BAD_REQUEST,
				                 "batch: items %zu and %zu have the same key", j,
				                 i);
		}
	}
	list = json_array();
	if (!list)
		return oom(err);
	for (size_t i = 0; i < n; i++) {
		json_t *put = json_object();
		req = tagged("PutRequest", put); /* owns put */
		if (!req) {
			json_decref(list);
			return oom(err);
		}
		if (json_object_set(put, "Item", items[i]) != 0) {
			json_decref(req);
			json_decref(list);
			return oom(err);
		}
		if (json_array_append_new(list, req) != 0) {
			json_decref(list);
			return oom(err);
		}
	}
	body = json_pack("{s:{s:o}}", "RequestItems", table, list);
	if (!body)
		return oom(err);
	*out = body;
	return ERR_OK;
}

/* The answer's JSON object, or NULL with *rc ERR_BAD_REQUEST, or ERR_INTERNAL when jansson
 * ran out of memory: it may then report a syntax error or drop a byte of a string, so a
 * failed allocation would pass for a broken answer or give a wrong item (sink_alloc_probe). */
static json_t *load_answer(const char *body, size_t len, const char *what, struct error *err,
                           enum error_code *rc)
{
	json_error_t jerr;
	json_t *root;
	bool no_memory;

	*rc = ERR_BAD_REQUEST;
	if (!body) {
		error_set(err, ERR_BAD_REQUEST, "%s: no answer", what);
		return NULL;
	}
	root = ops_json_loadb(body, len, JSON_ALLOW_NUL, &jerr, &no_memory);
	if (no_memory) {
		*rc = oom(err);
		return NULL;
	}
	if (!root) {
		error_set(err, ERR_BAD_REQUEST, "%s: not JSON: %.80s", what, jerr.text);
		return NULL;
	}
	if (!json_is_object(root)) {
		json_decref(root);
		error_set(err, ERR_BAD_REQUEST, "%s: expected an object", what);
		return NULL;
	}
	return root;
}

enum error_code ddbitem_batch_write_parse(const char *body, size_t len, const char *table,
                                          json_t **unprocessed, struct error *err)
{
	json_t *root = NULL, *result = NULL, *ui, *list, *e;
	const char *key;
	size_t i;
	enum error_code rc = table_ok(table, err);

	if (rc != ERR_OK)
		return rc;
	if (!unprocessed)
		return error_set(err, ERR_BAD_REQUEST, "no output");
	*unprocessed = NULL;
	root = load_answer(body, len, "BatchWriteItem answer", err, &rc);
	if (!root)
		return rc;
	result = json_array();
	if (!result) {
		rc = oom(err);
		goto out;
	}
	ui = json_object_get(root, "UnprocessedItems");
	if (ui && !json_is_null(ui) && !json_is_object(ui)) {
		rc = error_set(err, ERR_BAD_REQUEST,
		               "BatchWriteItem answer: UnprocessedItems is not an object");
		goto out;
	}
	json_object_foreach(ui, key, list)
	{
		if (strcmp(key, table) != 0 || !json_is_array(list)) {
			rc = error_set(err, ERR_BAD_REQUEST,
			               "BatchWriteItem answer: unexpected UnprocessedItems.%.60s",
			               key);
			goto out;
		}
		json_array_foreach(list, i, e)
		{
			json_t *it = json_object_get(json_object_get(e, "PutRequest"), "Item");
			if (!json_is_object(it) || ddbitem_key(it, NULL, NULL) != 0) {
				rc =
				    error_set(err, ERR_BAD_REQUEST,
				              "BatchWriteItem answer: unprocessed entry %zu is not "
				              "a put of an item",
				              i);
				goto out;
			}
			if (json_array_append(result, it) != 0) {
				rc = oom(err);
				goto out;
			}
		}
	}
	*unprocessed = result;
	result = NULL;
	rc = ERR_OK;
out:
	json_decref(result);
	json_decref(root);
	return rc;
}

/* A key of this table: exactly conversation (S) and sk (S). */
static bool key_ok(const json_t *key)
{
	return json_is_object(key) && json_object_size(key) == 2 &&
	       ddbitem_key(key, NULL, NULL) == 0;
}

enum error_code ddbitem_query_request(const char *table, const char *conversation,
                                      const json_t *start_key, json_t **out, struct error *err)
{
	json_t *body;
	const char *start_conv;
	enum error_code rc = table_ok(table, err);

	if (rc == ERR_OK)
		rc = conversation_ok(conversation, err);
	if (rc != ERR_OK)
		return rc;
	if (!out)
		return error_set(err, ERR_BAD_REQUEST, "no output");
	*out = NULL;
	if (start_key && (!key_ok(start_key) || ddbitem_key(start_key, &start_conv, NULL) != 0 ||
	                  strcmp(start_conv, conversation) != 0))
		return error_set(err, ERR_BAD_REQUEST,
		                 "start key: expected a key of this conversation");
	/* "#c" because the attribute name might be a reserved word of expressions */
	body = json_pack("{s:s, s:s, s:{s:s}, s:{s:{s:s}}, s:b}", "TableName", table,
	                 "KeyConditionExpression", "#c = :c", "ExpressionAttributeNames", "#c",
	                 "conversation", "ExpressionAttributeValues", ":c", "S", conversation,
	                 "ConsistentRead", 1);
	if (!body)
		return oom(err);
	if (start_key && json_object_set(body, "ExclusiveStartKey", (json_t *)start_key) != 0) {
		json_decref(body);
		return oom(err);
	}
	*out = body;
	return ERR_OK;
}

enum error_code ddbitem_query_parse(const char *body, size_t len, json_t **items, json_t **last_key,
                                    struct error *err)
{
	json_t *root, *list, *key, *e;
	enum error_code rc;
	size_t i;

	if (!items || !last_key)
		return error_set(err, ERR_BAD_REQUEST, "no output");
	*items = NULL;
	*last_key = NULL;
	root = load_answer(body, len, "Query answer", err, &rc);
	if (!root)
		return rc;
	list = json_object_get(root, "Items");
	key = json_object_get(root, "LastEvaluatedKey");
	if (!json_is_array(list)) {
		json_decref(root);
		return error_set(err, ERR_BAD_REQUEST, "Query answer: Items is not an array");
	}
	json_array_foreach(list, i, e)
	{
		if (!json_is_object(e) || ddbitem_key(e, NULL, NULL) != 0) {
			json_decref(root);
			return error_set(err, ERR_BAD_REQUEST,
			                 "Query answer: item %zu has no conversation and sk", i);
		}
	}
	if (key && !json_is_null(key) && !key_ok(key)) {
		json_decref(root);
		return error_set(err, ERR_BAD_REQUEST, "Query answer: malformed LastEvaluatedKey");
	}
	*items = json_incref(list);
	*last_key = json_is_object(key) ? json_incref(key) : NULL;
	json_decref(root);
	return ERR_OK;
}

enum error_code ddbitem_create_table_request(const char *table, json_t **out, struct error *err)
{
	enum error_code rc = table_ok(table, err);
	if (rc != ERR_OK)
		return rc;
	if (!out)
		return error_set(err, ERR_BAD_REQUEST, "no output");
	*out =
	    json_pack("{s:s, s:[{s:s, s:s}, {s:s, s:s}], s:[{s:s, s:s}, {s:s, s:s}], s:s}",
	              "TableName", table, "AttributeDefinitions", "AttributeName", "conversation",
	              "AttributeType", "S", "AttributeName", "sk", "AttributeType", "S",
	              "KeySchema", "AttributeName", "conversation", "KeyType", "HASH",
	              "AttributeName", "sk", "KeyType", "RANGE", "BillingMode", "PAY_PER_REQUEST");
	return *out ? ERR_OK : oom(err);
}

int ddbitem_error_parse(const char *body, size_t len, char *type, size_t type_size, char *message,
                        size_t message_size)
{
	enum error_code rc;
	json_t *root = load_answer(body, len, "error", NULL, &rc), *t, *m;
	const char *name, *hash;
	if (!root)
		return rc == ERR_INTERNAL ? -ENOMEM : -EINVAL;
	t = json_object_get(root, "__type");
	m = json_object_get(root, "message");
	if (!m)
		m = json_object_get(root, "Message");
	if (!json_is_string(t)) {
		json_decref(root);
		return -EINVAL;
	}
	name = json_string_value(t);
	hash = strrchr(name, '#');
	if (hash)
		name = hash + 1;
	if (type && type_size)
		snprintf(type, type_size, "%s", name);
	if (message && message_size)
		snprintf(message, message_size, "%s",
		         json_is_string(m) ? json_string_value(m) : "");
	json_decref(root);
	return 0;
}

bool ddbitem_error_permanent(const char *type)
{
	static const char *const permanent[] = {
	    "ValidationException",
	    "SerializationException",
	    "ItemCollectionSizeLimitExceededException",
	    "ConditionalCheckFailedException",
	    NULL,
	};
	for (const char *const *p = permanent; type && *p; p++)
		if (strcmp(type, *p) == 0)
			return true;
	return false;
}
