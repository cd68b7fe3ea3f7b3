/*
 * The NFS tiers' test client (tests/nfs/nfs-test.sh, handle-spike.sh, failover.sh), on libnfs.
 *
 * File handles are what an NFS client holds across a server restart, so this client deals in
 * raw handles: it gets one (NFSv3 MOUNT + LOOKUP, or NFSv4 PUTROOTFH + LOOKUP + GETFH) and prints
 * it in hex; the driver keeps it in a file across events (ganesha restart, cache drop, remount,
 * crash) and hands it back, and each use opens a fresh connection to the server and sends the
 * handle as it is (NFSv3 GETATTR/READ/READDIR/WRITE/COMMIT on the handle, NFSv4 PUTFH in a new
 * COMPOUND from a client the server has never seen). The namespace operations use libnfs's
 * ordinary path API over NFSv3 or NFSv4.
 *
 * Usage: nfs-client SERVER COMMAND ARGS...
 *   ops EXPORT 3|4 DIR      make, write, rename, truncate, list and remove under EXPORT/DIR
 *   walk EXPORT 3|4 DIR     print "path d", "path l target" or
 *                           "path f size nlink mode mtime hex-content"
 *                           for everything under EXPORT/DIR
 *   mkdir EXPORT PATH, put EXPORT PATH TEXT, rename EXPORT FROM TO, unlink EXPORT PATH,
 *   link EXPORT FROM TO,
 *   chmod EXPORT PATH OCTAL one operation over NFSv3 (as root)
 *   putfile EXPORT 3|4 PATH  write standard input to EXPORT/PATH (created or truncated)
 *   cat EXPORT 3|4 PATH      write EXPORT/PATH to standard output
 *   tryput EXPORT 3|4 PATH TEXT
 *                           create (or truncate) and write EXPORT/PATH: "OK" or "ERR <errno name>"
 *   trycat EXPORT 3|4 PATH  read EXPORT/PATH (4 KiB at most): "OK <data>" or "ERR <errno name>"
 *   putas EXPORT UID PATH TEXT
 *                           create and write a file over NFSv3 as user and group UID:
 *                           "OK" or "ERR <errno name>"
 *   v3fh EXPORT PATH        the NFSv3 handle of EXPORT/PATH (hex)
 *   v4fh EXPORT PATH        the NFSv4 handle of EXPORT/PATH (hex)
 *   v3read FH               GETATTR + READ of a file handle: "OK <data>" or "ERR <status>"
 *   v3ls FH                 READDIR of a directory handle: "OK name..." (sorted, no . and ..)
 *   v3lookup FH NAME        LOOKUP of NAME in a directory handle: "OK <fileid>" or "ERR ..."
 *   v3fileid FH             GETATTR: "OK <fileid>"
 *   v3write FH DATA         WRITE UNSTABLE at offset 0, then COMMIT: "OK" or "ERR ..."
 *   v3wstamp FH VER FIRST N commit|nocommit
 *                           WRITE UNSTABLE of 4 KiB blocks FIRST.. stamped with their offset
 *                           and VER, then COMMIT or not: "OK wverf=HEX [cverf=HEX]"
 *   v3commit FH             COMMIT: "OK cverf=HEX" (the write verifier: a change says the
 *                           server lost uncommitted writes and the client must resend them)
 *   v3check FH VER FIRST N  READ of those blocks against their stamps: "OK good=G bad=B ..."
 *   v4read FH               PUTFH + READ (anonymous stateid): "OK <data>" or "ERR <status>"
 *   v4ls FH                 PUTFH + READDIR: "OK name..."
 * Exit status: 0 when the answer is OK or an NFS error (printed), 1 on a transport or usage error.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <nfsc/libnfs.h>
#include <nfsc/libnfs-raw.h>
#include <nfsc/libnfs-raw-mount.h>
#include <nfsc/libnfs-raw-nfs.h>
#include <nfsc/libnfs-raw-nfs4.h>

static const char *server;

static void die(const char *what, const char *why)
{
	fprintf(stderr, "nfs-client: %s: %s\n", what, why ? why : "(no reason)");
	exit(1);
}

/* --- handles in hex ------------------------------------------------------------------------ */

struct fh {
	unsigned len;
	char val[128];
};

static void fh_set(struct fh *fh, const char *val, unsigned len)
{
	if (len > sizeof(fh->val))
		die("file handle", "longer than 128 bytes");
	fh->len = len;
	memcpy(fh->val, val, len);
}

static void fh_print(const struct fh *fh)
{
	for (unsigned i = 0; i < fh->len; i++)
		printf("%02x", (unsigned char)fh->val[i]);
	printf("\n");
}

static struct fh fh_parse(const char *hex)
{
	struct fh fh;
	size_t n = strlen(hex);
	if (n % 2 || n / 2 > sizeof(fh.val) || n == 0)
		die("file handle", "not a hex string of 1 to 128 bytes");
	fh.len = n / 2;
	for (size_t i = 0; i < fh.len; i++) {
		unsigned b;
		if (sscanf(hex + 2 * i, "%2x", &b) != 1)
			die("file handle", "not hex");
		fh.val[i] = (char)b;
	}
	return fh;
}

/* --- waiting for one raw RPC --------------------------------------------------------------- */

struct call {
	int done;
	int status;
	char error[256];
	void (*copy)(struct call *, void *data);
	void *out;
};

static void called(struct rpc_context *rpc, int status, void *data, void *private_data)
{
	struct call *c = private_data;
	(void)rpc;
	c->done = 1;
	c->status = status;
	if (status == RPC_STATUS_SUCCESS) {
		if (c->copy)
			c->copy(c, data);
	} else {
		snprintf(c->error, sizeof(c->error), "%s",
			 status == RPC_STATUS_ERROR && data ? (char *)data : "cancelled");
	}
}

static void wait_for(struct rpc_context *rpc, struct call *c, const char *what)
{
	while (!c->done) {
		struct pollfd pfd = { .fd = rpc_get_fd(rpc), .events = rpc_which_events(rpc) };
		if (poll(&pfd, 1, 100) < 0)
			die(what, strerror(errno));
		if (rpc_service(rpc, pfd.revents) < 0)
			die(what, rpc_get_error(rpc));
	}
	if (c->status != RPC_STATUS_SUCCESS)
		die(what, c->error);
}

static struct rpc_context *connect_program(int program, int version)
{
	struct rpc_context *rpc = rpc_init_context();
	struct call c = { 0 };
	if (!rpc)
		die("rpc_init_context", "failed");
	if (rpc_connect_program_async(rpc, server, program, version, called, &c))
		die("connect", rpc_get_error(rpc));
	wait_for(rpc, &c, "connect");
	return rpc;
}

static struct rpc_context *connect_nfs4(void)
{
	struct rpc_context *rpc = rpc_init_context();
	struct call c = { 0 };
	if (!rpc)
		die("rpc_init_context", "failed");
	if (rpc_connect_async(rpc, server, 2049, called, &c))
		die("connect", rpc_get_error(rpc));
	wait_for(rpc, &c, "connect");
	return rpc;
}

static const char *nfsstat_name(int s)
{
	switch (s) {
	case 0: return "OK";
	case 1: return "PERM";
	case 2: return "NOENT";
	case 5: return "IO";
	case 13: return "ACCES";
	case 20: return "NOTDIR";
	case 21: return "ISDIR";
	case 22: return "INVAL";
	case 30: return "ROFS";
	case 70: return "STALE";
	case 10001: return "BADHANDLE";
	case 10020: return "FHEXPIRED";
	}
	return "OTHER";
}

static void print_err(int s)
{
	printf("ERR %s %d\n", nfsstat_name(s), s);
}

/* --- NFSv3 --------------------------------------------------------------------------------- */

static void copy_mnt(struct call *c, void *data)
{
	mountres3 *r = data;
	struct fh *fh = c->out;
	if (r->fhs_status != MNT3_OK) {
		c->status = RPC_STATUS_ERROR;
		snprintf(c->error, sizeof(c->error), "MOUNT status %d", r->fhs_status);
		return;
	}
	fh_set(fh, r->mountres3_u.mountinfo.fhandle.fhandle3_val,
	       r->mountres3_u.mountinfo.fhandle.fhandle3_len);
}

struct lookup_out {
	int status;
	struct fh fh;
	uint64_t fileid;
};

static void copy_lookup(struct call *c, void *data)
{
	LOOKUP3res *r = data;
	struct lookup_out *o = c->out;
	o->status = r->status;
	if (r->status == NFS3_OK) {
		fh_set(&o->fh, r->LOOKUP3res_u.resok.object.data.data_val,
		       r->LOOKUP3res_u.resok.object.data.data_len);
		if (r->LOOKUP3res_u.resok.obj_attributes.attributes_follow)
			o->fileid = r->LOOKUP3res_u.resok.obj_attributes.post_op_attr_u.attributes.fileid;
	}
}

static struct lookup_out v3_lookup(struct rpc_context *rpc, struct fh *dir, const char *name)
{
	struct lookup_out o = { 0 };
	struct call c = { .copy = copy_lookup, .out = &o };
	LOOKUP3args a = { 0 };
	a.what.dir.data.data_len = dir->len;
	a.what.dir.data.data_val = dir->val;
	a.what.name = (char *)name;
	if (rpc_nfs3_lookup_async(rpc, called, &a, &c))
		die("LOOKUP3", rpc_get_error(rpc));
	wait_for(rpc, &c, "LOOKUP3");
	return o;
}

static int cmd_v3fh(const char *export, const char *path)
{
	struct rpc_context *m = connect_program(MOUNT_PROGRAM, MOUNT_V3);
	struct fh fh;
	struct call c = { .copy = copy_mnt, .out = &fh };
	if (rpc_mount3_mnt_async(m, called, (char *)export, &c))
		die("MOUNT", rpc_get_error(m));
	wait_for(m, &c, "MOUNT");
	rpc_destroy_context(m);

	struct rpc_context *rpc = connect_program(NFS_PROGRAM, NFS_V3);
	char *p = strdup(path), *save = NULL;
	for (char *name = strtok_r(p, "/", &save); name; name = strtok_r(NULL, "/", &save)) {
		struct lookup_out o = v3_lookup(rpc, &fh, name);
		if (o.status != NFS3_OK) {
			print_err(o.status);
			return 0;
		}
		fh = o.fh;
	}
	free(p);
	fh_print(&fh);
	rpc_destroy_context(rpc);
	return 0;
}

struct getattr_out {
	int status;
	fattr3 attr;
};

static void copy_getattr(struct call *c, void *data)
{
	GETATTR3res *r = data;
	struct getattr_out *o = c->out;
	o->status = r->status;
	if (r->status == NFS3_OK)
		o->attr = r->GETATTR3res_u.resok.obj_attributes;
}

static struct getattr_out v3_getattr(struct rpc_context *rpc, struct fh *fh)
{
	struct getattr_out o = { 0 };
	struct call c = { .copy = copy_getattr, .out = &o };
	GETATTR3args a = { 0 };
	a.object.data.data_len = fh->len;
	a.object.data.data_val = fh->val;
	if (rpc_nfs3_getattr_async(rpc, called, &a, &c))
		die("GETATTR3", rpc_get_error(rpc));
	wait_for(rpc, &c, "GETATTR3");
	return o;
}

static int cmd_v3fileid(const char *hex)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_program(NFS_PROGRAM, NFS_V3);
	struct getattr_out g = v3_getattr(rpc, &fh);
	if (g.status != NFS3_OK)
		print_err(g.status);
	else
		printf("OK %llu\n", (unsigned long long)g.attr.fileid);
	rpc_destroy_context(rpc);
	return 0;
}

struct read_out {
	int status;
	unsigned len;
	char data[4096];
};

static void copy_read3(struct call *c, void *data)
{
	READ3res *r = data;
	struct read_out *o = c->out;
	o->status = r->status;
	if (r->status == NFS3_OK) {
		o->len = r->READ3res_u.resok.data.data_len;
		if (o->len > sizeof(o->data))
			o->len = sizeof(o->data);
		memcpy(o->data, r->READ3res_u.resok.data.data_val, o->len);
	}
}

static int cmd_v3read(const char *hex)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_program(NFS_PROGRAM, NFS_V3);
	struct getattr_out g = v3_getattr(rpc, &fh);
	if (g.status != NFS3_OK) {
		print_err(g.status);
		return 0;
	}
	struct read_out o = { 0 };
	struct call c = { .copy = copy_read3, .out = &o };
	READ3args a = { 0 };
	a.file.data.data_len = fh.len;
	a.file.data.data_val = fh.val;
	a.offset = 0;
	a.count = sizeof(o.data);
	if (rpc_nfs3_read_async(rpc, called, &a, &c))
		die("READ3", rpc_get_error(rpc));
	wait_for(rpc, &c, "READ3");
	if (o.status != NFS3_OK)
		print_err(o.status);
	else
		printf("OK %.*s\n", (int)o.len, o.data);
	rpc_destroy_context(rpc);
	return 0;
}

/* Names of one directory listing, sorted, without "." and "..". */
struct names {
	int status;
	int eof;
	uint64_t cookie;
	char cookieverf[8];
	int n;
	char *name[4096];
};

static void names_add(struct names *o, const char *name, unsigned len)
{
	if ((len == 1 && name[0] == '.') || (len == 2 && name[0] == '.' && name[1] == '.'))
		return;
	if (o->n < 4096)
		o->name[o->n++] = strndup(name, len);
}

static int cmp_names(const void *a, const void *b)
{
	return strcmp(*(char *const *)a, *(char *const *)b);
}

static void names_print(struct names *o)
{
	qsort(o->name, o->n, sizeof(o->name[0]), cmp_names);
	printf("OK");
	for (int i = 0; i < o->n; i++)
		printf(" %s", o->name[i]);
	printf("\n");
}

static void copy_readdir3(struct call *c, void *data)
{
	READDIR3res *r = data;
	struct names *o = c->out;
	o->status = r->status;
	if (r->status != NFS3_OK)
		return;
	memcpy(o->cookieverf, r->READDIR3res_u.resok.cookieverf, 8);
	for (entry3 *e = r->READDIR3res_u.resok.reply.entries; e; e = e->nextentry) {
		names_add(o, e->name, strlen(e->name));
		o->cookie = e->cookie;
	}
	o->eof = r->READDIR3res_u.resok.reply.eof;
}

static int cmd_v3ls(const char *hex)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_program(NFS_PROGRAM, NFS_V3);
	static struct names o;
	while (!o.eof) {
		struct call c = { .copy = copy_readdir3, .out = &o };
		READDIR3args a = { 0 };
		a.dir.data.data_len = fh.len;
		a.dir.data.data_val = fh.val;
		a.cookie = o.cookie;
		memcpy(a.cookieverf, o.cookieverf, 8);
		a.count = 8192;
		if (rpc_nfs3_readdir_async(rpc, called, &a, &c))
			die("READDIR3", rpc_get_error(rpc));
		wait_for(rpc, &c, "READDIR3");
		if (o.status != NFS3_OK) {
			print_err(o.status);
			return 0;
		}
	}
	names_print(&o);
	rpc_destroy_context(rpc);
	return 0;
}

static int cmd_v3lookup(const char *hex, const char *name)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_program(NFS_PROGRAM, NFS_V3);
	struct lookup_out o = v3_lookup(rpc, &fh, name);
	if (o.status != NFS3_OK)
		print_err(o.status);
	else
		printf("OK %llu\n", (unsigned long long)o.fileid);
	rpc_destroy_context(rpc);
	return 0;
}

struct write_out {
	int status;
	int committed;
	unsigned count;
	char verf[8];
};

static void copy_write3(struct call *c, void *data)
{
	WRITE3res *r = data;
	struct write_out *o = c->out;
	o->status = r->status;
	if (r->status == NFS3_OK) {
		o->committed = r->WRITE3res_u.resok.committed;
		o->count = r->WRITE3res_u.resok.count;
		memcpy(o->verf, r->WRITE3res_u.resok.verf, 8);
	}
}

static void copy_commit3(struct call *c, void *data)
{
	COMMIT3res *r = data;
	struct write_out *o = c->out;
	o->status = r->status;
	if (r->status == NFS3_OK)
		memcpy(o->verf, r->COMMIT3res_u.resok.verf, 8);
}

static int cmd_v3write(const char *hex, const char *text)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_program(NFS_PROGRAM, NFS_V3);
	struct write_out w = { 0 }, cm = { 0 };
	struct call c = { .copy = copy_write3, .out = &w };
	WRITE3args a = { 0 };
	a.file.data.data_len = fh.len;
	a.file.data.data_val = fh.val;
	a.offset = 0;
	a.count = strlen(text);
	a.stable = UNSTABLE;
	a.data.data_len = strlen(text);
	a.data.data_val = (char *)text;
	if (rpc_nfs3_write_async(rpc, called, &a, &c))
		die("WRITE3", rpc_get_error(rpc));
	wait_for(rpc, &c, "WRITE3");
	if (w.status != NFS3_OK) {
		print_err(w.status);
		return 0;
	}
	if (w.count != strlen(text))
		die("WRITE3", "short write");
	struct call c2 = { .copy = copy_commit3, .out = &cm };
	COMMIT3args ca = { 0 };
	ca.file.data.data_len = fh.len;
	ca.file.data.data_val = fh.val;
	if (rpc_nfs3_commit_async(rpc, called, &ca, &c2))
		die("COMMIT3", rpc_get_error(rpc));
	wait_for(rpc, &c2, "COMMIT3");
	if (cm.status != NFS3_OK) {
		print_err(cm.status);
		return 0;
	}
	/* A verifier that changed between WRITE and COMMIT means the server lost the write. */
	printf("OK write=%s verifier=%s\n",
	       w.committed == UNSTABLE ? "unstable" : w.committed == DATA_SYNC ? "data_sync" : "file_sync",
	       memcmp(w.verf, cm.verf, 8) ? "changed" : "same");
	rpc_destroy_context(rpc);
	return 0;
}

/* --- stamped blocks (tests/nfs/failover.sh) ------------------------------------------------
 * Block i of a file is 4 KiB of 32-byte records, each naming its own byte offset and a version:
 * "o=<offset> v=<version>" padded with dots to 31 bytes and a newline. A block read back says
 * which write put it there, so a lost or misplaced write is seen, not only a changed checksum. */

#define STAMP_BLOCK 4096

static void stamp(char *buf, unsigned long long block, unsigned version)
{
	for (unsigned r = 0; r < STAMP_BLOCK / 32; r++) {
		char *rec = buf + 32 * r;
		memset(rec, '.', 31);
		int n = snprintf(rec, 31, "o=%llu v=%u", block * STAMP_BLOCK + 32ULL * r, version);
		rec[n] = '.';
		rec[31] = '\n';
	}
}

static void hex8(const char *v, char *out)
{
	for (int i = 0; i < 8; i++)
		sprintf(out + 2 * i, "%02x", (unsigned char)v[i]);
}

static int v3_commit(struct rpc_context *rpc, struct fh *fh, char *verf_hex)
{
	struct write_out cm = { 0 };
	struct call c = { .copy = copy_commit3, .out = &cm };
	COMMIT3args ca = { 0 };
	ca.file.data.data_len = fh->len;
	ca.file.data.data_val = fh->val;
	if (rpc_nfs3_commit_async(rpc, called, &ca, &c))
		die("COMMIT3", rpc_get_error(rpc));
	wait_for(rpc, &c, "COMMIT3");
	if (cm.status == NFS3_OK)
		hex8(cm.verf, verf_hex);
	return cm.status;
}

/* v3wstamp FH VERSION FIRST N commit|nocommit: WRITE UNSTABLE of blocks FIRST..FIRST+N-1 stamped
 * with VERSION, then (commit) one COMMIT of the file. Prints "OK wverf=HEX" (the verifier of the
 * last WRITE; "changed" if the WRITEs' verifiers differed) and " cverf=HEX" after a COMMIT. */
static int cmd_v3wstamp(const char *hex, unsigned version, unsigned long long first, unsigned n,
			int commit)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_program(NFS_PROGRAM, NFS_V3);
	char buf[STAMP_BLOCK], wv[17] = "", cv[17] = "", prev[8];
	int changed = 0;
	for (unsigned i = 0; i < n; i++) {
		struct write_out w = { 0 };
		struct call c = { .copy = copy_write3, .out = &w };
		WRITE3args a = { 0 };
		stamp(buf, first + i, version);
		a.file.data.data_len = fh.len;
		a.file.data.data_val = fh.val;
		a.offset = (first + i) * STAMP_BLOCK;
		a.count = STAMP_BLOCK;
		a.stable = UNSTABLE;
		a.data.data_len = STAMP_BLOCK;
		a.data.data_val = buf;
		if (rpc_nfs3_write_async(rpc, called, &a, &c))
			die("WRITE3", rpc_get_error(rpc));
		wait_for(rpc, &c, "WRITE3");
		if (w.status != NFS3_OK) {
			print_err(w.status);
			return 0;
		}
		if (w.count != STAMP_BLOCK)
			die("WRITE3", "short write");
		if (i && memcmp(prev, w.verf, 8))
			changed = 1;
		memcpy(prev, w.verf, 8);
		hex8(w.verf, wv);
	}
	if (commit) {
		int s = v3_commit(rpc, &fh, cv);
		if (s != NFS3_OK) {
			print_err(s);
			return 0;
		}
	}
	printf("OK wverf=%s%s%s%s\n", changed ? "changed" : wv, commit ? " cverf=" : "", cv,
	       commit && strcmp(wv, cv) ? " (write and commit verifiers differ)" : "");
	rpc_destroy_context(rpc);
	return 0;
}

/* v3commit FH: COMMIT of the whole file: "OK cverf=HEX" or "ERR ...". */
static int cmd_v3commit(const char *hex)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_program(NFS_PROGRAM, NFS_V3);
	char cv[17] = "";
	int s = v3_commit(rpc, &fh, cv);
	if (s != NFS3_OK)
		print_err(s);
	else
		printf("OK cverf=%s\n", cv);
	rpc_destroy_context(rpc);
	return 0;
}

/* v3check FH VERSION FIRST N: READ of blocks FIRST..FIRST+N-1, each compared with its stamp of
 * VERSION: "OK good=G bad=B [blocks: i(what it holds) ...]" or "ERR ...". */
static int cmd_v3check(const char *hex, unsigned version, unsigned long long first, unsigned n)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_program(NFS_PROGRAM, NFS_V3);
	char want[STAMP_BLOCK], list[4096] = "";
	unsigned good = 0, bad = 0;
	for (unsigned i = 0; i < n; i++) {
		struct read_out o = { 0 };
		struct call c = { .copy = copy_read3, .out = &o };
		READ3args a = { 0 };
		a.file.data.data_len = fh.len;
		a.file.data.data_val = fh.val;
		a.offset = (first + i) * STAMP_BLOCK;
		a.count = STAMP_BLOCK;
		if (rpc_nfs3_read_async(rpc, called, &a, &c))
			die("READ3", rpc_get_error(rpc));
		wait_for(rpc, &c, "READ3");
		if (o.status != NFS3_OK) {
			print_err(o.status);
			return 0;
		}
		stamp(want, first + i, version);
		if (o.len == STAMP_BLOCK && !memcmp(o.data, want, STAMP_BLOCK)) {
			good++;
			continue;
		}
		bad++;
		size_t l = strlen(list);
		if (l < sizeof(list) - 64) {
			char head[24] = "";
			for (unsigned k = 0; k < o.len && k < 20 && o.data[k] != '.' && o.data[k] != '\n'; k++)
				head[k] = o.data[k] ? o.data[k] : '0';
			snprintf(list + l, sizeof(list) - l, " %llu(%u bytes: %s)", first + i, o.len,
				 head[0] ? head : "-");
		}
	}
	printf("OK good=%u bad=%u%s%s\n", good, bad, bad ? " blocks:" : "", list);
	rpc_destroy_context(rpc);
	return 0;
}

/* --- NFSv4: one COMPOUND on a fresh connection ---------------------------------------------- */

struct v4_out {
	int status; /* the COMPOUND's status (that of the first failing op) */
	struct fh fh;
	struct read_out rd;
	struct names *ls;
};

static void copy_compound(struct call *c, void *data)
{
	COMPOUND4res *r = data;
	struct v4_out *o = c->out;
	o->status = r->status;
	for (unsigned i = 0; i < r->resarray.resarray_len; i++) {
		nfs_resop4 *op = &r->resarray.resarray_val[i];
		switch (op->resop) {
		case OP_GETFH:
			if (op->nfs_resop4_u.opgetfh.status == NFS4_OK)
				fh_set(&o->fh, op->nfs_resop4_u.opgetfh.GETFH4res_u.resok4.object.nfs_fh4_val,
				       op->nfs_resop4_u.opgetfh.GETFH4res_u.resok4.object.nfs_fh4_len);
			break;
		case OP_READ:
			if (op->nfs_resop4_u.opread.status == NFS4_OK) {
				READ4resok *ok = &op->nfs_resop4_u.opread.READ4res_u.resok4;
				o->rd.len = ok->data.data_len < sizeof(o->rd.data) ? ok->data.data_len
										  : sizeof(o->rd.data);
				memcpy(o->rd.data, ok->data.data_val, o->rd.len);
			}
			break;
		case OP_READDIR:
			if (op->nfs_resop4_u.opreaddir.status == NFS4_OK) {
				READDIR4resok *ok = &op->nfs_resop4_u.opreaddir.READDIR4res_u.resok4;
				for (entry4 *e = ok->reply.entries; e; e = e->nextentry) {
					names_add(o->ls, e->name.utf8string_val, e->name.utf8string_len);
					o->ls->cookie = e->cookie;
				}
				memcpy(o->ls->cookieverf, ok->cookieverf, 8);
				o->ls->eof = ok->reply.eof;
			}
			break;
		default:
			break;
		}
	}
}

static struct v4_out compound(struct rpc_context *rpc, nfs_argop4 *ops, unsigned n, struct names *ls)
{
	struct v4_out o = { .ls = ls };
	struct call c = { .copy = copy_compound, .out = &o };
	COMPOUND4args a = { 0 };
	a.minorversion = 0;
	a.argarray.argarray_len = n;
	a.argarray.argarray_val = ops;
	if (rpc_nfs4_compound_async(rpc, called, &a, &c))
		die("COMPOUND", rpc_get_error(rpc));
	wait_for(rpc, &c, "COMPOUND");
	return o;
}

static void op_lookup(nfs_argop4 *op, char *name)
{
	op->argop = OP_LOOKUP;
	op->nfs_argop4_u.oplookup.objname.utf8string_len = strlen(name);
	op->nfs_argop4_u.oplookup.objname.utf8string_val = name;
}

static void op_putfh(nfs_argop4 *op, struct fh *fh)
{
	op->argop = OP_PUTFH;
	op->nfs_argop4_u.opputfh.object.nfs_fh4_len = fh->len;
	op->nfs_argop4_u.opputfh.object.nfs_fh4_val = fh->val;
}

static int cmd_v4fh(const char *export, const char *path)
{
	struct rpc_context *rpc = connect_nfs4();
	nfs_argop4 ops[64];
	unsigned n = 0;
	char *full = malloc(strlen(export) + strlen(path) + 2), *save = NULL;
	sprintf(full, "%s/%s", export, path);
	memset(ops, 0, sizeof(ops));
	ops[n++].argop = OP_PUTROOTFH;
	for (char *name = strtok_r(full, "/", &save); name && n < 62; name = strtok_r(NULL, "/", &save))
		op_lookup(&ops[n++], name);
	ops[n++].argop = OP_GETFH;
	struct v4_out o = compound(rpc, ops, n, NULL);
	if (o.status != NFS4_OK)
		print_err(o.status);
	else
		fh_print(&o.fh);
	rpc_destroy_context(rpc);
	return 0;
}

static int cmd_v4read(const char *hex)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_nfs4();
	nfs_argop4 ops[2];
	memset(ops, 0, sizeof(ops));
	op_putfh(&ops[0], &fh);
	ops[1].argop = OP_READ;
	/* The anonymous stateid (all zeros): a READ without OPEN. */
	ops[1].nfs_argop4_u.opread.offset = 0;
	ops[1].nfs_argop4_u.opread.count = 4096;
	struct v4_out o = compound(rpc, ops, 2, NULL);
	if (o.status != NFS4_OK)
		print_err(o.status);
	else
		printf("OK %.*s\n", (int)o.rd.len, o.rd.data);
	rpc_destroy_context(rpc);
	return 0;
}

static int cmd_v4ls(const char *hex)
{
	struct fh fh = fh_parse(hex);
	struct rpc_context *rpc = connect_nfs4();
	static struct names ls;
	uint32_t want[2] = { 1u << 20 /* FATTR4_FILEID */, 0 };
	while (!ls.eof) {
		nfs_argop4 ops[2];
		memset(ops, 0, sizeof(ops));
		op_putfh(&ops[0], &fh);
		ops[1].argop = OP_READDIR;
		READDIR4args *a = &ops[1].nfs_argop4_u.opreaddir;
		a->cookie = ls.cookie;
		memcpy(a->cookieverf, ls.cookieverf, 8);
		a->dircount = 8192;
		a->maxcount = 32768;
		a->attr_request.bitmap4_len = 1;
		a->attr_request.bitmap4_val = want;
		struct v4_out o = compound(rpc, ops, 2, &ls);
		if (o.status != NFS4_OK) {
			print_err(o.status);
			return 0;
		}
	}
	names_print(&ls);
	rpc_destroy_context(rpc);
	return 0;
}

/* --- namespace operations through libnfs's path API ----------------------------------------- */

static struct nfs_context *nfs_connect(const char *export, int version)
{
	struct nfs_context *nfs = nfs_init_context();
	if (!nfs)
		die("nfs_init_context", "failed");
	nfs_set_timeout(nfs, 20000);
	if (nfs_set_version(nfs, version == 4 ? NFS_V4 : NFS_V3))
		die("nfs_set_version", nfs_get_error(nfs));
	if (nfs_mount(nfs, server, export))
		die("nfs_mount", nfs_get_error(nfs));
	return nfs;
}

#define TRY(what, call)                                                         \
	do {                                                                    \
		if ((call) < 0)                                                 \
			die(what, nfs_get_error(nfs));                          \
	} while (0)

static void put(struct nfs_context *nfs, const char *path, const char *text)
{
	struct nfsfh *f;
	TRY(path, nfs_open2(nfs, path, O_CREAT | O_WRONLY | O_TRUNC, 0644, &f));
	TRY(path, nfs_write(nfs, f, strlen(text), text));
	TRY(path, nfs_close(nfs, f));
}

static int cmd_ops(const char *export, int version, const char *dir)
{
	struct nfs_context *nfs = nfs_connect(export, version);
	char p[512], q[512];
#define P(fmt, ...) (snprintf(p, sizeof(p), "%s/" fmt, dir, ##__VA_ARGS__), p)
#define Q(fmt, ...) (snprintf(q, sizeof(q), "%s/" fmt, dir, ##__VA_ARGS__), q)
	TRY("mkdir", nfs_mkdir(nfs, dir));
	TRY("mkdir", nfs_mkdir(nfs, P("a")));
	TRY("mkdir", nfs_mkdir(nfs, P("a/b")));
	TRY("mkdir", nfs_mkdir(nfs, P("gone")));
	put(nfs, P("a/b/one"), "first file, written through NFS");
	put(nfs, P("two"), "second file: to be truncated");
	put(nfs, P("three"), "third file: to be renamed");
	put(nfs, P("gone/x"), "removed with its directory");
	put(nfs, P("victim"), "removed");
	/* An overwrite in the middle of a file. */
	struct nfsfh *f;
	TRY("open", nfs_open(nfs, P("a/b/one"), O_WRONLY, &f));
	TRY("pwrite", nfs_pwrite(nfs, f, 6, 4, "FILE"));
	TRY("close", nfs_close(nfs, f));
	TRY("truncate", nfs_truncate(nfs, P("two"), 11));
	TRY("rename", nfs_rename(nfs, P("three"), Q("a/three-renamed")));
	TRY("rename", nfs_rename(nfs, P("a/b"), Q("b-moved")));
	TRY("unlink", nfs_unlink(nfs, P("victim")));
	TRY("chmod", nfs_chmod(nfs, P("two"), 0640));
	struct timeval times[2] = { { 1000000000, 0 }, { 1234567890, 0 } };
	TRY("utimes", nfs_utimes(nfs, P("a/three-renamed"), times));
	TRY("symlink", nfs_symlink(nfs, "a/three-renamed", P("link")));
	TRY("link", nfs_link(nfs, P("two"), Q("b-moved/two-again")));
	TRY("unlink", nfs_unlink(nfs, P("gone/x")));
	TRY("rmdir", nfs_rmdir(nfs, P("gone")));
	/* A listing through NFS must show what the operations left. */
	struct nfsdir *d;
	TRY("opendir", nfs_opendir(nfs, dir, &d));
	static struct names ls;
	for (struct nfsdirent *e; (e = nfs_readdir(nfs, d));)
		names_add(&ls, e->name, strlen(e->name));
	nfs_closedir(nfs, d);
	names_print(&ls);
	nfs_destroy_context(nfs);
	return 0;
}

static int cmp_rows(const void *a, const void *b)
{
	return strcmp(a, b);
}

static void walk(struct nfs_context *nfs, const char *root, const char *rel)
{
	char path[1024];
	snprintf(path, sizeof(path), "%s%s%s", root, *rel ? "/" : "", rel);
	struct nfsdir *d;
	TRY("opendir", nfs_opendir(nfs, path, &d));
	static char names[256][256];
	int n = 0;
	for (struct nfsdirent *e; (e = nfs_readdir(nfs, d));)
		if (strcmp(e->name, ".") && strcmp(e->name, "..") && n < 256)
			snprintf(names[n++], 256, "%s", e->name);
	nfs_closedir(nfs, d);
	qsort(names, n, 256, cmp_rows);
	char (*mine)[256] = malloc((size_t)n * 256);
	memcpy(mine, names, (size_t)n * 256);
	for (int i = 0; i < n; i++) {
		char r[1024], full[2048];
		snprintf(r, sizeof(r), "%s%s%s", rel, *rel ? "/" : "", mine[i]);
		snprintf(full, sizeof(full), "%s/%s", root, r);
		struct nfs_stat_64 st;
		TRY(full, nfs_lstat64(nfs, full, &st));
		if (S_ISLNK(st.nfs_mode)) {
			char target[1024];
			memset(target, 0, sizeof(target));
			TRY(full, nfs_readlink(nfs, full, target, sizeof(target) - 1));
			printf("%s l %s\n", r, target);
		} else if (S_ISDIR(st.nfs_mode)) {
			printf("%s d\n", r);
			walk(nfs, root, r);
		} else {
			struct nfsfh *f;
			char buf[4096];
			TRY(full, nfs_open(nfs, full, O_RDONLY, &f));
			int got = nfs_pread(nfs, f, 0, sizeof(buf), buf);
			if (got < 0)
				die(full, nfs_get_error(nfs));
			nfs_close(nfs, f);
			printf("%s f %llu %llu %o %llu ", r, (unsigned long long)st.nfs_size,
			       (unsigned long long)st.nfs_nlink, (unsigned)(st.nfs_mode & 07777),
			       (unsigned long long)st.nfs_mtime);
			for (int k = 0; k < got; k++)
				printf("%02x", (unsigned char)buf[k]);
			printf("\n");
		}
	}
	free(mine);
}

static int cmd_walk(const char *export, int version, const char *dir)
{
	struct nfs_context *nfs = nfs_connect(export, version);
	walk(nfs, dir, "");
	nfs_destroy_context(nfs);
	return 0;
}

static int cmd_one(const char *export, int argc, char **argv)
{
	struct nfs_context *nfs = nfs_connect(export, 3);
	const char *op = argv[0];
	if (!strcmp(op, "mkdir") && argc == 2)
		TRY("mkdir", nfs_mkdir(nfs, argv[1]));
	else if (!strcmp(op, "put") && argc == 3)
		put(nfs, argv[1], argv[2]);
	else if (!strcmp(op, "rename") && argc == 3)
		TRY("rename", nfs_rename(nfs, argv[1], argv[2]));
	else if (!strcmp(op, "unlink") && argc == 2)
		TRY("unlink", nfs_unlink(nfs, argv[1]));
	else if (!strcmp(op, "link") && argc == 3)
		TRY("link", nfs_link(nfs, argv[1], argv[2]));
	else if (!strcmp(op, "chmod") && argc == 3)
		TRY("chmod", nfs_chmod(nfs, argv[1], (int)strtol(argv[2], NULL, 8)));
	else
		die(op, "unknown command or wrong arguments");
	nfs_destroy_context(nfs);
	return 0;
}

static int cmd_putfile(const char *export, int version, const char *path)
{
	struct nfs_context *nfs = nfs_connect(export, version);
	struct nfsfh *f;
	static char buf[1 << 15];
	/* libnfs 4.0 cannot encode an NFSv4 WRITE of 4 KiB or more (its COMPOUND buffer). */
	size_t chunk = version == 4 ? 2048 : sizeof(buf);
	uint64_t off = 0;
	size_t n;
	TRY(path, nfs_open2(nfs, path, O_CREAT | O_WRONLY | O_TRUNC, 0644, &f));
	while ((n = fread(buf, 1, sizeof(buf), stdin)) > 0) {
		for (size_t done = 0; done < n;) {
			size_t len = n - done < chunk ? n - done : chunk;
			int w = nfs_pwrite(nfs, f, off + done, len, buf + done);
			if (w <= 0)
				die(path, nfs_get_error(nfs));
			done += (size_t)w;
		}
		off += n;
	}
	TRY(path, nfs_fsync(nfs, f));
	TRY(path, nfs_close(nfs, f));
	nfs_destroy_context(nfs);
	return 0;
}

static int cmd_cat(const char *export, int version, const char *path)
{
	struct nfs_context *nfs = nfs_connect(export, version);
	struct nfsfh *f;
	static char buf[1 << 15];
	uint64_t off = 0;
	int n;
	TRY(path, nfs_open(nfs, path, O_RDONLY, &f));
	while ((n = nfs_pread(nfs, f, off, sizeof(buf), buf)) > 0) {
		if (fwrite(buf, 1, (size_t)n, stdout) != (size_t)n)
			die("stdout", strerror(errno));
		off += (uint64_t)n;
	}
	if (n < 0)
		die(path, nfs_get_error(nfs));
	nfs_close(nfs, f);
	nfs_destroy_context(nfs);
	return 0;
}

static int cmd_putas(const char *export, int uid, const char *path, const char *text)
{
	struct nfs_context *nfs = nfs_init_context();
	struct nfsfh *f;
	if (!nfs)
		die("nfs_init_context", "failed");
	nfs_set_timeout(nfs, 20000);
	nfs_set_uid(nfs, uid);
	nfs_set_gid(nfs, uid);
	if (nfs_mount(nfs, server, export))
		die("nfs_mount", nfs_get_error(nfs));
	int err = nfs_open2(nfs, path, O_CREAT | O_WRONLY | O_TRUNC, 0644, &f);
	if (err == 0) {
		err = nfs_write(nfs, f, strlen(text), text);
		nfs_close(nfs, f);
	}
	if (err < 0)
		printf("ERR %s\n", strerrorname_np(-err) ? strerrorname_np(-err) : "?");
	else
		printf("OK\n");
	nfs_destroy_context(nfs);
	return 0;
}

/* Create (or truncate) and write EXPORT/PATH over NFSv3 or NFSv4: "OK" or "ERR <errno name>". */
static int cmd_tryput(const char *export, int version, const char *path, const char *text)
{
	struct nfs_context *nfs = nfs_connect(export, version);
	struct nfsfh *f;
	int err = nfs_open2(nfs, path, O_CREAT | O_WRONLY | O_TRUNC, 0644, &f);
	if (err == 0) {
		err = nfs_write(nfs, f, strlen(text), text);
		int closed = nfs_close(nfs, f);
		if (err >= 0 && closed < 0)
			err = closed;
	}
	if (err < 0)
		printf("ERR %s\n", strerrorname_np(-err) ? strerrorname_np(-err) : "?");
	else
		printf("OK\n");
	nfs_destroy_context(nfs);
	return 0;
}

/* Read EXPORT/PATH (its first 4 KiB) over NFSv3 or NFSv4: "OK <data>" or "ERR <errno name>". */
static int cmd_trycat(const char *export, int version, const char *path)
{
	struct nfs_context *nfs = nfs_connect(export, version);
	struct nfsfh *f;
	char buf[4096];
	int n = nfs_open(nfs, path, O_RDONLY, &f);
	if (n == 0) {
		n = nfs_read(nfs, f, sizeof(buf), buf);
		nfs_close(nfs, f);
	}
	if (n < 0)
		printf("ERR %s\n", strerrorname_np(-n) ? strerrorname_np(-n) : "?");
	else
		printf("OK %.*s\n", n, buf);
	nfs_destroy_context(nfs);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc < 4) {
		fprintf(stderr, "usage: nfs-client SERVER COMMAND ARGS... (see the source)\n");
		return 1;
	}
	server = argv[1];
	const char *cmd = argv[2];
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (!strcmp(cmd, "ops") && argc == 6)
		return cmd_ops(argv[3], atoi(argv[4]), argv[5]);
	if (!strcmp(cmd, "walk") && argc == 6)
		return cmd_walk(argv[3], atoi(argv[4]), argv[5]);
	if (!strcmp(cmd, "putfile") && argc == 6)
		return cmd_putfile(argv[3], atoi(argv[4]), argv[5]);
	if (!strcmp(cmd, "cat") && argc == 6)
		return cmd_cat(argv[3], atoi(argv[4]), argv[5]);
	if (!strcmp(cmd, "tryput") && argc == 7)
		return cmd_tryput(argv[3], atoi(argv[4]), argv[5], argv[6]);
	if (!strcmp(cmd, "trycat") && argc == 6)
		return cmd_trycat(argv[3], atoi(argv[4]), argv[5]);
	if (!strcmp(cmd, "putas") && argc == 7)
		return cmd_putas(argv[3], atoi(argv[4]), argv[5], argv[6]);
	if (!strcmp(cmd, "mkdir") || !strcmp(cmd, "put") || !strcmp(cmd, "rename") ||
	    !strcmp(cmd, "unlink") || !strcmp(cmd, "chmod") || !strcmp(cmd, "link"))
		return argc < 5 ? 1 : cmd_one(argv[3], argc - 3, (char *[]){ argv[2], argv[4], argc > 5 ? argv[5] : NULL });
	if (!strcmp(cmd, "v3fh") && argc == 5)
		return cmd_v3fh(argv[3], argv[4]);
	if (!strcmp(cmd, "v4fh") && argc == 5)
		return cmd_v4fh(argv[3], argv[4]);
	if (!strcmp(cmd, "v3read") && argc == 4)
		return cmd_v3read(argv[3]);
	if (!strcmp(cmd, "v3ls") && argc == 4)
		return cmd_v3ls(argv[3]);
	if (!strcmp(cmd, "v3fileid") && argc == 4)
		return cmd_v3fileid(argv[3]);
	if (!strcmp(cmd, "v3lookup") && argc == 5)
		return cmd_v3lookup(argv[3], argv[4]);
	if (!strcmp(cmd, "v3write") && argc == 5)
		return cmd_v3write(argv[3], argv[4]);
	if (!strcmp(cmd, "v3wstamp") && argc == 8)
		return cmd_v3wstamp(argv[3], atoi(argv[4]), strtoull(argv[5], NULL, 10), atoi(argv[6]),
				    !strcmp(argv[7], "commit"));
	if (!strcmp(cmd, "v3commit") && argc == 4)
		return cmd_v3commit(argv[3]);
	if (!strcmp(cmd, "v3check") && argc == 7)
		return cmd_v3check(argv[3], atoi(argv[4]), strtoull(argv[5], NULL, 10), atoi(argv[6]));
	if (!strcmp(cmd, "v4read") && argc == 4)
		return cmd_v4read(argv[3]);
	if (!strcmp(cmd, "v4ls") && argc == 4)
		return cmd_v4ls(argv[3]);
	fprintf(stderr, "nfs-client: unknown command or wrong arguments: %s\n", cmd);
	return 1;
}
