/* Readiness, status and watchdog notifications to the service manager (the sd_notify
 * datagram protocol, spoken directly: no libsystemd). Every call is a no-op when
 * NOTIFY_SOCKET is not set, so the daemon never depends on systemd at run time.
 *
 * The notifier is process-wide (one NOTIFY_SOCKET per process), hence no handle. */
#ifndef CONVOD_NOTIFY_H
#define CONVOD_NOTIFY_H

#include <uv.h>

/* Reads NOTIFY_SOCKET ("/path" or "@abstract"), WATCHDOG_USEC and WATCHDOG_PID and opens
 * the datagram socket. loop is borrowed until notify_close; the watchdog timer is started
 * by notify_ready. 0 (also when nothing is set or the setting is unusable: logged, then
 * ignored) or -errno when the socket cannot be created. */
int notify_init(uv_loop_t *loop);

/* Sends READY=1 with STATUS=status (borrowed; NULL for none) and starts pinging WATCHDOG=1
 * every half of WATCHDOG_USEC when the service manager asked for it. */
void notify_ready(const char *status);

/* Sends STOPPING=1 (once; later calls do nothing) with STATUS=status (NULL for none). */
void notify_stopping(const char *status);

/* Sends STATUS=<formatted text>; the text is cut at 512 bytes and newlines become spaces. */
void notify_status(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Stops the watchdog, closes its timer (on the loop: run it once more) and the socket.
 * Safe to call more than once and without notify_init. Later calls send nothing. */
void notify_close(void);

#endif
