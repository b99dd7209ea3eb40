/* powercut: an LD_PRELOAD library that records what a process writes to the files of one
 * directory, when each file was created (an open that made it) and synced, so that a test can build
 * what a power loss at any moment would have left on the disk (test_powercut.py): every file
 * holding only the writes made before its last successful fsync or fdatasync. It changes nothing
 * the process does: each call goes to libc first, and is recorded only when it succeeded.
 *
 * POWERCUT_DIR: the directory (an absolute path, as SQLite opens its files by); files
 * named below it are followed, but not SQLite's "-shm" index, which a start rebuilds from
 * the WAL, and so is the directory itself, for its syncs (SQLite syncs it after creating a
 * journal or a WAL). POWERCUT_LOG: the record, appended. Without both, nothing is
 * recorded.
 *
 * Whatever the process writes to a socket (its answers) is recorded too, with an empty
 * path and the descriptor for offset, so that the test knows which answers had been sent
 * at any point of the record; and so is what it sends (libcurl's requests to DynamoDB, over
 * plain HTTP in the tests), so that the test knows which had left the host by then.
 *
 * A record: one byte of kind ('W' write, 'T' truncate, 'S' sync, 'C' created by an open,
 * 'U' unlink, 'A' written to a socket, 'N' sent by send), then the path's length (4 bytes), the
 * offset or size (8) and the data's length (8), all little endian, then the path and the data
 * (writes only). Records are written under one lock, in the order the calls returned, by a plain
 * write to the log (O_APPEND). Two threads' calls on one file at the same time are ordered as they
 * were recorded; what an answer waits for is recorded before it all the same, since the daemon's
 * commit syncs its writes after making them, and answers after the sync. */
/* The plain and the 64-bit names are defined apart here: no redirection of one to the
 * other (meson builds everything with _FILE_OFFSET_BITS=64). */
#undef _FILE_OFFSET_BITS
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define MAX_FD 4096

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t once = PTHREAD_ONCE_INIT;
static int log_fd = -1;
static char dir[4096];
static size_t dir_len;
static char *paths[MAX_FD]; /* followed descriptors: their paths */
static char kinds[MAX_FD];  /* other descriptors: 0 not known yet, 'S' a socket, 'O' not */

static int (*real_open64)(const char *, int, ...);
static int (*real_open)(const char *, int, ...);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off64_t);
static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_send)(int, const void *, size_t, int);
static int (*real_ftruncate64)(int, off64_t);
static int (*real_ftruncate)(int, off_t);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_unlink)(const char *);
static int (*real_close)(int);

static void init(void)
{
	const char *d = getenv("POWERCUT_DIR"), *l = getenv("POWERCUT_LOG");

	*(void **)&real_open64 = dlsym(RTLD_NEXT, "open64");
	*(void **)&real_open = dlsym(RTLD_NEXT, "open");
	*(void **)&real_pwrite64 = dlsym(RTLD_NEXT, "pwrite64");
	*(void **)&real_write = dlsym(RTLD_NEXT, "write");
	*(void **)&real_send = dlsym(RTLD_NEXT, "send");
	*(void **)&real_ftruncate64 = dlsym(RTLD_NEXT, "ftruncate64");
	*(void **)&real_ftruncate = dlsym(RTLD_NEXT, "ftruncate");
	*(void **)&real_fsync = dlsym(RTLD_NEXT, "fsync");
	*(void **)&real_fdatasync = dlsym(RTLD_NEXT, "fdatasync");
	*(void **)&real_unlink = dlsym(RTLD_NEXT, "unlink");
	*(void **)&real_close = dlsym(RTLD_NEXT, "close");
	if (!d || !l || strlen(d) + 2 > sizeof(dir))
		return;
	dir_len = strlen(d);
	memcpy(dir, d, dir_len);
	if (dir_len && dir[dir_len - 1] != '/')
		dir[dir_len++] = '/';
	log_fd = real_open64(l, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
}

/* A file below the directory, or the directory itself (whose syncs make unlinks and new
 * names durable). */
static bool followed_path(const char *path)
{
	size_t n = strlen(path);
	if (log_fd < 0)
		return false;
	if (n == dir_len - 1 && memcmp(path, dir, n) == 0)
		return true;
	return n > dir_len && memcmp(path, dir, dir_len) == 0 &&
	       !(n >= 4 && strcmp(path + n - 4, "-shm") == 0);
}

static void put_all(const void *p, size_t n)
{
	const char *q = p;
	while (n) {
		ssize_t w = real_write(log_fd, q, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0)
			abort(); /* a record lost would make the test's image wrong */
		q += w;
		n -= (size_t)w;
	}
}

static void put_u(unsigned char *p, uint64_t v, int n)
{
	for (int i = 0; i < n; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

/* Appends one record; mu held. */
static void record(char kind, const char *path, uint64_t off, const void *data, size_t len)
{
	unsigned char head[21];
	size_t plen = strlen(path);

	head[0] = (unsigned char)kind;
	put_u(head + 1, plen, 4);
	put_u(head + 5, off, 8);
	put_u(head + 13, len, 8);
	put_all(head, sizeof(head));
	put_all(path, plen);
	if (len)
		put_all(data, len);
}

static void opened(int fd, const char *path, int flags, bool created)
{
	if (fd < 0 || fd >= MAX_FD)
		return;
	pthread_mutex_lock(&mu);
	kinds[fd] = 0; /* a number closed out of sight (fclose) comes back as something else */
	if (!followed_path(path)) {
		pthread_mutex_unlock(&mu);
		return;
	}
	free(paths[fd]);
	if (!(paths[fd] = strdup(path)))
		abort(); /* a file no longer followed would make the test's image wrong */
	if (created)
		record('C', path, 0, NULL, 0);
	if (flags & O_TRUNC)
		record('T', path, 0, NULL, 0);
	pthread_mutex_unlock(&mu);
}

static int open_common(int (*real)(const char *, int, ...), const char *path, int flags, va_list ap)
{
	mode_t mode = 0;
	bool existed = true;
	int fd;

	if (flags & (O_CREAT | O_TMPFILE))
		mode = (mode_t)va_arg(ap, int);
	/* Whether this open creates the file. Another thread could create it in between; the
	 * daemon does not race itself for its files (SQLite opens each under its own lock). */
	if (flags & O_CREAT) {
		int saved = errno;
		existed = access(path, F_OK) == 0;
		errno = saved;
	}
	fd = real(path, flags, mode);
	if (fd >= 0) {
		int saved = errno;
		opened(fd, path, flags, !existed);
		errno = saved;
	}
	return fd;
}

/* open64 and open: the same but for the function they pass the call on to. */
#define DEFINE_OPEN(name, real)                                                                    \
	int name(const char *path, int flags, ...)                                                 \
	{                                                                                          \
		va_list ap;                                                                        \
		int fd;                                                                            \
		pthread_once(&once, init);                                                         \
		va_start(ap, flags);                                                               \
		fd = open_common(real, path, flags, ap);                                           \
		va_end(ap);                                                                        \
		return fd;                                                                         \
	}
DEFINE_OPEN(open64, real_open64)
DEFINE_OPEN(open, real_open)

/* Runs the record for fd when it is followed; keeps errno. */
#define FOLLOWED(fd, stmt)                                                                         \
	do {                                                                                       \
		int saved_ = errno;                                                                \
		if ((fd) >= 0 && (fd) < MAX_FD) {                                                  \
			pthread_mutex_lock(&mu);                                                   \
			if (paths[fd])                                                             \
				stmt;                                                              \
			pthread_mutex_unlock(&mu);                                                 \
		}                                                                                  \
		errno = saved_;                                                                    \
	} while (0)

ssize_t pwrite64(int fd, const void *buf, size_t n, off64_t off)
{
	ssize_t w;

	pthread_once(&once, init);
	w = real_pwrite64(fd, buf, n, off);
	if (w > 0)
		FOLLOWED(fd, record('W', paths[fd], (uint64_t)off, buf, (size_t)w));
	return w;
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t off)
{
	return pwrite64(fd, buf, n, off);
}

ssize_t write(int fd, const void *buf, size_t n)
{
	off64_t at = -1;
	ssize_t w;

	pthread_once(&once, init);
	if (fd >= 0 && fd < MAX_FD && fd != log_fd) {
		pthread_mutex_lock(&mu);
		if (paths[fd])
			at = lseek64(fd, 0, SEEK_CUR);
		pthread_mutex_unlock(&mu);
	}
	w = real_write(fd, buf, n);
	if (w > 0 && at >= 0)
		FOLLOWED(fd, record('W', paths[fd], (uint64_t)at, buf, (size_t)w));
	else if (w > 0 && log_fd >= 0 && fd >= 0 && fd < MAX_FD && fd != log_fd) {
		int saved = errno;
		pthread_mutex_lock(&mu);
		if (!kinds[fd]) {
			struct stat st;
			kinds[fd] = fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) ? 'S' : 'O';
		}
		if (kinds[fd] == 'S')
			record('A', "", (uint64_t)fd, buf, (size_t)w);
		pthread_mutex_unlock(&mu);
		errno = saved;
	}
	return w;
}

ssize_t send(int fd, const void *buf, size_t n, int flags)
{
	ssize_t w;

	pthread_once(&once, init);
	w = real_send(fd, buf, n, flags);
	if (w > 0 && log_fd >= 0 && fd >= 0) {
		int saved = errno;
		pthread_mutex_lock(&mu);
		record('N', "", (uint64_t)fd, buf, (size_t)w);
		pthread_mutex_unlock(&mu);
		errno = saved;
	}
	return w;
}

static int truncated(int fd, off64_t len, int rc)
{
	if (rc == 0)
		FOLLOWED(fd, record('T', paths[fd], (uint64_t)len, NULL, 0));
	return rc;
}

int ftruncate64(int fd, off64_t len)
{
	pthread_once(&once, init);
	return truncated(fd, len, real_ftruncate64(fd, len));
}

int ftruncate(int fd, off_t len)
{
	pthread_once(&once, init);
	return truncated(fd, len, real_ftruncate(fd, len));
}

static int synced(int fd, int rc)
{
	if (rc == 0)
		FOLLOWED(fd, record('S', paths[fd], 0, NULL, 0));
	return rc;
}

int fsync(int fd)
{
	pthread_once(&once, init);
	return synced(fd, real_fsync(fd));
}

int fdatasync(int fd)
{
	pthread_once(&once, init);
	return synced(fd, real_fdatasync(fd));
}

int unlink(const char *path)
{
	int rc;

	pthread_once(&once, init);
	rc = real_unlink(path);
	if (rc == 0 && followed_path(path)) {
		int saved = errno;
		pthread_mutex_lock(&mu);
		record('U', path, 0, NULL, 0);
		pthread_mutex_unlock(&mu);
		errno = saved;
	}
	return rc;
}

int close(int fd)
{
	pthread_once(&once, init);
	if (fd >= 0 && fd < MAX_FD && fd != log_fd) {
		pthread_mutex_lock(&mu);
		free(paths[fd]);
		paths[fd] = NULL;
		kinds[fd] = 0;
		pthread_mutex_unlock(&mu);
	}
	return real_close(fd);
}
