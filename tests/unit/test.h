/* A tiny unit-test harness: CHECK records a failure and goes on, the test's main returns
 * test_done() (0 only when nothing failed). One process per module, run by meson test. */
#ifndef CONVO_TEST_H
#define CONVO_TEST_H

#include <stdio.h>
#include <string.h>

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

static inline int test_done(const char *name)
{
	fprintf(stderr, "%s: %d checks, %d failed\n", name, test_checks, test_failures);
	return test_failures ? 1 : 0;
}

#endif
