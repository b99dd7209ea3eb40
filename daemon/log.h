/* Logging: one line per event on stderr, with a level and a subsystem. */
#ifndef CONVOD_LOG_H
#define CONVOD_LOG_H

enum log_level { LOG_DEBUG = 0, LOG_INFO, LOG_WARN, LOG_ERROR };

/* Messages below level are dropped. */
void log_set_level(enum log_level level);
/* Parses "debug", "info", "warn", "error"; 0 or -EINVAL. */
int log_level_parse(const char *s, enum log_level *out);
const char *log_level_str(enum log_level level);

/* Writes "LEVEL subsystem: message" to stderr. Never pass secrets. */
void log_msg(enum log_level level, const char *subsystem, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

#endif
