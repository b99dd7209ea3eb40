/* convod: the conversation daemon. Parses the command line, opens the local store,
 * restores what it holds, runs the event loop until SIGINT/SIGTERM, then stops in order:
 * answer what was read, flush every conversation, let the flusher drain, close the store. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <uv.h>

#include "awsconf.h"
#include "config.h"
#include "ddbclient.h"
#include "dispatch.h"
#include "log.h"
#include "server.h"
#include "sink.h"
#include "store.h"

struct daemon {
	uv_loop_t loop;
	struct config cfg;
	struct awsconf aws;
	struct store *store;
	struct sink *sink;
	struct dispatch dispatch;
	struct server server;
	uv_signal_t sigint, sigterm;
	uv_timer_t flush_timer;
	int signals_seen;
	int exit_code;
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

static void on_flush_timer(uv_timer_t *t)
{
	struct daemon *d = t->data;
	dispatch_flush_tick(&d->dispatch, false);
}

static void on_sink_closed(void *arg)
{
	struct daemon *d = arg;
	d->sink = NULL;
	uv_close((uv_handle_t *)&d->sigint, NULL);
	uv_close((uv_handle_t *)&d->sigterm, NULL);
}

static void on_stopped(struct server *s)
{
	struct daemon *d = (struct daemon *)((char *)s - offsetof(struct daemon, server));

	uv_timer_stop(&d->flush_timer);
	uv_close((uv_handle_t *)&d->flush_timer, NULL);
	/* Every conversation's last message goes to the spool, then the flusher drains it. */
	dispatch_flush_tick(&d->dispatch, true);
	if (d->sink)
		sink_close(d->sink, d->signals_seen > 1 ? 0 : d->cfg.drain_ms, on_sink_closed, d);
	else
		on_sink_closed(d);
}

static void on_signal(uv_signal_t *h, int signum)
{
	struct daemon *d = h->data;

	d->signals_seen++;
	log_msg(LOG_INFO, "main", "%s: %s", strsignal(signum),
		d->signals_seen == 1 ? "stopping (answering what was read, then flushing)"
				     : "stopping now");
	server_stop(&d->server, on_stopped);
}

static void on_table_created(void *arg, int status)
{
	(void)arg;
	if (status == 0 || status == -EEXIST)
		log_msg(LOG_INFO, "sink", "table ready");
	else
		log_msg(LOG_ERROR, "sink", "cannot create the table: %s", strerror(-status));
}

/* Opens the store and the sink; the embedded default when DynamoDB is not configured. */
static int open_persistence(struct daemon *d)
{
	char errbuf[512] = "";
	struct sink_config sc;
	bool remote;
	int rc;

	if (d->cfg.memory_only) {
		log_msg(LOG_WARN, "main", "memory only: nothing survives a restart");
		return 0;
	}
	rc = store_open(d->cfg.state_dir, (enum durability)d->cfg.durability, &d->store, errbuf,
			sizeof(errbuf));
	if (rc < 0) {
		log_msg(LOG_ERROR, "store", "%s", errbuf[0] ? errbuf : strerror(-rc));
		return rc;
	}
	{
		char awserr[AWSCONF_ERRBUF_SIZE] = "";
		rc = awsconf_load(&d->aws, awserr);
		if (rc < 0) {
			log_msg(LOG_ERROR, "aws", "%s", awserr);
			return rc;
		}
	}
	remote = awsconf_dynamodb_configured(&d->aws);
	sink_config_defaults(&sc);
	sc.table = remote ? d->cfg.dynamodb_table : NULL;
	sc.batch_items = d->cfg.batch_items;
	sc.retry_base_ms = d->cfg.retry_base_ms;
	sc.retry_max_ms = d->cfg.retry_max_ms;
	sc.spool_max_items = d->cfg.spool_max_items;
	sc.expires_days = d->cfg.expires_days;
	if (remote && ddbclient_global_init() < 0) {
		log_msg(LOG_ERROR, "sink", "cannot initialise libcurl");
		return -EIO;
	}
	rc = sink_new(&d->loop, d->store, &sc, remote ? &d->aws : NULL, dispatch_settled,
		      &d->dispatch, &d->sink);
	if (rc < 0)
		return rc;
	if (remote) {
		char desc[256];
		log_msg(LOG_INFO, "sink", "DynamoDB table %s at %s", d->cfg.dynamodb_table,
			awsconf_describe(&d->aws, desc, sizeof(desc)));
		if (d->cfg.create_table)
			sink_create_table(d->sink, on_table_created, d);
	} else {
		log_msg(LOG_INFO, "sink", "no DynamoDB configured: the local store is the sink");
	}
	return 0;
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
	uv_loop_init(&d.loop);

	rc = make_dirs(d.cfg.state_dir);
	if (rc < 0) {
		log_msg(LOG_ERROR, "main", "cannot create state directory %s: %s", d.cfg.state_dir,
			strerror(-rc));
		d.exit_code = 1;
		goto out;
	}
	if (open_persistence(&d) < 0) {
		d.exit_code = 1;
		goto out;
	}
	rc = dispatch_init(&d.dispatch, &d.cfg, d.store, d.sink);
	if (rc < 0) {
		log_msg(LOG_ERROR, "main", "cannot initialise: %s", strerror(-rc));
		d.exit_code = 1;
		goto out;
	}
	if (dispatch_restore(&d.dispatch) < 0) {
		d.exit_code = 1;
		goto out;
	}
	if (server_start(&d.server, &d.loop, &d.cfg, &d.dispatch) < 0) {
		d.exit_code = 1;
		goto out;
	}
	uv_signal_init(&d.loop, &d.sigint);
	uv_signal_init(&d.loop, &d.sigterm);
	d.sigint.data = d.sigterm.data = &d;
	uv_signal_start(&d.sigint, on_signal, SIGINT);
	uv_signal_start(&d.sigterm, on_signal, SIGTERM);
	uv_timer_init(&d.loop, &d.flush_timer);
	d.flush_timer.data = &d;
	uv_timer_start(&d.flush_timer, on_flush_timer, d.cfg.flush_interval_ms,
		       d.cfg.flush_interval_ms);
	log_msg(LOG_INFO, "main", "convod %s ready (%s, durability %s)", CONVOD_VERSION,
		d.store ? "local store" : "memory only",
		store_durability_str((enum durability)d.cfg.durability));

	uv_run(&d.loop, UV_RUN_DEFAULT);
	log_msg(LOG_INFO, "main", "stopped");
out:
	if (d.sink) {
		/* Start-up failed after the sink existed: close it on the loop. */
		sink_close(d.sink, 0, NULL, NULL);
		d.sink = NULL;
	}
	uv_run(&d.loop, UV_RUN_DEFAULT);
	if (uv_loop_close(&d.loop) != 0)
		log_msg(LOG_WARN, "main", "event loop closed with handles still open");
	/* What the flusher confirmed while draining is still in the open transaction. */
	if (d.store && store_in_transaction(d.store) && store_commit(d.store) < 0)
		log_msg(LOG_WARN, "store", "last commit failed: confirmed writes will be sent again");
	dispatch_free(&d.dispatch);
	store_close(d.store);
	awsconf_free(&d.aws);
	ddbclient_global_cleanup();
	return d.exit_code;
}
