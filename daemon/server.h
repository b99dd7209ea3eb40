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
	uv_loop_t *loop;                /* borrowed */
	const struct config *cfg;       /* borrowed */
	struct dispatch *dispatch;      /* borrowed */
	uv_pipe_t listener;
	uv_check_t turn;                /* end of a loop turn: commit, then write */
	uv_prepare_t turn_before_poll;  /* same, for answers made outside the poll phase */
	uv_timer_t deadline;            /* bounds a graceful stop */
	struct conn *conns;             /* every open connection */
	struct conn *dirty;             /* connections with answers waiting for the commit */
	size_t nconns;
	int handles_open;               /* while stopping: handles whose close is pending */
	bool listening, stopping, socket_created;
	void (*on_stopped)(struct server *s); /* called once every handle is closed */
};

/* Binds cfg->socket_path (mode 0660 whatever the umask; a stale socket file is replaced,
 * a live one or a non-socket file is an error) and starts accepting. 0 or -errno, after
 * logging why. */
int server_start(struct server *s, uv_loop_t *loop, const struct config *cfg,
		 struct dispatch *dispatch);

/* Graceful stop: stop accepting, remove the socket file, answer every complete line
 * already read, write the answers, close each connection, then call on_stopped. A second
 * call closes every connection at once. */
void server_stop(struct server *s, void (*on_stopped)(struct server *s));

#endif
