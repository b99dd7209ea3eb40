/* Replays fuzz inputs without libFuzzer: every file named on the command line, or every
 * regular file of a directory named there, goes once through LLVMFuzzerTestOneInput. The
 * normal test run uses it to replay each target's corpus under the sanitizers. */
#include <dirent.h>
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fuzz.h"

/* Reads the whole file; caller frees *out (never NULL on success, even when empty). */
static int read_all(const char *path, uint8_t **out, size_t *len)
{
	FILE *f = fopen(path, "rb");
	uint8_t *data = NULL;
	size_t cap = 0, n = 0;
	int rc = 0;

	if (!f)
		return -errno;
	for (;;) {
		size_t got;
		if (cap - n < 4096) {
			size_t ncap = cap ? 2 * cap : 65536;
			uint8_t *p = realloc(data, ncap);
			if (!p) {
				rc = -ENOMEM;
				goto out;
			}
			data = p;
			cap = ncap;
		}
		got = fread(data + n, 1, cap - n, f);
		n += got;
		if (got == 0) {
			if (ferror(f))
				rc = -EIO;
			break;
		}
	}
out:
	fclose(f);
	if (rc < 0) {
		free(data);
		return rc;
	}
	*out = data;
	*len = n;
	return 0;
}

static int replay_file(const char *path)
{
	uint8_t *data = NULL;
	size_t len = 0;
	int rc = read_all(path, &data, &len);

	if (rc < 0) {
		fprintf(stderr, "%s: %s\n", path, strerror(-rc));
		return rc;
	}
	LLVMFuzzerTestOneInput(data, len);
	free(data);
	return 0;
}

static int cmp_names(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Every regular file of dir, in name order so that a failure is reproducible. */
static int replay_dir(const char *dir, size_t *count)
{
	DIR *d = opendir(dir);
	struct dirent *e;
	char **names = NULL;
	size_t n = 0, cap = 0;
	int rc = 0;

	if (!d) {
		fprintf(stderr, "%s: %s\n", dir, strerror(errno));
		return -errno;
	}
	while ((e = readdir(d))) {
		size_t len = strlen(dir) + strlen(e->d_name) + 2;
		struct stat st;
		char *path;

		if (e->d_name[0] == '.')
			continue;
		path = malloc(len);
		if (!path) {
			rc = -ENOMEM;
			goto out;
		}
		snprintf(path, len, "%s/%s", dir, e->d_name);
		if (stat(path, &st) < 0 || !S_ISREG(st.st_mode)) {
			free(path);
			continue;
		}
		if (n == cap) {
			size_t ncap = cap ? 2 * cap : 64;
			char **p = realloc(names, ncap * sizeof(*p));
			if (!p) {
				free(path);
				rc = -ENOMEM;
				goto out;
			}
			names = p;
			cap = ncap;
		}
		names[n++] = path;
	}
	if (n)
		qsort(names, n, sizeof(*names), cmp_names);
	for (size_t i = 0; i < n && rc == 0; i++) {
		rc = replay_file(names[i]);
		if (rc == 0)
			(*count)++;
	}
out:
	for (size_t i = 0; i < n; i++)
		free(names[i]);
	free(names);
	closedir(d);
	return rc;
}

int main(int argc, char **argv)
{
	size_t count = 0;

	if (argc < 2) {
		fprintf(stderr, "usage: %s CORPUS_DIR_OR_FILE...\n", argv[0]);
		return 2;
	}
	for (int i = 1; i < argc; i++) {
		struct stat st;
		int rc;

		if (stat(argv[i], &st) < 0) {
			fprintf(stderr, "%s: %s\n", argv[i], strerror(errno));
			return 1;
		}
		if (S_ISDIR(st.st_mode)) {
			rc = replay_dir(argv[i], &count);
		} else {
			rc = replay_file(argv[i]);
			if (rc == 0)
				count++;
		}
		if (rc < 0)
			return 1;
	}
	if (count == 0) {
		fprintf(stderr, "no input replayed\n");
		return 1;
	}
	printf("replayed %zu inputs\n", count);
	return 0;
}
