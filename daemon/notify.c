/* sd_notify spoken directly: one AF_UNIX datagram of "KEY=value" lines per notification to
 * the address in NOTIFY_SOCKET, and a loop timer for the watchdog pings. */
#include "notify.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include "log.h"

#define STATUS_MAX 512
/* How long READY=1 and STOPPING=1 may wait for room in the service manager's queue (it
 * reads them promptly; libsystemd waits without a bound). Pings and statuses never wait. */
#define SEND_WAIT_MS 1000

/* Process-wide like the environment it comes from. */
static struct {
	int fd; /* the datagram socket; -1 when not notifying */
	struct sockaddr_un addr;
	socklen_t addr_len;
	unsigned long long watchdog_usec; /* 0 = no pings */
	uv_loop_t *loop;                  /* borrowed */
	uv_timer_t timer;
	bool timer_live; /* uv_timer_init done, uv_close not yet */
	bool stopping_sent;
	bool send_failed; /* the last send failed: log the next failures at debug level */
} notifier = {.fd = -1};

/* A positive decimal integer with nothing after it; 0 or -EINVAL. */
static int parse_ull(const char *s, unsigned long long *out)
{
	char *end = NULL;
	unsigned long long v;

	if (!s || *s < '0' || *s > '9')
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || v == 0)
		return -EINVAL;
	*out = v;
	return 0;
}

/* must_arrive: wait (bounded) while the receiver's queue is full instead of dropping. */
static void notify_send(const char *msg, bool must_arrive)
{
	struct iovec iov;
	struct msghdr mh;
	ssize_t n;

	if (notifier.fd < 0)
		return;
	iov.iov_base = (void *)msg;
	iov.iov_len = strlen(msg);
	memset(&mh, 0, sizeof(mh));
	mh.msg_name = &notifier.addr;
	mh.msg_namelen = notifier.addr_len;
	mh.msg_iov = &iov;
	mh.msg_iovlen = 1;
	do
		n = sendmsg(notifier.fd, &mh, MSG_NOSIGNAL | (must_arrive ? 0 : MSG_DONTWAIT));
	while (n < 0 && errno == EINTR);
	if (n >= 0) {
		notifier.send_failed = false;
		return;
	}
	log_msg(notifier.send_failed ? LOG_DEBUG : LOG_WARN, "notify",
	        "cannot notify the service manager: %s", strerror(errno));
	notifier.send_failed = true;
}

/* Appends "KEY=" and text to msg (size cap), newlines in text made spaces. */
static void append_field(char *msg, size_t cap, const char *key, const char *text)
{
	size_t len = strlen(msg), i;

	if (len > 0 && len + 1 < cap)
		msg[len++] = '\n';
	for (i = 0; key[i] && len + 1 < cap; i++)
		msg[len++] = key[i];
	for (i = 0; text[i] && len + 1 < cap && i < STATUS_MAX; i++)
		msg[len++] = text[i] == '\n' ? ' ' : text[i];
	msg[len] = '\0';
}

static void on_watchdog(uv_timer_t *t)
{
	(void)t;
	notify_send("WATCHDOG=1", false);
}

/* Watchdog pings only for this process: WATCHDOG_PID, when set, must be ours. */
static void watchdog_setup(void)
{
	const char *usec = getenv("WATCHDOG_USEC"), *pid = getenv("WATCHDOG_PID");
	unsigned long long v, p;

	if (!usec || !*usec)
		return;
	if (parse_ull(usec, &v) < 0) {
		log_msg(LOG_WARN, "notify", "ignoring WATCHDOG_USEC=%s: not a positive integer",
		        usec);
		return;
	}
	if (pid && *pid) {
		if (parse_ull(pid, &p) < 0 || p != (unsigned long long)getpid()) {
			log_msg(LOG_DEBUG, "notify", "WATCHDOG_PID=%s is not this process", pid);
			return;
		}
	}
	notifier.watchdog_usec = v;
}

int notify_init(uv_loop_t *loop)
{
	const char *e = getenv("NOTIFY_SOCKET");
	size_t len;
	int fd;

	if (notifier.fd >= 0 || !e || !*e)
		return 0;
	len = strlen(e);
	if (e[0] != '/' && e[0] != '@') {
		log_msg(
		    LOG_WARN, "notify",
		    "ignoring NOTIFY_SOCKET=%s: only /path and @abstract addresses are supported",
		    e);
		return 0;
	}
	if (len >= sizeof(notifier.addr.sun_path) || len < 2) {
		log_msg(LOG_WARN, "notify", "ignoring NOTIFY_SOCKET: address of %zu bytes", len);
		return 0;
	}
	fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		int err = errno;
		log_msg(LOG_ERROR, "notify", "cannot create the notification socket: %s",
		        strerror(err));
		return -err;
	}
	{
		struct timeval tv = {.tv_sec = SEND_WAIT_MS / 1000,
		                     .tv_usec = (SEND_WAIT_MS % 1000) * 1000};
		if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0) {
			int err = errno;
			close(fd);
			log_msg(LOG_ERROR, "notify", "SO_SNDTIMEO: %s", strerror(err));
			return -err;
		}
	}
	memset(&notifier.addr, 0, sizeof(notifier.addr));
	notifier.addr.sun_family = AF_UNIX;
	memcpy(notifier.addr.sun_path, e, len);
	if (e[0] == '@') {
		/* Abstract namespace: a leading NUL, and the length says where the name ends. */
		notifier.addr.sun_path[0] = '\0';
		notifier.addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len);
	} else {
		notifier.addr_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len + 1);
	}
	notifier.fd = fd;
	notifier.loop = loop;
	notifier.stopping_sent = false;
	notifier.send_failed = false;
	watchdog_setup();
	log_msg(LOG_DEBUG, "notify", "notifying %s%s", e,
	        notifier.watchdog_usec ? " (watchdog on)" : "");
	return 0;
}

void notify_ready(const char *status)
{
	char msg[STATUS_MAX + 32] = "READY=1";
	uint64_t ms;

	if (notifier.fd < 0)
		return;
	if (status)
		append_field(msg, sizeof(msg), "STATUS=", status);
	notify_send(msg, true);
	if (!notifier.watchdog_usec || notifier.stopping_sent)
		return;
	if (!notifier.timer_live) {
		if (uv_timer_init(notifier.loop, &notifier.timer) < 0)
			return;
		notifier.timer_live = true;
		/* A ping never keeps the daemon alive; notify_close still closes the handle. */
		uv_unref((uv_handle_t *)&notifier.timer);
	}
	/* Half the interval, as sd_watchdog_enabled(3) advises, so one late turn is no miss. */
	ms = notifier.watchdog_usec / 2000;
	if (ms == 0)
		ms = 1;
	uv_timer_start(&notifier.timer, on_watchdog, ms, ms);
	notify_send("WATCHDOG=1", false);
}

void notify_stopping(const char *status)
{
	char msg[STATUS_MAX + 32] = "STOPPING=1";

	if (notifier.fd < 0 || notifier.stopping_sent)
		return;
	notifier.stopping_sent = true;
	if (status)
		append_field(msg, sizeof(msg), "STATUS=", status);
	notify_send(msg, true);
}

void notify_status(const char *fmt, ...)
{
	char text[STATUS_MAX + 1], msg[STATUS_MAX + 16] = "";
	va_list ap;

	if (notifier.fd < 0)
		return;
	va_start(ap, fmt);
	vsnprintf(text, sizeof(text), fmt, ap);
	va_end(ap);
	append_field(msg, sizeof(msg), "STATUS=", text);
	notify_send(msg, false);
}

void notify_close(void)
{
	if (notifier.timer_live) {
		notifier.timer_live = false;
		uv_timer_stop(&notifier.timer);
		uv_close((uv_handle_t *)&notifier.timer, NULL);
	}
	if (notifier.fd >= 0) {
		close(notifier.fd);
		notifier.fd = -1;
	}
	notifier.watchdog_usec = 0;
}
