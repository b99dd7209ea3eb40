/* Forced into every source of test_alloc_fail and sink_alloc_probe (-include): routes
 * malloc, calloc, realloc, strdup, strndup and free of lib/ and daemon/ code through the
 * counter of alloc_fail.c, which can fail the Nth allocation. The system headers come
 * first, so their declarations keep the real names. */
#ifndef CONVOD_ALLOC_FAIL_H
#define CONVOD_ALLOC_FAIL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* The counter's state (alloc_fail.c), set by the test between runs. */
struct alloc_fail {
	bool armed;            /* count (and maybe refuse) allocations */
	unsigned long calls;   /* allocations counted while armed in this run */
	unsigned long fail_at; /* the allocation to refuse; 0 = none */
	bool failed;           /* it was refused during the current run or request */
	/* Allocations not yet freed, armed or not (the store's writer thread frees too). */
	_Atomic long live;
	void *refuse_old; /* realloc of this block fails, armed or not; NULL = none */
	bool refuse_all;  /* while armed, every allocation fails (memory is out) */
	bool out_from;    /* refuse fail_at and every later one (memory runs out at fail_at) */
	/* Count and refuse only the allocations of this thread (the loop's), when set: other
	 * threads (curl's resolver, SQLite's helpers) go through unrefused. */
	bool one_thread;
	pthread_t thread;
};
extern struct alloc_fail alloc_fail;

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
