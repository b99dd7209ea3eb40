/* Unit tests for daemon/awsconf: the environment and the shared files in a temporary HOME,
 * their precedence, the INI reader's rules and refusals, the endpoint and Host derived from
 * the settings, and a log line that never shows a secret. */
#include "awsconf.h"
#include "test.h"

#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define KEY_ID "AKIDEXAMPLE0000WXYZ"
#define SECRET "wJalrXUtnFEMI/K7MDENG+bPxRfiCYSECRETKEY"
#define TOKEN "FwoGZXIvYXdzEXAMPLETOKEN"

static char home[256];

static const char *const vars[] = {
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL_DYNAMODB",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_CONFIG_FILE",
    "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
};

static void env_clear(void)
{
	for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++)
		unsetenv(vars[i]);
	setenv("HOME", home, 1);
}

static void path_in_home(char *buf, size_t size, const char *name)
{
	snprintf(buf, size, "%s/%s", home, name);
}

static void write_file(const char *name, const char *text)
{
	char path[512];
	FILE *f;

	path_in_home(path, sizeof(path), name);
	f = fopen(path, "w");
	CHECK(f != NULL);
	if (!f)
		return;
	fputs(text, f);
	fclose(f);
}

static void remove_file(const char *name)
{
	char path[512];

	path_in_home(path, sizeof(path), name);
	unlink(path);
}

/* awsconf_load expecting success; the caller frees c. */
static void load_ok(struct awsconf *c)
{
	char err[AWSCONF_ERRBUF_SIZE] = "";
	int rc = awsconf_load(c, err);

	CHECK(rc == 0);
	if (rc != 0)
		fprintf(stderr, "  awsconf_load: %d %s\n", rc, err);
}

/* awsconf_load expecting rc; checks conf is left zeroed, the message holds want and none of
 * the secrets. */
static void load_fails(int want_rc, const char *want)
{
	char err[AWSCONF_ERRBUF_SIZE] = "";
	struct awsconf c, zero;
	int rc;

	memset(&c, 0x5a, sizeof(c));
	memset(&zero, 0, sizeof(zero));
	rc = awsconf_load(&c, err);
	CHECK(rc == want_rc);
	if (rc != want_rc)
		fprintf(stderr, "  awsconf_load: %d (wanted %d) %s\n", rc, want_rc, err);
	CHECK(memcmp(&c, &zero, sizeof(c)) == 0);
	CHECK(err[0] != '\0');
	CHECK(strstr(err, want) != NULL);
	if (!strstr(err, want))
		fprintf(stderr, "  message '%s' lacks '%s'\n", err, want);
	CHECK(strstr(err, SECRET) == NULL);
	CHECK(strstr(err, TOKEN) == NULL);
	CHECK(strstr(err, "s3cr3t") == NULL);
	awsconf_free(&c);
}

static void check_describe_safe(const struct awsconf *c)
{
	char line[512];

	awsconf_describe(c, line, sizeof(line));
	CHECK(strstr(line, SECRET) == NULL);
	CHECK(strstr(line, TOKEN) == NULL);
	if (c->access_key_id && strlen(c->access_key_id) > 4)
		CHECK(strstr(line, c->access_key_id) == NULL);
	if (c->secret_access_key)
		CHECK(strstr(line, c->secret_access_key) == NULL);
}

static void test_nothing(void)
{
	struct awsconf c;
	char buf[256], want[512];

	env_clear();
	load_ok(&c);
	CHECK(!awsconf_dynamodb_configured(&c));
	CHECK(!awsconf_has_credentials(&c));
	CHECK_STR(c.profile, "default");
	path_in_home(want, sizeof(want), ".aws/credentials");
	CHECK_STR(c.credentials_file, want);
	path_in_home(want, sizeof(want), ".aws/config");
	CHECK_STR(c.config_file, want);
	CHECK(c.region == NULL && c.endpoint_url == NULL && c.access_key_id == NULL);
	CHECK(awsconf_endpoint(&c, buf, sizeof(buf)) == -ENOENT);
	CHECK(awsconf_host(&c, buf, sizeof(buf)) == -ENOENT);
	CHECK_STR(awsconf_signing_region(&c), AWSCONF_DEFAULT_SIGNING_REGION);
	CHECK(strstr(awsconf_describe(&c, buf, sizeof(buf)), "not configured") != NULL);
	awsconf_free(&c);
	awsconf_free(&c); /* zeroed: freeing again is harmless */
	awsconf_free(NULL);

	/* empty variables count as unset */
	setenv("AWS_REGION", "", 1);
	setenv("AWS_ACCESS_KEY_ID", "", 1);
	load_ok(&c);
	CHECK(!awsconf_dynamodb_configured(&c) && !awsconf_has_credentials(&c));
	awsconf_free(&c);
}

static void test_env(void)
{
	struct awsconf c;
	char buf[512];

	env_clear();
	setenv("AWS_DEFAULT_REGION", "eu-west-1", 1);
	setenv("AWS_ACCESS_KEY_ID", KEY_ID, 1);
	setenv("AWS_SECRET_ACCESS_KEY", SECRET, 1);
	setenv("AWS_SESSION_TOKEN", TOKEN, 1);
	load_ok(&c);
	CHECK(awsconf_dynamodb_configured(&c) && awsconf_has_credentials(&c));
	CHECK_STR(c.region, "eu-west-1");
	CHECK(c.region_source == AWSCONF_ENV && c.credentials_source == AWSCONF_ENV);
	CHECK_STR(c.access_key_id, KEY_ID);
	CHECK_STR(c.secret_access_key, SECRET);
	CHECK_STR(c.session_token, TOKEN);
	CHECK(awsconf_endpoint(&c, buf, sizeof(buf)) == 0);
	CHECK_STR(buf, "https://dynamodb.eu-west-1.amazonaws.com");
	CHECK(awsconf_host(&c, buf, sizeof(buf)) == 0);
	CHECK_STR(buf, "dynamodb.eu-west-1.amazonaws.com");
	CHECK(awsconf_endpoint(&c, buf, 10) == -ENOSPC);
	CHECK(awsconf_host(&c, buf, 10) == -ENOSPC);
	awsconf_describe(&c, buf, sizeof(buf));
	CHECK(strstr(buf, "****WXYZ") != NULL);
	CHECK(strstr(buf, "session token") != NULL);
	CHECK(strstr(buf, "eu-west-1") != NULL);
	check_describe_safe(&c);
	/* cut to fit, still terminated */
	CHECK(strlen(awsconf_describe(&c, buf, 20)) == 19);
	awsconf_free(&c);

	/* AWS_REGION over AWS_DEFAULT_REGION; the dedicated endpoint over the global one */
	setenv("AWS_REGION", "us-west-2", 1);
	setenv("AWS_ENDPOINT_URL", "http://global.example:1", 1);
	setenv("AWS_ENDPOINT_URL_DYNAMODB", "http://127.0.0.1:8000/", 1);
	load_ok(&c);
	CHECK_STR(c.region, "us-west-2");
	CHECK_STR(c.endpoint_url, "http://127.0.0.1:8000/");
	CHECK(c.endpoint_source == AWSCONF_ENV);
	CHECK(awsconf_endpoint(&c, buf, sizeof(buf)) == 0);
	CHECK_STR(buf, "http://127.0.0.1:8000/");
	CHECK(awsconf_host(&c, buf, sizeof(buf)) == 0);
	CHECK_STR(buf, "127.0.0.1:8000");
	awsconf_free(&c);
	unsetenv("AWS_ENDPOINT_URL_DYNAMODB");
	load_ok(&c);
	CHECK_STR(c.endpoint_url, "http://global.example:1");
	awsconf_free(&c);

	/* an endpoint alone configures DynamoDB; the signing region falls back */
	env_clear();
	setenv("AWS_ENDPOINT_URL_DYNAMODB", "https://DDB.Example.com:443", 1);
	load_ok(&c);
	CHECK(awsconf_dynamodb_configured(&c));
	CHECK(!awsconf_has_credentials(&c));
	CHECK_STR(awsconf_signing_region(&c), AWSCONF_DEFAULT_SIGNING_REGION);
	CHECK(awsconf_host(&c, buf, sizeof(buf)) == 0);
	CHECK_STR(buf, "ddb.example.com");
	CHECK(strstr(awsconf_describe(&c, buf, sizeof(buf)), "no credentials") != NULL);
	awsconf_free(&c);
	setenv("AWS_ENDPOINT_URL_DYNAMODB", "http://[::1]:8123", 1);
	load_ok(&c);
	CHECK(awsconf_host(&c, buf, sizeof(buf)) == 0);
	CHECK_STR(buf, "[::1]:8123");
	awsconf_free(&c);
	setenv("AWS_ENDPOINT_URL_DYNAMODB", "http://localhost:80", 1);
	load_ok(&c);
	CHECK(awsconf_host(&c, buf, sizeof(buf)) == 0);
	CHECK_STR(buf, "localhost");
	awsconf_free(&c);
	setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true", 1);
	load_ok(&c);
	CHECK(c.endpoint_url == NULL && !awsconf_dynamodb_configured(&c));
	awsconf_free(&c);

	/* a short key id shows none of its characters */
	env_clear();
	setenv("AWS_REGION", "us-east-1", 1);
	setenv("AWS_ACCESS_KEY_ID", "ab12", 1);
	setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t", 1);
	load_ok(&c);
	awsconf_describe(&c, buf, sizeof(buf));
	CHECK(strstr(buf, "ab12") == NULL && strstr(buf, "s3cr3t") == NULL);
	CHECK(strstr(buf, "****") != NULL);
	awsconf_free(&c);
}

static void test_env_refused(void)
{
	static const char *const bad_endpoints[] = {
	    "ftp://host",        "http://",          "http://user:s3cr3t@host",
	    "http://host/path",  "http://host?x=1",  "http://host:0",
	    "http://host:65536", "http://host:",     "http://:80",
	    "http://ho st",      "host:8000",        "http://[::1",
	    "http://[::1]x",     "http://host#frag", "http://host:80a",
	};

	for (size_t i = 0; i < sizeof(bad_endpoints) / sizeof(bad_endpoints[0]); i++) {
		env_clear();
		setenv("AWS_ENDPOINT_URL_DYNAMODB", bad_endpoints[i], 1);
		load_fails(-EINVAL, "endpoint URL");
	}
	env_clear();
	setenv("AWS_REGION", "us east 1", 1);
	load_fails(-EINVAL, "region");
	setenv("AWS_REGION", "../x", 1);
	load_fails(-EINVAL, "region");

	env_clear();
	setenv("AWS_ACCESS_KEY_ID", KEY_ID, 1);
	load_fails(-EINVAL, "AWS_SECRET_ACCESS_KEY is not");
	env_clear();
	setenv("AWS_SECRET_ACCESS_KEY", SECRET, 1);
	load_fails(-EINVAL, "AWS_ACCESS_KEY_ID is not");
}

static const char credentials_text[] = "# shared credentials\n"
                                       "; another comment\n"
                                       "\n"
                                       "[default]\n"
                                       "aws_access_key_id = " KEY_ID "\n"
                                       "  aws_secret_access_key=" SECRET "   \n"
                                       "\n"
                                       "[work]\n"
                                       "AWS_Access_Key_Id : AKIDWORK00000001\n"
                                       "aws_secret_access_key = workSecret\n"
                                       "aws_session_token = " TOKEN "\n"
                                       "[both]\n"
                                       "aws_access_key_id = AKIDFROMCREDENTIALS\n"
                                       "aws_secret_access_key = fromCredentials\n"
                                       "[dup]\n"
                                       "aws_access_key_id = AKIDFIRST0000000\n"
                                       "aws_secret_access_key = first\n"
                                       "aws_access_key_id = AKIDSECOND000000\n";

static const char config_text[] = "[default]\n"
                                  "region = eu-central-1\n"
                                  "cli_pager = a multi-line\n"
                                  "   value continued\n"
                                  "output = json\n"
                                  "[profile   work  ]\n"
                                  "region=ap-south-1\n"
                                  "endpoint_url = http://localhost:9000\n"
                                  "s3 =\n"
                                  "  max_concurrent_requests = 10\n"
                                  "[profile cfgonly]\n"
                                  "aws_access_key_id = AKIDCONFIG000001\n"
                                  "aws_secret_access_key = configSecret\n"
                                  "[profile both]\n"
                                  "aws_access_key_id = AKIDFROMCONFIG00\n"
                                  "aws_secret_access_key = fromConfig\n"
                                  "region = sa-east-1\n"
                                  "[profile svc]\n"
                                  "region = us-east-2\n"
                                  "services = local\n"
                                  "endpoint_url = http://global.local:1\n"
                                  "[services local]\n"
                                  "dynamodb =\n"
                                  "  endpoint_url = http://ddb.local:8000\n"
                                  "s3 =\n"
                                  "  endpoint_url = http://s3.local:9000\n"
                                  "[profile empty]\n";

static void test_files(void)
{
	struct awsconf c;
	char buf[512];

	env_clear();
	path_in_home(buf, sizeof(buf), ".aws");
	mkdir(buf, 0700);
	write_file(".aws/credentials", credentials_text);
	write_file(".aws/config", config_text);

	load_ok(&c);
	CHECK_STR(c.access_key_id, KEY_ID);
	CHECK_STR(c.secret_access_key, SECRET);
	CHECK(c.session_token == NULL);
	CHECK(c.credentials_source == AWSCONF_CREDENTIALS_FILE);
	CHECK_STR(c.region, "eu-central-1");
	CHECK(c.region_source == AWSCONF_CONFIG_FILE);
	CHECK(c.endpoint_url == NULL);
	check_describe_safe(&c);
	awsconf_free(&c);

	/* a named profile: "[profile NAME]" in config, "[NAME]" in credentials; ':' works */
	setenv("AWS_PROFILE", "work", 1);
	load_ok(&c);
	CHECK_STR(c.profile, "work");
	CHECK_STR(c.access_key_id, "AKIDWORK00000001");
	CHECK_STR(c.secret_access_key, "workSecret");
	CHECK_STR(c.session_token, TOKEN);
	CHECK_STR(c.region, "ap-south-1");
	CHECK_STR(c.endpoint_url, "http://localhost:9000");
	CHECK(c.endpoint_source == AWSCONF_CONFIG_FILE);
	check_describe_safe(&c);
	awsconf_free(&c);

	/* the environment wins over the files */
	setenv("AWS_REGION", "us-west-1", 1);
	setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1234", 1);
	setenv("AWS_ACCESS_KEY_ID", "AKIDENV000000001", 1);
	setenv("AWS_SECRET_ACCESS_KEY", "envSecret", 1);
	load_ok(&c);
	CHECK_STR(c.region, "us-west-1");
	CHECK_STR(c.endpoint_url, "http://127.0.0.1:1234");
	CHECK_STR(c.access_key_id, "AKIDENV000000001");
	CHECK(c.session_token == NULL); /* the file's token does not go with the env's keys */
	CHECK(c.credentials_source == AWSCONF_ENV && c.region_source == AWSCONF_ENV);
	awsconf_free(&c);

	/* keys from the config file when the credentials file has none; the credentials file
	 * wins when both have them */
	env_clear();
	setenv("AWS_PROFILE", "cfgonly", 1);
	load_ok(&c);
	CHECK_STR(c.access_key_id, "AKIDCONFIG000001");
	CHECK(c.credentials_source == AWSCONF_CONFIG_FILE);
	CHECK(c.region == NULL);
	awsconf_free(&c);
	setenv("AWS_PROFILE", "both", 1);
	load_ok(&c);
	CHECK_STR(c.access_key_id, "AKIDFROMCREDENTIALS");
	CHECK_STR(c.secret_access_key, "fromCredentials");
	CHECK_STR(c.region, "sa-east-1");
	awsconf_free(&c);

	/* a later line wins */
	setenv("AWS_PROFILE", "dup", 1);
	load_ok(&c);
	CHECK_STR(c.access_key_id, "AKIDSECOND000000");
	awsconf_free(&c);

	/* nested settings: the services section's dynamodb endpoint beats the profile's */
	setenv("AWS_PROFILE", "svc", 1);
	load_ok(&c);
	CHECK_STR(c.endpoint_url, "http://ddb.local:8000");
	CHECK_STR(c.region, "us-east-2");
	CHECK(!awsconf_has_credentials(&c));
	awsconf_free(&c);

	/* an empty section exists; an unknown profile does not */
	setenv("AWS_PROFILE", "empty", 1);
	load_ok(&c);
	CHECK(!awsconf_dynamodb_configured(&c) && !awsconf_has_credentials(&c));
	awsconf_free(&c);
	setenv("AWS_PROFILE", "nosuch", 1);
	load_fails(-EINVAL, "nosuch");
	setenv("AWS_ACCESS_KEY_ID", KEY_ID, 1);
	setenv("AWS_SECRET_ACCESS_KEY", SECRET, 1);
	load_ok(&c); /* nothing needed from the profile */
	awsconf_free(&c);

	/* other file locations, "~/" expanded; missing files are no error */
	env_clear();
	setenv("AWS_SHARED_CREDENTIALS_FILE", "~/creds-elsewhere", 1);
	setenv("AWS_CONFIG_FILE", "~/no-such-config", 1);
	write_file("creds-elsewhere", "[default]\naws_access_key_id=AKIDELSEWHERE001\n"
	                              "aws_secret_access_key=elsewhere\n");
	load_ok(&c);
	path_in_home(buf, sizeof(buf), "creds-elsewhere");
	CHECK_STR(c.credentials_file, buf);
	CHECK_STR(c.access_key_id, "AKIDELSEWHERE001");
	CHECK(c.region == NULL);
	awsconf_free(&c);
	remove_file("creds-elsewhere");

	/* no HOME: no default files, nothing fails */
	env_clear();
	unsetenv("HOME");
	setenv("AWS_REGION", "us-east-1", 1);
	load_ok(&c);
	CHECK(c.credentials_file == NULL && c.config_file == NULL);
	CHECK(!awsconf_has_credentials(&c));
	awsconf_free(&c);
}

static void test_files_refused(void)
{
	char path[512], *big;

	env_clear();
	setenv("AWS_SHARED_CREDENTIALS_FILE", "~/bad", 1);

	write_file("bad", "[default]\naws_access_key_id = " KEY_ID "\ns3cr3t-in-a-bad-line\n");
	load_fails(-EINVAL, "bad:3:");
	write_file("bad", "aws_secret_access_key = s3cr3t\n[default]\n");
	load_fails(-EINVAL, "bad:1: setting before");
	write_file("bad", "[default\naws_access_key_id = x\n");
	load_fails(-EINVAL, "bad:1:");
	write_file("bad", "[   ]\n");
	load_fails(-EINVAL, "bad:1:");
	write_file("bad", "[default]\n= s3cr3t\n");
	load_fails(-EINVAL, "bad:2:");
	write_file("bad", "[default]\naws_access_key_id = " KEY_ID "\n");
	load_fails(-EINVAL, "without aws_secret_access_key");
	write_file("bad", "[default]\naws_secret_access_key = s3cr3t\n");
	load_fails(-EINVAL, "without aws_access_key_id");

	big = malloc(AWSCONF_MAX_FILE_BYTES + 2);
	CHECK(big != NULL);
	if (big) {
		memset(big, '#', AWSCONF_MAX_FILE_BYTES + 1);
		big[AWSCONF_MAX_FILE_BYTES + 1] = '\0';
		write_file("bad", big);
		load_fails(-EFBIG, "larger than");
		/* exactly at the limit is fine (one long comment line) */
		big[AWSCONF_MAX_FILE_BYTES] = '\0';
		write_file("bad", big);
		struct awsconf c;
		load_ok(&c);
		awsconf_free(&c);
		free(big);
	}
	remove_file("bad");

	path_in_home(path, sizeof(path), "adir");
	mkdir(path, 0700);
	setenv("AWS_SHARED_CREDENTIALS_FILE", path, 1);
	load_fails(-EISDIR, "directory");
	rmdir(path);

	/* the config file is read with the same rules */
	env_clear();
	setenv("AWS_CONFIG_FILE", "~/badconfig", 1);
	write_file("badconfig", "[default]\nregion = us_east_1\n");
	load_fails(-EINVAL, "region from config file");
	write_file("badconfig", "[default]\nendpoint_url = http://h/p\n");
	load_fails(-EINVAL, "endpoint URL from config file");
	remove_file("badconfig");
}

int main(void)
{
	char tmpl[] = "/tmp/test_awsconf.XXXXXX", path[512];

	if (!mkdtemp(tmpl)) {
		perror("mkdtemp");
		return 1;
	}
	snprintf(home, sizeof(home), "%s", tmpl);
	test_nothing();
	test_env();
	test_env_refused();
	test_files();
	test_files_refused();

	remove_file(".aws/credentials");
	remove_file(".aws/config");
	path_in_home(path, sizeof(path), ".aws");
	rmdir(path);
	rmdir(home);
	return test_done("awsconf");
}
