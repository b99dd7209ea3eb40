/* Where every AWS client looks for its settings: the environment, then the shared
 * credentials and config files of a profile. Gives the daemon its DynamoDB endpoint, region
 * and credentials, and a description of them that is safe to log. */
#ifndef CONVOD_AWSCONF_H
#define CONVOD_AWSCONF_H

#include <stdbool.h>
#include <stddef.h>

#define AWSCONF_ERRBUF_SIZE 256
#define AWSCONF_MAX_FILE_BYTES (1024 * 1024) /* a bigger credentials or config file is refused */
#define AWSCONF_DEFAULT_SIGNING_REGION "us-east-1"

/* Where a setting was found. */
enum awsconf_source {
	AWSCONF_NONE = 0,
	AWSCONF_ENV,
	AWSCONF_CREDENTIALS_FILE,
	AWSCONF_CONFIG_FILE,
};

/* Every string is owned by the struct (awsconf_free) and NULL when not set. */
struct awsconf {
	char *profile;          /* AWS_PROFILE, else "default" */
	char *credentials_file; /* AWS_SHARED_CREDENTIALS_FILE, else ~/.aws/credentials */
	char *config_file;      /* AWS_CONFIG_FILE, else ~/.aws/config */
	char *region;           /* AWS_REGION, AWS_DEFAULT_REGION, then the config file */
	char *endpoint_url;     /* AWS_ENDPOINT_URL_DYNAMODB, AWS_ENDPOINT_URL, then the config
	                         * file; NULL = the region's public endpoint */
	char *access_key_id;    /* with secret_access_key: both set or both NULL */
	char *secret_access_key;
	char *session_token;
	enum awsconf_source region_source, endpoint_source, credentials_source;
};

/* Fills conf from the environment and the files (the environment wins; for credentials the
 * credentials file wins over the config file). A missing file is no error. On failure conf
 * is left zeroed and errbuf says why (never holding a secret). conf is the caller's; free
 * it with awsconf_free. 0, -EINVAL (a malformed file, a bad endpoint URL or region, half a
 * key pair, an explicit AWS_PROFILE found nowhere), -EFBIG, -ENOMEM or another -errno of
 * reading a file. */
int awsconf_load(struct awsconf *conf, char errbuf[AWSCONF_ERRBUF_SIZE]);

/* Frees the strings of conf (the secret is wiped first) and zeroes it; accepts NULL. */
void awsconf_free(struct awsconf *conf);

/* For a start whose awsconf_load failed: whether DynamoDB is wanted all the same, as far as
 * can be told: a region or an endpoint in the environment, or in AWS_PROFILE's section of
 * the config file if that can be read. */
bool awsconf_dynamodb_wanted(void);

/* DynamoDB is configured when an endpoint or a region is set. */
bool awsconf_dynamodb_configured(const struct awsconf *conf);

/* Both halves of a key pair are set. */
bool awsconf_has_credentials(const struct awsconf *conf);

/* Region to sign with: the configured one, else AWSCONF_DEFAULT_SIGNING_REGION (an explicit
 * endpoint without a region, e.g. a local server). Borrowed from conf or static. */
const char *awsconf_signing_region(const struct awsconf *conf);

/* URL to POST to: the explicit endpoint, else https://dynamodb.REGION.amazonaws.com.
 * NUL-terminated into buf. 0, -ENOENT (not configured) or -ENOSPC. */
int awsconf_endpoint(const struct awsconf *conf, char *buf, size_t size);

/* Host header value for that URL: host[:port], the port left out when it is the scheme's
 * default. 0, -ENOENT or -ENOSPC. */
int awsconf_host(const struct awsconf *conf, char *buf, size_t size);

/* One line for logs: endpoint, region, profile and the credentials' origin, with only the
 * last 4 characters of the access key id and never the secret or the token. Returns buf
 * (always NUL-terminated, cut to fit). */
const char *awsconf_describe(const struct awsconf *conf, char *buf, size_t size);

/* "env", "credentials file", "config file" or "none"; static. */
const char *awsconf_source_str(enum awsconf_source s);

#endif
