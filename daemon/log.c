/* Logging to stderr, one line per event, with a level and a subsystem. */
#include "log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static enum log_level min_level = LOG_INFO;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

void log_set_level(enum log_level level)
{
	min_level = level;
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

void log_msg(enum log_level level, const char *subsystem, const char *fmt, ...)
{
	char line[1024];
	int n;
	va_list ap;

	if (level < min_level)
		return;
	n = snprintf(line, sizeof(line), "%s %s: ", log_level_str(level), subsystem);
	if (n < 0)
		return;
	va_start(ap, fmt);
	vsnprintf(line + n, sizeof(line) - (size_t)n, fmt, ap);
	va_end(ap);
	/* One write per line so concurrent writers never interleave within a line. */
	fprintf(stderr, "%s\n", line);
}
