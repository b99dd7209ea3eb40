/* convod: the conversation daemon. Parses the command line, prepares the state directory,
 * runs the event loop until SIGINT/SIGTERM, then stops gracefully. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <uv.h>

#include "config.h"
#include "dispatch.h"
#include "log.h"
#include "server.h"

struct daemon {
	uv_loop_t loop;
	struct config cfg;
	struct dispatch dispatch;
	struct server server;
	uv_signal_t sigint, sigterm;
	int signals_seen;
};

/* mkdir -p with mode 0750 for the parts it creates. 0 or -errno. */
static int make_dirs(const char *path)
{
	char *p = strdup(path), *s;
	int rc = 0;

	if (!p)
		return -ENOMEM;
	for (s = p + 1;; s++) {
		if (*s == '/' || *s == '\0') {
			char saved = *s;
			*s = '\0';
			if (mkdir(p, 0750) < 0 && errno != EEXIST) {
				rc = -errno;
				break;
			}
			*s = saved;
			if (!saved)
				break;
		}
	}
	free(p);
	if (rc == 0) {
		struct stat st;
		if (stat(path, &st) < 0)
			rc = -errno;
		else if (!S_ISDIR(st.st_mode))
			rc = -ENOTDIR;
	}
	return rc;
}

static void on_stopped(struct server *s)
{
	struct daemon *d = (struct daemon *)((char *)s - offsetof(struct daemon, server));
	uv_close((uv_handle_t *)&d->sigint, NULL);
	uv_close((uv_handle_t *)&d->sigterm, NULL);
}

static void on_signal(uv_signal_t *h, int signum)
{
	struct daemon *d = h->data;

	d->signals_seen++;
	log_msg(LOG_INFO, "main", "%s: %s", strsignal(signum),
		d->signals_seen == 1 ? "stopping (answering what was read)"
				     : "stopping now");
	server_stop(&d->server, on_stopped);
}

int main(int argc, char **argv)
{
	static struct daemon d;
	enum config_action action;
	int rc;

	config_defaults(&d.cfg);
	if (config_parse_args(&d.cfg, argc, argv, &action) < 0)
		return 2;
	if (action == CONFIG_HELP) {
		config_usage(argv[0]);
		return 0;
	}
	if (action == CONFIG_VERSION) {
		printf("convod %s (protocol 1)\n", CONVOD_VERSION);
		return 0;
	}
	log_set_level(d.cfg.log_level);
	signal(SIGPIPE, SIG_IGN);

	rc = make_dirs(d.cfg.state_dir);
	if (rc < 0) {
		log_msg(LOG_ERROR, "main", "cannot create state directory %s: %s", d.cfg.state_dir,
			strerror(-rc));
		return 1;
	}
	rc = dispatch_init(&d.dispatch, &d.cfg);
	if (rc < 0) {
		log_msg(LOG_ERROR, "main", "cannot initialise: %s", strerror(-rc));
		return 1;
	}
	uv_loop_init(&d.loop);
	if (server_start(&d.server, &d.loop, &d.cfg, &d.dispatch) < 0) {
		uv_run(&d.loop, UV_RUN_NOWAIT);
		uv_loop_close(&d.loop);
		dispatch_free(&d.dispatch);
		return 1;
	}
	uv_signal_init(&d.loop, &d.sigint);
	uv_signal_init(&d.loop, &d.sigterm);
	d.sigint.data = d.sigterm.data = &d;
	uv_signal_start(&d.sigint, on_signal, SIGINT);
	uv_signal_start(&d.sigterm, on_signal, SIGTERM);
	log_msg(LOG_INFO, "main", "convod %s ready (memory only)", CONVOD_VERSION);

	uv_run(&d.loop, UV_RUN_DEFAULT);

	if (uv_loop_close(&d.loop) != 0)
		log_msg(LOG_WARN, "main", "event loop closed with handles still open");
	dispatch_free(&d.dispatch);
	log_msg(LOG_INFO, "main", "stopped");
	return 0;
}
