/* convod: the conversation daemon. Parses the command line, opens the local store,
 * restores what it holds, runs the event loop until SIGINT/SIGTERM, then stops in order:
 * answer what was read, flush every conversation, let the flusher drain, close the store. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <malloc.h>
#include <pthread.h>
#include <stdlib.h>
#include <fcntl.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "awsconf.h"
#include "config.h"
#include "ddbclient.h"
#include "dispatch.h"
#include "ops.h"
#include "log.h"
#include "notify.h"
#include "server.h"
#include "sink.h"
#include "store.h"

struct daemon {
	uv_loop_t loop;
	struct config cfg;
	struct config_args args; /* the command line, applied again over the file at a reload */
	struct awsconf aws;
	struct store *store;
	struct sink *sink;
	struct dispatch dispatch;
	struct server server;
	uv_signal_t sigint, sigterm;
	uv_signal_t sighup;
	uv_timer_t flush_timer;
	uv_idle_t retry_idle;   /* retry_dead_letters' move, parts each loop turn */
	uv_timer_t retry_pause; /* or once the checkpoint thread had a while */
	uv_async_t committed; /* the store's writer thread wakes the loop through it */
	int signals_seen;
	bool draining; /* sink_close has been called with on_sink_closed */
	int exit_code;
	int listen_fd; /* passed by the service manager, until server_start owns it; or -1 */
	int lock_fd;   /* STATE_DIR/convod.lock, locked for as long as the daemon runs; or -1 */
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

static void on_flush_timer(uv_timer_t *t);

/* Enough is pending for the sink: the next tick now, then every interval again. */
static void on_flush_soon(void *arg)
{
	struct daemon *d = arg;
	uv_timer_start(&d->flush_timer, on_flush_timer, 0, d->cfg.flush_interval_ms);
}

static void on_flush_timer(uv_timer_t *t)
{
	struct daemon *d = t->data;
	dispatch_flush_tick(&d->dispatch, false);
	/* glibc keeps freed memory for reuse: once conversations left memory (close), hand
	 * what is free back to the system, at most once a tick, so that RSS follows the
	 * conversations held. */
	if (d->dispatch.dropped_since_trim) {
		d->dispatch.dropped_since_trim = 0;
		malloc_trim(0);
	}
}

static void on_retry_idle(uv_idle_t *h);

static void on_retry_soon(void *arg)
{
	struct daemon *d = arg;
	uv_idle_start(&d->retry_idle, on_retry_idle);
}

static void on_retry_pause(uv_timer_t *t)
{
	on_retry_soon(t->data);
}

static void on_retry_idle(uv_idle_t *h)
{
	struct daemon *d = h->data;
	enum dispatch_retry r = dispatch_retry_step(&d->dispatch);

	if (r == DISPATCH_RETRY_MORE)
		return;
	uv_idle_stop(h);
	/* Not the idle handle: the loop would spin on it while the checkpoint thread copies. */
	if (r == DISPATCH_RETRY_WAIT)
		uv_timer_start(&d->retry_pause, on_retry_pause, 2, 0);
}

static void on_committed(uv_async_t *h)
{
	struct daemon *d = h->data;
	server_progress(&d->server);
}

/* Called on the store's writer thread. */
static void wake_loop(void *arg)
{
	uv_async_send(arg);
}

static void on_sink_closed(void *arg)
{
	struct daemon *d = arg;
	d->sink = NULL;
	d->dispatch.sink = NULL; /* a commit still under way reports to no sink */
	notify_close();
	uv_close((uv_handle_t *)&d->sigint, NULL);
	uv_close((uv_handle_t *)&d->sigterm, NULL);
	uv_close((uv_handle_t *)&d->sighup, NULL);
	/* Closing the last handle of a signal gives it back its default action, which ends the
	 * process: a reload or a second stop arriving during the last commit and the store's
	 * close (a second or more) would turn a clean stop into exit 129 or 143. Ignored now:
	 * the stop is under way and has no wait left to skip. */
	signal(SIGINT, SIG_IGN);
	signal(SIGTERM, SIG_IGN);
	signal(SIGHUP, SIG_IGN);
}

static void on_stopped(struct server *s)
{
	struct daemon *d = (struct daemon *)((char *)s - offsetof(struct daemon, server));

	uv_timer_stop(&d->flush_timer);
	uv_close((uv_handle_t *)&d->flush_timer, NULL);
	d->dispatch.flush_soon = NULL;
	uv_close((uv_handle_t *)&d->retry_idle, NULL);
	uv_close((uv_handle_t *)&d->retry_pause, NULL);
	d->dispatch.retry_soon = NULL;
	dispatch_retry_stop(&d->dispatch);
	/* Every conversation's last message goes to the spool, then the flusher drains it:
	 * what the spool takes now is handed to the sink once written. */
	dispatch_flush_tick(&d->dispatch, true);
	dispatch_sync(&d->dispatch);
	if (d->sink && sink_remote(d->sink) && d->signals_seen < 2)
		notify_status("Stopping: sending the spool (up to %llu ms)",
			      (unsigned long long)d->cfg.drain_ms);
	if (d->sink) {
		d->draining = true;
		sink_close(d->sink, d->signals_seen > 1 ? 0 : d->cfg.drain_ms, on_sink_closed, d);
	} else {
		on_sink_closed(d);
	}
}

static void on_signal(uv_signal_t *h, int signum)
{
	struct daemon *d = h->data;

	d->signals_seen++;
	notify_stopping("Stopping: answering what was sent before, then flushing");
	log_msg(LOG_INFO, "main", "%s: %s", strsignal(signum),
	        d->signals_seen == 1 ? "stopping (answering what was sent before, then flushing)"
	                             : "stopping now");
	server_stop(&d->server, on_stopped);
	/* A second signal while the flusher drains: stop waiting for it (the spool keeps
	 * what is unsent for the next start). */
	if (d->signals_seen > 1 && d->sink && d->draining)
		sink_close(d->sink, 0, NULL, NULL);
}

/* The sink's share of the settings (the table is set by the caller). */
static void sink_config_from(const struct config *cfg, struct sink_config *sc)
{
	sink_config_defaults(sc);
	sc->batch_items = cfg->batch_items;
	sc->retry_base_ms = cfg->retry_base_ms;
	sc->retry_max_ms = cfg->retry_max_ms;
	sc->spool_max_items = cfg->spool_max_items;
	sc->expires_days = cfg->expires_days;
	sc->connect_timeout_ms = (long)cfg->connect_timeout_ms;
	sc->request_timeout_ms = (long)cfg->request_timeout_ms;
	sc->ignore_crc32 = cfg->ignore_crc32;
}

/* Whether a reload may read the config file: not a FIFO or a socket, whose read would hold
 * the loop until a writer comes (and a pipe read at its end again is an empty file, which
 * would put every setting back to its default). Logs why not. */
static bool config_path_readable_now(const struct daemon *d)
{
	const char *path = d->cfg.file ? d->cfg.file
	                   : d->args.config_path && d->args.config_path[0] == '-'
	                       ? d->args.config_path + 1
	                       : d->args.config_path;
	struct stat st;

	if (!path || stat(path, &st) < 0 || S_ISREG(st.st_mode) || S_ISDIR(st.st_mode) ||
	    S_ISCHR(st.st_mode))
		return true; /* config_load says what is wrong, if anything */
	log_msg(LOG_ERROR, "config",
	        "%s: not a regular file (a %s); a reload reads regular files only; keeping the "
	        "running settings",
	        path, S_ISFIFO(st.st_mode) ? "FIFO or pipe" : "socket or device");
	return false;
}

/* SIGHUP: rereads the config file, applies the flags over it again, and applies what may
 * change while running (config_reload logs each change and what needs a restart); a bad
 * file changes nothing. Then rereads the AWS credentials. d->cfg only ever changes here,
 * on the loop thread, like every reader of it. */
static void on_sighup(uv_signal_t *h, int signum)
{
	struct daemon *d = h->data;
	struct config next;
	char err[CONFIG_ERR_SIZE];

	(void)signum;
	if (d->server.stopping)
		return;
	log_msg(LOG_INFO, "config", "SIGHUP: reloading %s",
	        d->cfg.file           ? d->cfg.file
	        : d->args.config_path ? d->args.config_path + 1 /* -FILE, absent */
	                              : "the flags (no config file)");
	if (d->cfg.file && d->args.config_path[0] == '-' && access(d->cfg.file, F_OK) != 0 &&
	    errno == ENOENT) {
		/* -FILE was read before and is gone now (renamed away while edited, say): a file
		 * that cannot be read, not a return to the defaults, which would drop an
		 * allow-list. */
		log_msg(LOG_ERROR, "config", "%s: no such file; keeping the running settings",
		        d->cfg.file);
		config_defaults(&next);
	} else if (!config_path_readable_now(d)) {
		config_defaults(&next); /* logged */
	} else if (config_load(&next, &d->args, err, sizeof(err)) < 0) {
		log_msg(LOG_ERROR, "config", "%s; keeping the running settings", err);
	} else {
		unsigned changed = config_reload(&d->cfg, &next);
		if (changed & CONFIG_RELOAD_FLUSH_TIMER)
			uv_timer_start(&d->flush_timer, on_flush_timer, d->cfg.flush_interval_ms,
				       d->cfg.flush_interval_ms);
		if (changed & CONFIG_RELOAD_SINK) {
			struct sink_config sc;
			sink_config_from(&d->cfg, &sc);
			if (sink_reconfigure(d->sink, &sc) < 0)
				log_msg(LOG_ERROR, "config", "the flusher refused the settings");
		}
	}
	config_free(&next);
	if (d->sink)
		sink_reload_credentials(d->sink);
}

/* Whether the DynamoDB table was named by flag or in the file (it has a default). */
static bool table_named(const struct config *cfg)
{
	int i = config_setting_index("dynamodb-table");
	return i >= 0 && cfg->source[i] != CONFIG_SRC_DEFAULT;
}

/* --check-config: the effective settings and the AWS ones (secrets masked) on stdout. */
static int check_config(struct daemon *d)
{
	char awserr[AWSCONF_ERRBUF_SIZE] = "";

	if (awsconf_load(&d->aws, awserr) < 0) {
		/* The verdict of a start (open_persistence): fatal only when DynamoDB is wanted. */
		if (table_named(&d->cfg) || d->cfg.create_table || awsconf_dynamodb_wanted()) {
			fprintf(stderr, "convod: AWS settings: %s\n", awserr);
			return 2;
		}
		fprintf(
		    stderr,
		    "convod: AWS settings: %s; no DynamoDB table, region or endpoint is set, so "
		    "DynamoDB is not used\n",
		    awserr);
	}
	config_print(&d->cfg, stdout);
	config_print_aws(&d->aws, stdout);
	fflush(stdout);
	return ferror(stdout) ? 1 : 0;
}

static void on_table_created(void *arg, int status)
{
	(void)arg;
	if (status == 0 || status == -EEXIST)
		log_msg(LOG_INFO, "sink", "table ready");
	else
		log_msg(LOG_ERROR, "sink", "cannot create the table: %s", strerror(-status));
}

/* Takes STATE_DIR/convod.lock (flock, exclusive) for as long as the daemon runs: a second
 * daemon on the same state directory would open the same store, take its write lock and
 * fail every write of the first (or read a store the first is writing). The lock goes with
 * the process, however it ends; the file keeps the pid of the last daemon that held it. */
static int lock_state_dir(struct daemon *d)
{
	char path[4096], pid[32] = "";
	int fd, n;

	if ((size_t)snprintf(path, sizeof(path), "%s/convod.lock", d->cfg.state_dir) >=
	    sizeof(path)) {
		log_msg(LOG_ERROR, "main", "state directory path too long");
		return -ENAMETOOLONG;
	}
	fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0640);
	if (fd < 0) {
		int e = errno;
		log_msg(LOG_ERROR, "main", "cannot open %s: %s", path, strerror(e));
		return -e;
	}
	if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
		int e = errno;
		if (e == EWOULDBLOCK) {
			n = (int)pread(fd, pid, sizeof(pid) - 1, 0);
			pid[n > 0 ? n : 0] = '\0';
			pid[strcspn(pid, "\n")] = '\0';
			log_msg(
			    LOG_ERROR, "main",
			    "state directory %s is in use by another convod%s%s%s; not starting",
			    d->cfg.state_dir, pid[0] ? " (pid " : "", pid, pid[0] ? ")" : "");
		} else {
			log_msg(LOG_ERROR, "main", "cannot lock %s: %s", path, strerror(e));
		}
		close(fd);
		return -e;
	}
	n = snprintf(pid, sizeof(pid), "%ld\n", (long)getpid());
	if (ftruncate(fd, 0) < 0 || pwrite(fd, pid, (size_t)n, 0) != n)
		log_msg(LOG_WARN, "main", "cannot write the pid into %s: %s", path,
		        strerror(errno));
	d->lock_fd = fd;
	return 0;
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
		if (table_named(&d->cfg) || d->cfg.create_table)
			log_msg(LOG_WARN, "sink",
			        "memory-only is set: dynamodb-table and create-table are ignored "
			        "(no local store, no DynamoDB: nothing is written anywhere)");
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
		/* Settings that cannot be read stop the start only when DynamoDB is wanted: a
		 * table named, or a region or endpoint in the environment or the config file.
		 * Otherwise a shell's AWS_PROFILE or a stale ~/.aws would keep the embedded
		 * default, which never uses them, from starting. */
		if (rc < 0 &&
		    (table_named(&d->cfg) || d->cfg.create_table || awsconf_dynamodb_wanted())) {
			log_msg(LOG_ERROR, "aws", "%s", awserr);
			return rc;
		}
		if (rc < 0)
			log_msg(LOG_WARN, "aws",
			        "%s; no DynamoDB table, region or endpoint is set, so DynamoDB is "
			        "not used: the local store is the sink",
			        awserr);
	}
	remote = awsconf_dynamodb_configured(&d->aws);
	sink_config_from(&d->cfg, &sc);
	sc.table = remote ? d->cfg.dynamodb_table : NULL;
	if (remote && ddbclient_global_init() < 0) {
		log_msg(LOG_ERROR, "sink", "cannot initialise libcurl");
		return -EIO;
	}
	rc = sink_new(&d->loop, d->store, &sc, remote ? &d->aws : NULL, dispatch_settled,
		      &d->dispatch, &d->sink);
	if (rc < 0)
		return rc;
	if (remote) {
		/* (sink_new logs the table and the AWS settings) */
		if (d->cfg.create_table)
			sink_create_table(d->sink, on_table_created, d);
	} else if (table_named(&d->cfg) || d->cfg.create_table) {
		/* Asked for by name, yet off: most likely a region missing from this host's
		 * environment, and nothing would ever reach the table. */
		log_msg(LOG_WARN, "sink",
		        "%s is set but no AWS region or DynamoDB endpoint is (AWS_REGION, "
		        "AWS_ENDPOINT_URL_DYNAMODB, or a region in the AWS config file): DynamoDB "
		        "is not used; the local store is the sink",
		        d->cfg.create_table ? "create-table" : "dynamodb-table");
	} else {
		log_msg(LOG_INFO, "sink", "no DynamoDB configured: the local store is the sink");
	}
	return 0;
}

int main(int argc, char **argv)
{
	static struct daemon d;
	char err[CONFIG_ERR_SIZE];
	sigset_t hup;
	int rc;

	d.lock_fd = -1;
	/* A reload asked for while the daemon starts (SIGHUP's default action ends the process)
	 * waits until the handler exists: blocked here, in every thread started from here on,
	 * and unblocked on this thread once the handler is installed, which then runs it. */
	sigemptyset(&hup);
	sigaddset(&hup, SIGHUP);
	pthread_sigmask(SIG_BLOCK, &hup, NULL);

	/* jansson's allocation failures become `internal` answers, never a mangled value. */
	ops_json_alloc_init(malloc, free);
	if (config_parse_args(&d.args, argc, argv, err, sizeof(err)) < 0) {
		fprintf(stderr, "convod: %s\n", err);
		return 2;
	}
	if (d.args.action == CONFIG_HELP || d.args.action == CONFIG_VERSION) {
		if (d.args.action == CONFIG_HELP)
			config_usage(argv[0]);
		else
			printf("convod %s (protocol 1)\n", CONVOD_VERSION);
		config_args_free(&d.args);
		return 0;
	}
	/* The file first, then the flags over it; a bad file is a bad command line. */
	if (config_load(&d.cfg, &d.args, err, sizeof(err)) < 0) {
		fprintf(stderr, "convod: %s\n", err);
		d.exit_code = 2;
	} else if (d.args.action == CONFIG_CHECK) {
		d.exit_code = check_config(&d);
	}
	if (d.exit_code || d.args.action == CONFIG_CHECK) {
		awsconf_free(&d.aws);
		config_free(&d.cfg);
		config_args_free(&d.args);
		return d.exit_code;
	}
	log_set_level(d.cfg.log_level);
	log_set_format(d.cfg.log_format);
	if (d.cfg.file)
		log_msg(LOG_INFO, "config", "settings from %s", d.cfg.file);
	else if (d.args.config_path)
		log_msg(LOG_INFO, "config", "%s does not exist: defaults and flags only",
		        d.args.config_path + 1);
	signal(SIGPIPE, SIG_IGN);
	uv_loop_init(&d.loop);
	/* Before any thread exists (it edits the environment); no-ops without systemd. */
	if (server_take_activation(&d.listen_fd) < 0 || notify_init(&d.loop) < 0) {
		d.exit_code = 1;
		goto out;
	}

	rc = d.cfg.memory_only ? 0 : make_dirs(d.cfg.state_dir); /* no store, no lock */
	if (rc < 0) {
		log_msg(LOG_ERROR, "main", "cannot create state directory %s: %s", d.cfg.state_dir,
			strerror(-rc));
		d.exit_code = 1;
		goto out;
	}
	if ((!d.cfg.memory_only && lock_state_dir(&d) < 0) ||
	    (d.listen_fd < 0 && server_check_path(&d.cfg) < 0)) {
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
	/* Not counted as a reason to run: the loop ends with the other handles. */
	uv_async_init(&d.loop, &d.committed, on_committed);
	d.committed.data = &d;
	uv_unref((uv_handle_t *)&d.committed);
	if (d.store)
		store_set_wake(d.store, wake_loop, &d.committed);
	rc = server_start(&d.server, &d.loop, &d.cfg, &d.dispatch, d.listen_fd);
	d.listen_fd = -1; /* the server's now, even when it failed */
	if (rc < 0) {
		d.exit_code = 1;
		goto out;
	}
	uv_signal_init(&d.loop, &d.sigint);
	uv_signal_init(&d.loop, &d.sigterm);
	d.sigint.data = d.sigterm.data = &d;
	uv_signal_start(&d.sigint, on_signal, SIGINT);
	uv_signal_start(&d.sigterm, on_signal, SIGTERM);
	uv_signal_init(&d.loop, &d.sighup);
	d.sighup.data = &d;
	uv_signal_start(&d.sighup, on_sighup, SIGHUP);
	pthread_sigmask(SIG_UNBLOCK, &hup, NULL);
	uv_timer_init(&d.loop, &d.flush_timer);
	d.flush_timer.data = &d;
	uv_timer_start(&d.flush_timer, on_flush_timer, d.cfg.flush_interval_ms,
		       d.cfg.flush_interval_ms);
	d.dispatch.flush_soon = on_flush_soon;
	d.dispatch.flush_soon_arg = &d;
	uv_idle_init(&d.loop, &d.retry_idle);
	uv_timer_init(&d.loop, &d.retry_pause);
	d.retry_idle.data = d.retry_pause.data = &d;
	d.dispatch.retry_soon = on_retry_soon;
	d.dispatch.retry_soon_arg = &d;
	log_msg(LOG_INFO, "main", "convod %s ready (%s, durability %s)", CONVOD_VERSION,
		d.store ? "local store" : "memory only",
		store_durability_str((enum durability)d.cfg.durability));
	{
		char status[160];
		snprintf(status, sizeof(status), "Ready: %zu conversation%s restored, %s",
			 d.dispatch.reg.count, d.dispatch.reg.count == 1 ? "" : "s",
			 d.store ? "local store" : "memory only");
		notify_ready(status);
	}

	uv_run(&d.loop, UV_RUN_DEFAULT);
	log_flush_suppressed();
	log_msg(LOG_INFO, "main", "stopped");
out:
	if (d.listen_fd >= 0)
		close(d.listen_fd);
	notify_close();
	if (d.sink) {
		/* Start-up failed after the sink existed: close it on the loop. */
		sink_close(d.sink, 0, NULL, NULL);
		d.sink = NULL;
	}
	uv_run(&d.loop, UV_RUN_DEFAULT);
	/* What the flusher confirmed while draining is still in the open transaction. */
	if (d.store && store_in_transaction(d.store)) {
		size_t repairs = store_repairs_in_transaction(d.store);
		if (store_commit(d.store) < 0) {
			log_msg(LOG_WARN, "store",
			        "last commit failed: confirmed writes will be sent again");
			if (repairs)
				log_msg(LOG_ERROR, "store",
				        "that commit held %zu row%s of messages to look at again "
				        "after a write without an answer: those no earlier commit "
				        "wrote are lost, and the next start does not look at their "
				        "messages",
				        repairs, repairs == 1 ? "" : "s");
		}
	}
	/* The writer ends with the store: no wake after that. */
	store_close(d.store);
	d.store = NULL;
	if (uv_is_active((uv_handle_t *)&d.committed) || d.committed.loop) {
		uv_close((uv_handle_t *)&d.committed, NULL);
		uv_run(&d.loop, UV_RUN_DEFAULT);
	}
	if (uv_loop_close(&d.loop) != 0)
		log_msg(LOG_WARN, "main", "event loop closed with handles still open");
	dispatch_free(&d.dispatch);
	awsconf_free(&d.aws);
	ddbclient_global_cleanup();
	config_free(&d.cfg);
	config_args_free(&d.args);
	if (d.lock_fd >= 0)
		close(d.lock_fd);
	return d.exit_code;
}
