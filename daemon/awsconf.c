/* AWS settings from the environment and the shared credentials/config files, with the
 * small INI reader those files need. Secrets are copied only into the struct and never
 * into a message. */
#include "awsconf.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#define REGION_MAX 64
#define ENDPOINT_MAX 2048

/* One key of a section, or a section header alone (key NULL) so that empty sections are
 * found too. Strings owned by the ini. */
struct ini_entry {
	char *section;
	char *key; /* lower case; "parent.sub" for an indented sub-setting */
	char *value;
};

struct ini {
	struct ini_entry *v;
	size_t n, cap;
	bool loaded; /* the file existed */
};

static void seterr(char *errbuf, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static void seterr(char *errbuf, const char *fmt, ...)
{
	va_list ap;

	if (!errbuf)
		return;
	va_start(ap, fmt);
	vsnprintf(errbuf, AWSCONF_ERRBUF_SIZE, fmt, ap);
	va_end(ap);
}

/* free() that first wipes a string that may hold a secret. */
static void free_secret(char *s)
{
	if (s) {
		volatile char *p = s;
		while (*p)
			*p++ = '\0';
	}
	free(s);
}

static void ini_free(struct ini *ini)
{
	for (size_t i = 0; i < ini->n; i++) {
		free(ini->v[i].section);
		free(ini->v[i].key);
		free_secret(ini->v[i].value);
	}
	free(ini->v);
	memset(ini, 0, sizeof(*ini));
}

static char *dup_range(const char *s, size_t len)
{
	char *d = malloc(len + 1);

	if (d) {
		memcpy(d, s, len);
		d[len] = '\0';
	}
	return d;
}

/* Adds an entry; takes ownership of nothing, copies everything. 0 or -ENOMEM. */
static int ini_add(struct ini *ini, const char *section, const char *key, size_t key_len,
                   const char *value, size_t value_len)
{
	struct ini_entry *e;

	if (ini->n == ini->cap) {
		size_t cap = ini->cap ? 2 * ini->cap : 16;
		struct ini_entry *v = realloc(ini->v, cap * sizeof(*v));
		if (!v)
			return -ENOMEM;
		ini->v = v;
		ini->cap = cap;
	}
	e = &ini->v[ini->n];
	memset(e, 0, sizeof(*e));
	e->section = strdup(section);
	if (key) {
		e->key = dup_range(key, key_len);
		e->value = dup_range(value, value_len);
	}
	if (!e->section || (key && (!e->key || !e->value))) {
		free(e->section);
		free(e->key);
		free_secret(e->value);
		return -ENOMEM;
	}
	for (char *k = e->key; k && *k; k++)
		*k = (char)tolower((unsigned char)*k);
	ini->n++;
	return 0;
}

/* The last value of key in section (later lines win), borrowed; NULL when absent. */
static const char *ini_get(const struct ini *ini, const char *section, const char *key)
{
	for (size_t i = ini->n; i-- > 0;) {
		const struct ini_entry *e = &ini->v[i];
		if (e->key && strcmp(e->section, section) == 0 && strcasecmp(e->key, key) == 0)
			return e->value;
	}
	return NULL;
}

static bool ini_has_section(const struct ini *ini, const char *section)
{
	for (size_t i = 0; i < ini->n; i++)
		if (strcmp(ini->v[i].section, section) == 0)
			return true;
	return false;
}

static void trim(const char **s, size_t *len)
{
	while (*len > 0 && isspace((unsigned char)**s)) {
		(*s)++;
		(*len)--;
	}
	while (*len > 0 && isspace((unsigned char)(*s)[*len - 1]))
		(*len)--;
}

/* "[ profile   name ]" -> "profile name": trimmed, the words after the first joined by one
 * space. NULL on allocation failure. */
static char *section_name(const char *s, size_t len)
{
	size_t first = 0, rest_off;
	char *out;

	trim(&s, &len);
	while (first < len && !isspace((unsigned char)s[first]))
		first++;
	rest_off = first;
	while (rest_off < len && isspace((unsigned char)s[rest_off]))
		rest_off++;
	if (rest_off == len)
		return dup_range(s, first);
	out = malloc(len + 1);
	if (!out)
		return NULL;
	memcpy(out, s, first);
	out[first] = ' ';
	memcpy(out + first + 1, s + rest_off, len - rest_off);
	out[first + 1 + len - rest_off] = '\0';
	return out;
}

/* Parses text[0..len) in the AWS flavour of INI: "[section]", "key = value" (or ':'), whole
 * line comments starting with '#' or ';', whitespace trimmed, keys case-insensitive, and
 * indented "sub = value" lines under a key with an empty value (nested settings such as
 * "dynamodb =\n  endpoint_url = ..."). An indented line without '=' or ':' after a key
 * continues a multi-line value, which nothing here reads; any other indented line is read
 * as if it were not indented. 0, -EINVAL (errbuf names the file and line, never its text)
 * or -ENOMEM. */
static int ini_parse(const char *text, size_t len, const char *path, struct ini *ini, char *errbuf)
{
	char *section = NULL;
	char parent[128] = "";
	bool after_key = false;
	size_t lineno = 0;
	int rc = 0;

	for (size_t pos = 0; pos < len;) {
		const char *line = text + pos, *nl = memchr(line, '\n', len - pos);
		size_t line_len = nl ? (size_t)(nl - line) : len - pos;
		bool indented = line_len > 0 && (line[0] == ' ' || line[0] == '\t');
		const char *key, *value, *eq;
		size_t key_len, value_len;

		pos += line_len + (nl ? 1 : 0);
		lineno++;
		if (memchr(line, '\0', line_len)) {
			seterr(errbuf, "%s:%zu: NUL byte", path, lineno);
			rc = -EINVAL;
			goto out;
		}
		trim(&line, &line_len);
		if (line_len == 0) {
			parent[0] = '\0';
			after_key = false;
			continue;
		}
		if (line[0] == '#' || line[0] == ';')
			continue;
		if (line[0] == '[') {
			/* "[name]", then perhaps a comment, as the AWS tools' parser reads it */
			const char *close = memchr(line, ']', line_len), *rest;
			size_t rest_len;
			if (close) {
				rest = close + 1;
				rest_len = line_len - (size_t)(rest - line);
				trim(&rest, &rest_len);
				if (rest_len && rest[0] != '#' && rest[0] != ';')
					close = NULL;
			}
			if (!close || close - line < 2) {
				seterr(errbuf, "%s:%zu: expected '[section]'", path, lineno);
				rc = -EINVAL;
				goto out;
			}
			free(section);
			section = section_name(line + 1, (size_t)(close - line) - 1);
			if (!section) {
				rc = -ENOMEM;
				goto out;
			}
			if (section[0] == '\0') {
				seterr(errbuf, "%s:%zu: empty section name", path, lineno);
				rc = -EINVAL;
				goto out;
			}
			rc = ini_add(ini, section, NULL, 0, NULL, 0);
			if (rc < 0)
				goto out;
			parent[0] = '\0';
			after_key = false;
			continue;
		}
		eq = line;
		while (eq < line + line_len && *eq != '=' && *eq != ':')
			eq++;
		if (indented && after_key && eq == line + line_len)
			continue; /* continuation of a multi-line value: nothing we read */
		if (eq == line + line_len || eq == line) {
			seterr(errbuf, "%s:%zu: expected 'key = value', '[section]' or a comment",
			       path, lineno);
			rc = -EINVAL;
			goto out;
		}
		if (!section) {
			seterr(errbuf, "%s:%zu: setting before the first [section]", path, lineno);
			rc = -EINVAL;
			goto out;
		}
		key = line;
		key_len = (size_t)(eq - line);
		value = eq + 1;
		value_len = line_len - key_len - 1;
		trim(&key, &key_len);
		trim(&value, &value_len);
		if (indented && parent[0]) {
			char full[256];
			int n = snprintf(full, sizeof(full), "%s.%.*s", parent, (int)key_len, key);
			if (n < 0 || (size_t)n >= sizeof(full)) {
				seterr(errbuf, "%s:%zu: key too long", path, lineno);
				rc = -EINVAL;
				goto out;
			}
			rc = ini_add(ini, section, full, (size_t)n, value, value_len);
			if (rc < 0)
				goto out;
			continue;
		}
		rc = ini_add(ini, section, key, key_len, value, value_len);
		if (rc < 0)
			goto out;
		after_key = true;
		parent[0] = '\0';
		if (value_len == 0 && key_len < sizeof(parent)) {
			memcpy(parent, key, key_len);
			parent[key_len] = '\0';
		}
	}
out:
	free(section);
	return rc;
}

/* Reads and parses path; a missing file leaves ini empty and unloaded. 0 or -errno. */
static int ini_load(const char *path, struct ini *ini, char *errbuf)
{
	FILE *f = NULL;
	char *text = NULL;
	struct stat st;
	size_t len;
	int fd = -1, rc = 0;

	if (!path)
		return 0;
	/* Not blocking: a FIFO in the file's place would hang the start, or the loop at a
	 * reload, waiting for a writer. */
	fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
	if (fd < 0) {
		if (errno == ENOENT || errno == ENOTDIR)
			return 0;
		rc = -errno;
		seterr(errbuf, "%s: %s", path, strerror(errno));
		goto out;
	}
	if (fstat(fd, &st) < 0) {
		rc = -errno;
		seterr(errbuf, "%s: %s", path, strerror(errno));
		goto out;
	}
	if (S_ISDIR(st.st_mode)) {
		rc = -EISDIR;
		seterr(errbuf, "%s: is a directory", path);
		goto out;
	}
	if (!S_ISREG(st.st_mode) && !S_ISCHR(st.st_mode)) {
		rc = -EINVAL;
		seterr(errbuf, "%s: not a regular file", path);
		goto out;
	}
	if (!(f = fdopen(fd, "rb"))) {
		rc = -errno;
		seterr(errbuf, "%s: %s", path, strerror(errno));
		goto out;
	}
	fd = -1; /* f's now */
	text = malloc(AWSCONF_MAX_FILE_BYTES + 1);
	if (!text) {
		rc = -ENOMEM;
		goto out;
	}
	len = fread(text, 1, AWSCONF_MAX_FILE_BYTES + 1, f);
	if (ferror(f)) {
		rc = -EIO;
		seterr(errbuf, "%s: read error", path);
		goto out;
	}
	if (len > AWSCONF_MAX_FILE_BYTES) {
		rc = -EFBIG;
		seterr(errbuf, "%s: larger than %d bytes", path, AWSCONF_MAX_FILE_BYTES);
		goto out;
	}
	ini->loaded = true;
	rc = ini_parse(text, len, path, ini, errbuf);
out:
	if (text) {
		memset(text, 0, AWSCONF_MAX_FILE_BYTES + 1);
		free(text);
	}
	if (f)
		fclose(f);
	if (fd >= 0)
		close(fd);
	if (rc < 0)
		ini_free(ini);
	return rc;
}

static const char *env(const char *name)
{
	const char *v = getenv(name);
	return v && v[0] ? v : NULL;
}

/* A copy of path with a leading "~/" replaced by $HOME; path itself when HOME is unset. */
static char *expand_home(const char *path)
{
	const char *home = env("HOME");
	char *out;

	if (path[0] != '~' || (path[1] != '/' && path[1] != '\0') || !home)
		return strdup(path);
	out = malloc(strlen(home) + strlen(path));
	if (out) {
		strcpy(out, home);
		strcat(out, path + 1);
	}
	return out;
}

/* The path from the environment variable, else ~/.aws/NAME; *out NULL when neither exists
 * (no HOME). 0 or -ENOMEM. */
static int file_path(const char *var, const char *name, char **out)
{
	const char *v = env(var);
	char buf[64];

	if (!v) {
		if (!env("HOME")) {
			*out = NULL;
			return 0;
		}
		snprintf(buf, sizeof(buf), "~/.aws/%s", name);
		v = buf;
	}
	*out = expand_home(v);
	return *out ? 0 : -ENOMEM;
}

static bool region_valid(const char *r)
{
	size_t n = strlen(r);

	if (n == 0 || n > REGION_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!islower((unsigned char)r[i]) && !isdigit((unsigned char)r[i]) && r[i] != '-')
			return false;
	return true;
}

/* Splits an endpoint URL into scheme and authority (host[:port]). Accepts http and https,
 * no user info, an optional port of 1..65535 and an empty path or "/". 0 or -EINVAL. */
static int endpoint_split(const char *url, bool *https, const char **auth, size_t *auth_len,
                          const char **port, size_t *host_len)
{
	const char *a, *end, *colon = NULL;
	size_t i;

	if (strlen(url) > ENDPOINT_MAX)
		return -EINVAL;
	for (const char *p = url; *p; p++)
		if ((unsigned char)*p <= ' ' || (unsigned char)*p >= 0x7f)
			return -EINVAL;
	if (strncasecmp(url, "https://", 8) == 0) {
		*https = true;
		a = url + 8;
	} else if (strncasecmp(url, "http://", 7) == 0) {
		*https = false;
		a = url + 7;
	} else {
		return -EINVAL;
	}
	end = a + strcspn(a, "/?#");
	if (end[0] != '\0' && strcmp(end, "/") != 0)
		return -EINVAL;
	if (end == a || memchr(a, '@', (size_t)(end - a)))
		return -EINVAL;
	if (a[0] == '[') {
		const char *rb = memchr(a, ']', (size_t)(end - a));
		if (!rb || rb == a + 1)
			return -EINVAL;
		if (rb + 1 < end) {
			if (rb[1] != ':')
				return -EINVAL;
			colon = rb + 1;
		}
	} else {
		colon = memchr(a, ':', (size_t)(end - a));
		if (colon == a)
			return -EINVAL;
	}
	if (colon) {
		unsigned long v = 0;
		if (colon + 1 == end || end - colon > 6)
			return -EINVAL;
		for (const char *p = colon + 1; p < end; p++) {
			if (!isdigit((unsigned char)*p))
				return -EINVAL;
			v = v * 10 + (unsigned long)(*p - '0');
		}
		if (v == 0 || v > 65535)
			return -EINVAL;
	}
	for (i = 0; a + i < (colon ? colon : end); i++) {
		char c = a[i];
		if (!isalnum((unsigned char)c) && !strchr("-._~[]:%", c))
			return -EINVAL;
	}
	*auth = a;
	*auth_len = (size_t)(end - a);
	*port = colon ? colon + 1 : NULL;
	*host_len = (size_t)((colon ? colon : end) - a);
	return 0;
}

/* Copies v into *dst (replacing nothing: *dst must be NULL). 0 or -ENOMEM. */
static int set_str(char **dst, const char *v)
{
	if (!v)
		return 0;
	*dst = strdup(v);
	return *dst ? 0 : -ENOMEM;
}

static bool is_true(const char *v)
{
	return v && strcasecmp(v, "true") == 0;
}

/* Section of profile in the config file: "[profile NAME]", or "[default]" for the default
 * profile (which may also be written "[profile default]"). Borrowed or static. */
static const char *config_section(const struct ini *cfg, const char *profile, char *buf,
                                  size_t size)
{
	snprintf(buf, size, "profile %s", profile);
	if (strcmp(profile, "default") == 0 && !ini_has_section(cfg, buf))
		return "default";
	return buf;
}

/* Key pair (and token) of one file section. 0, -EINVAL for half a pair, or -ENOMEM. */
static int take_keys(struct awsconf *c, const struct ini *ini, const char *section,
                     const char *path, enum awsconf_source src, char *errbuf)
{
	const char *id = ini_get(ini, section, "aws_access_key_id");
	const char *secret = ini_get(ini, section, "aws_secret_access_key");
	const char *token = ini_get(ini, section, "aws_session_token");
	int rc;

	if (id && !id[0])
		id = NULL;
	if (secret && !secret[0])
		secret = NULL;
	if (!id && !secret)
		return 0;
	if (!id || !secret) {
		seterr(errbuf, "%s: [%s] has %s without %s", path, section,
		       id ? "aws_access_key_id" : "aws_secret_access_key",
		       id ? "aws_secret_access_key" : "aws_access_key_id");
		return -EINVAL;
	}
	if ((rc = set_str(&c->access_key_id, id)) < 0 ||
	    (rc = set_str(&c->secret_access_key, secret)) < 0 ||
	    (rc = set_str(&c->session_token, token && token[0] ? token : NULL)) < 0)
		return rc;
	c->credentials_source = src;
	return 0;
}

int awsconf_load(struct awsconf *conf, char errbuf[AWSCONF_ERRBUF_SIZE])
{
	struct awsconf c;
	struct ini creds = {0}, cfg = {0};
	const char *v, *psec = NULL;
	char secbuf[300];
	bool profile_explicit;
	int rc = 0;

	memset(&c, 0, sizeof(c));
	if (errbuf)
		errbuf[0] = '\0';
	v = env("AWS_PROFILE");
	profile_explicit = v != NULL;
	rc = set_str(&c.profile, v ? v : "default");
	if (rc == 0)
		rc = file_path("AWS_SHARED_CREDENTIALS_FILE", "credentials", &c.credentials_file);
	if (rc == 0)
		rc = file_path("AWS_CONFIG_FILE", "config", &c.config_file);
	if (rc < 0)
		goto out;
	if (strlen(c.profile) > 255 || strpbrk(c.profile, "[]\n")) {
		seterr(errbuf, "AWS_PROFILE: not a profile name");
		rc = -EINVAL;
		goto out;
	}
	if ((rc = ini_load(c.credentials_file, &creds, errbuf)) < 0 ||
	    (rc = ini_load(c.config_file, &cfg, errbuf)) < 0)
		goto out;
	psec = config_section(&cfg, c.profile, secbuf, sizeof(secbuf));

	/* region */
	if ((v = env("AWS_REGION")) || (v = env("AWS_DEFAULT_REGION"))) {
		c.region_source = AWSCONF_ENV;
	} else if ((v = ini_get(&cfg, psec, "region")) && v[0]) {
		c.region_source = AWSCONF_CONFIG_FILE;
	} else {
		v = NULL;
	}
	if (v && !region_valid(v)) {
		seterr(errbuf, "region from %s: expected 1 to %d of [a-z0-9-]",
		       awsconf_source_str(c.region_source), REGION_MAX);
		rc = -EINVAL;
		goto out;
	}
	if ((rc = set_str(&c.region, v)) < 0)
		goto out;

	/* endpoint: the service's own before the global one, the environment before the file */
	v = NULL;
	if (!is_true(env("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS")) &&
	    !is_true(ini_get(&cfg, psec, "ignore_configured_endpoint_urls"))) {
		const char *services = ini_get(&cfg, psec, "services");
		if ((v = env("AWS_ENDPOINT_URL_DYNAMODB")) || (v = env("AWS_ENDPOINT_URL"))) {
			c.endpoint_source = AWSCONF_ENV;
		} else {
			char svc[300];
			if (services && services[0]) {
				snprintf(svc, sizeof(svc), "services %s", services);
				v = ini_get(&cfg, svc, "dynamodb.endpoint_url");
			}
			if (!v || !v[0])
				v = ini_get(&cfg, psec, "endpoint_url");
			if (v && !v[0])
				v = NULL;
			if (v)
				c.endpoint_source = AWSCONF_CONFIG_FILE;
		}
	}
	if (v) {
		bool https;
		const char *auth, *port;
		size_t auth_len, host_len;
		if (endpoint_split(v, &https, &auth, &auth_len, &port, &host_len) < 0) {
			seterr(errbuf,
			       "endpoint URL from %s: expected http(s)://host[:port] with no path, "
			       "query or user info",
			       awsconf_source_str(c.endpoint_source));
			rc = -EINVAL;
			goto out;
		}
		if ((rc = set_str(&c.endpoint_url, v)) < 0)
			goto out;
	}

	/* credentials: the environment as a pair, then the credentials file, then config */
	v = env("AWS_ACCESS_KEY_ID");
	if (v || env("AWS_SECRET_ACCESS_KEY")) {
		if (!v || !env("AWS_SECRET_ACCESS_KEY")) {
			seterr(errbuf, "%s is set but %s is not",
			       v ? "AWS_ACCESS_KEY_ID" : "AWS_SECRET_ACCESS_KEY",
			       v ? "AWS_SECRET_ACCESS_KEY" : "AWS_ACCESS_KEY_ID");
			rc = -EINVAL;
			goto out;
		}
		if ((rc = set_str(&c.access_key_id, v)) < 0 ||
		    (rc = set_str(&c.secret_access_key, env("AWS_SECRET_ACCESS_KEY"))) < 0 ||
		    (rc = set_str(&c.session_token, env("AWS_SESSION_TOKEN"))) < 0)
			goto out;
		c.credentials_source = AWSCONF_ENV;
	} else {
		rc = take_keys(&c, &creds, c.profile, c.credentials_file, AWSCONF_CREDENTIALS_FILE,
		               errbuf);
		if (rc == 0 && !c.access_key_id)
			rc = take_keys(&c, &cfg, psec, c.config_file, AWSCONF_CONFIG_FILE, errbuf);
		if (rc < 0)
			goto out;
		if (profile_explicit && !ini_has_section(&creds, c.profile) &&
		    !ini_has_section(&cfg, psec)) {
			seterr(errbuf, "AWS_PROFILE: profile '%.64s' is in neither %s nor %s",
			       c.profile, c.credentials_file ? c.credentials_file : "(no HOME)",
			       c.config_file ? c.config_file : "(no HOME)");
			rc = -EINVAL;
			goto out;
		}
	}
out:
	ini_free(&creds);
	ini_free(&cfg);
	if (rc < 0) {
		if (rc == -ENOMEM && errbuf && !errbuf[0])
			seterr(errbuf, "out of memory");
		awsconf_free(&c);
		memset(conf, 0, sizeof(*conf));
		return rc;
	}
	*conf = c;
	return 0;
}

bool awsconf_dynamodb_wanted(void)
{
	struct ini cfg = {0};
	char *path = NULL, secbuf[300];
	const char *profile = env("AWS_PROFILE"), *psec;
	bool wanted = false;

	if (env("AWS_REGION") || env("AWS_DEFAULT_REGION") || env("AWS_ENDPOINT_URL_DYNAMODB") ||
	    env("AWS_ENDPOINT_URL"))
		return true;
	if (!profile)
		profile = "default";
	if (strlen(profile) > 255 || file_path("AWS_CONFIG_FILE", "config", &path) < 0)
		return false;
	if (ini_load(path, &cfg, NULL) == 0) {
		const char *v;
		psec = config_section(&cfg, profile, secbuf, sizeof(secbuf));
		wanted = ((v = ini_get(&cfg, psec, "region")) && v[0]) ||
		         ((v = ini_get(&cfg, psec, "endpoint_url")) && v[0]) ||
		         ((v = ini_get(&cfg, psec, "services")) && v[0]);
	}
	ini_free(&cfg);
	free(path);
	return wanted;
}

void awsconf_free(struct awsconf *conf)
{
	if (!conf)
		return;
	free(conf->profile);
	free(conf->credentials_file);
	free(conf->config_file);
	free(conf->region);
	free(conf->endpoint_url);
	free(conf->access_key_id);
	free_secret(conf->secret_access_key);
	free_secret(conf->session_token);
	memset(conf, 0, sizeof(*conf));
}

bool awsconf_dynamodb_configured(const struct awsconf *conf)
{
	return conf && (conf->endpoint_url || conf->region);
}

bool awsconf_has_credentials(const struct awsconf *conf)
{
	return conf && conf->access_key_id && conf->secret_access_key;
}

const char *awsconf_signing_region(const struct awsconf *conf)
{
	return conf && conf->region ? conf->region : AWSCONF_DEFAULT_SIGNING_REGION;
}

int awsconf_endpoint(const struct awsconf *conf, char *buf, size_t size)
{
	int n;

	if (!awsconf_dynamodb_configured(conf))
		return -ENOENT;
	if (conf->endpoint_url)
		n = snprintf(buf, size, "%s", conf->endpoint_url);
	else
		n = snprintf(buf, size, "https://dynamodb.%s.amazonaws.com", conf->region);
	return n < 0 || (size_t)n >= size ? -ENOSPC : 0;
}

int awsconf_host(const struct awsconf *conf, char *buf, size_t size)
{
	const char *auth, *port;
	size_t auth_len, host_len, len;
	bool https;
	int n;

	if (!awsconf_dynamodb_configured(conf))
		return -ENOENT;
	if (!conf->endpoint_url) {
		n = snprintf(buf, size, "dynamodb.%s.amazonaws.com", conf->region);
		return n < 0 || (size_t)n >= size ? -ENOSPC : 0;
	}
	if (endpoint_split(conf->endpoint_url, &https, &auth, &auth_len, &port, &host_len) < 0)
		return -EINVAL; /* awsconf_load never keeps such a URL */
	len = auth_len;
	if (port && strtol(port, NULL, 10) == (https ? 443 : 80))
		len = host_len;
	if (len >= size)
		return -ENOSPC;
	for (size_t i = 0; i < len; i++)
		buf[i] = (char)tolower((unsigned char)auth[i]);
	buf[len] = '\0';
	return 0;
}

const char *awsconf_source_str(enum awsconf_source s)
{
	switch (s) {
	case AWSCONF_ENV:
		return "env";
	case AWSCONF_CREDENTIALS_FILE:
		return "credentials file";
	case AWSCONF_CONFIG_FILE:
		return "config file";
	case AWSCONF_NONE:
		break;
	}
	return "none";
}

const char *awsconf_describe(const struct awsconf *conf, char *buf, size_t size)
{
	char endpoint[ENDPOINT_MAX + 64], key[16];
	size_t idlen;

	if (!buf || size == 0)
		return buf;
	if (!awsconf_dynamodb_configured(conf)) {
		snprintf(buf, size, "dynamodb: not configured (no endpoint, no region)");
		return buf;
	}
	if (conf->endpoint_url)
		snprintf(endpoint, sizeof(endpoint), "%s (%s)", conf->endpoint_url,
		         awsconf_source_str(conf->endpoint_source));
	else
		snprintf(endpoint, sizeof(endpoint), "https://dynamodb.%s.amazonaws.com",
		         conf->region);
	idlen = conf->access_key_id ? strlen(conf->access_key_id) : 0;
	/* the last 4 characters only, and none of an id so short that 4 would be most of it */
	if (idlen >= 8)
		snprintf(key, sizeof(key), "****%s", conf->access_key_id + idlen - 4);
	else
		snprintf(key, sizeof(key), "****");
	if (awsconf_has_credentials(conf))
		snprintf(buf, size,
		         "dynamodb: endpoint %s, region %s (%s), profile %s, access key %s (%s)%s",
		         endpoint, awsconf_signing_region(conf),
		         conf->region ? awsconf_source_str(conf->region_source) : "default",
		         conf->profile ? conf->profile : "default", key,
		         awsconf_source_str(conf->credentials_source),
		         conf->session_token ? " with a session token" : "");
	else
		snprintf(buf, size,
		         "dynamodb: endpoint %s, region %s (%s), profile %s, no credentials",
		         endpoint, awsconf_signing_region(conf),
		         conf->region ? awsconf_source_str(conf->region_source) : "default",
		         conf->profile ? conf->profile : "default");
	return buf;
}
