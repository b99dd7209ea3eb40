/* slowsync: an LD_PRELOAD library that makes the disk under a process slow, and lets a test
 * make its syncs fail (test_disk_full.py): each fsync and fdatasync takes SLOWSYNC_MS longer,
 * and fails with EIO, at once, while the file SLOWSYNC_FAILFILE exists. */
#include <dlfcn.h>
#include <errno.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int (*real_fsync)(int);
static int (*real_fdatasync)(int);

/* Before any thread of the process can sync. */
__attribute__((constructor)) static void init(void)
{
	*(void **)&real_fsync = dlsym(RTLD_NEXT, "fsync");
	*(void **)&real_fdatasync = dlsym(RTLD_NEXT, "fdatasync");
}

/* Whether syncs fail now; otherwise, after the delay. */
static int slowed(void)
{
	const char *f = getenv("SLOWSYNC_FAILFILE"), *ms = getenv("SLOWSYNC_MS");
	struct stat st;

	if (f && *f && stat(f, &st) == 0) {
		errno = EIO;
		return -1;
	}
	if (ms && *ms) {
		long n = atol(ms);
		struct timespec ts = {n / 1000, (n % 1000) * 1000000L};
		while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
			;
	}
	return 0;
}

int fsync(int fd)
{
	return slowed() < 0 ? -1 : real_fsync(fd);
}

int fdatasync(int fd)
{
	return slowed() < 0 ? -1 : real_fdatasync(fd);
}
