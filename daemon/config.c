/* The daemon's settings: one table of every setting drives the config file parser, the
 * command-line flags, the usage text, --check-config's report and what a reload applies. */
#include "config.h"

#include "awsconf.h"
#include "ddbitem.h"
#include "store.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <grp.h>
#include <inttypes.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

enum setting_type {
	T_STR,
	T_SIZE,
	T_U64,
	T_U32,
	T_BOOL,
	T_LEVEL,
	T_FORMAT,
	T_DURABILITY,
	T_UIDS,
	T_GIDS,
};

struct setting {
	const char *key;   /* file key and flag name */
	const char *alias; /* another flag name, or NULL */
	enum setting_type type;
	size_t off, off_n; /* the field; off_n: the count of an id list */
	uint64_t min, max; /* integers */
	bool runtime;      /* a reload applies it */
	unsigned action;   /* CONFIG_RELOAD_* bits when it changes */
	const char *arg;   /* the flag's value in the usage text */
	const char *help;
	const char *section; /* a heading printed before it in the usage text */
};

#define F(field) offsetof(struct config, field)

static const struct setting settings[] = {
    {"socket", NULL, T_STR, F(socket_path), 0, 0, 0, false, 0, "PATH", "listening socket", NULL},
    {"state-dir", NULL, T_STR, F(state_dir), 0, 0, 0, false, 0, "DIR",
     "state directory, created if missing", NULL},
    {"max-line-bytes", NULL, T_SIZE, F(max_line_bytes), 0, 64, SIZE_MAX, true, 0, "N",
     "longest request line (connections opened after a reload)", "Limits:"},
    {"max-output-bytes", NULL, T_SIZE, F(max_output_bytes), 0, 1024, SIZE_MAX, true, 0, "N",
     "queued output per connection before reading pauses", NULL},
    {"max-connections", NULL, T_SIZE, F(max_connections), 0, 1, SIZE_MAX, true, 0, "N",
     "concurrent connections", NULL},
    {"max-conversations", NULL, T_SIZE, F(max_conversations), 0, 1, SIZE_MAX, true, 0, "N",
     "conversations in memory", NULL},
    {"max-messages", NULL, T_SIZE, F(max_messages), 0, 2, SIZE_MAX, true, 0, "N",
     "messages per conversation", NULL},
    {"max-conversation-bytes", NULL, T_SIZE, F(max_conversation_bytes), 0, 1, SIZE_MAX, true, 0,
     "N", "content bytes per conversation", NULL},
    {"max-conversation-id-bytes", NULL, T_SIZE, F(max_conversation_id_bytes), 0, 1, SIZE_MAX, true,
     0, "N", "conversation id length", NULL},
    {"allow-uids", "allow-uid", T_UIDS, F(allow_uids), F(nallow_uids), 0, 0, true, 0, "LIST",
     "users (ids or names, comma-separated; repeated flags add up) allowed on the socket; "
     "empty: no allow-list",
     "Access:"},
    {"allow-gids", "allow-gid", T_GIDS, F(allow_gids), F(nallow_gids), 0, 0, true, 0, "LIST",
     "groups (ids or names; primary or supplementary) allowed on the socket", NULL},
    {"log-level", NULL, T_LEVEL, F(log_level), 0, 0, 0, true, 0, "debug|info|warn|error",
     "least severe level logged", "Logging:"},
    {"log-format", NULL, T_FORMAT, F(log_format), 0, 0, 0, true, 0, "auto|plain|journal",
     "journal: <N> priority prefixes; auto: journal under systemd", NULL},
    {"durability", NULL, T_DURABILITY, F(durability), 0, 0, 0, false, 0, "process|machine|none",
     "when an answer is sent", "Persistence:"},
    {"memory-only", NULL, T_BOOL, F(memory_only), 0, 0, 0, false, 0, NULL,
     "no local store: nothing survives a restart", NULL},
    {"dynamodb-table", NULL, T_STR, F(dynamodb_table), 0, 0, 0, false, 0, "NAME",
     "DynamoDB table when AWS_REGION or an endpoint is set", NULL},
    {"create-table", NULL, T_BOOL, F(create_table), 0, 0, 0, false, 0, NULL,
     "create the table at start (development)", NULL},
    {"flush-interval", NULL, T_U64, F(flush_interval_ms), 0, 1, 3600000, true,
     CONFIG_RELOAD_FLUSH_TIMER, "MS", "flusher period", NULL},
    {"idle-ms", NULL, T_U64, F(idle_ms), 0, 0, 86400000, true, 0, "MS",
     "idle time before the last message is flushed too", NULL},
    {"batch-items", NULL, T_SIZE, F(batch_items), 0, 1, 25, true, CONFIG_RELOAD_SINK, "N",
     "items per BatchWriteItem, 1-25", NULL},
    {"retry-base-ms", NULL, T_U64, F(retry_base_ms), 0, 1, 3600000, true, CONFIG_RELOAD_SINK, "MS",
     "first retry backoff cap", NULL},
    {"retry-max-ms", NULL, T_U64, F(retry_max_ms), 0, 1, 3600000, true, CONFIG_RELOAD_SINK, "MS",
     "largest retry backoff cap", NULL},
    {"spool-max-items", NULL, T_SIZE, F(spool_max_items), 0, 1, SIZE_MAX, true, CONFIG_RELOAD_SINK,
     "N", "unsent items before changes are refused with unavailable", NULL},
    {"expires-days", NULL, T_U32, F(expires_days), 0, 0, 36500, true, CONFIG_RELOAD_SINK, "N",
     "DynamoDB TTL attribute 'expires', 0 = none", NULL},
    {"closed-retention-days", NULL, T_U32, F(closed_retention_days), 0, 0, 36500, true, 0, "N",
     "with DynamoDB, closed conversations kept locally", NULL},
    {"drain-ms", NULL, T_U64, F(drain_ms), 0, 0, 3600000, true, 0, "MS",
     "at shutdown, time left to send the spool", NULL},
    {"connect-timeout-ms", NULL, T_U64, F(connect_timeout_ms), 0, 1, 600000, false, 0, "MS",
     "DynamoDB connection timeout", NULL},
    {"request-timeout-ms", NULL, T_U64, F(request_timeout_ms), 0, 1, 600000, false, 0, "MS",
     "DynamoDB request timeout, connection included", NULL},
    {"ignore-crc32", NULL, T_BOOL, F(ignore_crc32), 0, 0, 0, false, 0, NULL,
     "take DynamoDB answers that do not match their x-amz-crc32 (a proxy that rewrites them)",
     NULL},
};

#undef F

#define NSETTINGS (sizeof(settings) / sizeof(settings[0]))

_Static_assert(NSETTINGS <= CONFIG_MAX_SETTINGS, "raise CONFIG_MAX_SETTINGS");
/* Id lists are handled as unsigned int arrays. */
_Static_assert(sizeof(uid_t) == sizeof(unsigned) && sizeof(gid_t) == sizeof(unsigned),
               "uid_t and gid_t must be unsigned int");

static void *field(struct config *cfg, size_t off)
{
	return (char *)cfg + off;
}

static const void *cfield(const struct config *cfg, size_t off)
{
	return (const char *)cfg + off;
}

static void set_err(char *err, size_t errsize, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_err(char *err, size_t errsize, const char *fmt, ...)
{
	va_list ap;

	if (!err || errsize == 0)
		return;
	va_start(ap, fmt);
	vsnprintf(err, errsize, fmt, ap);
	va_end(ap);
}

void config_defaults(struct config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->socket_path = "/run/convod/convod.sock";
	cfg->state_dir = "/var/lib/convod";
	cfg->max_line_bytes = 1024 * 1024;
	cfg->max_output_bytes = 8 * 1024 * 1024;
	cfg->max_connections = 1024;
	cfg->max_conversations = 1000000;
	cfg->max_messages = 100000;
	cfg->max_conversation_bytes = 64 * 1024 * 1024;
	cfg->max_conversation_id_bytes = 256;
	cfg->log_level = LOG_INFO;
	cfg->log_format = LOG_FORMAT_AUTO;
	cfg->durability = DURABILITY_PROCESS;
	cfg->dynamodb_table = "convod";
	cfg->flush_interval_ms = 1000;
	cfg->idle_ms = 30000;
	cfg->batch_items = 25;
	cfg->retry_base_ms = 100;
	cfg->retry_max_ms = 30000;
	cfg->spool_max_items = 1000000;
	cfg->expires_days = 0;
	cfg->closed_retention_days = 30;
	cfg->drain_ms = 5000;
	cfg->connect_timeout_ms = 3000;
	cfg->request_timeout_ms = 10000;
}

void config_free(struct config *cfg)
{
	if (!cfg)
		return;
	for (size_t i = 0; i < cfg->nstrs; i++)
		free(cfg->strs[i]);
	free(cfg->strs);
	free(cfg->allow_uids);
	free(cfg->allow_gids);
	free(cfg->file);
	memset(cfg, 0, sizeof(*cfg));
}

const char *config_setting_key(size_t i)
{
	return i < NSETTINGS ? settings[i].key : NULL;
}

int config_setting_index(const char *key)
{
	for (size_t i = 0; i < NSETTINGS; i++) {
		if (strcmp(settings[i].key, key) == 0)
			return (int)i;
	}
	return -1;
}

/* --- values ---------------------------------------------------------------------------- */

static int parse_uint(const struct setting *s, const char *v, const char *where, uint64_t *out,
                      char *err, size_t errsize)
{
	char *end = NULL;
	uintmax_t n;

	if (*v < '0' || *v > '9')
		goto bad;
	errno = 0;
	n = strtoumax(v, &end, 10);
	if (errno || *end || n < s->min || n > s->max)
		goto bad;
	*out = (uint64_t)n;
	return 0;
bad:
	if (s->max == SIZE_MAX)
		set_err(err, errsize, "%s: expected an integer >= %" PRIu64 ", got '%s'", where,
		        s->min, v);
	else
		set_err(err, errsize,
		        "%s: expected an integer from %" PRIu64 " to %" PRIu64 ", got '%s'", where,
		        s->min, s->max, v);
	return -EINVAL;
}

/* One user or group: digits are an id, anything else a name looked up in the system's
 * databases (getpwnam/getgrnam: blocking, but only at start and on SIGHUP). */
static int parse_id(bool user, const char *item, const char *where, unsigned *out, char *err,
                    size_t errsize)
{
	if (*item >= '0' && *item <= '9') {
		char *end = NULL;
		uintmax_t n;

		errno = 0;
		n = strtoumax(item, &end, 10);
		/* (uid_t)-1 means "no id" to the kernel. */
		if (errno || *end || n >= UINT32_MAX) {
			set_err(err, errsize, "%s: '%s' is not a valid %s id", where, item,
			        user ? "user" : "group");
			return -EINVAL;
		}
		*out = (unsigned)n;
		return 0;
	}
	if (user) {
		struct passwd *pw = getpwnam(item);
		if (pw) {
			*out = (unsigned)pw->pw_uid;
			return 0;
		}
	} else {
		struct group *gr = getgrnam(item);
		if (gr) {
			*out = (unsigned)gr->gr_gid;
			return 0;
		}
	}
	set_err(err, errsize, "%s: unknown %s '%s'", where, user ? "user" : "group", item);
	return -EINVAL;
}

/* "1000, alice,0" into a new array (NULL for an empty list). */
static int parse_ids(bool user, const char *v, const char *where, unsigned **out, size_t *nout,
                     char *err, size_t errsize)
{
	unsigned *ids = NULL;
	size_t n = 0, cap = 0;
	char *copy = NULL, *item, *next;
	int rc = 0;

	*out = NULL;
	*nout = 0;
	while (isspace((unsigned char)*v))
		v++;
	if (!*v)
		return 0;
	copy = strdup(v);
	if (!copy) {
		rc = -ENOMEM;
		goto out;
	}
	for (item = copy; item; item = next) {
		char *end;

		next = strchr(item, ',');
		if (next)
			*next++ = '\0';
		while (isspace((unsigned char)*item))
			item++;
		end = item + strlen(item);
		while (end > item && isspace((unsigned char)end[-1]))
			*--end = '\0';
		if (!*item) {
			set_err(err, errsize, "%s: empty entry in the list '%s'", where, v);
			rc = -EINVAL;
			goto out;
		}
		if (n == cap) {
			unsigned *grown;
			if (cap >= CONFIG_MAX_IDS) {
				set_err(err, errsize, "%s: more than %d entries", where,
				        CONFIG_MAX_IDS);
				rc = -EINVAL;
				goto out;
			}
			cap = cap ? cap * 2 : 8;
			grown = realloc(ids, cap * sizeof(*ids));
			if (!grown) {
				rc = -ENOMEM;
				goto out;
			}
			ids = grown;
		}
		rc = parse_id(user, item, where, &ids[n], err, errsize);
		if (rc < 0)
			goto out;
		n++;
	}
	*out = ids;
	*nout = n;
	ids = NULL;
out:
	if (rc == -ENOMEM)
		set_err(err, errsize, "%s: out of memory", where);
	free(ids);
	free(copy);
	return rc;
}

static int keep_string(struct config *cfg, const char *v, const char **out)
{
	char **grown, *copy = strdup(v);

	if (!copy)
		return -ENOMEM;
	grown = realloc(cfg->strs, (cfg->nstrs + 1) * sizeof(*grown));
	if (!grown) {
		free(copy);
		return -ENOMEM;
	}
	cfg->strs = grown;
	cfg->strs[cfg->nstrs++] = copy;
	*out = copy;
	return 0;
}

/* A control character or a double quote: what no value may hold, in a file or a flag. */
static bool has_forbidden_char(const char *v)
{
	for (; *v; v++)
		if ((unsigned char)*v < 0x20 || *v == 0x7f || *v == '"')
			return true;
	return false;
}

static int check_string(size_t i, const char *v, const char *where, char *err, size_t errsize)
{
	if (!*v) {
		set_err(err, errsize, "%s: expected a value", where);
		return -EINVAL;
	}
	/* What the file refuses, a flag refuses too: --check-config prints every setting as a
	 * line of a file that reads back the same. */
	if (has_forbidden_char(v)) {
		set_err(err, errsize, "%s: control character or double quote in the value", where);
		return -EINVAL;
	}
	if (strcmp(settings[i].key, "socket") == 0) {
		struct sockaddr_un sa;
		if (strlen(v) >= sizeof(sa.sun_path)) {
			set_err(err, errsize, "%s: a socket path is at most %zu bytes", where,
			        sizeof(sa.sun_path) - 1);
			return -EINVAL;
		}
	}
	if (strcmp(settings[i].key, "dynamodb-table") == 0 && !ddbitem_table_name_valid(v)) {
		set_err(err, errsize, "%s: expected 3 to 255 of A-Z a-z 0-9 _ . -, got '%s'", where,
		        v);
		return -EINVAL;
	}
	return 0;
}

int config_set(struct config *cfg, const char *key, const char *value, enum config_source src,
               unsigned line, const char *where, char *err, size_t errsize)
{
	const struct setting *s;
	int i = config_setting_index(key);
	uint64_t n = 0;
	int rc = 0;

	if (i < 0) {
		set_err(err, errsize, "%s: unknown key (see convod.conf(5))", where);
		return -ENOENT;
	}
	s = &settings[i];
	switch (s->type) {
	case T_STR:
		rc = check_string((size_t)i, value, where, err, errsize);
		if (rc == 0) {
			rc = keep_string(cfg, value, (const char **)field(cfg, s->off));
			if (rc < 0)
				set_err(err, errsize, "%s: out of memory", where);
		}
		break;
	case T_SIZE:
		rc = parse_uint(s, value, where, &n, err, errsize);
		if (rc == 0)
			*(size_t *)field(cfg, s->off) = (size_t)n;
		break;
	case T_U64:
		rc = parse_uint(s, value, where, &n, err, errsize);
		if (rc == 0)
			*(uint64_t *)field(cfg, s->off) = n;
		break;
	case T_U32:
		rc = parse_uint(s, value, where, &n, err, errsize);
		if (rc == 0)
			*(uint32_t *)field(cfg, s->off) = (uint32_t)n;
		break;
	case T_BOOL:
		if (strcmp(value, "true") == 0) {
			*(bool *)field(cfg, s->off) = true;
		} else if (strcmp(value, "false") == 0) {
			*(bool *)field(cfg, s->off) = false;
		} else {
			set_err(err, errsize, "%s: expected true or false, got '%s'", where, value);
			rc = -EINVAL;
		}
		break;
	case T_LEVEL:
		if (log_level_parse(value, (enum log_level *)field(cfg, s->off)) < 0) {
			set_err(err, errsize, "%s: expected debug, info, warn or error, got '%s'",
			        where, value);
			rc = -EINVAL;
		}
		break;
	case T_FORMAT:
		if (log_format_parse(value, (enum log_format *)field(cfg, s->off)) < 0) {
			set_err(err, errsize, "%s: expected auto, plain or journal, got '%s'",
			        where, value);
			rc = -EINVAL;
		}
		break;
	case T_DURABILITY: {
		enum durability dur;
		if (store_durability_parse(value, &dur) < 0) {
			set_err(err, errsize, "%s: expected process, machine or none, got '%s'",
			        where, value);
			rc = -EINVAL;
		} else {
			*(int *)field(cfg, s->off) = (int)dur;
		}
		break;
	}
	case T_UIDS:
	case T_GIDS: {
		unsigned *ids = NULL;
		size_t nids = 0;
		rc = parse_ids(s->type == T_UIDS, value, where, &ids, &nids, err, errsize);
		if (rc == 0) {
			unsigned **p = field(cfg, s->off);
			free(*p);
			*p = ids;
			*(size_t *)field(cfg, s->off_n) = nids;
		}
		break;
	}
	}
	if (rc < 0)
		return rc;
	cfg->source[i] = src;
	cfg->line[i] = src == CONFIG_SRC_FILE ? line : 0;
	return 0;
}

/* Where an error about setting i is: the file and line, or the flag. */
static void setting_where(const struct config *cfg, size_t i, char *buf, size_t size)
{
	if (cfg->source[i] == CONFIG_SRC_FILE)
		snprintf(buf, size, "%s:%u: %s", cfg->file ? cfg->file : "(config)", cfg->line[i],
		         settings[i].key);
	else if (cfg->source[i] == CONFIG_SRC_FLAG)
		snprintf(buf, size, "--%s", settings[i].key);
	else
		snprintf(buf, size, "%s (default)", settings[i].key);
}

int config_validate(const struct config *cfg, char *err, size_t errsize)
{
	if (cfg->retry_max_ms < cfg->retry_base_ms) {
		int imax = config_setting_index("retry-max-ms");
		int ibase = config_setting_index("retry-base-ms");
		/* Blame the one set most explicitly: a flag over the file over a default. */
		int blame = cfg->source[imax] >= cfg->source[ibase] ? imax : ibase;
		char where[300];

		setting_where(cfg, (size_t)blame, where, sizeof(where));
		set_err(err, errsize,
		        "%s: retry-max-ms (%" PRIu64 ") must be at least retry-base-ms (%" PRIu64
		        ")",
		        where, cfg->retry_max_ms, cfg->retry_base_ms);
		return -EINVAL;
	}
	return 0;
}

/* --- the file -------------------------------------------------------------------------- */

static bool is_blank(char c)
{
	return c == ' ' || c == '\t' || c == '\r';
}

/* Value text between the '=' and the end of the line: a '#' at its start or after a blank,
 * outside double quotes, starts a comment; surrounding blanks go; one pair of double
 * quotes around the whole value goes too (so a value may keep blanks or a " #"). */
static int parse_value(char *v, char **out)
{
	bool quoted = false;
	char *p, *end;

	for (p = v; *p; p++) {
		if (*p == '"')
			quoted = !quoted;
		else if (*p == '#' && !quoted && (p == v || is_blank(p[-1])))
			break;
	}
	*p = '\0';
	while (is_blank(*v))
		v++;
	end = v + strlen(v);
	while (end > v && is_blank(end[-1]))
		*--end = '\0';
	if (end - v >= 2 && v[0] == '"' && end[-1] == '"') {
		end[-1] = '\0';
		v++;
	}
	/* There is no escape: a '"' may only surround the whole value (so that every value
	 * --check-config prints reads back the same). */
	if (has_forbidden_char(v))
		return -EINVAL;
	*out = v;
	return 0;
}

int config_parse_text(struct config *cfg, const char *name, const char *text, size_t len, char *err,
                      size_t errsize)
{
	unsigned seen[NSETTINGS];
	static char line[CONFIG_MAX_LINE_BYTES + 2]; /* the loop thread's only */
	size_t pos = 0;
	unsigned lineno = 0;

	memset(seen, 0, sizeof(seen));
	if (len >= 3 && memcmp(text, "\xef\xbb\xbf", 3) == 0)
		pos = 3;
	while (pos < len) {
		const char *nl = memchr(text + pos, '\n', len - pos);
		size_t n = (nl ? (size_t)(nl - text) : len) - pos;
		char *p, *key, *value, where[4096 + 256];
		int i, rc;

		lineno++;
		/* The limit is the line's text: a CR before its LF is not counted. */
		if (n - (n && text[pos + n - 1] == '\r') > CONFIG_MAX_LINE_BYTES) {
			set_err(err, errsize, "%s:%u: line longer than %d bytes", name, lineno,
			        CONFIG_MAX_LINE_BYTES);
			return -EINVAL;
		}
		if (memchr(text + pos, '\0', n)) {
			set_err(err, errsize, "%s:%u: contains a NUL byte", name, lineno);
			return -EINVAL;
		}
		memcpy(line, text + pos, n);
		line[n] = '\0';
		pos += n + (nl ? 1 : 0);

		for (p = line; is_blank(*p); p++)
			;
		if (*p == '\0' || *p == '#')
			continue;
		key = p;
		while (*p && *p != '=' && !is_blank(*p))
			p++;
		if (p == key) {
			set_err(err, errsize, "%s:%u: expected 'key = value'", name, lineno);
			return -EINVAL;
		}
		for (char *k = key; k < p; k++) {
			if (!((*k >= 'a' && *k <= 'z') || (*k >= '0' && *k <= '9') || *k == '-')) {
				set_err(err, errsize,
				        "%s:%u: expected 'key = value' (keys are lower-case words "
				        "joined by '-')",
				        name, lineno);
				return -EINVAL;
			}
		}
		while (is_blank(*p))
			*p++ = '\0';
		if (*p != '=') {
			*p = '\0';
			set_err(err, errsize, "%s:%u: %.*s: expected '=' after the key", name,
			        lineno, 200, key);
			return -EINVAL;
		}
		*p++ = '\0';
		snprintf(where, sizeof(where), "%s:%u: %.200s", name, lineno, key);
		i = config_setting_index(key);
		if (i < 0) {
			set_err(err, errsize, "%s: unknown key (see convod.conf(5))", where);
			return -EINVAL;
		}
		if (seen[i]) {
			set_err(err, errsize, "%s: duplicate key (first set on line %u)", where,
			        seen[i]);
			return -EINVAL;
		}
		seen[i] = lineno;
		if (parse_value(p, &value) < 0) {
			set_err(
			    err, errsize,
			    "%s: control character or inner double quote in the value (a double "
			    "quote may only surround the whole value)",
			    where);
			return -EINVAL;
		}
		rc = config_set(cfg, key, value, CONFIG_SRC_FILE, lineno, where, err, errsize);
		if (rc < 0)
			return rc == -ENOMEM ? rc : -EINVAL;
	}
	return 0;
}

/* Reads a whole (small) file. 0 or -errno with err set. */
static int read_file(const char *path, char **out, size_t *outlen, char *err, size_t errsize)
{
	struct stat st;
	char *data = NULL;
	size_t len = 0, cap = 0;
	int fd, rc = 0;

	*out = NULL;
	*outlen = 0;
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		rc = -errno;
		set_err(err, errsize, "%s: cannot open: %s", path, strerror(-rc));
		return rc;
	}
	if (fstat(fd, &st) < 0) {
		rc = -errno;
		set_err(err, errsize, "%s: %s", path, strerror(-rc));
		goto out;
	}
	if (S_ISDIR(st.st_mode)) {
		rc = -EISDIR;
		set_err(err, errsize, "%s: is a directory", path);
		goto out;
	}
	for (;;) {
		ssize_t got;
		if (len == cap) {
			char *grown;
			if (cap > CONFIG_MAX_FILE_BYTES) {
				rc = -EFBIG;
				set_err(err, errsize, "%s: larger than %d bytes", path,
				        CONFIG_MAX_FILE_BYTES);
				goto out;
			}
			cap = cap ? cap * 2 : 4096;
			grown = realloc(data, cap + 1);
			if (!grown) {
				rc = -ENOMEM;
				set_err(err, errsize, "%s: out of memory", path);
				goto out;
			}
			data = grown;
		}
		got = read(fd, data + len, cap - len);
		if (got < 0 && errno == EINTR)
			continue;
		if (got < 0) {
			rc = -errno;
			set_err(err, errsize, "%s: cannot read: %s", path, strerror(-rc));
			goto out;
		}
		if (got == 0)
			break;
		len += (size_t)got;
	}
	if (len > CONFIG_MAX_FILE_BYTES) {
		rc = -EFBIG;
		set_err(err, errsize, "%s: larger than %d bytes", path, CONFIG_MAX_FILE_BYTES);
		goto out;
	}
	if (!data && !(data = malloc(1))) {
		rc = -ENOMEM;
		set_err(err, errsize, "%s: out of memory", path);
		goto out;
	}
	data[len] = '\0';
	*out = data;
	*outlen = len;
	data = NULL;
out:
	free(data);
	close(fd);
	return rc;
}

int config_load(struct config *cfg, const struct config_args *args, char *err, size_t errsize)
{
	char *text = NULL;
	size_t len = 0;
	int rc = 0;

	config_defaults(cfg);
	if (args->config_path) {
		/* "-PATH", as in systemd's EnvironmentFile=-: read PATH when it exists, so the
		 * unit can name the operator's file without requiring it. */
		const char *path = args->config_path;
		bool optional = path[0] == '-' && path[1] != '\0';
		if (optional)
			path++;
		if (optional && access(path, F_OK) != 0 && errno == ENOENT)
			goto flags;
		cfg->file = strdup(path);
		if (!cfg->file) {
			rc = -ENOMEM;
			set_err(err, errsize, "out of memory");
			goto out;
		}
		rc = read_file(path, &text, &len, err, errsize);
		if (rc < 0)
			goto out;
		rc = config_parse_text(cfg, path, text, len, err, errsize);
		if (rc < 0)
			goto out;
	}
flags:
	for (size_t i = 0; i < args->nflags; i++) {
		char where[128];
		snprintf(where, sizeof(where), "--%s", args->flags[i].key);
		rc = config_set(cfg, args->flags[i].key, args->flags[i].value, CONFIG_SRC_FLAG, 0,
		                where, err, errsize);
		if (rc < 0)
			goto out;
	}
	rc = config_validate(cfg, err, errsize);
out:
	free(text);
	return rc;
}

/* --- the command line ------------------------------------------------------------------ */

enum { OPT_CONFIG = 1000, OPT_CHECK, OPT_HELP, OPT_VERSION };

void config_args_free(struct config_args *args)
{
	if (!args)
		return;
	for (size_t i = 0; i < args->nflags; i++) {
		free(args->flags[i].key);
		free(args->flags[i].value);
	}
	free(args->flags);
	memset(args, 0, sizeof(*args));
}

/* Records key = value; a later flag replaces an earlier one, lists add up. */
static int args_put(struct config_args *args, const struct setting *s, const char *value)
{
	struct config_flag *grown;
	char *v;

	for (size_t i = 0; i < args->nflags; i++) {
		struct config_flag *f = &args->flags[i];
		if (strcmp(f->key, s->key) != 0)
			continue;
		if ((s->type == T_UIDS || s->type == T_GIDS) && *f->value && *value) {
			size_t a = strlen(f->value), b = strlen(value);
			v = malloc(a + b + 2);
			if (!v)
				return -ENOMEM;
			memcpy(v, f->value, a);
			v[a] = ',';
			memcpy(v + a + 1, value, b + 1);
		} else if (!(v = strdup(value))) { /* an empty list flag empties the list */
			return -ENOMEM;
		}
		free(f->value);
		f->value = v;
		return 0;
	}
	grown = realloc(args->flags, (args->nflags + 1) * sizeof(*grown));
	if (!grown)
		return -ENOMEM;
	args->flags = grown;
	grown[args->nflags].key = strdup(s->key);
	grown[args->nflags].value = strdup(value);
	if (!grown[args->nflags].key || !grown[args->nflags].value) {
		free(grown[args->nflags].key);
		free(grown[args->nflags].value);
		return -ENOMEM;
	}
	args->nflags++;
	return 0;
}

/* The word of the option getopt_long just returned: argv[optind - 1], or the one before
 * when its value was a word of its own. */
static const char *option_word(char **argv, int optind_now, const char *arg)
{
	return argv[optind_now - 1 - (arg && arg == argv[optind_now - 1])];
}

/* Whether option word w names name in full: "--NAME" or "--NAME=...". */
static bool exact_option(const char *w, const char *name)
{
	size_t n = strlen(name);

	return w[0] == '-' && w[1] == '-' && strncmp(w + 2, name, n) == 0 &&
	       (w[2 + n] == '\0' || w[2 + n] == '=');
}

int config_parse_args(struct config_args *args, int argc, char **argv, char *err, size_t errsize)
{
	struct option opts[2 * NSETTINGS + 5];
	struct config scratch;
	size_t n = 0;
	int c, li, rc = 0;

	memset(args, 0, sizeof(*args));
	config_defaults(&scratch);
	for (size_t i = 0; i < NSETTINGS; i++) {
		int has = settings[i].type == T_BOOL ? optional_argument : required_argument;
		opts[n++] = (struct option){settings[i].key, has, NULL, (int)i};
		if (settings[i].alias)
			opts[n++] = (struct option){settings[i].alias, has, NULL, (int)i};
	}
	opts[n++] = (struct option){"config", required_argument, NULL, OPT_CONFIG};
	opts[n++] = (struct option){"check-config", no_argument, NULL, OPT_CHECK};
	opts[n++] = (struct option){"help", no_argument, NULL, OPT_HELP};
	opts[n++] = (struct option){"version", no_argument, NULL, OPT_VERSION};
	opts[n] = (struct option){NULL, 0, NULL, 0};

	opterr = 0;
	optind = 1;
	while ((li = -1, c = getopt_long(argc, argv, ":", opts, &li)) != -1) {
		if (li >= 0 && !exact_option(option_word(argv, optind, optarg), opts[li].name)) {
			/* getopt_long takes a prefix of one name for it ("--mem" for
			 * --memory-only): not here, where a setting must be named in full. */
			set_err(err, errsize,
			        "unknown option '%s' (options are not abbreviated; see "
			        "--help)",
			        option_word(argv, optind, optarg));
			rc = -EINVAL;
			goto fail;
		}
		if (c >= 0 && (size_t)c < NSETTINGS) {
			const struct setting *s = &settings[c];
			const char *value = optarg;
			char where[128];

			if (s->type == T_BOOL && !value)
				value = "true";
			snprintf(where, sizeof(where), "--%s", s->key);
			/* Checked now, so that a bad flag fails before anything starts. */
			rc = config_set(&scratch, s->key, value, CONFIG_SRC_FLAG, 0, where, err,
			                errsize);
			if (rc == 0 && (rc = args_put(args, s, value)) < 0)
				set_err(err, errsize, "out of memory");
			if (rc < 0)
				goto fail;
			continue;
		}
		switch (c) {
		case OPT_CONFIG:
			if (!*optarg) {
				set_err(err, errsize, "--config: expected a file");
				rc = -EINVAL;
				goto fail;
			}
			args->config_path = optarg;
			break;
		case OPT_CHECK:
			if (args->action == CONFIG_RUN)
				args->action = CONFIG_CHECK;
			break;
		case OPT_HELP:
			args->action = CONFIG_HELP;
			break;
		case OPT_VERSION:
			if (args->action != CONFIG_HELP)
				args->action = CONFIG_VERSION;
			break;
		case ':':
			set_err(err, errsize, "%s: missing value", argv[optind - 1]);
			rc = -EINVAL;
			goto fail;
		default:
			set_err(err, errsize, "unknown option '%s' (see --help)", argv[optind - 1]);
			rc = -EINVAL;
			goto fail;
		}
	}
	if (optind < argc) {
		set_err(err, errsize, "unexpected argument '%s' (see --help)", argv[optind]);
		rc = -EINVAL;
		goto fail;
	}
	config_free(&scratch);
	return 0;
fail:
	config_free(&scratch);
	config_args_free(args);
	return rc;
}

/* --- reports --------------------------------------------------------------------------- */

static bool needs_quotes(const char *v)
{
	size_t n = strlen(v);

	if (n == 0 || is_blank(v[0]) || is_blank(v[n - 1]) || v[0] == '"' || v[0] == '#')
		return true;
	for (const char *p = v + 1; *p; p++) {
		if (*p == '#' && is_blank(p[-1]))
			return true;
	}
	return false;
}

/* An id list, comma-separated, cut with "..." to fit. */
static void format_ids(const unsigned *ids, size_t n, char *buf, size_t size)
{
	size_t used = 0;

	buf[0] = '\0';
	for (size_t i = 0; i < n; i++) {
		int w = snprintf(buf + used, size - used, "%s%u", i ? "," : "", ids[i]);
		if (w < 0 || (size_t)w >= size - used) {
			if (size >= 4)
				strcpy(buf + (used < size - 4 ? used : size - 4), "...");
			return;
		}
		used += (size_t)w;
	}
}

const char *config_format_value(const struct config *cfg, size_t i, char *buf, size_t size)
{
	const struct setting *s;

	if (!buf || size == 0)
		return buf;
	buf[0] = '\0';
	if (i >= NSETTINGS)
		return buf;
	s = &settings[i];
	switch (s->type) {
	case T_STR: {
		const char *v = *(const char *const *)cfield(cfg, s->off);
		if (!v)
			v = "";
		snprintf(buf, size, needs_quotes(v) ? "\"%s\"" : "%s", v);
		break;
	}
	case T_SIZE:
		snprintf(buf, size, "%zu", *(const size_t *)cfield(cfg, s->off));
		break;
	case T_U64:
		snprintf(buf, size, "%" PRIu64, *(const uint64_t *)cfield(cfg, s->off));
		break;
	case T_U32:
		snprintf(buf, size, "%" PRIu32, *(const uint32_t *)cfield(cfg, s->off));
		break;
	case T_BOOL:
		snprintf(buf, size, "%s", *(const bool *)cfield(cfg, s->off) ? "true" : "false");
		break;
	case T_LEVEL:
		snprintf(buf, size, "%s",
		         log_level_str(*(const enum log_level *)cfield(cfg, s->off)));
		break;
	case T_FORMAT:
		snprintf(buf, size, "%s",
		         log_format_str(*(const enum log_format *)cfield(cfg, s->off)));
		break;
	case T_DURABILITY:
		snprintf(
		    buf, size, "%s",
		    store_durability_str((enum durability) * (const int *)cfield(cfg, s->off)));
		break;
	case T_UIDS:
	case T_GIDS:
		format_ids(*(unsigned *const *)cfield(cfg, s->off),
		           *(const size_t *)cfield(cfg, s->off_n), buf, size);
		break;
	}
	return buf;
}

static bool setting_equal(const struct config *a, const struct config *b, size_t i)
{
	const struct setting *s = &settings[i];

	switch (s->type) {
	case T_STR:
		return strcmp(*(const char *const *)cfield(a, s->off),
		              *(const char *const *)cfield(b, s->off)) == 0;
	case T_SIZE:
		return *(const size_t *)cfield(a, s->off) == *(const size_t *)cfield(b, s->off);
	case T_U64:
		return *(const uint64_t *)cfield(a, s->off) == *(const uint64_t *)cfield(b, s->off);
	case T_U32:
		return *(const uint32_t *)cfield(a, s->off) == *(const uint32_t *)cfield(b, s->off);
	case T_BOOL:
		return *(const bool *)cfield(a, s->off) == *(const bool *)cfield(b, s->off);
	case T_LEVEL:
		return *(const enum log_level *)cfield(a, s->off) ==
		       *(const enum log_level *)cfield(b, s->off);
	case T_FORMAT:
		return *(const enum log_format *)cfield(a, s->off) ==
		       *(const enum log_format *)cfield(b, s->off);
	case T_DURABILITY:
		return *(const int *)cfield(a, s->off) == *(const int *)cfield(b, s->off);
	case T_UIDS:
	case T_GIDS: {
		size_t na = *(const size_t *)cfield(a, s->off_n);
		size_t nb = *(const size_t *)cfield(b, s->off_n);
		const unsigned *ia = *(unsigned *const *)cfield(a, s->off);
		const unsigned *ib = *(unsigned *const *)cfield(b, s->off);
		return na == nb && (na == 0 || memcmp(ia, ib, na * sizeof(*ia)) == 0);
	}
	}
	return true;
}

void config_print(const struct config *cfg, FILE *f)
{
	/* Room for the longest line a file may hold, and for a path given as a flag. */
	static char value[CONFIG_MAX_LINE_BYTES + 8192];

	fprintf(f, "# convod %s: effective settings (defaults, then %s%s, then flags)\n",
	        CONVOD_VERSION, cfg->file ? "the file " : "no config file",
	        cfg->file ? cfg->file : "");
	for (size_t i = 0; i < NSETTINGS; i++) {
		const struct setting *s = &settings[i];
		int w;

		if (s->type == T_UIDS || s->type == T_GIDS) {
			/* In full, however long. */
			const unsigned *ids = *(unsigned *const *)cfield(cfg, s->off);
			size_t nids = *(const size_t *)cfield(cfg, s->off_n);
			w = fprintf(f, "%s = ", s->key);
			for (size_t k = 0; k < nids; k++)
				w += fprintf(f, "%s%u", k ? "," : "", ids[k]);
		} else {
			w = fprintf(f, "%s = %s", s->key,
			            config_format_value(cfg, i, value, sizeof(value)));
		}
		fprintf(f, "%*s# ", w < 40 ? 40 - w : 2, "");
		if (cfg->source[i] == CONFIG_SRC_FILE)
			fprintf(f, "file (line %u)\n", cfg->line[i]);
		else if (cfg->source[i] == CONFIG_SRC_FLAG)
			fprintf(f, "flag\n");
		else
			fprintf(f, "default\n");
	}
}

bool config_peer_allowed(const struct config *cfg, uid_t uid, gid_t gid)
{
	if (cfg->nallow_uids == 0 && cfg->nallow_gids == 0)
		return true;
	for (size_t i = 0; i < cfg->nallow_uids; i++) {
		if (cfg->allow_uids[i] == uid)
			return true;
	}
	for (size_t i = 0; i < cfg->nallow_gids; i++) {
		if (cfg->allow_gids[i] == gid)
			return true;
	}
	return false;
}

void config_print_aws(const struct awsconf *aws, FILE *f)
{
	size_t idlen = aws->access_key_id ? strlen(aws->access_key_id) : 0;

	fprintf(f, "# AWS settings (the environment and the AWS files; not set in this file):\n");
	fprintf(f, "#   dynamodb = %s\n",
	        awsconf_dynamodb_configured(aws) ? "configured"
	                                         : "not configured: the local store is the sink");
	if (aws->region)
		fprintf(f, "#   region = %s (%s)\n", aws->region,
		        awsconf_source_str(aws->region_source));
	else
		fprintf(f, "#   region = (unset)\n");
	if (aws->endpoint_url)
		fprintf(f, "#   endpoint = %s (%s)\n", aws->endpoint_url,
		        awsconf_source_str(aws->endpoint_source));
	else
		fprintf(f, "#   endpoint = %s\n",
		        aws->region ? "(the region's public endpoint)" : "(unset)");
	fprintf(f, "#   profile = %s\n", aws->profile ? aws->profile : "default");
	/* The last 4 characters only, none of an id so short that 4 would be most of it. */
	if (idlen >= 8)
		fprintf(f, "#   access-key-id = ****%s (%s)\n", aws->access_key_id + idlen - 4,
		        awsconf_source_str(aws->credentials_source));
	else
		fprintf(f, "#   access-key-id = %s (%s)\n", idlen ? "(set)" : "(unset)",
		        awsconf_source_str(aws->credentials_source));
	fprintf(f, "#   secret-access-key = %s\n", aws->secret_access_key ? "(set)" : "(unset)");
	fprintf(f, "#   session-token = %s\n", aws->session_token ? "(set)" : "(unset)");
}

/* --- reload ---------------------------------------------------------------------------- */

/* Moves setting i from next into running (an id list is swapped, so next frees the old). */
static void move_setting(struct config *running, struct config *next, size_t i)
{
	const struct setting *s = &settings[i];

	switch (s->type) {
	case T_STR:
		/* Never at run time: the running strings are borrowed by the server. */
		break;
	case T_SIZE:
		*(size_t *)field(running, s->off) = *(size_t *)field(next, s->off);
		break;
	case T_U64:
		*(uint64_t *)field(running, s->off) = *(uint64_t *)field(next, s->off);
		break;
	case T_U32:
		*(uint32_t *)field(running, s->off) = *(uint32_t *)field(next, s->off);
		break;
	case T_BOOL:
		*(bool *)field(running, s->off) = *(bool *)field(next, s->off);
		break;
	case T_LEVEL:
		*(enum log_level *)field(running, s->off) = *(enum log_level *)field(next, s->off);
		break;
	case T_FORMAT:
		*(enum log_format *)field(running, s->off) =
		    *(enum log_format *)field(next, s->off);
		break;
	case T_DURABILITY:
		*(int *)field(running, s->off) = *(int *)field(next, s->off);
		break;
	case T_UIDS:
	case T_GIDS: {
		unsigned **a = field(running, s->off), **b = field(next, s->off);
		size_t *na = field(running, s->off_n), *nb = field(next, s->off_n);
		unsigned *tp = *a;
		size_t tn = *na;
		*a = *b;
		*na = *nb;
		*b = tp;
		*nb = tn;
		break;
	}
	}
	running->source[i] = next->source[i];
	running->line[i] = next->line[i];
}

unsigned config_reload(struct config *running, struct config *next)
{
	char before[256], after[256];
	unsigned bits = 0, changed = 0, kept = 0;

	/* The log settings first, so the report below follows the new level and format. */
	log_set_level(next->log_level);
	log_set_format(next->log_format);
	for (size_t i = 0; i < NSETTINGS; i++) {
		const struct setting *s = &settings[i];

		if (setting_equal(running, next, i)) {
			if (s->runtime) {
				running->source[i] = next->source[i];
				running->line[i] = next->line[i];
			}
			continue;
		}
		config_format_value(running, i, before, sizeof(before));
		config_format_value(next, i, after, sizeof(after));
		if (!s->runtime) {
			log_msg_unlimited(
			    LOG_WARN, "config", "%s changed to %s; needs a restart; keeping %s",
			    s->key, after[0] ? after : "(none)", before[0] ? before : "(none)");
			kept++;
			continue;
		}
		log_msg_unlimited(LOG_INFO, "config", "%s %s -> %s", s->key,
		                  before[0] ? before : "(none)", after[0] ? after : "(none)");
		move_setting(running, next, i);
		bits |= s->action;
		changed++;
	}
	log_msg_unlimited(LOG_INFO, "config", "reloaded: %u setting%s changed%s", changed,
	                  changed == 1 ? "" : "s", kept ? ", some kept until a restart" : "");
	/* The file this reload read (NULL: a -FILE that does not exist). */
	free(running->file);
	running->file = next->file;
	next->file = NULL;
	return bits;
}

/* --- usage ----------------------------------------------------------------------------- */

/* Writes text from column col, wrapped before column 92 with continuation lines indented
 * to col. */
static void print_wrapped(const char *text, int col, int at)
{
	const int width = 92;

	while (*text) {
		const char *sp = NULL, *p;
		int room = width - at;

		for (p = text; *p && p - text <= room; p++) {
			if (*p == ' ')
				sp = p;
		}
		if (!*p || !sp) {
			printf("%s", text);
			break;
		}
		printf("%.*s\n%*s", (int)(sp - text), text, col, "");
		at = col;
		text = sp + 1;
	}
	printf("\n");
}

void config_usage(const char *prog)
{
	struct config d;
	char def[256], text[512], head[128];

	config_defaults(&d);
	printf(
	    "Usage: %s [--config FILE] [OPTIONS]\n"
	    "Keeps LLM conversations for voice assistants; clients speak newline-delimited JSON\n"
	    "over a Unix socket (protocol v1). Flags override the config file\n"
	    "(convod.conf(5)), whose keys are the flags without \"--\".\n\n",
	    prog);
	printf("  %-36s%s\n", "--config FILE", "config file read first (default: none)");
	printf("  %-36s%s\n", "--check-config",
	       "check the settings, print them (secrets masked), exit");
	for (size_t i = 0; i < NSETTINGS; i++) {
		const struct setting *s = &settings[i];
		int w;

		if (s->section)
			printf("%s\n", s->section);
		if (s->type == T_BOOL)
			snprintf(head, sizeof(head), "--%s[=false]", s->key);
		else
			snprintf(head, sizeof(head), "--%s %s", s->alias ? s->alias : s->key,
			         s->arg);
		config_format_value(&d, i, def, sizeof(def));
		if (s->type == T_BOOL)
			snprintf(text, sizeof(text), "%s", s->help);
		else
			snprintf(text, sizeof(text), "%s (default %s)", s->help,
			         def[0] ? def : "empty");
		w = printf("  %-36s", head);
		if (w > 38) {
			printf("\n%*s", 38, "");
			w = 38;
		}
		print_wrapped(text, 38, w);
	}
	printf("  %-36s%s\n", "--help", "this text");
	printf("  %-36s%s\n", "--version", "the version");
	printf(
	    "A reload (SIGHUP) rereads the file and applies the flags again; socket, state-dir,\n"
	    "durability, memory-only, dynamodb-table, create-table, connect-timeout-ms,\n"
	    "request-timeout-ms and ignore-crc32 need a restart. Options are not abbreviated.\n");
}
