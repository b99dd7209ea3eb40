/* The listening Unix socket and its connections: reads into a framer, hands complete lines
 * to dispatch, and after each loop turn commits the turn's mutations once and then writes
 * every connection's answers (group commit). Queued output is bounded per connection:
 * above the limit the connection is neither read nor served until the client drains it. */
#ifndef CONVOD_SERVER_H
#define CONVOD_SERVER_H

#include <stdbool.h>
#include <uv.h>

#include "config.h"
#include "dispatch.h"

struct conn;

struct server {
	uv_loop_t *loop;           /* borrowed */
	const struct config *cfg;  /* borrowed */
	struct dispatch *dispatch; /* borrowed */
	uv_pipe_t listener;
	uv_check_t turn;               /* end of a loop turn: commit, then write */
	uv_prepare_t turn_before_poll; /* same, for answers made outside the poll phase */
	uv_idle_t one_more_poll;       /* active: a turn's commit waits for one more poll */
	uv_timer_t deadline;           /* bounds a graceful stop */
	struct conn *conns;            /* every open connection */
	struct conn *dirty;            /* connections with answers of this turn */
	struct conn *held;             /* connections with answers waiting for a commit */
	uint64_t failures_seen;        /* the dispatch's failed commits already answered */
	size_t nconns;
	/* A connection's memory, for accepting one (to refuse it) when calloc fails. */
	struct conn *spare;
	bool accept_waiting; /* one waits in libuv for the spare (on_connection) */
	size_t fd_conns;     /* connections the open-file limit leaves room for (conn_limit) */
	size_t fd_limit_for; /* the max-connections that was worked out for */
	int handles_open; /* while stopping: handles whose close is pending */
	bool listening, stopping, socket_created;
	bool waits_failed; /* the stop's deadline answered what waited for DynamoDB */
	bool activated;                       /* the socket came from the service manager */
	void (*on_stopped)(struct server *s); /* called once every handle is closed */
};

/* Socket activation: when LISTEN_PID is this process and LISTEN_FDS >= 1, *fd is the
 * passed listening socket (fd 3, made close-on-exec and non-blocking; further ones are
 * closed) and the caller owns it until server_start; else *fd is -1. Always removes
 * LISTEN_PID, LISTEN_FDS and LISTEN_FDNAMES from the environment: call it before any thread
 * starts. 0, or -errno after logging why (fd 3 is not a listening Unix stream socket,
 * LISTEN_FDS is unreadable). */
int server_take_activation(int *fd);

/* Before the store is opened (a restore may take a while), what would make binding
 * cfg->socket_path fail for sure: its directory missing or not a directory, a file there that
 * is not a socket, another daemon listening on it. Changes nothing. 0 or -errno, after
 * logging why. */
int server_check_path(const struct config *cfg);

/* Starts accepting. listen_fd >= 0: a socket from server_take_activation, owned by the
 * server from now on (closed on failure too); the socket file is the service manager's and
 * is never created, chmod-ed nor removed. listen_fd -1: binds cfg->socket_path (mode 0660
 * whatever the umask; a stale socket file is replaced, a live one or a non-socket file is
 * an error). cfg's allow-list (allow_uids, allow_gids), when not empty, is checked for
 * every connection with SO_PEERCRED. 0 or -errno, after logging why. */
int server_start(struct server *s, uv_loop_t *loop, const struct config *cfg,
                 struct dispatch *dispatch, int listen_fd);

/* The store's writer finished something (main's async handle): answers whose commit is
 * written go out; after a failed commit, the dependent ones become `unavailable`. */
void server_progress(struct server *s);

/* Graceful stop: stop accepting, remove the socket file it created, answer every complete line
 * already read, write the answers, close each connection, then call on_stopped. A second
 * call closes every connection at once. */
void server_stop(struct server *s, void (*on_stopped)(struct server *s));

#endif
