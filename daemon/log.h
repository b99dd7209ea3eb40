/* Logging: one line per event on stderr, with a level and a subsystem; journald priority
 * prefixes when asked for (or when running under systemd); repeats rate-limited. */
#ifndef CONVOD_LOG_H
#define CONVOD_LOG_H

#include <stdint.h>

enum log_level { LOG_DEBUG = 0, LOG_INFO, LOG_WARN, LOG_ERROR };

/* plain: "LEVEL subsystem: message"; journal: the same behind a syslog priority prefix
 * ("<3>" error, "<4>" warn, "<6>" info, "<7>" debug) that journald turns into the entry's
 * priority; auto: journal when JOURNAL_STREAM or INVOCATION_ID is set (systemd), else
 * plain. */
enum log_format { LOG_FORMAT_AUTO = 0, LOG_FORMAT_PLAIN, LOG_FORMAT_JOURNAL };

/* The same (level, subsystem, format string) logged more than LOG_RATE_BURST times within
 * LOG_RATE_WINDOW_MS is dropped; the next one logged after the window is preceded by
 * "(suppressed N similar messages)". */
#define LOG_RATE_BURST 10
#define LOG_RATE_WINDOW_MS 10000

/* Messages below level are dropped. */
void log_set_level(enum log_level level);
enum log_level log_get_level(void);
/* Parses "debug", "info", "warn", "error"; 0 or -EINVAL. */
int log_level_parse(const char *s, enum log_level *out);
/* The name of a level; static. */
const char *log_level_str(enum log_level level);

/* Sets the line format; auto is resolved here, from the environment at the time of the call. */
void log_set_format(enum log_format format);
/* The format in effect (never auto). */
enum log_format log_get_format(void);
/* Parses "auto", "plain", "journal"; 0 or -EINVAL. */
int log_format_parse(const char *s, enum log_format *out);
/* The name of a format; static. */
const char *log_format_str(enum log_format format);

/* Writes one line to stderr (newlines and other control characters in the message become
 * spaces), rate-limited as above. Never pass secrets. Any thread: the store's writer logs
 * too, and walvfs on whichever thread commits (the rate limiter's slots are locked). */
void log_msg(enum log_level level, const char *subsystem, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The same without the rate limit, for lines an operator asked for (the report of a
 * reload: one line per changed setting, which all share one format string). */
void log_msg_unlimited(enum log_level level, const char *subsystem, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Tests: replaces the monotonic millisecond clock of the rate limiter (NULL restores it)
 * and forgets every rate-limit window. */
void log_set_clock(uint64_t (*now_ms)(void));
/* Writes the "(suppressed N similar messages)" line of every message whose repeats the rate
 * limit is holding back (at the stop: they would be lost). */
void log_flush_suppressed(void);

#endif
