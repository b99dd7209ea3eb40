/* slowsync: an LD_PRELOAD library that makes every fsync and fdatasync of the process take
 * SLOWSYNC_MS milliseconds longer (a slow disk), before the real call, so that a test can
 * have the store's writer in its sync while the loop serves more requests (test_disk_full.py).
 * Without SLOWSYNC_MS, or at 0, nothing changes. */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static void slowsync_wait(void)
{
	const char *e = getenv("SLOWSYNC_MS");
	long ms = e ? atol(e) : 0;
	struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};

	/* Slept through signals: the daemon's are handled on its loop, not here. */
	while (ms > 0 && nanosleep(&ts, &ts) < 0 && errno == EINTR)
		;
}

int fsync(int fd)
{
	static int (*real)(int);

	if (!real)
		*(void **)&real = dlsym(RTLD_NEXT, "fsync");
	slowsync_wait();
	return real(fd);
}

int fdatasync(int fd)
{
	static int (*real)(int);

	if (!real)
		*(void **)&real = dlsym(RTLD_NEXT, "fdatasync");
	slowsync_wait();
	return real(fd);
}
