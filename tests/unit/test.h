/* A tiny unit-test harness: CHECK records a failure and goes on, the test's main returns
 * test_done() (0 only when nothing failed). One process per module, run by meson test. */
#ifndef CONVO_TEST_H
#define CONVO_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int test_failures;
static int test_checks;

#define CHECK(cond)                                                                        \
	do {                                                                               \
		test_checks++;                                                             \
		if (!(cond)) {                                                             \
			test_failures++;                                                   \
			fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
		}                                                                          \
	} while (0)

#define CHECK_STR(a, b)                                                                    \
	do {                                                                               \
		const char *check_a_ = (a), *check_b_ = (b);                               \
		test_checks++;                                                             \
		if (!check_a_ || !check_b_ || strcmp(check_a_, check_b_) != 0) {           \
			test_failures++;                                                   \
			fprintf(stderr, "%s:%d: CHECK_STR failed: %s\n  got:      %s\n  expected: %s\n", \
				__FILE__, __LINE__, #a, check_a_ ? check_a_ : "(null)",    \
				check_b_ ? check_b_ : "(null)");                           \
		}                                                                          \
	} while (0)

/* xorshift64, for varied but repeatable input: *state is the generator (never 0). */
static inline uint64_t test_rand(uint64_t *state)
{
	uint64_t x = *state;

	x ^= x << 13;
	x ^= x >> 7;
	x ^= x << 17;
	return *state = x;
}

/* capture_begin sends fd 2 to a temporary file; capture_end restores it and returns what
 * was written (the caller frees it). For checking what the code under test logs. */
static int test_saved_stderr = -1;
static FILE *test_capture_file;

static inline void capture_begin(void)
{
	fflush(stderr);
	test_capture_file = tmpfile();
	test_saved_stderr = dup(2);
	dup2(fileno(test_capture_file), 2);
}

static inline char *capture_end(void)
{
	long n;
	char *text;

	fflush(stderr);
	dup2(test_saved_stderr, 2);
	close(test_saved_stderr);
	n = ftell(test_capture_file);
	text = calloc(1, (size_t)(n > 0 ? n : 0) + 1);
	rewind(test_capture_file);
	if (text && n > 0 && fread(text, 1, (size_t)n, test_capture_file) != (size_t)n)
		text[0] = '\0';
	fclose(test_capture_file);
	return text;
}

static inline int test_done(const char *name)
{
	fprintf(stderr, "%s: %d checks, %d failed\n", name, test_checks, test_failures);
	return test_failures ? 1 : 0;
}

#endif
