/* Forced into every source of test_alloc_fail (-include): routes malloc, calloc, realloc,
 * strdup, strndup and free of lib/ and daemon/ code through the test's counter, which can
 * fail the Nth allocation. The system headers come first, so their declarations keep the
 * real names. */
#ifndef CONVOD_ALLOC_FAIL_H
#define CONVOD_ALLOC_FAIL_H

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

void *test_malloc(size_t n);
void *test_calloc(size_t n, size_t size);
void *test_realloc(void *p, size_t n);
char *test_strdup(const char *s);
char *test_strndup(const char *s, size_t n);
void test_free(void *p);

#define malloc(n) test_malloc(n)
#define calloc(n, size) test_calloc(n, size)
#define realloc(p, n) test_realloc(p, n)
#define strdup(s) test_strdup(s)
#define strndup(s, n) test_strndup(s, n)
#define free(p) test_free(p)

#endif
