/* Unit tests of daemon/log.c: levels, the plain and journal formats, auto-detection and the
 * rate limit on repeats (on a fake clock). */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "test.h"

static uint64_t fake_now = 1000000;

static uint64_t fake_clock(void)
{
	return fake_now;
}

static size_t count(const char *text, const char *needle)
{
	size_t n = 0;
	for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle))
		n++;
	return n;
}

static void test_parse(void)
{
	enum log_level l;
	enum log_format f;

	CHECK(log_level_parse("debug", &l) == 0 && l == LOG_DEBUG);
	CHECK(log_level_parse("error", &l) == 0 && l == LOG_ERROR);
	CHECK(log_level_parse("ERROR", &l) < 0);
	CHECK(log_level_parse("", &l) < 0);
	CHECK(log_format_parse("journal", &f) == 0 && f == LOG_FORMAT_JOURNAL);
	CHECK(log_format_parse("auto", &f) == 0 && f == LOG_FORMAT_AUTO);
	CHECK(log_format_parse("plain", &f) == 0 && f == LOG_FORMAT_PLAIN);
	CHECK(log_format_parse("json", &f) < 0);
	CHECK_STR(log_level_str(LOG_WARN), "warn");
	CHECK_STR(log_format_str(LOG_FORMAT_JOURNAL), "journal");
}

static void test_formats(void)
{
	char *out;

	log_set_level(LOG_DEBUG);
	log_set_format(LOG_FORMAT_PLAIN);
	capture_begin();
	log_msg(LOG_INFO, "main", "hello %d", 42);
	log_msg(LOG_WARN, "server", "multi\nline\rmessage");
	out = capture_end();
	CHECK_STR(out, "info main: hello 42\nwarn server: multi line message\n");
	free(out);

	log_set_format(LOG_FORMAT_JOURNAL);
	CHECK(log_get_format() == LOG_FORMAT_JOURNAL);
	capture_begin();
	log_msg(LOG_ERROR, "a", "e");
	log_msg(LOG_WARN, "a", "w");
	log_msg(LOG_INFO, "a", "i");
	log_msg(LOG_DEBUG, "a", "d");
	out = capture_end();
	CHECK_STR(out, "<3>error a: e\n<4>warn a: w\n<6>info a: i\n<7>debug a: d\n");
	free(out);

	/* Levels below the minimum are dropped. */
	log_set_level(LOG_WARN);
	CHECK(log_get_level() == LOG_WARN);
	capture_begin();
	log_msg(LOG_INFO, "a", "dropped");
	log_msg(LOG_DEBUG, "a", "dropped");
	log_msg(LOG_WARN, "a", "kept");
	out = capture_end();
	CHECK_STR(out, "<4>warn a: kept\n");
	free(out);

	/* A long message is cut, still one line. */
	log_set_format(LOG_FORMAT_PLAIN);
	{
		char big[5000];
		memset(big, 'x', sizeof(big) - 1);
		big[sizeof(big) - 1] = '\0';
		capture_begin();
		log_msg(LOG_ERROR, "a", "%s", big);
		out = capture_end();
		CHECK(count(out, "\n") == 1);
		CHECK(out[strlen(out) - 1] == '\n');
		CHECK(strncmp(out, "error a: xxx", 12) == 0);
		free(out);
	}
	log_set_level(LOG_INFO);
}

static void test_auto(void)
{
	unsetenv("JOURNAL_STREAM");
	unsetenv("INVOCATION_ID");
	log_set_format(LOG_FORMAT_AUTO);
	CHECK(log_get_format() == LOG_FORMAT_PLAIN);
	setenv("JOURNAL_STREAM", "8:12345", 1);
	log_set_format(LOG_FORMAT_AUTO);
	CHECK(log_get_format() == LOG_FORMAT_JOURNAL);
	unsetenv("JOURNAL_STREAM");
	setenv("INVOCATION_ID", "0123456789abcdef", 1);
	log_set_format(LOG_FORMAT_AUTO);
	CHECK(log_get_format() == LOG_FORMAT_JOURNAL);
	/* Explicit settings win over the environment. */
	log_set_format(LOG_FORMAT_PLAIN);
	CHECK(log_get_format() == LOG_FORMAT_PLAIN);
	unsetenv("INVOCATION_ID");
}

static void test_rate_limit(void)
{
	char *out;

	log_set_clock(fake_clock);
	log_set_level(LOG_INFO);
	log_set_format(LOG_FORMAT_PLAIN);

	/* 25 of one message within the window: 10 written. Other messages are not held up. */
	capture_begin();
	for (int i = 0; i < 25; i++) {
		log_msg(LOG_WARN, "server", "refused peer %d", i);
		if (i % 5 == 0)
			log_msg(LOG_WARN, "server", "another message %d", i);
		fake_now += 100;
	}
	log_msg(LOG_INFO, "server", "refused peer %d", 99);           /* another level */
	log_msg(LOG_WARN, "other", "refused peer %d", 99);            /* another subsystem */
	log_msg_unlimited(LOG_WARN, "server", "refused peer %d", 98); /* not counted */
	out = capture_end();
	CHECK(count(out, "warn server: refused peer ") == 11);
	CHECK(strstr(out, "warn server: refused peer 9\n") != NULL);
	CHECK(strstr(out, "warn server: refused peer 10\n") == NULL);
	CHECK(strstr(out, "warn server: refused peer 98\n") != NULL);
	CHECK(count(out, "another message") == 5);
	CHECK(strstr(out, "info server: refused peer 99") != NULL);
	CHECK(strstr(out, "warn other: refused peer 99") != NULL);
	CHECK(strstr(out, "suppressed") == NULL);
	free(out);

	/* Still within the window: dropped, no report yet. */
	capture_begin();
	log_msg(LOG_WARN, "server", "refused peer %d", 100);
	out = capture_end();
	CHECK_STR(out, "");
	free(out);

	/* After the window: the count of what was dropped (15 + 1), then the message. */
	fake_now += LOG_RATE_WINDOW_MS;
	capture_begin();
	log_msg(LOG_WARN, "server", "refused peer %d", 200);
	log_msg(LOG_WARN, "server", "refused peer %d", 201);
	out = capture_end();
	CHECK_STR(out, "warn server: (suppressed 16 similar messages)\n"
	               "warn server: refused peer 200\n"
	               "warn server: refused peer 201\n");
	free(out);

	/* A new window that is not exceeded reports nothing. */
	fake_now += LOG_RATE_WINDOW_MS;
	capture_begin();
	log_msg(LOG_WARN, "server", "refused peer %d", 300);
	out = capture_end();
	CHECK_STR(out, "warn server: refused peer 300\n");
	free(out);

	/* Exactly one dropped: singular. */
	fake_now += LOG_RATE_WINDOW_MS;
	capture_begin();
	for (int i = 0; i < LOG_RATE_BURST + 1; i++)
		log_msg(LOG_ERROR, "x", "boom");
	fake_now += LOG_RATE_WINDOW_MS;
	log_msg(LOG_ERROR, "x", "boom");
	out = capture_end();
	CHECK(count(out, "error x: boom\n") == LOG_RATE_BURST + 1);
	CHECK(strstr(out, "error x: (suppressed 1 similar message)\n") != NULL);
	free(out);

	/* Many distinct messages evict old windows; a dropped count is reported, not lost. */
	log_set_clock(fake_clock);
	capture_begin();
	for (int i = 0; i < LOG_RATE_BURST + 3; i++)
		log_msg(LOG_WARN, "flood", "the same");
	for (int i = 0; i < 100; i++) {
		char subsystem[16];
		fake_now += 1;
		snprintf(subsystem, sizeof(subsystem), "s%d", i);
		log_msg(LOG_INFO, subsystem, "once");
	}
	out = capture_end();
	CHECK(count(out, "warn flood: the same\n") == LOG_RATE_BURST);
	CHECK(count(out, "warn flood: (suppressed 3 similar messages)\n") == 1);
	CHECK(count(out, ": once\n") == 100);
	free(out);
	log_set_clock(NULL);
}

int main(void)
{
	test_parse();
	test_formats();
	test_auto();
	test_rate_limit();
	return test_done("log");
}
