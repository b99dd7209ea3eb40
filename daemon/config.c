/* The daemon's settings: defaults and command-line parsing. */
#include "config.h"

#include "store.h"

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void config_defaults(struct config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->socket_path = "/run/convod/convod.sock";
	cfg->state_dir = "/var/lib/convod";
	cfg->max_line_bytes = 1024 * 1024;
	cfg->max_output_bytes = 8 * 1024 * 1024;
	cfg->max_connections = 1024;
	cfg->max_conversations = 1000000;
	cfg->max_messages = 100000;
	cfg->max_conversation_bytes = 64 * 1024 * 1024;
	cfg->max_conversation_id_bytes = 256;
	cfg->log_level = LOG_INFO;
	cfg->durability = DURABILITY_PROCESS;
	cfg->dynamodb_table = "convod";
	cfg->flush_interval_ms = 1000;
	cfg->idle_ms = 30000;
	cfg->batch_items = 25;
	cfg->retry_base_ms = 100;
	cfg->retry_max_ms = 30000;
	cfg->spool_max_items = 1000000;
	cfg->expires_days = 0;
	cfg->closed_retention_days = 30;
	cfg->drain_ms = 5000;
}

void config_usage(const char *prog)
{
	struct config d;
	config_defaults(&d);
	printf("Usage: %s [OPTIONS]\n"
	       "Keeps LLM conversations for voice assistants; clients speak newline-delimited JSON\n"
	       "over a Unix socket (protocol v1).\n\n"
	       "  --socket PATH                    listening socket (default %s)\n"
	       "  --state-dir DIR                  state directory (default %s)\n"
	       "  --max-line-bytes N               longest request line (default %zu)\n"
	       "  --max-output-bytes N             queued output per connection before reading\n"
	       "                                   pauses (default %zu)\n"
	       "  --max-connections N              concurrent connections (default %zu)\n"
	       "  --max-conversations N            conversations in memory (default %zu)\n"
	       "  --max-messages N                 messages per conversation (default %zu)\n"
	       "  --max-conversation-bytes N       content bytes per conversation (default %zu)\n"
	       "  --max-conversation-id-bytes N    conversation id length (default %zu)\n"
	       "  --log-level debug|info|warn|error (default %s)\n"
	       "Persistence:\n"
	       "  --durability process|machine|none  when an answer is sent (default %s)\n"
	       "  --memory-only                    no local store: nothing survives a restart\n"
	       "  --dynamodb-table NAME            DynamoDB table when AWS_REGION or an\n"
	       "                                   endpoint is set (default %s)\n"
	       "  --create-table                   create the table at start (development)\n"
	       "  --flush-interval MS              flusher period (default %llu)\n"
	       "  --idle-ms MS                     idle time before the last message is\n"
	       "                                   flushed too (default %llu)\n"
	       "  --batch-items N                  items per BatchWriteItem, 1-25 (default %zu)\n"
	       "  --retry-base-ms MS               first retry backoff cap (default %llu)\n"
	       "  --retry-max-ms MS                largest retry backoff cap (default %llu)\n"
	       "  --spool-max-items N              unsent items before mutating requests are\n"
	       "                                   refused with unavailable (default %zu)\n"
	       "  --expires-days N                 DynamoDB TTL attribute 'expires', 0 = none\n"
	       "                                   (default %u)\n"
	       "  --closed-retention-days N        closed conversations kept locally (default %u)\n"
	       "  --drain-ms MS                    at shutdown, time left to send the spool\n"
	       "                                   (default %llu)\n"
	       "  --help                           this text\n"
	       "  --version                        the version\n",
	       prog, d.socket_path, d.state_dir, d.max_line_bytes, d.max_output_bytes,
	       d.max_connections, d.max_conversations, d.max_messages, d.max_conversation_bytes,
	       d.max_conversation_id_bytes, log_level_str(d.log_level),
	       store_durability_str((enum durability)d.durability), d.dynamodb_table,
	       (unsigned long long)d.flush_interval_ms, (unsigned long long)d.idle_ms,
	       d.batch_items, (unsigned long long)d.retry_base_ms,
	       (unsigned long long)d.retry_max_ms, d.spool_max_items, d.expires_days,
	       d.closed_retention_days, (unsigned long long)d.drain_ms);
}

static int parse_size(const char *flag, const char *s, size_t min, size_t *out)
{
	char *end = NULL;
	uintmax_t v;

	if (!s || *s < '0' || *s > '9')
		goto bad;
	errno = 0;
	v = strtoumax(s, &end, 10);
	if (errno || *end || v > SIZE_MAX || v < min)
		goto bad;
	*out = (size_t)v;
	return 0;
bad:
	fprintf(stderr, "convod: %s: expected an integer >= %zu, got '%s'\n", flag, min,
		s ? s : "");
	return -EINVAL;
}

enum {
	OPT_SOCKET = 256,
	OPT_STATE_DIR,
	OPT_MAX_LINE,
	OPT_MAX_OUTPUT,
	OPT_MAX_CONNECTIONS,
	OPT_MAX_CONVERSATIONS,
	OPT_MAX_MESSAGES,
	OPT_MAX_CONV_BYTES,
	OPT_MAX_ID_BYTES,
	OPT_LOG_LEVEL,
	OPT_HELP,
	OPT_VERSION,
	OPT_DURABILITY,
	OPT_MEMORY_ONLY,
	OPT_TABLE,
	OPT_CREATE_TABLE,
	OPT_FLUSH_INTERVAL,
	OPT_IDLE_MS,
	OPT_BATCH_ITEMS,
	OPT_RETRY_BASE,
	OPT_RETRY_MAX,
	OPT_SPOOL_MAX,
	OPT_EXPIRES_DAYS,
	OPT_CLOSED_RETENTION,
	OPT_DRAIN_MS,
};

static int parse_u64(const char *flag, const char *s, uint64_t min, uint64_t max, uint64_t *out)
{
	size_t v;
	if (parse_size(flag, s, (size_t)min, &v) < 0)
		return -EINVAL;
	if ((uint64_t)v > max) {
		fprintf(stderr, "convod: %s: expected at most %llu, got '%s'\n", flag,
			(unsigned long long)max, s);
		return -EINVAL;
	}
	*out = v;
	return 0;
}

int config_parse_args(struct config *cfg, int argc, char **argv, enum config_action *action)
{
	static const struct option opts[] = {
		{"socket", required_argument, NULL, OPT_SOCKET},
		{"state-dir", required_argument, NULL, OPT_STATE_DIR},
		{"max-line-bytes", required_argument, NULL, OPT_MAX_LINE},
		{"max-output-bytes", required_argument, NULL, OPT_MAX_OUTPUT},
		{"max-connections", required_argument, NULL, OPT_MAX_CONNECTIONS},
		{"max-conversations", required_argument, NULL, OPT_MAX_CONVERSATIONS},
		{"max-messages", required_argument, NULL, OPT_MAX_MESSAGES},
		{"max-conversation-bytes", required_argument, NULL, OPT_MAX_CONV_BYTES},
		{"max-conversation-id-bytes", required_argument, NULL, OPT_MAX_ID_BYTES},
		{"log-level", required_argument, NULL, OPT_LOG_LEVEL},
		{"help", no_argument, NULL, OPT_HELP},
		{"version", no_argument, NULL, OPT_VERSION},
		{"durability", required_argument, NULL, OPT_DURABILITY},
		{"memory-only", no_argument, NULL, OPT_MEMORY_ONLY},
		{"dynamodb-table", required_argument, NULL, OPT_TABLE},
		{"create-table", no_argument, NULL, OPT_CREATE_TABLE},
		{"flush-interval", required_argument, NULL, OPT_FLUSH_INTERVAL},
		{"idle-ms", required_argument, NULL, OPT_IDLE_MS},
		{"batch-items", required_argument, NULL, OPT_BATCH_ITEMS},
		{"retry-base-ms", required_argument, NULL, OPT_RETRY_BASE},
		{"retry-max-ms", required_argument, NULL, OPT_RETRY_MAX},
		{"spool-max-items", required_argument, NULL, OPT_SPOOL_MAX},
		{"expires-days", required_argument, NULL, OPT_EXPIRES_DAYS},
		{"closed-retention-days", required_argument, NULL, OPT_CLOSED_RETENTION},
		{"drain-ms", required_argument, NULL, OPT_DRAIN_MS},
		{NULL, 0, NULL, 0},
	};
	int c, rc = 0;

	*action = CONFIG_RUN;
	opterr = 0;
	optind = 1;
	while ((c = getopt_long(argc, argv, ":", opts, NULL)) != -1) {
		switch (c) {
		case OPT_SOCKET:
			if (!*optarg) {
				fprintf(stderr, "convod: --socket: expected a path\n");
				return -EINVAL;
			}
			cfg->socket_path = optarg;
			break;
		case OPT_STATE_DIR:
			if (!*optarg) {
				fprintf(stderr, "convod: --state-dir: expected a directory\n");
				return -EINVAL;
			}
			cfg->state_dir = optarg;
			break;
		case OPT_MAX_LINE:
			rc = parse_size("--max-line-bytes", optarg, 64, &cfg->max_line_bytes);
			break;
		case OPT_MAX_OUTPUT:
			rc = parse_size("--max-output-bytes", optarg, 1024, &cfg->max_output_bytes);
			break;
		case OPT_MAX_CONNECTIONS:
			rc = parse_size("--max-connections", optarg, 1, &cfg->max_connections);
			break;
		case OPT_MAX_CONVERSATIONS:
			rc = parse_size("--max-conversations", optarg, 1, &cfg->max_conversations);
			break;
		case OPT_MAX_MESSAGES:
			rc = parse_size("--max-messages", optarg, 2, &cfg->max_messages);
			break;
		case OPT_MAX_CONV_BYTES:
			rc = parse_size("--max-conversation-bytes", optarg, 1,
					&cfg->max_conversation_bytes);
			break;
		case OPT_MAX_ID_BYTES:
			rc = parse_size("--max-conversation-id-bytes", optarg, 1,
					&cfg->max_conversation_id_bytes);
			break;
		case OPT_LOG_LEVEL:
			if (log_level_parse(optarg, &cfg->log_level) < 0) {
				fprintf(stderr,
					"convod: --log-level: expected debug, info, warn or error, "
					"got '%s'\n",
					optarg);
				return -EINVAL;
			}
			break;
		case OPT_HELP:
			*action = CONFIG_HELP;
			break;
		case OPT_VERSION:
			*action = CONFIG_VERSION;
			break;
		case OPT_DURABILITY: {
			enum durability dur;
			if (store_durability_parse(optarg, &dur) < 0) {
				fprintf(stderr,
					"convod: --durability: expected process, machine or none, got "
					"'%s'\n",
					optarg);
				return -EINVAL;
			}
			cfg->durability = (int)dur;
			break;
		}
		case OPT_MEMORY_ONLY:
			cfg->memory_only = true;
			break;
		case OPT_TABLE:
			if (!*optarg) {
				fprintf(stderr, "convod: --dynamodb-table: expected a table name\n");
				return -EINVAL;
			}
			cfg->dynamodb_table = optarg;
			break;
		case OPT_CREATE_TABLE:
			cfg->create_table = true;
			break;
		case OPT_FLUSH_INTERVAL:
			rc = parse_u64("--flush-interval", optarg, 1, 3600000, &cfg->flush_interval_ms);
			break;
		case OPT_IDLE_MS:
			rc = parse_u64("--idle-ms", optarg, 0, UINT64_C(86400000), &cfg->idle_ms);
			break;
		case OPT_BATCH_ITEMS:
			rc = parse_size("--batch-items", optarg, 1, &cfg->batch_items);
			if (rc == 0 && cfg->batch_items > 25) {
				fprintf(stderr, "convod: --batch-items: at most 25 (DynamoDB's limit)\n");
				rc = -EINVAL;
			}
			break;
		case OPT_RETRY_BASE:
			rc = parse_u64("--retry-base-ms", optarg, 1, 3600000, &cfg->retry_base_ms);
			break;
		case OPT_RETRY_MAX:
			rc = parse_u64("--retry-max-ms", optarg, 1, 3600000, &cfg->retry_max_ms);
			break;
		case OPT_SPOOL_MAX:
			rc = parse_size("--spool-max-items", optarg, 1, &cfg->spool_max_items);
			break;
		case OPT_EXPIRES_DAYS: {
			uint64_t v = 0;
			rc = parse_u64("--expires-days", optarg, 0, 36500, &v);
			cfg->expires_days = (uint32_t)v;
			break;
		}
		case OPT_CLOSED_RETENTION: {
			uint64_t v = 0;
			rc = parse_u64("--closed-retention-days", optarg, 0, 36500, &v);
			cfg->closed_retention_days = (uint32_t)v;
			break;
		}
		case OPT_DRAIN_MS:
			rc = parse_u64("--drain-ms", optarg, 0, 3600000, &cfg->drain_ms);
			break;
		case ':':
			fprintf(stderr, "convod: %s: missing value\n", argv[optind - 1]);
			return -EINVAL;
		default:
			fprintf(stderr, "convod: unknown option '%s' (see --help)\n",
				argv[optind - 1]);
			return -EINVAL;
		}
		if (rc < 0)
			return rc;
	}
	if (optind < argc) {
		fprintf(stderr, "convod: unexpected argument '%s' (see --help)\n", argv[optind]);
		return -EINVAL;
	}
	return 0;
}
