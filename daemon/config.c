/* The daemon's settings: defaults and command-line parsing. */
#include "config.h"

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
	       "  --help                           this text\n"
	       "  --version                        the version\n",
	       prog, d.socket_path, d.state_dir, d.max_line_bytes, d.max_output_bytes,
	       d.max_connections, d.max_conversations, d.max_messages, d.max_conversation_bytes,
	       d.max_conversation_id_bytes, log_level_str(d.log_level));
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
};

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
