/* convoctl: the command-line client of convod. Turns one command into one request of the wire
 * protocol (or forwards raw request lines from stdin, pipelined; or, for follow, repeats one
 * request on a timer) and prints the answers. It speaks protocol.md only and shares no code
 * with the daemon. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#ifndef CONVOD_VERSION
#define CONVOD_VERSION "unknown"
#endif

#define DEFAULT_SOCKET "/run/convod/convod.sock"
#define DEFAULT_TIMEOUT_MS 30000
/* create-table: the daemon waits up to a minute for the table to become ACTIVE. */
#define CREATE_TABLE_TIMEOUT_MS 120000
/* follow: the default pause between two polls, and the longest one allowed. */
#define DEFAULT_INTERVAL_MS 500
#define MAX_INTERVAL_MS 86400000LL
/* A response line longer than this is refused rather than buffered without bound. */
#define MAX_RESPONSE_BYTES ((size_t)1 << 30)
/* Reading stdin pauses while this much is waiting to be sent. */
#define MAX_PENDING_OUTPUT ((size_t)1 << 20)

/* Exit statuses, as documented in convoctl.1. */
enum exit_status {
	EXIT_OK = 0,
	EXIT_ERROR_RESPONSE = 1,
	EXIT_USAGE = 2,
	EXIT_UNREACHABLE = 3,
};

/* Option groups: a command accepts the options of the groups in its mask. */
enum opt_group {
	G_FORMAT = 1u << 0,
	G_SUMMARY = 1u << 1,
	G_IDS = 1u << 2,
	G_MAP = 1u << 3,
	G_META = 1u << 4,
	G_LIMIT = 1u << 5,
	G_FOLLOW = 1u << 6,
};

enum opt_id {
	O_FORMAT,
	O_PREAMBLE,
	O_INCLUDE_PREVIOUS,
	O_FORMAT_PART,
	O_IDS,
	O_VERSIONS,
	O_FULL,
	O_INCLUDE_LAST,
	O_TIMING,
	O_AUX,
	O_LIMIT,
	O_INTERVAL,
	O_COUNT,
};

struct opt_def {
	const char *name;
	enum opt_id id;
	unsigned group;
	bool has_value;
	const char *field; /* for O_FORMAT_PART: the key in the "format" object */
};

static const struct opt_def opt_defs[] = {
    {"--format", O_FORMAT, G_FORMAT, true, NULL},
    {"--preamble", O_PREAMBLE, G_SUMMARY, true, NULL},
    {"--include-previous-summary", O_INCLUDE_PREVIOUS, G_SUMMARY, false, NULL},
    {"--prefix", O_FORMAT_PART, G_SUMMARY, true, "prefix"},
    {"--postfix", O_FORMAT_PART, G_SUMMARY, true, "postfix"},
    {"--user-tag", O_FORMAT_PART, G_SUMMARY, true, "user_tag"},
    {"--assistant-tag", O_FORMAT_PART, G_SUMMARY, true, "assistant_tag"},
    {"--summary-tag", O_FORMAT_PART, G_SUMMARY, true, "summary_tag"},
    {"--separator", O_FORMAT_PART, G_SUMMARY, true, "separator"},
    {"--closure", O_FORMAT_PART, G_SUMMARY, true, "closure"},
    {"--summary-closure", O_FORMAT_PART, G_SUMMARY, true, "summary_closure"},
    {"--ids", O_IDS, G_IDS, true, NULL},
    {"--versions", O_VERSIONS, G_IDS, true, NULL},
    {"--full", O_FULL, G_MAP, false, NULL},
    {"--include-last", O_INCLUDE_LAST, G_MAP, false, NULL},
    {"--timing", O_TIMING, G_META, true, NULL},
    {"--aux", O_AUX, G_META, true, NULL},
    {"--limit", O_LIMIT, G_LIMIT, true, NULL},
    {"--interval", O_INTERVAL, G_FOLLOW, true, NULL},
    {"--count", O_COUNT, G_FOLLOW, true, NULL},
};

/* Settings of follow that stay in the client. */
struct follow_opts {
	long long interval_ms;
	long long count; /* stop after this many prints; 0: never */
};

struct command {
	const char *name;
	const char *op; /* NULL for the raw mode */
	unsigned groups;
	int min_pos;
	int max_pos; /* -1: no limit */
	/* JSON fields of the leading positional arguments; the rest, if contents, are the
	 * contents. */
	const char *pos_fields[2];
	bool contents;
	bool meta_top_level;   /* --timing/--aux go to the request itself, not to "metadata" */
	bool prints_text;      /* print result.text verbatim instead of the JSON result */
	bool follow;           /* repeat the request until interrupted, printing changes */
	const char *fixed;     /* JSON object of fields every request of the command has */
	const char *select[2]; /* print only these keys of the result (NULL: all) */
	int timeout_ms;        /* default --timeout of the command (0: DEFAULT_TIMEOUT_MS) */
	const char *synopsis;
	const char *help;
};

static const struct command commands[] = {
    {
        .name = "add-user",
        .op = "add_user",
        .groups = G_META,
        .min_pos = 2,
        .max_pos = -1,
        .pos_fields = {"conversation"},
        .contents = true,
        .synopsis = "CONV TEXT... [--timing KEY=MS]... [--aux KEY=JSON]...",
        .help = "append a user message (merged into the last one if that is a user message)",
    },
    {
        .name = "add-assistant",
        .op = "add_assistant",
        .groups = G_META,
        .min_pos = 2,
        .max_pos = -1,
        .pos_fields = {"conversation"},
        .contents = true,
        .synopsis = "CONV TEXT... [--timing KEY=MS]... [--aux KEY=JSON]...",
        .help = "append an assistant message (merged into the last one if that is an "
                "assistant message)",
    },
    {
        .name = "add-message",
        .op = "add_message",
        .groups = G_META,
        .min_pos = 3,
        .max_pos = -1,
        .pos_fields = {"conversation", "role"},
        .contents = true,
        .synopsis = "CONV ROLE TEXT... [--timing KEY=MS]... [--aux KEY=JSON]...",
        .help = "append a message of ROLE (user or assistant)",
    },
    {
        .name = "get-messages",
        .op = "get_messages",
        .groups = G_FORMAT,
        .min_pos = 1,
        .max_pos = 1,
        .pos_fields = {"conversation"},
        .synopsis = "CONV [--format meta|bedrock|anthropic|openai]",
        .help = "print the LLM view (in that format) and the last summary's contents",
    },
    {
        .name = "summary-info",
        .op = "get_summary_info",
        .groups = G_SUMMARY,
        .min_pos = 1,
        .max_pos = 1,
        .pos_fields = {"conversation"},
        .synopsis = "CONV [--preamble S] [--include-previous-summary] [--prefix S] [--postfix S]\n"
                    "      [--user-tag S] [--assistant-tag S] [--summary-tag S] [--separator S]\n"
                    "      [--closure S] [--summary-closure S]",
        .help = "print what to summarize next: messages, ids, versions and the text",
    },
    {
        .name = "add-summary",
        .op = "add_summary",
        .groups = G_IDS,
        .min_pos = 2,
        .max_pos = -1,
        .pos_fields = {"conversation"},
        .contents = true,
        .synopsis = "CONV TEXT... --ids ID,ID,... [--versions N,N,...]",
        .help = "add a summary of the messages named by --ids (from summary-info)",
    },
    {
        .name = "last-summary",
        .op = "get_last_summary",
        .min_pos = 1,
        .max_pos = 1,
        .pos_fields = {"conversation"},
        .synopsis = "CONV",
        .help = "print the last summary message, or null",
    },
    {
        .name = "messages-map",
        .op = "to_messages_map",
        .groups = G_MAP,
        .min_pos = 1,
        .max_pos = 1,
        .pos_fields = {"conversation"},
        .synopsis = "CONV [--full] [--include-last]",
        .help = "print the messages new or changed since the last call (--full: the whole log)",
    },
    {
        .name = "set-metadata",
        .op = "set_metadata",
        .groups = G_META,
        .min_pos = 2,
        .max_pos = 2,
        .pos_fields = {"conversation", "message_id"},
        .meta_top_level = true,
        .synopsis = "CONV MESSAGE_ID [--timing KEY=MS]... [--aux KEY=JSON]...",
        .help = "set timing and aux keys of a message (--aux KEY=null removes KEY)",
    },
    {
        .name = "describe",
        .op = "describe",
        .min_pos = 1,
        .max_pos = 1,
        .pos_fields = {"conversation"},
        .prints_text = true,
        .synopsis = "CONV",
        .help = "print a human-readable dump of the log",
    },
    {
        .name = "flush",
        .op = "flush",
        .min_pos = 0,
        .max_pos = 1,
        .pos_fields = {"conversation"},
        .synopsis = "[CONV]",
        .help = "write what is pending (of CONV, or of every conversation) to the spool now",
    },
    {
        .name = "close",
        .op = "close",
        .min_pos = 1,
        .max_pos = 1,
        .pos_fields = {"conversation"},
        .synopsis = "CONV",
        .help = "flush CONV, then drop it from memory",
    },
    {.name = "list", .op = "list", .synopsis = "", .help = "list the conversations in memory"},
    {.name = "stats", .op = "stats", .synopsis = "", .help = "print the daemon's counters"},
    {.name = "ping", .op = "ping", .synopsis = "", .help = "check that the daemon answers"},
    {
        .name = "metrics",
        .op = "stats",
        .fixed = "{\"format\": \"prometheus\"}",
        .prints_text = true,
        .synopsis = "",
        .help = "print the daemon's counters in the Prometheus text format",
    },
    {
        .name = "spool",
        .op = "stats",
        .select = {"spool", "sink"},
        .synopsis = "",
        .help = "print the spool (writes not yet confirmed) and the sink's counters",
    },
    {
        .name = "store",
        .op = "stats",
        .select = {"store"},
        .synopsis = "",
        .help = "print the local store's counters: commits, the fold, checkpoints, file sizes",
    },
    {
        .name = "dead-letters",
        .op = "dead_letters",
        .groups = G_LIMIT,
        .synopsis = "[--limit N]",
        .help = "list the writes the sink refused for good (the newest N, default 100)",
    },
    {
        .name = "retry-dead-letters",
        .op = "retry_dead_letters",
        .synopsis = "",
        .help = "put every dead letter back into the spool, to be sent again",
    },
    {
        .name = "create-table",
        .op = "create_table",
        .timeout_ms = CREATE_TABLE_TIMEOUT_MS,
        .synopsis = "",
        .help = "create the DynamoDB table and wait until it is ready (--timeout 120)",
    },
    {
        .name = "follow",
        .op = "describe",
        .groups = G_FOLLOW,
        .min_pos = 1,
        .max_pos = 1,
        .pos_fields = {"conversation"},
        .prints_text = true,
        .follow = true,
        .synopsis = "CONV [--interval MS] [--count N]",
        .help = "print describe of CONV whenever it changes (polled every MS, default 500)",
    },
    {
        .name = "raw",
        .synopsis = "",
        .help = "send request lines from stdin (pipelined), print every response line",
    },
    {.name = "-", .synopsis = "", .help = "same as raw"},
};

#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

struct globals {
	const char *socket_path;
	bool raw;
	bool timeout_given; /* --timeout was on the command line */
	int timeout_ms;     /* -1: wait forever */
};

/* Set by SIGINT/SIGTERM while follow runs. */
static volatile sig_atomic_t stop_requested;

/* A growable byte buffer. */
struct buf {
	char *data;
	size_t len;
	size_t cap;
};

/* One connection: bytes to send, bytes received, and how many answers are owed. */
struct session {
	int fd;
	int in_fd; /* stdin in raw mode; -1 once at EOF or when there is no input */
	const struct globals *g;
	const struct command *cmd; /* NULL in raw mode */
	struct buf out;
	size_t out_off;
	struct buf in;
	size_t sent_lines;  /* request lines queued (non-blank) */
	size_t answered;    /* response lines received */
	bool line_has_text; /* the stdin line being forwarded has a non-blank byte */
	bool line_open;     /* the last stdin byte forwarded was not '\n' */
	bool write_closed;  /* the daemon will not read more */
	bool peer_closed;   /* the daemon closed the connection after every answer owed */
	bool error_seen;    /* some response was an error */
	bool output_failed; /* writing to stdout failed */
	/* follow: the signal mask while waiting (SIGINT/SIGTERM deliverable), NULL otherwise */
	const sigset_t *wait_mask;
	char *last_text; /* follow: the last text printed (owned) */
	size_t last_len;
	long long prints; /* follow: texts printed */
};

static void buf_free(struct buf *b)
{
	free(b->data);
	b->data = NULL;
	b->len = 0;
	b->cap = 0;
}

static int buf_append(struct buf *b, const void *p, size_t n, size_t limit)
{
	char *grown = NULL;
	size_t cap;

	if (n > limit || b->len > limit - n)
		return -E2BIG;
	if (b->len + n > b->cap) {
		cap = b->cap ? b->cap : 4096;
		while (cap < b->len + n)
			cap = cap > SIZE_MAX / 2 ? b->len + n : cap * 2;
		grown = realloc(b->data, cap);
		if (!grown)
			return -ENOMEM;
		b->data = grown;
		b->cap = cap;
	}
	memcpy(b->data + b->len, p, n);
	b->len += n;
	return 0;
}

static void buf_consume(struct buf *b, size_t n)
{
	memmove(b->data, b->data + n, b->len - n);
	b->len -= n;
}

static void usage(FILE *f)
{
	size_t i;

	fprintf(f,
	        "Usage: convoctl [--socket PATH] [--raw] [--timeout SEC] COMMAND [ARGS]\n"
	        "       convoctl --help | --version\n"
	        "\n"
	        "Options:\n"
	        "  --socket PATH  the daemon's socket (default: $CONVOD_SOCKET, else "
	        "%s)\n"
	        "  --raw          print each response line exactly as received\n"
	        "  --timeout SEC  give up when the daemon has not answered for SEC seconds\n"
	        "                 (default %d; 0 waits forever)\n"
	        "  --help         print this help\n"
	        "  --version      print the version\n"
	        "\n"
	        "Commands:\n",
	        DEFAULT_SOCKET, DEFAULT_TIMEOUT_MS / 1000);
	for (i = 0; i < ARRAY_LEN(commands); i++)
		fprintf(f, "  %s%s%s\n        %s\n", commands[i].name,
		        *commands[i].synopsis ? " " : "", commands[i].synopsis, commands[i].help);
	fprintf(
	    f,
	    "\n"
	    "Several TEXT arguments make a contents array, one makes a string. Options may\n"
	    "follow the command anywhere; \"--\" ends them (for a TEXT that starts with \"--\").\n"
	    "MS is an integer (Unix time in milliseconds); JSON is any JSON value.\n"
	    "\n"
	    "Exit status: 0 ok, 1 the daemon answered an error, 2 usage error,\n"
	    "3 the daemon could not be reached or did not answer.\n");
}

/* Prints "convoctl: " and the problem, then the usage; returns EXIT_USAGE. */
static int usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static int usage_error(const char *fmt, ...)
{
	va_list ap;

	fputs("convoctl: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputs("\n\n", stderr);
	usage(stderr);
	return EXIT_USAGE;
}

/* Matches argv[*i] against name, as "--name", or "--name=value" / "--name value" when
 * has_value. Returns 1 on a match (advancing *i past a separate value), 0 when it is another
 * option, -1 when the value is missing. */
static int opt_match(int argc, char **argv, int *i, const char *name, bool has_value,
                     const char **value)
{
	const char *arg = argv[*i];
	size_t n = strlen(name);

	if (strncmp(arg, name, n) != 0)
		return 0;
	if (arg[n] == '\0') {
		if (!has_value)
			return 1;
		if (*i + 1 >= argc)
			return -1;
		*i += 1;
		*value = argv[*i];
		return 1;
	}
	if (arg[n] == '=' && has_value) {
		*value = arg + n + 1;
		return 1;
	}
	return 0;
}

static const struct command *command_lookup(const char *name)
{
	size_t i;

	for (i = 0; i < ARRAY_LEN(commands); i++)
		if (strcmp(commands[i].name, name) == 0)
			return &commands[i];
	return NULL;
}

/* Parses a whole decimal integer; 0 or -EINVAL. */
static int parse_int(const char *s, long long *out)
{
	char *end = NULL;

	errno = 0;
	if (*s == '\0')
		return -EINVAL;
	*out = strtoll(s, &end, 10);
	if (errno || *end != '\0')
		return -EINVAL;
	return 0;
}

/* Splits "a,b,c" into a new JSON array of strings (or, when numbers, of integers). "" gives
 * an empty array. Returns NULL when an item is empty or not a number. */
static json_t *split_list_new(const char *s, bool numbers)
{
	json_t *list = json_array();
	const char *p = s;
	const char *comma;
	char *item = NULL;
	long long v;

	if (!list)
		return NULL;
	if (*s == '\0')
		return list;
	for (;;) {
		comma = strchr(p, ',');
		item = comma ? strndup(p, (size_t)(comma - p)) : strdup(p);
		if (!item || *item == '\0')
			goto fail;
		if (numbers) {
			if (parse_int(item, &v) != 0 ||
			    json_array_append_new(list, json_integer((json_int_t)v)) != 0)
				goto fail;
		} else if (json_array_append_new(list, json_string(item)) != 0) {
			goto fail;
		}
		free(item);
		item = NULL;
		if (!comma)
			return list;
		p = comma + 1;
	}
fail:
	free(item);
	json_decref(list);
	return NULL;
}

/* The object named key inside parent, created if absent (borrowed). */
static json_t *object_child(json_t *parent, const char *key)
{
	json_t *child = json_object_get(parent, key);

	if (child)
		return child;
	child = json_object();
	if (json_object_set_new(parent, key, child) != 0)
		return NULL;
	return child;
}

/* Parses value as an integer from min to max for option name; 0, or EXIT_USAGE after
 * printing the problem and the usage. */
static int parse_option_int(const char *name, const char *value, long long min, long long max,
                            long long *out)
{
	if (parse_int(value, out) != 0 || *out < min || *out > max)
		return usage_error("%s: expected an integer from %lld to %lld, got '%s'", name, min,
		                   max, value);
	return 0;
}

/* Applies one command option to the request (meta: the object that gets "timing" and "aux";
 * fo: follow's own settings). Returns EXIT_OK, or EXIT_USAGE after printing the problem and
 * the usage. */
static int apply_option(const struct opt_def *o, const char *value, json_t *req, json_t *meta,
                        struct follow_opts *fo)
{
	json_t *v = NULL;
	json_t *target = req;
	json_error_t jerr;
	const char *key = NULL;
	const char *eq;
	char *key_copy = NULL;
	long long n;
	int rc = EXIT_ERROR_RESPONSE;

	switch (o->id) {
	case O_FORMAT:
		v = json_string(value);
		key = "format";
		break;
	case O_PREAMBLE:
		v = json_string(value);
		key = "preamble";
		break;
	case O_INCLUDE_PREVIOUS:
		v = json_true();
		key = "include_previous_summary";
		break;
	case O_FORMAT_PART:
		v = json_string(value);
		target = object_child(req, "format");
		key = o->field;
		break;
	case O_IDS:
	case O_VERSIONS:
		v = split_list_new(value, o->id == O_VERSIONS);
		if (!v) {
			rc = usage_error("%s: expected a comma-separated list of %s, got '%s'",
			                 o->name, o->id == O_VERSIONS ? "integers" : "ids", value);
			goto out;
		}
		key = o->id == O_IDS ? "ids" : "versions";
		break;
	case O_FULL:
		v = json_false();
		key = "incremental";
		break;
	case O_INCLUDE_LAST:
		v = json_false();
		key = "exclude_last";
		break;
	case O_LIMIT:
		/* The range is the daemon's to check (bad_request); only a non-number is ours. */
		if (parse_int(value, &n) != 0) {
			rc = usage_error("--limit: '%s' is not an integer", value);
			goto out;
		}
		v = json_integer((json_int_t)n);
		key = "limit";
		break;
	case O_INTERVAL:
		if (parse_option_int(o->name, value, 1, MAX_INTERVAL_MS, &fo->interval_ms) != 0) {
			rc = EXIT_USAGE;
			goto out;
		}
		rc = EXIT_OK;
		goto out;
	case O_COUNT:
		if (parse_option_int(o->name, value, 1, LLONG_MAX, &fo->count) != 0) {
			rc = EXIT_USAGE;
			goto out;
		}
		rc = EXIT_OK;
		goto out;
	case O_TIMING:
	case O_AUX:
		eq = strchr(value, '=');
		if (!eq || eq == value) {
			rc = usage_error("%s: expected KEY=%s, got '%s'", o->name,
			                 o->id == O_TIMING ? "MS" : "JSON", value);
			goto out;
		}
		if (o->id == O_TIMING) {
			if (parse_int(eq + 1, &n) != 0) {
				rc = usage_error("--timing: '%s' is not an integer", eq + 1);
				goto out;
			}
			v = json_integer((json_int_t)n);
		} else {
			v = json_loads(eq + 1, JSON_DECODE_ANY, &jerr);
			if (!v) {
				rc = usage_error("--aux: '%s' is not JSON (%s); quote a string, "
				                 "as in KEY='\"text\"'",
				                 eq + 1, jerr.text);
				goto out;
			}
		}
		target = object_child(meta, o->id == O_TIMING ? "timing" : "aux");
		key = key_copy = strndup(value, (size_t)(eq - value));
		break;
	}
	if (!v || !target || !key)
		goto oom;
	/* json_object_set_new takes v even when it fails. */
	if (json_object_set_new(target, key, v) != 0) {
		v = NULL;
		goto oom;
	}
	v = NULL;
	rc = EXIT_OK;
	goto out;
oom:
	fputs("convoctl: out of memory\n", stderr);
out:
	json_decref(v);
	free(key_copy);
	return rc;
}

/* Builds the request of cmd from its arguments (argv[0] is the command name), and fo from
 * follow's options. On success *req_out is a new object the caller frees. Returns an exit
 * status (EXIT_OK on success). */
static int build_request(const struct command *cmd, int argc, char **argv, json_t **req_out,
                         struct follow_opts *fo)
{
	json_t *req = NULL;
	json_t *meta = NULL;
	json_t *contents = NULL;
	const char **pos = NULL;
	const char *value = NULL;
	bool options_done = false;
	int npos = 0;
	int i, m, rc = EXIT_ERROR_RESPONSE;
	size_t k;

	req = json_object();
	meta = json_object();
	pos = calloc((size_t)argc, sizeof(*pos));
	if (!req || !meta || !pos || json_object_set_new(req, "op", json_string(cmd->op)) != 0)
		goto oom;
	if (cmd->fixed) {
		json_t *fixed = json_loads(cmd->fixed, 0, NULL);
		int failed = !fixed || json_object_update(req, fixed) != 0;

		json_decref(fixed);
		if (failed)
			goto oom;
	}
	if (cmd->groups & G_MAP) {
		if (json_object_set_new(req, "incremental", json_true()) != 0 ||
		    json_object_set_new(req, "exclude_last", json_true()) != 0)
			goto oom;
	}
	for (i = 1; i < argc; i++) {
		const struct opt_def *o = NULL;

		if (options_done || strncmp(argv[i], "--", 2) != 0) {
			pos[npos++] = argv[i];
			continue;
		}
		if (strcmp(argv[i], "--") == 0) {
			options_done = true;
			continue;
		}
		if (strcmp(argv[i], "--help") == 0) {
			usage(stdout);
			rc = -1; /* tells main to exit 0 */
			goto out;
		}
		for (k = 0; k < ARRAY_LEN(opt_defs) && !o; k++) {
			if (!(opt_defs[k].group & cmd->groups))
				continue;
			m = opt_match(argc, argv, &i, opt_defs[k].name, opt_defs[k].has_value,
			              &value);
			if (m < 0) {
				rc = usage_error("option %s needs a value", opt_defs[k].name);
				goto out;
			}
			if (m > 0)
				o = &opt_defs[k];
		}
		if (!o) {
			rc = usage_error("%s: unknown option '%s'", cmd->name, argv[i]);
			goto out;
		}
		rc = apply_option(o, value, req, cmd->meta_top_level ? req : meta, fo);
		if (rc != EXIT_OK)
			goto out;
	}
	if (npos < cmd->min_pos || (cmd->max_pos >= 0 && npos > cmd->max_pos)) {
		rc = usage_error("%s: %s (expected: %s %s)", cmd->name,
		                 npos < cmd->min_pos ? "missing arguments" : "too many arguments",
		                 cmd->name, cmd->synopsis);
		goto out;
	}
	for (i = 0; i < npos && i < 2 && cmd->pos_fields[i]; i++)
		if (json_object_set_new(req, cmd->pos_fields[i], json_string(pos[i])) != 0)
			goto oom;
	if (cmd->contents) {
		if (npos - i == 1) {
			contents = json_string(pos[i]);
		} else {
			contents = json_array();
			for (; contents && i < npos; i++)
				if (json_array_append_new(contents, json_string(pos[i])) != 0)
					goto oom;
		}
		if (json_object_set_new(req, "contents", contents) != 0) {
			contents = NULL;
			goto oom;
		}
		contents = NULL;
	}
	if ((cmd->groups & G_IDS) && !json_object_get(req, "ids")) {
		rc = usage_error("%s: --ids is required", cmd->name);
		goto out;
	}
	if (json_object_size(meta) > 0 && json_object_set(req, "metadata", meta) != 0)
		goto oom;
	*req_out = req;
	req = NULL;
	rc = EXIT_OK;
	goto out;
oom:
	fputs("convoctl: out of memory\n", stderr);
	rc = EXIT_ERROR_RESPONSE;
out:
	json_decref(contents);
	json_decref(meta);
	json_decref(req);
	free(pos);
	return rc;
}

/* Connects to the daemon's socket; the descriptor, or -1 after printing why. */
static int connect_daemon(const struct globals *g)
{
	struct sockaddr_un addr;
	struct timeval tv;
	int fd;

	memset(&addr, 0, sizeof(addr));
	addr.sun_family = AF_UNIX;
	if (strlen(g->socket_path) >= sizeof(addr.sun_path)) {
		fprintf(stderr, "convoctl: socket path too long: %s\n", g->socket_path);
		return -1;
	}
	strcpy(addr.sun_path, g->socket_path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		fprintf(stderr, "convoctl: socket: %s\n", strerror(errno));
		return -1;
	}
	/* A full listen backlog makes connect() wait; bound that wait by the timeout. */
	if (g->timeout_ms > 0) {
		tv.tv_sec = g->timeout_ms / 1000;
		tv.tv_usec = (g->timeout_ms % 1000) * 1000;
		setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	}
	if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
		fprintf(stderr, "convoctl: cannot connect to %s: %s\n", g->socket_path,
		        strerror(errno));
		close(fd);
		return -1;
	}
	if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) != 0) {
		fprintf(stderr, "convoctl: fcntl: %s\n", strerror(errno));
		close(fd);
		return -1;
	}
	return fd;
}

static void print_error_response(json_t *resp)
{
	json_t *error = json_object_get(resp, "error");
	const char *code = json_string_value(json_object_get(error, "code"));
	const char *message = json_string_value(json_object_get(error, "message"));

	fprintf(stderr, "convoctl: %s: %s\n", code ? code : "error", message ? message : "");
}

static void malformed_response(struct session *s, const char *line, size_t len)
{
	fprintf(stderr, "convoctl: malformed response from the daemon: %.*s\n",
	        len > 200 ? 200 : (int)len, line);
	s->error_seen = true;
}

/* Writes a response line as received. */
static void write_line(struct session *s, const char *line, size_t len)
{
	if (fwrite(line, 1, len, stdout) != len || putchar('\n') == EOF)
		s->output_failed = true;
	fflush(stdout);
}

/* Writes a result's text as is. */
static void write_text(struct session *s, const char *text, size_t len)
{
	if (fwrite(text, 1, len, stdout) != len)
		s->output_failed = true;
	/* A dump that does not end its last row still leaves the shell prompt on its own
	 * line. */
	if (len > 0 && text[len - 1] != '\n' && putchar('\n') == EOF)
		s->output_failed = true;
}

/* follow: prints the result's text (or, with --raw, the line) when it differs from the last
 * one printed. */
static void follow_print(struct session *s, const json_t *result, const char *line, size_t len)
{
	const json_t *t = json_object_get(result, "text");
	const char *text;
	size_t text_len;
	char *copy;

	if (!json_is_string(t)) {
		malformed_response(s, line, len);
		return;
	}
	text = json_string_value(t);
	text_len = json_string_length(t);
	if (s->last_text && s->last_len == text_len && memcmp(s->last_text, text, text_len) == 0)
		return;
	copy = malloc(text_len + 1);
	if (!copy) {
		fputs("convoctl: out of memory\n", stderr);
		s->error_seen = true;
		return;
	}
	memcpy(copy, text, text_len + 1);
	free(s->last_text);
	s->last_text = copy;
	s->last_len = text_len;
	if (s->g->raw)
		write_line(s, line, len);
	else
		write_text(s, text, text_len);
	s->prints++;
	if (fflush(stdout) != 0)
		s->output_failed = true;
}

/* The keys of result named by the command's select, as a new object (NULL: out of memory). */
static json_t *select_keys(const struct command *cmd, const json_t *result)
{
	json_t *out = json_object();
	size_t i;

	for (i = 0; out && i < ARRAY_LEN(cmd->select) && cmd->select[i]; i++) {
		json_t *v = json_object_get(result, cmd->select[i]);

		if (json_object_set(out, cmd->select[i], v ? v : json_null()) != 0) {
			json_decref(out);
			out = NULL;
		}
	}
	return out;
}

/* Handles one response line: prints it and notes whether it was an error. */
static void on_response(struct session *s, const char *line, size_t len)
{
	json_t *resp = NULL;
	json_t *result;
	json_t *selected = NULL;
	json_error_t jerr;
	char *dump = NULL;
	bool verbatim = s->g->raw || !s->cmd;
	bool follow = s->cmd && s->cmd->follow;

	resp = json_loadb(line, len, 0, &jerr);
	if (verbatim && !follow)
		write_line(s, line, len);
	if (!resp || !json_is_object(resp) || !json_is_boolean(json_object_get(resp, "ok"))) {
		malformed_response(s, line, len);
		goto out;
	}
	if (!json_is_true(json_object_get(resp, "ok"))) {
		if (verbatim && follow)
			write_line(s, line, len);
		print_error_response(resp);
		s->error_seen = true;
		goto out;
	}
	result = json_object_get(resp, "result");
	if (follow) {
		follow_print(s, result, line, len);
		goto out;
	}
	if (verbatim)
		goto out;
	if (s->cmd->prints_text && json_is_string(json_object_get(result, "text"))) {
		write_text(s, json_string_value(json_object_get(result, "text")),
		           json_string_length(json_object_get(result, "text")));
		goto out;
	}
	if (s->cmd->select[0]) {
		selected = select_keys(s->cmd, result);
		if (!selected) {
			fputs("convoctl: out of memory\n", stderr);
			s->error_seen = true;
			goto out;
		}
		result = selected;
	}
	dump = json_dumps(result ? result : json_null(), JSON_INDENT(2) | JSON_ENCODE_ANY);
	if (!dump || puts(dump) == EOF)
		s->output_failed = true;
out:
	free(dump);
	json_decref(selected);
	json_decref(resp);
}

/* Forwards what stdin has to the output buffer, counting the request lines (non-blank). */
static int pump_stdin(struct session *s)
{
	char chunk[65536];
	ssize_t n, i;

	n = read(s->in_fd, chunk, sizeof(chunk));
	if (n < 0) {
		if (errno == EINTR || errno == EAGAIN)
			return 0;
		fprintf(stderr, "convoctl: reading stdin: %s\n", strerror(errno));
		return -1;
	}
	if (n == 0) {
		s->in_fd = -1;
		/* An unterminated last line is still a request. */
		if (s->line_open) {
			if (buf_append(&s->out, "\n", 1, SIZE_MAX) != 0) {
				fputs("convoctl: out of memory\n", stderr);
				return -1;
			}
			if (s->line_has_text)
				s->sent_lines++;
		}
		return 0;
	}
	for (i = 0; i < n; i++) {
		char c = chunk[i];

		if (c == '\n') {
			if (s->line_has_text)
				s->sent_lines++;
			s->line_has_text = false;
		} else if (c != ' ' && c != '\t' && c != '\r') {
			s->line_has_text = true;
		}
	}
	s->line_open = chunk[n - 1] != '\n';
	if (buf_append(&s->out, chunk, (size_t)n, SIZE_MAX) != 0) {
		fputs("convoctl: out of memory\n", stderr);
		return -1;
	}
	return 0;
}

/* Sends what is pending; a daemon that stopped reading ends the sending, not the session. */
static void pump_socket_out(struct session *s)
{
	ssize_t n;

	while (s->out_off < s->out.len) {
		n = send(s->fd, s->out.data + s->out_off, s->out.len - s->out_off, MSG_NOSIGNAL);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK)
				break;
			s->write_closed = true;
			break;
		}
		s->out_off += (size_t)n;
	}
	if (s->out_off == s->out.len) {
		s->out.len = 0;
		s->out_off = 0;
	}
}

/* Reads what the daemon sent and handles each complete line. Returns 1 at end of stream,
 * 0 to go on, -1 on a read error. */
static int pump_socket_in(struct session *s)
{
	char chunk[65536];
	ssize_t n;
	char *nl;
	size_t len;

	for (;;) {
		n = recv(s->fd, chunk, sizeof(chunk), 0);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			if (errno == EAGAIN || errno == EWOULDBLOCK)
				return 0;
			return -1;
		}
		if (n == 0)
			return 1;
		if (buf_append(&s->in, chunk, (size_t)n, MAX_RESPONSE_BYTES) != 0) {
			fputs("convoctl: response too large\n", stderr);
			return -1;
		}
		while (s->in.len > 0 && (nl = memchr(s->in.data, '\n', s->in.len)) != NULL) {
			len = (size_t)(nl - s->in.data);
			if (len > 0 && s->in.data[len - 1] == '\r')
				len--;
			on_response(s, s->in.data, len);
			s->answered++;
			buf_consume(&s->in, (size_t)(nl - s->in.data) + 1);
		}
	}
}

/* poll() with a timeout in ms (-1: none) that lets SIGINT/SIGTERM in only while waiting
 * when mask is not NULL (follow), so a signal cannot slip in just before the wait. */
static int wait_fds(struct pollfd *pfd, nfds_t n, int timeout_ms, const sigset_t *mask)
{
	struct timespec ts;

	if (timeout_ms < 0)
		return ppoll(pfd, n, NULL, mask);
	ts.tv_sec = timeout_ms / 1000;
	ts.tv_nsec = (long)(timeout_ms % 1000) * 1000000L;
	return ppoll(pfd, n, &ts, mask);
}

/* Runs the exchange until every request has its answer (and stdin, if any, is done).
 * Returns the exit status (EXIT_OK at once when follow is interrupted). */
static int session_run(struct session *s)
{
	struct pollfd pfd[2];
	int n, rc;
	bool waiting;

	for (;;) {
		bool in_open = s->in_fd >= 0;
		bool pending = s->out_off < s->out.len && !s->write_closed && !s->peer_closed;

		if (s->peer_closed && s->answered < s->sent_lines) {
			/* stdin had another request after all */
			fputs("convoctl: the daemon closed the connection\n", stderr);
			return EXIT_UNREACHABLE;
		}
		if (!in_open && !pending && s->answered >= s->sent_lines)
			break;
		pfd[0].fd = s->peer_closed ? -1 : s->fd;
		pfd[0].events = POLLIN | (pending ? POLLOUT : 0);
		pfd[0].revents = 0;
		pfd[1].fd = s->in_fd;
		pfd[1].events = POLLIN;
		pfd[1].revents = 0;
		/* Reading stdin pauses while much is unsent, so memory stays bounded. */
		if (!in_open || s->write_closed || s->out.len - s->out_off > MAX_PENDING_OUTPUT)
			pfd[1].fd = -1;
		/* The timeout measures the daemon's silence, not the user's typing. */
		waiting = pending || s->answered < s->sent_lines;
		n = wait_fds(pfd, 2, waiting ? s->g->timeout_ms : -1, s->wait_mask);
		if (n < 0) {
			if (errno == EINTR && stop_requested)
				return EXIT_OK;
			if (errno == EINTR)
				continue;
			fprintf(stderr, "convoctl: poll: %s\n", strerror(errno));
			return EXIT_UNREACHABLE;
		}
		if (n == 0) {
			fprintf(stderr, "convoctl: no answer from the daemon within %d ms\n",
			        s->g->timeout_ms);
			return EXIT_UNREACHABLE;
		}
		if (pfd[1].revents & (POLLIN | POLLHUP | POLLERR)) {
			if (pump_stdin(s) != 0)
				return EXIT_ERROR_RESPONSE;
		}
		if (pfd[0].revents & POLLOUT)
			pump_socket_out(s);
		if (pfd[0].revents & (POLLIN | POLLHUP | POLLERR)) {
			rc = pump_socket_in(s);
			if (rc != 0) {
				if (s->answered < s->sent_lines || (rc < 0 && s->in_fd >= 0)) {
					fprintf(stderr, "convoctl: %s\n",
					        rc < 0 ? "connection to the daemon failed"
					               : "the daemon closed the connection");
					return EXIT_UNREACHABLE;
				}
				if (s->in_fd < 0)
					break;
				/* Every answer owed is in and stdin is still open: it may hold
				 * no more than its end (the daemon may close as soon as it has
				 * answered). Only another request is an error. */
				s->peer_closed = true;
			}
		}
	}
	if (s->output_failed) {
		fputs("convoctl: writing to stdout failed\n", stderr);
		return EXIT_ERROR_RESPONSE;
	}
	return s->error_seen ? EXIT_ERROR_RESPONSE : EXIT_OK;
}

/* Connects and runs one session: the request in req (may be NULL in raw mode). */
static int run(const struct globals *g, const struct command *cmd, json_t *req)
{
	struct session s;
	char *line = NULL;
	int rc = EXIT_UNREACHABLE;

	memset(&s, 0, sizeof(s));
	s.g = g;
	s.cmd = cmd->op ? cmd : NULL;
	s.in_fd = -1;
	s.fd = -1;
	if (req) {
		line = json_dumps(req, JSON_COMPACT);
		if (!line || buf_append(&s.out, line, strlen(line), SIZE_MAX) != 0 ||
		    buf_append(&s.out, "\n", 1, SIZE_MAX) != 0) {
			fputs("convoctl: out of memory\n", stderr);
			rc = EXIT_ERROR_RESPONSE;
			goto out;
		}
		s.sent_lines = 1;
	} else {
		s.in_fd = STDIN_FILENO;
	}
	s.fd = connect_daemon(g);
	if (s.fd < 0)
		goto out;
	rc = session_run(&s);
	if (fflush(stdout) != 0 && rc == EXIT_OK) {
		fputs("convoctl: writing to stdout failed\n", stderr);
		rc = EXIT_ERROR_RESPONSE;
	}
out:
	if (s.fd >= 0)
		close(s.fd);
	free(line);
	buf_free(&s.out);
	buf_free(&s.in);
	return rc;
}

static void on_stop_signal(int sig)
{
	(void)sig;
	stop_requested = 1;
}

static long long monotonic_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* follow: waits ms between two polls, watching the connection. Returns -1 when the time is
 * up, EXIT_OK when interrupted, EXIT_UNREACHABLE when the connection ended or failed. */
static int follow_pause(struct session *s, long long ms)
{
	long long deadline = monotonic_ms() + ms;
	struct pollfd pfd;
	long long left;
	int n, rc;

	for (;;) {
		if (stop_requested)
			return EXIT_OK;
		left = deadline - monotonic_ms();
		if (left <= 0)
			return -1;
		pfd.fd = s->fd;
		pfd.events = POLLIN;
		pfd.revents = 0;
		n = wait_fds(&pfd, 1, left > INT_MAX ? INT_MAX : (int)left, s->wait_mask);
		if (n < 0) {
			if (errno == EINTR)
				continue;
			fprintf(stderr, "convoctl: poll: %s\n", strerror(errno));
			return EXIT_UNREACHABLE;
		}
		if (n > 0) {
			/* Nothing is owed: the daemon closing the connection is the usual cause. */
			rc = pump_socket_in(s);
			if (rc != 0) {
				fprintf(stderr, "convoctl: %s\n",
				        rc < 0 ? "connection to the daemon failed"
				               : "the daemon closed the connection");
				return EXIT_UNREACHABLE;
			}
		}
	}
}

/* follow: sends req on one connection every fo->interval_ms, printing the text when it
 * changed, until SIGINT/SIGTERM (exit 0), fo->count prints (0), an error answer (1) or the
 * connection's end (3). */
static int run_follow(const struct globals *g, const struct command *cmd, json_t *req,
                      const struct follow_opts *fo)
{
	struct session s;
	struct sigaction sa;
	sigset_t stop_set, old_set, wait_set;
	char *line = NULL;
	size_t line_len;
	int rc = EXIT_UNREACHABLE;

	memset(&s, 0, sizeof(s));
	s.g = g;
	s.cmd = cmd;
	s.in_fd = -1;
	s.fd = -1;
	/* The signals stay blocked except while waiting for the daemon or for the next poll,
	 * where they end the wait (a write to a stuck stdout is ended by SIGPIPE instead). */
	sigemptyset(&stop_set);
	sigaddset(&stop_set, SIGINT);
	sigaddset(&stop_set, SIGTERM);
	sigprocmask(SIG_BLOCK, &stop_set, &old_set);
	wait_set = old_set;
	sigdelset(&wait_set, SIGINT);
	sigdelset(&wait_set, SIGTERM);
	s.wait_mask = &wait_set;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_stop_signal;
	sigemptyset(&sa.sa_mask);
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);

	line = json_dumps(req, JSON_COMPACT);
	if (!line) {
		fputs("convoctl: out of memory\n", stderr);
		rc = EXIT_ERROR_RESPONSE;
		goto out;
	}
	line_len = strlen(line);
	s.fd = connect_daemon(g);
	if (s.fd < 0)
		goto out;
	for (;;) {
		if (buf_append(&s.out, line, line_len, SIZE_MAX) != 0 ||
		    buf_append(&s.out, "\n", 1, SIZE_MAX) != 0) {
			fputs("convoctl: out of memory\n", stderr);
			rc = EXIT_ERROR_RESPONSE;
			goto out;
		}
		s.sent_lines++;
		rc = session_run(&s);
		if (rc != EXIT_OK || stop_requested)
			break;
		if (fo->count > 0 && s.prints >= fo->count)
			break;
		rc = follow_pause(&s, fo->interval_ms);
		if (rc >= 0)
			break;
	}
	if (fflush(stdout) != 0 && rc == EXIT_OK) {
		fputs("convoctl: writing to stdout failed\n", stderr);
		rc = EXIT_ERROR_RESPONSE;
	}
out:
	if (s.fd >= 0)
		close(s.fd);
	free(line);
	free(s.last_text);
	buf_free(&s.out);
	buf_free(&s.in);
	return rc;
}

/* Parses --timeout's SEC (a non-negative decimal, 0 = forever) into milliseconds. */
static int parse_timeout(const char *s, int *ms)
{
	char *end = NULL;
	double sec;

	errno = 0;
	sec = strtod(s, &end);
	if (*s == '\0' || errno || *end != '\0' || !isfinite(sec) || sec < 0)
		return -EINVAL;
	if (sec == 0) {
		*ms = -1;
		return 0;
	}
	*ms = sec * 1000.0 >= (double)INT_MAX ? INT_MAX : (int)(sec * 1000.0 + 0.999);
	return 0;
}

int main(int argc, char **argv)
{
	struct globals g;
	struct follow_opts fo = {DEFAULT_INTERVAL_MS, 0};
	const struct command *cmd;
	json_t *req = NULL;
	const char *value = NULL;
	const char *env = getenv("CONVOD_SOCKET");
	int i, m, rc;

	g.socket_path = env && *env ? env : DEFAULT_SOCKET;
	g.raw = false;
	g.timeout_given = false;
	g.timeout_ms = DEFAULT_TIMEOUT_MS;
	for (i = 1; i < argc && strncmp(argv[i], "-", 1) == 0 && strcmp(argv[i], "-") != 0; i++) {
		if (strcmp(argv[i], "--") == 0) {
			i++;
			break;
		}
		if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
			usage(stdout);
			return EXIT_OK;
		}
		if (strcmp(argv[i], "--version") == 0) {
			printf("convoctl %s (protocol 1)\n", CONVOD_VERSION);
			return EXIT_OK;
		}
		if (strcmp(argv[i], "--raw") == 0) {
			g.raw = true;
			continue;
		}
		m = opt_match(argc, argv, &i, "--socket", true, &value);
		if (m > 0) {
			if (*value == '\0')
				return usage_error("--socket: empty path");
			g.socket_path = value;
			continue;
		}
		if (m == 0)
			m = opt_match(argc, argv, &i, "--timeout", true, &value);
		if (m > 0) {
			if (parse_timeout(value, &g.timeout_ms) != 0)
				return usage_error("--timeout: expected seconds >= 0, got '%s'",
				                   value);
			g.timeout_given = true;
			continue;
		}
		if (m < 0)
			return usage_error("option %s needs a value", argv[i]);
		return usage_error("unknown option '%s'", argv[i]);
	}
	if (i >= argc)
		return usage_error("missing command");
	cmd = command_lookup(argv[i]);
	if (!cmd)
		return usage_error("unknown command '%s'", argv[i]);
	if (!g.timeout_given && cmd->timeout_ms > 0)
		g.timeout_ms = cmd->timeout_ms;
	/* The protocol is UTF-8: refuse here what could never be sent, so that a failing
	 * json_string() later can only mean out of memory. */
	for (m = i + 1; m < argc; m++) {
		json_t *probe = json_string(argv[m]);

		if (!probe)
			return usage_error("argument %d is not valid UTF-8", m - i);
		json_decref(probe);
	}
	if (cmd->op) {
		rc = build_request(cmd, argc - i, argv + i, &req, &fo);
		if (rc < 0)
			return EXIT_OK;
		if (rc != EXIT_OK)
			return rc;
	} else if (argc - i > 1) {
		return usage_error("%s takes no arguments", cmd->name);
	}
	rc = cmd->follow ? run_follow(&g, cmd, req, &fo) : run(&g, cmd, req);
	json_decref(req);
	return rc;
}
