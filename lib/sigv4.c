/* AWS Signature Version 4: canonical request, string to sign and signature, computed with
 * libcrypto's SHA-256 and HMAC. No I/O, no clock: the caller passes the time. */
#include "sigv4.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#define SHA256_LEN 32
#define ALGORITHM "AWS4-HMAC-SHA256"

/* A growing string. Appends after a failed allocation are no-ops; the failure is reported
 * once, by sbuf_take. */
struct sbuf {
	char *p;
	size_t len;
	size_t cap;
	bool failed;
};

static void sbuf_addn(struct sbuf *b, const char *s, size_t n)
{
	if (b->failed)
		return;
	if (n > SIZE_MAX - b->len - 1) {
		b->failed = true;
		return;
	}
	if (b->len + n + 1 > b->cap) {
		size_t cap = b->cap ? b->cap : 64;
		while (cap < b->len + n + 1)
			cap = cap > SIZE_MAX / 2 ? b->len + n + 1 : cap * 2;
		char *p = realloc(b->p, cap);
		if (!p) {
			b->failed = true;
			return;
		}
		b->p = p;
		b->cap = cap;
	}
	memcpy(b->p + b->len, s, n);
	b->len += n;
	b->p[b->len] = '\0';
}

static void sbuf_add(struct sbuf *b, const char *s)
{
	sbuf_addn(b, s, strlen(s));
}

static void sbuf_addc(struct sbuf *b, char c)
{
	sbuf_addn(b, &c, 1);
}

/* Returns the string (caller frees), "" for an empty buffer, or NULL after a failure. */
static char *sbuf_take(struct sbuf *b)
{
	char *p;
	if (!b->failed && !b->p)
		sbuf_addn(b, "", 0);
	if (b->failed) {
		free(b->p);
		p = NULL;
	} else {
		p = b->p;
	}
	memset(b, 0, sizeof(*b));
	return p;
}

static void sbuf_release(struct sbuf *b)
{
	free(b->p);
	memset(b, 0, sizeof(*b));
}

static bool is_unreserved(unsigned char c)
{
	return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
	       c == '-' || c == '_' || c == '.' || c == '~';
}

/* Percent-encodes s[0..n): every byte but the unreserved ones (and '/' when keep_slash). */
static void uri_encode(struct sbuf *b, const char *s, size_t n, bool keep_slash)
{
	static const char hex[] = "0123456789ABCDEF";
	for (size_t i = 0; i < n; i++) {
		unsigned char c = (unsigned char)s[i];
		if (is_unreserved(c) || (keep_slash && c == '/')) {
			sbuf_addc(b, (char)c);
		} else {
			char e[3] = {'%', hex[c >> 4], hex[c & 15]};
			sbuf_addn(b, e, 3);
		}
	}
}

static int hex_value(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* Decodes the %XX escapes of s[0..n) into a new string of *out_len bytes (caller frees);
 * a '%' not followed by two hex digits stays literal. NULL on ENOMEM. */
static char *percent_decode(const char *s, size_t n, size_t *out_len)
{
	char *d = malloc(n + 1);
	size_t j = 0;
	if (!d)
		return NULL;
	for (size_t i = 0; i < n; i++) {
		int hi, lo;
		if (s[i] == '%' && i + 2 < n && (hi = hex_value(s[i + 1])) >= 0 &&
		    (lo = hex_value(s[i + 2])) >= 0) {
			d[j++] = (char)(hi << 4 | lo);
			i += 2;
		} else {
			d[j++] = s[i];
		}
	}
	d[j] = '\0';
	*out_len = j;
	return d;
}

/* Canonical URI: RFC 3986 dot-segment removal plus collapsed empty segments, the leading
 * and (when the input has one, or ends in a dot segment) the trailing slash kept, then
 * every byte but unreserved ones and '/' encoded. */
static int canonical_uri(struct sbuf *b, const char *path)
{
	size_t n = path ? strlen(path) : 0;
	size_t nseg = 0, cap = n / 2 + 1;
	const char **seg = NULL;
	size_t *seglen = NULL;
	bool trailing = false;
	int rc = 0;

	if (n == 0 || path[0] != '/') {
		if (n != 0)
			return -EINVAL;
		sbuf_addc(b, '/');
		return 0;
	}
	seg = calloc(cap, sizeof(*seg));
	seglen = calloc(cap, sizeof(*seglen));
	if (!seg || !seglen) {
		rc = -ENOMEM;
		goto out;
	}
	for (size_t i = 1; i <= n;) {
		size_t j = i;
		while (j < n && path[j] != '/')
			j++;
		size_t len = j - i;
		bool last = j >= n;
		if (len == 0) {
			/* an empty segment: a duplicate slash (dropped) or the trailing slash */
			if (last)
				trailing = true;
		} else if (len == 1 && path[i] == '.') {
			trailing = true;
		} else if (len == 2 && path[i] == '.' && path[i + 1] == '.') {
			if (nseg > 0)
				nseg--;
			trailing = true;
		} else {
			seg[nseg] = path + i;
			seglen[nseg] = len;
			nseg++;
			trailing = false;
		}
		i = j + 1;
	}
	sbuf_addc(b, '/');
	for (size_t k = 0; k < nseg; k++) {
		uri_encode(b, seg[k], seglen[k], false);
		if (k + 1 < nseg || trailing)
			sbuf_addc(b, '/');
	}
out:
	free(seg);
	free(seglen);
	return rc;
}

struct query_param {
	char *key; /* encoded */
	char *value;
};

static int query_param_cmp(const void *a, const void *b)
{
	const struct query_param *x = a, *y = b;
	int c = strcmp(x->key, y->key);
	return c ? c : strcmp(x->value, y->value);
}

/* Decodes one key or value of the wire query and encodes it the canonical way. */
static char *query_part(const char *s, size_t n)
{
	struct sbuf b = {0};
	size_t dlen;
	char *d = percent_decode(s, n, &dlen);
	if (!d)
		return NULL;
	uri_encode(&b, d, dlen, false);
	free(d);
	return sbuf_take(&b);
}

/* Canonical query string: parameters decoded, re-encoded, sorted by key then value. */
static int canonical_query(struct sbuf *b, const char *query)
{
	size_t n = query ? strlen(query) : 0, np = 0, cap = 1;
	struct query_param *p = NULL;
	int rc = 0;

	if (n == 0)
		return 0;
	for (size_t i = 0; i < n; i++)
		cap += query[i] == '&';
	p = calloc(cap, sizeof(*p));
	if (!p)
		return -ENOMEM;
	for (size_t i = 0; i <= n;) {
		size_t j = i, eq;
		while (j < n && query[j] != '&')
			j++;
		if (j > i) {
			eq = i;
			while (eq < j && query[eq] != '=')
				eq++;
			p[np].key = query_part(query + i, eq - i);
			p[np].value =
			    eq < j ? query_part(query + eq + 1, j - eq - 1) : query_part("", 0);
			np++;
			if (!p[np - 1].key || !p[np - 1].value) {
				rc = -ENOMEM;
				goto out;
			}
		}
		i = j + 1;
	}
	qsort(p, np, sizeof(*p), query_param_cmp);
	for (size_t k = 0; k < np; k++) {
		if (k)
			sbuf_addc(b, '&');
		sbuf_add(b, p[k].key);
		sbuf_addc(b, '=');
		sbuf_add(b, p[k].value);
	}
out:
	for (size_t k = 0; k < np; k++) {
		free(p[k].key);
		free(p[k].value);
	}
	free(p);
	return rc;
}

struct canon_header {
	char *name;  /* lower-cased */
	char *value; /* trimmed, inner runs of blanks collapsed, lines joined with ',' */
	size_t order;
};

static int canon_header_cmp(const void *a, const void *b)
{
	const struct canon_header *x = a, *y = b;
	int c = strcmp(x->name, y->name);
	if (c)
		return c;
	return x->order < y->order ? -1 : x->order > y->order;
}

static bool is_tchar(unsigned char c)
{
	/* RFC 9110 token characters */
	return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
	       (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
}

static bool name_ok(const char *name)
{
	if (!name || !*name)
		return false;
	for (; *name; name++)
		if (!is_tchar((unsigned char)*name))
			return false;
	return true;
}

/* Lower-cased copy of a valid name; NULL on ENOMEM. */
static char *canon_name(const char *name)
{
	size_t n = strlen(name);
	char *s = malloc(n + 1);
	if (!s)
		return NULL;
	for (size_t i = 0; i <= n; i++)
		s[i] = (name[i] >= 'A' && name[i] <= 'Z') ? (char)(name[i] - 'A' + 'a') : name[i];
	return s;
}

/* Canonical value: each line trimmed with inner blanks collapsed to one space; non-empty
 * lines joined with ','. NULL on ENOMEM. */
static char *canon_value(const char *v)
{
	struct sbuf b = {0};
	bool first_line = true;
	const char *p = v;
	for (;;) {
		const char *e = strchr(p, '\n');
		size_t n = e ? (size_t)(e - p) : strlen(p);
		size_t i = 0, end = n;
		while (i < n && (p[i] == ' ' || p[i] == '\t'))
			i++;
		while (end > i && (p[end - 1] == ' ' || p[end - 1] == '\t' || p[end - 1] == '\r'))
			end--;
		if (end > i) {
			bool blank = false;
			if (!first_line)
				sbuf_addc(&b, ',');
			first_line = false;
			for (; i < end; i++) {
				char c = p[i] == '\t' ? ' ' : p[i];
				if (c == ' ') {
					if (blank)
						continue;
					blank = true;
				} else {
					blank = false;
				}
				sbuf_addc(&b, c);
			}
		}
		if (!e)
			break;
		p = e + 1;
	}
	return sbuf_take(&b);
}

static void hex_encode(const unsigned char *d, size_t n, char *out)
{
	static const char hex[] = "0123456789abcdef";
	for (size_t i = 0; i < n; i++) {
		out[2 * i] = hex[d[i] >> 4];
		out[2 * i + 1] = hex[d[i] & 15];
	}
	out[2 * n] = '\0';
}

static int sha256_hex(const void *data, size_t n, char out[2 * SHA256_LEN + 1])
{
	unsigned char md[SHA256_LEN];
	unsigned int mdlen = 0;
	if (!EVP_Digest(data ? data : "", n, md, &mdlen, EVP_sha256(), NULL) || mdlen != SHA256_LEN)
		return -ENOMEM;
	hex_encode(md, SHA256_LEN, out);
	return 0;
}

static int hmac_sha256(const void *key, size_t keylen, const char *msg, size_t n,
                       unsigned char out[SHA256_LEN])
{
	unsigned int outlen = 0;
	if (keylen > INT32_MAX)
		return -EINVAL;
	if (!HMAC(EVP_sha256(), key, (int)keylen, (const unsigned char *)msg, n, out, &outlen) ||
	    outlen != SHA256_LEN)
		return -ENOMEM;
	return 0;
}

/* kSigning = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, date), region), service), "aws4_request") */
static int signing_key(const struct sigv4_credentials *cred, const char *date8,
                       unsigned char key[SHA256_LEN])
{
	struct sbuf k = {0};
	unsigned char a[SHA256_LEN], b[SHA256_LEN];
	int rc;

	sbuf_add(&k, "AWS4");
	sbuf_add(&k, cred->secret_access_key);
	if (k.failed) {
		sbuf_release(&k);
		return -ENOMEM;
	}
	rc = hmac_sha256(k.p, k.len, date8, strlen(date8), a);
	if (!rc)
		rc = hmac_sha256(a, sizeof(a), cred->region, strlen(cred->region), b);
	if (!rc)
		rc = hmac_sha256(b, sizeof(b), cred->service, strlen(cred->service), a);
	if (!rc)
		rc = hmac_sha256(a, sizeof(a), "aws4_request", strlen("aws4_request"), key);
	OPENSSL_cleanse(k.p, k.len);
	sbuf_release(&k);
	OPENSSL_cleanse(a, sizeof(a));
	OPENSSL_cleanse(b, sizeof(b));
	return rc;
}

static bool scope_part_ok(const char *s)
{
	return s && *s && !strchr(s, '/') && !strpbrk(s, " \r\n");
}

static int format_amz_date(int64_t now_s, char out[SIGV4_AMZ_DATE_LEN + 1])
{
	struct tm tm;
	time_t t;
	/* 9999-12-31T23:59:59Z keeps the year at four digits */
	if (now_s < 0 || now_s > 253402300799LL)
		return -EINVAL;
	t = (time_t)now_s;
	if (!gmtime_r(&t, &tm))
		return -EINVAL;
	if (strftime(out, SIGV4_AMZ_DATE_LEN + 1, "%Y%m%dT%H%M%SZ", &tm) != SIGV4_AMZ_DATE_LEN)
		return -EINVAL;
	return 0;
}

/* Adds (name, value) as an extra canonical header unless the request has one; when it does,
 * its canonical value must equal value. */
static int require_header(struct canon_header *h, size_t *nh, const char *name, const char *value,
                          bool *added)
{
	char *v = NULL;
	bool found = false;
	for (size_t i = 0; i < *nh; i++) {
		if (strcmp(h[i].name, name) != 0)
			continue;
		found = true;
		if (strcmp(h[i].value, value) != 0)
			return -EINVAL;
	}
	*added = !found;
	if (found)
		return 0;
	v = canon_value(value);
	h[*nh].name = strdup(name);
	h[*nh].value = v;
	h[*nh].order = *nh;
	if (!h[*nh].name || !v)
		return -ENOMEM;
	(*nh)++;
	if (strcmp(v, value) != 0)
		return -EINVAL; /* a token with blanks or line breaks would be sent altered */
	return 0;
}

static bool credentials_ok(const struct sigv4_credentials *c)
{
	return c && c->access_key_id && *c->access_key_id &&
	       !strpbrk(c->access_key_id, "/ ,\r\n") && c->secret_access_key &&
	       *c->secret_access_key && scope_part_ok(c->region) && scope_part_ok(c->service) &&
	       (!c->session_token || (*c->session_token && !strpbrk(c->session_token, " \t\r\n")));
}

int sigv4_sign(const struct sigv4_request *req, const struct sigv4_credentials *cred, int64_t now_s,
               struct sigv4_result *out)
{
	struct canon_header *h = NULL;
	size_t nh = 0;
	struct sbuf creq = {0}, sts = {0}, auth = {0}, signed_headers = {0};
	struct sigv4_result r;
	char date8[9], hash[2 * SHA256_LEN + 1], scope_tail[] = "/aws4_request";
	unsigned char key[SHA256_LEN], sig[SHA256_LEN];
	bool has_host = false;
	int rc;

	memset(&r, 0, sizeof(r));
	memset(key, 0, sizeof(key));
	if (!req || !out || !credentials_ok(cred) || !name_ok(req->method) ||
	    req->nheaders > SIGV4_MAX_HEADERS || (req->nheaders && !req->headers) ||
	    (req->body_len && !req->body))
		return -EINVAL;
	rc = format_amz_date(now_s, r.amz_date);
	if (rc)
		return rc;
	memcpy(date8, r.amz_date, 8);
	date8[8] = '\0';

	h = calloc(req->nheaders + 2, sizeof(*h));
	if (!h)
		return -ENOMEM;
	for (size_t i = 0; i < req->nheaders; i++) {
		const struct sigv4_header *in = &req->headers[i];
		if (!in->name || !in->value) {
			rc = -EINVAL;
			goto out;
		}
		if (!name_ok(in->name)) {
			rc = -EINVAL;
			goto out;
		}
		h[nh].name = canon_name(in->name);
		h[nh].value = canon_value(in->value);
		h[nh].order = nh;
		if (!h[nh].name || !h[nh].value) {
			rc = -ENOMEM;
			goto out;
		}
		if (strcmp(h[nh].name, "host") == 0)
			has_host = true;
		nh++;
	}
	if (!has_host) {
		rc = -EINVAL;
		goto out;
	}
	rc = require_header(h, &nh, "x-amz-date", r.amz_date, &r.send_amz_date);
	if (!rc && cred->session_token)
		rc = require_header(h, &nh, "x-amz-security-token", cred->session_token,
		                    &r.send_security_token);
	if (rc)
		goto out;
	qsort(h, nh, sizeof(*h), canon_header_cmp);

	/* canonical request */
	sbuf_add(&creq, req->method);
	sbuf_addc(&creq, '\n');
	rc = canonical_uri(&creq, req->path);
	if (rc)
		goto out;
	sbuf_addc(&creq, '\n');
	rc = canonical_query(&creq, req->query);
	if (rc)
		goto out;
	sbuf_addc(&creq, '\n');
	for (size_t i = 0; i < nh; i++) {
		bool same_as_prev = i > 0 && strcmp(h[i].name, h[i - 1].name) == 0;
		bool same_as_next = i + 1 < nh && strcmp(h[i].name, h[i + 1].name) == 0;
		if (!same_as_prev) {
			sbuf_add(&creq, h[i].name);
			sbuf_addc(&creq, ':');
			if (signed_headers.len || signed_headers.failed)
				sbuf_addc(&signed_headers, ';');
			sbuf_add(&signed_headers, h[i].name);
		} else {
			sbuf_addc(&creq, ',');
		}
		sbuf_add(&creq, h[i].value);
		if (!same_as_next)
			sbuf_addc(&creq, '\n');
	}
	sbuf_addc(&creq, '\n');
	sbuf_addn(&creq, signed_headers.p ? signed_headers.p : "", signed_headers.len);
	sbuf_addc(&creq, '\n');
	rc = sha256_hex(req->body, req->body_len, hash);
	if (rc)
		goto out;
	sbuf_add(&creq, hash);
	if (creq.failed || signed_headers.failed) {
		rc = -ENOMEM;
		goto out;
	}

	/* string to sign */
	rc = sha256_hex(creq.p, creq.len, hash);
	if (rc)
		goto out;
	sbuf_add(&sts, ALGORITHM "\n");
	sbuf_add(&sts, r.amz_date);
	sbuf_addc(&sts, '\n');
	sbuf_add(&sts, date8);
	sbuf_addc(&sts, '/');
	sbuf_add(&sts, cred->region);
	sbuf_addc(&sts, '/');
	sbuf_add(&sts, cred->service);
	sbuf_add(&sts, scope_tail);
	sbuf_addc(&sts, '\n');
	sbuf_add(&sts, hash);
	if (sts.failed) {
		rc = -ENOMEM;
		goto out;
	}

	/* signature */
	rc = signing_key(cred, date8, key);
	if (!rc)
		rc = hmac_sha256(key, sizeof(key), sts.p, sts.len, sig);
	if (rc)
		goto out;
	hex_encode(sig, sizeof(sig), r.signature);

	sbuf_add(&auth, ALGORITHM " Credential=");
	sbuf_add(&auth, cred->access_key_id);
	sbuf_addc(&auth, '/');
	sbuf_add(&auth, date8);
	sbuf_addc(&auth, '/');
	sbuf_add(&auth, cred->region);
	sbuf_addc(&auth, '/');
	sbuf_add(&auth, cred->service);
	sbuf_add(&auth, scope_tail);
	sbuf_add(&auth, ", SignedHeaders=");
	sbuf_addn(&auth, signed_headers.p, signed_headers.len);
	sbuf_add(&auth, ", Signature=");
	sbuf_add(&auth, r.signature);

	r.canonical_request = sbuf_take(&creq);
	r.string_to_sign = sbuf_take(&sts);
	r.authorization = sbuf_take(&auth);
	if (!r.canonical_request || !r.string_to_sign || !r.authorization) {
		sigv4_result_clear(&r);
		rc = -ENOMEM;
		goto out;
	}
	*out = r;
	rc = 0;
out:
	OPENSSL_cleanse(key, sizeof(key));
	/* h is zeroed past nh, where a half-built entry may sit after a failure */
	for (size_t i = 0; h && i < req->nheaders + 2; i++) {
		free(h[i].name);
		free(h[i].value);
	}
	free(h);
	sbuf_release(&creq);
	sbuf_release(&sts);
	sbuf_release(&auth);
	sbuf_release(&signed_headers);
	return rc;
}

void sigv4_result_clear(struct sigv4_result *r)
{
	if (!r)
		return;
	free(r->canonical_request);
	free(r->string_to_sign);
	free(r->authorization);
	memset(r, 0, sizeof(*r));
}
