// Baseline for convod's DynamoDB sink: the sustained items/s that the AWS SDK for
// JavaScript v3 (BatchWriteItemCommand, 25 items per call, N calls in flight) reaches
// against a DynamoDB-compatible endpoint (dynalite in tests), with items shaped like
// convod's (persistence.md). UnprocessedItems are sent again; only confirmed items count.
//
//   DYNAMODB_ENDPOINT=http://127.0.0.1:PORT node tests/bench/sdk_batchwrite.mjs \
//       [--seconds 10] [--concurrency 20] [--warmup 1] [--table NAME] [--content-bytes 100]
//
// Needs `npm ci --prefix tests`. Prints one JSON line, then "items/s: N".
import {
	BatchWriteItemCommand,
	CreateTableCommand,
	DeleteTableCommand,
	DescribeTableCommand,
	DynamoDBClient,
} from '@aws-sdk/client-dynamodb';

function parseArgs(argv) {
	const opts = { seconds: 10, concurrency: 20, warmup: 1, table: '', contentBytes: 100 };
	const names = {
		'--seconds': 'seconds',
		'--concurrency': 'concurrency',
		'--warmup': 'warmup',
		'--table': 'table',
		'--content-bytes': 'contentBytes',
	};
	for (let i = 0; i < argv.length; i++) {
		const key = names[argv[i]];
		if (!key || i + 1 >= argv.length) {
			console.error(`usage: sdk_batchwrite.mjs [--seconds S] [--concurrency N] [--warmup S] [--table NAME] [--content-bytes N] (bad argument ${argv[i]})`);
			process.exit(2);
		}
		const v = argv[++i];
		if (key === 'table') {
			opts.table = v;
		} else {
			opts[key] = Number(v);
			if (!Number.isFinite(opts[key]) || opts[key] < 0) {
				console.error(`sdk_batchwrite.mjs: ${argv[i - 1]} needs a number >= 0, not ${v}`);
				process.exit(2);
			}
		}
	}
	if (opts.seconds <= 0 || opts.concurrency < 1) {
		console.error('sdk_batchwrite.mjs: --seconds must be > 0 and --concurrency >= 1');
		process.exit(2);
	}
	return opts;
}

const opts = parseArgs(process.argv.slice(2));
const endpoint = process.env.DYNAMODB_ENDPOINT || process.env.AWS_ENDPOINT_URL_DYNAMODB ||
	process.env.AWS_ENDPOINT_URL;
if (!endpoint) {
	console.error('sdk_batchwrite.mjs: set DYNAMODB_ENDPOINT (e.g. http://127.0.0.1:4567)');
	process.exit(2);
}

const client = new DynamoDBClient({
	endpoint,
	region: process.env.AWS_REGION || process.env.AWS_DEFAULT_REGION || 'us-east-1',
	credentials: {
		accessKeyId: process.env.AWS_ACCESS_KEY_ID || 'AKIDCONVODBENCH',
		secretAccessKey: process.env.AWS_SECRET_ACCESS_KEY || 'convod-bench-secret',
	},
});

const createdTable = !opts.table;
const table = opts.table || `convod-bench-${process.pid}-${Date.now()}`;

async function ensureTable() {
	try {
		await client.send(new CreateTableCommand({
			TableName: table,
			AttributeDefinitions: [
				{ AttributeName: 'conversation', AttributeType: 'S' },
				{ AttributeName: 'sk', AttributeType: 'S' },
			],
			KeySchema: [
				{ AttributeName: 'conversation', KeyType: 'HASH' },
				{ AttributeName: 'sk', KeyType: 'RANGE' },
			],
			BillingMode: 'PAY_PER_REQUEST',
		}));
	} catch (e) {
		if (e.name !== 'ResourceInUseException')
			throw e;
	}
	for (;;) {
		const d = await client.send(new DescribeTableCommand({ TableName: table }));
		if (d.Table.TableStatus === 'ACTIVE')
			return;
		await new Promise((r) => setTimeout(r, 50));
	}
}

// Message ids: 26 characters in ULID's alphabet, increasing with seq.
const ALPHABET = '0123456789ABCDEFGHJKMNPQRSTVWXYZ';
function messageId(seq) {
	let s = '';
	for (let n = seq, i = 0; i < 16; i++, n = Math.floor(n / 32))
		s = ALPHABET[n % 32] + s;
	return '01J' + 'B'.repeat(7) + s;
}

const filler = 'x'.repeat(opts.contentBytes);
let seq = 0;
function nextItem() {
	const n = seq++;
	const id = messageId(n);
	const now = Date.now();
	return {
		conversation: { S: `bench-conv-${n % 1000}` },
		sk: { S: id },
		id: { S: id },
		message: { M: { role: { S: n % 2 ? 'assistant' : 'user' }, contents: { L: [{ S: filler }] } } },
		metadata: { M: { timing: { M: { creation: { N: String(now) } } } } },
		version: { N: '1' },
		updated: { N: String(now) },
	};
}

const stats = { items: 0, calls: 0, unprocessedRetries: 0, errors: 0, latencies: [] };
let measuring = false;

async function worker(deadline) {
	while (Date.now() < deadline) {
		let requests = { [table]: Array.from({ length: 25 }, () => ({ PutRequest: { Item: nextItem() } })) };
		while (requests && Date.now() < deadline) {
			const sent = requests[table].length;
			const t0 = process.hrtime.bigint();
			let out;
			try {
				out = await client.send(new BatchWriteItemCommand({ RequestItems: requests }));
			} catch (e) {
				stats.errors++;
				if (stats.errors <= 3)
					console.error(`BatchWriteItem failed: ${e.name}: ${e.message}`);
				await new Promise((r) => setTimeout(r, 10));
				continue; // same requests again
			}
			const ms = Number(process.hrtime.bigint() - t0) / 1e6;
			const back = out.UnprocessedItems && out.UnprocessedItems[table];
			const left = back ? back.length : 0;
			if (measuring) {
				stats.calls++;
				stats.items += sent - left;
				stats.latencies.push(ms);
				if (left)
					stats.unprocessedRetries++;
			}
			requests = left ? out.UnprocessedItems : null;
		}
	}
}

function pct(sorted, p) {
	if (!sorted.length)
		return 0;
	return sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))];
}

async function main() {
	await ensureTable();
	const start = Date.now();
	const end = start + (opts.warmup + opts.seconds) * 1000;
	const workers = Array.from({ length: opts.concurrency }, () => worker(end));
	await new Promise((r) => setTimeout(r, opts.warmup * 1000));
	measuring = true;
	const t0 = process.hrtime.bigint();
	await Promise.all(workers);
	measuring = false;
	const secs = Number(process.hrtime.bigint() - t0) / 1e9;
	if (createdTable)
		await client.send(new DeleteTableCommand({ TableName: table })).catch(() => {});
	const lat = stats.latencies.sort((a, b) => a - b);
	const itemsPerSec = stats.items / secs;
	console.log(JSON.stringify({
		bench: 'sdk_batchwrite',
		sdk: '@aws-sdk/client-dynamodb',
		endpoint,
		concurrency: opts.concurrency,
		seconds: Number(secs.toFixed(3)),
		items: stats.items,
		calls: stats.calls,
		items_per_s: Math.round(itemsPerSec),
		call_ms: { p50: +pct(lat, 0.5).toFixed(2), p99: +pct(lat, 0.99).toFixed(2) },
		unprocessed_retries: stats.unprocessedRetries,
		errors: stats.errors,
	}));
	console.log(`items/s: ${Math.round(itemsPerSec)}`);
	client.destroy();
	if (stats.items === 0)
		process.exit(1);
}

main().catch((e) => {
	console.error(`sdk_batchwrite.mjs: ${e.name}: ${e.message}`);
	process.exit(1);
});
