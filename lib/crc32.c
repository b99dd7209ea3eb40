/* CRC-32, reflected, polynomial 0x04C11DB7 (0xEDB88320 reflected), initial and final value
 * all ones: a table of 256 built once, one lookup a byte. */
#include "crc32.h"

#include <pthread.h>

static uint32_t table[256];
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void build(void)
{
	for (uint32_t i = 0; i < 256; i++) {
		uint32_t c = i;
		for (int k = 0; k < 8; k++)
			c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
		table[i] = c;
	}
}

uint32_t crc32_update(uint32_t crc, const void *p, size_t n)
{
	const unsigned char *b = p;

	pthread_once(&once, build);
	crc = ~crc;
	while (n--)
		crc = table[(crc ^ *b++) & 0xff] ^ (crc >> 8);
	return ~crc;
}
