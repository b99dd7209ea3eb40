/* The counting allocator of alloc_fail.h: every allocation of the sources compiled with it
 * is counted, and while armed the fail_at-th is refused (or all of them, or a realloc of one
 * block). Shared by tests/unit/test_alloc_fail.c and tests/integration/sink_alloc_probe. */
#include "alloc_fail.h"

/* This file's own calls are the real ones. */
#undef malloc
#undef calloc
#undef realloc
#undef strdup
#undef strndup
#undef free

struct alloc_fail alloc_fail;

static bool refuse(void)
{
	struct alloc_fail *a = &alloc_fail;

	if (!a->armed)
		return false;
	if (a->one_thread && !pthread_equal(pthread_self(), a->thread))
		return false;
	if (a->refuse_all) {
		a->failed = true;
		return true;
	}
	if (++a->calls != a->fail_at && !(a->out_from && a->fail_at && a->calls > a->fail_at))
		return false;
	a->failed = true;
	return true;
}

void *test_malloc(size_t n)
{
	void *p = refuse() ? NULL : malloc(n);
	if (p)
		alloc_fail.live++;
	return p;
}

void *test_calloc(size_t n, size_t size)
{
	void *p = refuse() ? NULL : calloc(n, size);
	if (p)
		alloc_fail.live++;
	return p;
}

void *test_realloc(void *old, size_t n)
{
	void *p;
	/* Refused like a failed realloc: the old block stays allocated and counted. */
	if (old && old == alloc_fail.refuse_old) {
		alloc_fail.failed = true;
		return NULL;
	}
	if (refuse())
		return NULL;
	p = realloc(old, n);
	if (!old && p)
		alloc_fail.live++;
	else if (old && !p && n == 0)
		alloc_fail.live--; /* realloc(p, 0) freed it */
	return p;
}

char *test_strdup(const char *s)
{
	char *p = refuse() ? NULL : strdup(s);
	if (p)
		alloc_fail.live++;
	return p;
}

char *test_strndup(const char *s, size_t n)
{
	char *p = refuse() ? NULL : strndup(s, n);
	if (p)
		alloc_fail.live++;
	return p;
}

void test_free(void *p)
{
	if (p)
		alloc_fail.live--;
	free(p);
}
