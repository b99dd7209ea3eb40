/* Logging to stderr, one line per event, with a level and a subsystem, a journald priority
 * prefix in journal format, and a rate limit on repeats of the same message. */
#include "log.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define LINE_MAX_BYTES 2048
#define RATE_SLOTS 64
#define SUBSYS_MAX 32

/* One (level, subsystem, format) being counted. Only a hash of the format is kept, so a
 * format string that is not a literal cannot dangle. */
struct rate_slot {
	uint64_t key;
	uint64_t window_start_ms;
	unsigned count;      /* logged in this window, suppressed ones included */
	unsigned suppressed; /* not written in this window */
	enum log_level level;
	char subsystem[SUBSYS_MAX];
	bool used;
};

static enum log_level min_level = LOG_INFO;
static enum log_format format = LOG_FORMAT_PLAIN;
static struct rate_slot slots[RATE_SLOTS];
/* The store's writer thread logs too: the rate slots are shared. */
static pthread_mutex_t slots_mu = PTHREAD_MUTEX_INITIALIZER;
static uint64_t (*clock_fn)(void);

static const char *const level_names[] = {"debug", "info", "warn", "error"};
static const char *const level_prefixes[] = {"<7>", "<6>", "<4>", "<3>"};
static const char *const format_names[] = {"auto", "plain", "journal"};

void log_set_level(enum log_level level)
{
	min_level = level <= LOG_ERROR ? level : LOG_ERROR;
}

enum log_level log_get_level(void)
{
	return min_level;
}

int log_level_parse(const char *s, enum log_level *out)
{
	for (int i = 0; i <= LOG_ERROR; i++) {
		if (strcmp(s, level_names[i]) == 0) {
			*out = (enum log_level)i;
			return 0;
		}
	}
	return -EINVAL;
}

const char *log_level_str(enum log_level level)
{
	return level <= LOG_ERROR ? level_names[level] : "error";
}

void log_set_format(enum log_format f)
{
	if (f == LOG_FORMAT_AUTO) {
		const char *js = getenv("JOURNAL_STREAM"), *inv = getenv("INVOCATION_ID");
		f = (js && *js) || (inv && *inv) ? LOG_FORMAT_JOURNAL : LOG_FORMAT_PLAIN;
	}
	format = f == LOG_FORMAT_JOURNAL ? LOG_FORMAT_JOURNAL : LOG_FORMAT_PLAIN;
}

enum log_format log_get_format(void)
{
	return format;
}

int log_format_parse(const char *s, enum log_format *out)
{
	for (int i = 0; i <= LOG_FORMAT_JOURNAL; i++) {
		if (strcmp(s, format_names[i]) == 0) {
			*out = (enum log_format)i;
			return 0;
		}
	}
	return -EINVAL;
}

const char *log_format_str(enum log_format f)
{
	return f <= LOG_FORMAT_JOURNAL ? format_names[f] : "plain";
}

void log_set_clock(uint64_t (*now_ms)(void))
{
	pthread_mutex_lock(&slots_mu);
	clock_fn = now_ms;
	memset(slots, 0, sizeof(slots));
	pthread_mutex_unlock(&slots_mu);
}

static uint64_t now_ms(void)
{
	struct timespec ts;

	if (clock_fn)
		return clock_fn();
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static uint64_t fnv1a(uint64_t h, const char *s)
{
	for (; *s; s++) {
		h ^= (unsigned char)*s;
		h *= 0x100000001b3ULL;
	}
	/* The terminator too, so that ("ab", "c") and ("a", "bc") differ. */
	h ^= 0xff;
	h *= 0x100000001b3ULL;
	return h;
}

/* One write per line, so that concurrent writers never interleave within a line. */
static void write_line(enum log_level level, const char *subsystem, const char *msg)
{
	char line[LINE_MAX_BYTES];
	int n;

	n = snprintf(line, sizeof(line), "%s%s %s: %s\n",
	             format == LOG_FORMAT_JOURNAL ? level_prefixes[level] : "",
	             log_level_str(level), subsystem, msg);
	if (n < 0)
		return;
	if ((size_t)n >= sizeof(line)) {
		n = (int)sizeof(line) - 1;
		line[n - 1] = '\n';
	}
	fwrite(line, 1, (size_t)n, stderr);
}

static void write_suppressed(const struct rate_slot *r)
{
	char msg[64];
	snprintf(msg, sizeof(msg), "(suppressed %u similar message%s)", r->suppressed,
	         r->suppressed == 1 ? "" : "s");
	write_line(r->level, r->subsystem, msg);
}

/* Counts one more (level, subsystem, fmt); false when it is to be dropped. */
static bool rate_admit(enum log_level level, const char *subsystem, const char *fmt)
{
	uint64_t key = fnv1a(fnv1a(0xcbf29ce484222325ULL ^ (uint64_t)level, subsystem), fmt);
	uint64_t now = now_ms();
	struct rate_slot *r = NULL, *victim = NULL;

	for (size_t i = 0; i < RATE_SLOTS; i++) {
		struct rate_slot *s = &slots[i];
		if (s->used && s->key == key) {
			r = s;
			break;
		}
		if (!victim || !s->used ||
		    (victim->used && s->window_start_ms < victim->window_start_ms))
			victim = s;
	}
	if (!r) {
		/* Evict the oldest window; its count is reported now rather than lost. */
		r = victim;
		if (r->used && r->suppressed)
			write_suppressed(r);
		memset(r, 0, sizeof(*r));
		r->used = true;
		r->key = key;
		r->level = level;
		snprintf(r->subsystem, sizeof(r->subsystem), "%s", subsystem);
		r->window_start_ms = now;
	} else if (now - r->window_start_ms >= LOG_RATE_WINDOW_MS) {
		if (r->suppressed)
			write_suppressed(r);
		r->window_start_ms = now;
		r->count = 0;
		r->suppressed = 0;
	}
	if (++r->count > LOG_RATE_BURST) {
		r->suppressed++;
		return false;
	}
	return true;
}

static void vlog(enum log_level level, const char *subsystem, bool limited, const char *fmt,
                 va_list ap) __attribute__((format(printf, 4, 0)));

static void vlog(enum log_level level, const char *subsystem, bool limited, const char *fmt,
                 va_list ap)
{
	char msg[LINE_MAX_BYTES];

	if (level > LOG_ERROR)
		level = LOG_ERROR;
	if (level < min_level)
		return;
	if (limited) {
		bool admit;
		pthread_mutex_lock(&slots_mu);
		admit = rate_admit(level, subsystem, fmt);
		pthread_mutex_unlock(&slots_mu);
		if (!admit)
			return;
	}
	if (vsnprintf(msg, sizeof(msg), fmt, ap) < 0)
		return;
	/* One event, one line: a message quoting a file or a peer cannot start a new one. */
	for (char *p = msg; *p; p++) {
		if ((unsigned char)*p < 0x20 || *p == 0x7f)
			*p = ' ';
	}
	write_line(level, subsystem, msg);
}

void log_flush_suppressed(void)
{
	pthread_mutex_lock(&slots_mu);
	for (size_t i = 0; i < RATE_SLOTS; i++) {
		struct rate_slot *r = &slots[i];
		if (r->used && r->suppressed && r->level >= min_level)
			write_suppressed(r);
		r->suppressed = 0;
	}
	pthread_mutex_unlock(&slots_mu);
}

void log_msg(enum log_level level, const char *subsystem, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vlog(level, subsystem, true, fmt, ap);
	va_end(ap);
}

void log_msg_unlimited(enum log_level level, const char *subsystem, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	vlog(level, subsystem, false, fmt, ap);
	va_end(ap);
}
