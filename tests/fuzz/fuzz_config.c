/* Fuzz target for the config file parser (daemon/config.c, convod.conf(5)): the input is a
 * file's text. The parser must accept it or refuse it with a message, never crash; a file
 * it accepts must print (config_print, what --check-config shows) as text that parses back
 * to the very same settings. */
#include <errno.h>
#include <string.h>

#include "config.h"
#include "fuzz.h"
#include "log.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	static bool quiet;
	struct config cfg, again;
	char err[CONFIG_ERR_SIZE], err2[CONFIG_ERR_SIZE];
	char *text = NULL;
	size_t len = 0;
	FILE *f;
	int rc;

	if (!quiet) {
		log_set_level(LOG_ERROR);
		quiet = true;
	}
	if (size > CONFIG_MAX_FILE_BYTES)
		return 0; /* config_load refuses bigger files before parsing */
	config_defaults(&cfg);
	config_defaults(&again);
	err[0] = '\0';
	rc = config_parse_text(&cfg, "fuzz.conf", (const char *)data, size, err, sizeof(err));
	FUZZ_REQUIRE(rc == 0 || rc == -EINVAL, "config_parse_text returned %d (%s)", rc, err);
	FUZZ_REQUIRE(memchr(err, '\0', sizeof(err)), "the message is not terminated");
	if (rc < 0) {
		FUZZ_REQUIRE(err[0] && strncmp(err, "fuzz.conf", 9) == 0,
		             "a refusal that does not name the file: '%s'", err);
		goto out;
	}
	(void)config_validate(&cfg, err, sizeof(err));

	/* What config_print writes must read back to the same settings. */
	f = open_memstream(&text, &len);
	if (!f)
		abort();
	config_print(&cfg, f);
	if (fclose(f) != 0)
		abort();
	rc = config_parse_text(&again, "printed", text, len, err2, sizeof(err2));
	FUZZ_REQUIRE(rc == 0, "the printed settings do not parse: %s\n%s", err2, text);
	for (size_t i = 0; config_setting_key(i); i++) {
		char a[8192], b[8192];
		config_format_value(&cfg, i, a, sizeof(a));
		config_format_value(&again, i, b, sizeof(b));
		FUZZ_REQUIRE(strcmp(a, b) == 0, "%s: '%s' printed, '%s' read back",
		             config_setting_key(i), a, b);
		FUZZ_REQUIRE(config_setting_index(config_setting_key(i)) == (int)i,
		             "setting %zu: index and key disagree", i);
	}
out:
	free(text);
	config_free(&cfg);
	config_free(&again);
	return 0;
}
