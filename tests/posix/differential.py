#!/usr/bin/env python3
"""Differential test: one seeded random sequence of system calls, applied identically to a
birchfs mount and to a directory of a kernel file system (ext4 on a loop device), compared.

Story: pjdfstest checks fixed scenarios and fsx checks one file's data; neither checks that
long, random mixes of namespace, data, xattr and descriptor operations leave birchfs in the
same state as a kernel file system, with the same errno at every step. This script does:

  * every step: draw ONE operation (side-independent parameters), apply it to the reference
    tree first and to the birch tree second, compare the result or errno; then lstat/fstat
    the objects the operation touched on both sides and compare type, mode, size, nlink,
    inode identity (the birch inode that pairs with an ext4 inode never changes), and for
    mtime/ctime whether they changed since they were last looked at (see ALLOWED_DIFFERENCES);
  * every --check-every steps and at the end: compare the whole trees: names, types, sizes,
    contents, modes, nlink, symlink targets, user.* xattrs, hard-link groups, mtime/ctime
    change, and on each side that readdir's d_ino (os.scandir inode()) equals lstat st_ino.

The namespace is tiny (5 names, 3 levels), so ENOENT, EEXIST, ENOTDIR, EISDIR, ENOTEMPTY,
EINVAL, ELOOP... happen often. Python 3.11 standard library only.

  differential.py --ref DIR --birch DIR [--seed S] [--ops N] [--check-every N]

Both DIRs must exist and be empty (the script works inside them). Prints the seed; `--seed`
replays. Exit 0: identical; 1: a mismatch (the op history tail and a replay command are
printed); 2: usage.
"""

import argparse
import errno
import os
import random
import stat
import sys
import time
import zlib

# ---------------------------------------------------------------------------------------------
# Allowed differences: what is NOT compared, or compared more weakly, and why. Everything not
# listed here is compared exactly.
# ---------------------------------------------------------------------------------------------
ALLOWED_DIFFERENCES = [
    ("st_dev, st_ino values",
     "different file systems; only identity is compared: hard-link groups must match, the "
     "pairing ext4 inode <-> birch inode of an object never changes (ext4 reuses freed inode "
     "numbers, birch never does, so a fresh ext4 pairing after a delete is accepted), and on "
     "each side readdir d_ino == lstat st_ino"),
    ("directory st_size and st_blocks, every st_blocks, st_blksize",
     "allocation policy: ext4 directories are multiples of 4096 bytes, birch reports the entry "
     "count; block counts depend on allocation (delalloc, preallocation, metadata blocks)"),
    ("atime",
     "relatime decisions and page-cache reads that never reach a FUSE server; atime is "
     "compared only right after utime set it explicitly"),
    ("mtime/ctime values",
     "clocks differ: compared as 'changed since last observed, or not' (ext4 on Linux >= 6.13 "
     "has multigrain timestamps: a change after an observation always gives a new value), and "
     "exactly after utime with explicit nanoseconds"),
    ("SEEK_DATA/SEEK_HOLE offsets on files that were ever fallocated",
     "ext4 reports unwritten (preallocated, not yet written) extents as holes, birch counts "
     "preallocated ranges as data (docs/SEMANTICS.md); such answers are only checked for "
     "validity on each side (a hole reads as zeros, ENXIO exactly past EOF)"),
    ("ctime after setxattr of the value already there",
     "ext4 skips such a set entirely (ext4_xattr_set_entry: same value, no change, no ctime "
     "update); birch, like tmpfs and xfs, updates ctime; accepted only in that direction and "
     "only for the object of that setxattr"),
    ("mtime/ctime of a regular file after truncate to its own size or fallocate (writeback cache)",
     "with FUSE's writeback cache (birch's default) the kernel owns a regular file's mtime and "
     "ctime and ignores the server's; it moves them on writes and size changes but not for a "
     "truncate that keeps the size or a fallocate, where ext4 does (docs/SEMANTICS.md §1). "
     "Accepted only for those operations, only in that direction; BIRCH_DIFF_WRITEBACK=0 "
     "(a mount with writeback=off) turns the allowance off"),
    ("mtime/ctime within one clock tick",
     "birch stamps times from the kernel's coarse clock (a jiffy, at most 10 ms), as the kernel "
     "itself does for a regular file under the writeback cache, so that a time the kernel "
     "stamps is never before one birch stamped earlier (docs/SEMANTICS.md §1); without "
     "multigrain timestamps two changes within one tick give one value where ext4 (Linux "
     ">= 6.13) gives two; accepted only when birch's unchanged value is less than a tick older "
     "than ext4's new one, only in that direction, for every kind of object"),
    ("statvfs: everything but f_namemax",
     "capacity and block size belong to each image; f_namemax must be 255 on both"),
    ("xattrs other than user.*",
     "only user.* names are generated; the kernel may add security.* or system.* ones"),
]

# Small namespace: errors happen often.
NAMES = ["a", "b", "c", "d0", "d1"]
XATTR_NAMES = ["user.x", "user.y", "user.long." + "n" * 40]
MAX_FILE = 4 << 20          # keeps whole-tree content compares cheap
SLOTS = 8                   # open descriptors per side
WORK_SUBDIR = "up2/up1/w"
# Multigrain timestamps (Linux 6.13): a change after an observed ctime always gets a new value.
# Before that, two changes within one clock tick look like one, so ext4 "unchanged" proves
# nothing and only "changed on ext4, unchanged on birch" is reported.
_KV = tuple(int(x) for x in os.uname().release.split("-")[0].split(".")[:2] if x.isdigit())
WRITEBACK_CACHE = os.environ.get("BIRCH_DIFF_WRITEBACK", "1") != "0"
# The kernel stamps a regular file's times itself under the writeback cache, from its coarse
# clock (one jiffy, at most 10 ms) and without multigrain timestamps (FUSE has no FS_MGTIME).
COARSE_TICK_NS = 10_000_000
MULTIGRAIN = _KV >= (6, 13)   # the operations' root, below the given directory

OPEN_ACC = [os.O_RDONLY, os.O_WRONLY, os.O_RDWR]
OPEN_EXTRA = [os.O_CREAT, os.O_EXCL, os.O_TRUNC, os.O_APPEND, os.O_DIRECTORY, os.O_NOFOLLOW]


class Mismatch(Exception):
    pass


def fmt_err(e):
    return errno.errorcode.get(e, str(e))


def call(fn, *a, **kw):
    """('ok', value) or ('err', ERRNAME)."""
    try:
        return ("ok", fn(*a, **kw))
    except OSError as e:
        return ("err", fmt_err(e.errno))


class Side:
    def __init__(self, name, top):
        self.name = name
        # Symlink targets climb at most two levels ("../../x"); the operations work two levels
        # below TOP, so whatever they create through such a symlink (open O_CREAT follows a
        # dangling one) stays inside TOP, which the whole-tree compare walks.
        self.top = top.rstrip("/")
        self.root = self.top + "/" + WORK_SUBDIR
        self.fds = [None] * SLOTS
        self.times = {}      # ino -> (mtime_ns, ctime_ns) last observed

    def p(self, rel):
        return self.root + "/" + rel if rel else self.root


def ftype(mode):
    for t, n in ((stat.S_ISREG, "reg"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "lnk"),
                 (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "sock"), (stat.S_ISCHR, "chr"),
                 (stat.S_ISBLK, "blk")):
        if t(mode):
            return n
    return "?"


def stat_view(st):
    """The comparable part of a stat result."""
    t = ftype(st.st_mode)
    return (t, oct(stat.S_IMODE(st.st_mode)), st.st_size if t != "dir" else None, st.st_nlink)


class Differential:
    def __init__(self, ref, birch, seed, ops, check_every, verbose):
        self.R = Side("ext4", ref)
        self.B = Side("birch", birch)
        self.seed = seed
        self.nops = ops
        self.check_every = check_every
        self.verbose = verbose
        self.rng = random.Random(seed)
        self.hist = []
        self.step = 0
        self.e2b = {}
        self.b2e = {}
        self.fallocated = set()   # birch inos ever fallocated (SEEK_DATA/HOLE allowance)
        self.slot_info = [None] * SLOTS   # (path, flags, is_dir) as opened on the ref side
        self.counts = {}
        self.same_xattr = None
        self.trace = open(os.environ["DIFF_TRACE"], "w") if os.environ.get("DIFF_TRACE") else None

    # ------------------------------------------------------------------ random parameters
    def rpath(self, depth=None):
        r = self.rng
        if depth is None:
            depth = r.choices([1, 2, 3], [50, 35, 15])[0]
        return "/".join(r.choice(NAMES) for _ in range(depth))

    def rparent_path(self):
        # a path whose parent is likely to exist
        return self.rpath()

    def rdata(self):
        r = self.rng
        n = r.choices([0, r.randint(1, 100), r.randint(1, 4096), r.randint(4096, 65536)],
                      [2, 50, 35, 13])[0]
        kind = r.random()
        if kind < 0.15:
            return bytes(n)          # zeros: data, not a hole
        return r.randbytes(n)

    def roff(self):
        r = self.rng
        return r.choices([0, r.randint(0, 8192), r.randint(0, 1 << 20),
                          r.randint(0, MAX_FILE - 65536), r.randrange(0, MAX_FILE, 4096)],
                         [10, 35, 25, 15, 15])[0]

    def rmode(self, dir_=False):
        r = self.rng
        base = r.choice([0o644, 0o600, 0o755, 0o700, 0o444, 0o000, 0o777, 0o640])
        if r.random() < 0.1:
            base |= r.choice([0o4000, 0o2000, 0o1000, 0o6000])
        return base

    def rtarget(self):
        r = self.rng
        k = r.random()
        if k < 0.6:
            t = self.rpath(r.choice([1, 1, 2]))
        elif k < 0.8:
            t = "../" + self.rpath(1)
        elif k < 0.9:
            t = r.choice([".", "..", "../..", "x" * r.randint(1, 300), "nonexistent/x"])
        else:
            t = "/".join([".."] * r.randint(1, 2) + [r.choice(NAMES)])
        return t

    def gen(self):
        """One operation as a tuple of side-independent parameters."""
        r = self.rng
        open_slots = [i for i in range(SLOTS) if self.slot_info[i] is not None]
        free_slots = [i for i in range(SLOTS) if self.slot_info[i] is None]
        reg_slots = [i for i in open_slots if not self.slot_info[i][2]]
        w = {
            "open": 14 if free_slots else 0, "close": 5 if open_slots else 0,
            "write": 10 if open_slots else 0, "pwrite": 14 if open_slots else 0,
            "read": 5 if open_slots else 0, "pread": 6 if open_slots else 0,
            "lseek": 3 if reg_slots else 0, "ftruncate": 5 if open_slots else 0,
            "truncate": 2, "fsync": 2 if open_slots else 0, "fdatasync": 2 if open_slots else 0,
            "fstat": 3 if open_slots else 0, "fallocate": 4 if open_slots else 0,
            "seek_data": 4 if reg_slots else 0, "seek_hole": 4 if reg_slots else 0,
            "mkdir": 8, "rmdir": 5, "unlink": 6, "rename": 9, "link": 5, "symlink": 5,
            "readlink": 3, "chmod": 4, "utime": 4, "setxattr": 5, "getxattr": 3,
            "listxattr": 2, "removexattr": 3, "statvfs": 1, "stat": 4, "listdir": 3,
            "longname": 1, "copy_file_range": 3 if open_slots else 0,
        }
        ops = [k for k, v in w.items() if v]
        op = r.choices(ops, [w[k] for k in ops])[0]
        slot = r.choice(open_slots) if open_slots else None
        if op == "open":
            flags = r.choice(OPEN_ACC)
            for f, pr in zip(OPEN_EXTRA, [0.6, 0.2, 0.2, 0.2, 0.05, 0.05]):
                if r.random() < pr:
                    flags |= f
            return ("open", self.rpath(), flags, self.rmode(), r.choice(free_slots))
        if op == "close":
            return ("close", slot)
        if op == "write":
            return ("write", slot, self.rdata())
        if op == "pwrite":
            return ("pwrite", slot, self.roff(), self.rdata())
        if op == "read":
            return ("read", slot, r.choice([1, 100, 4096, 70000]))
        if op == "pread":
            return ("pread", slot, r.choice([1, 100, 4096, 70000, 1 << 20]), self.roff())
        if op == "lseek":
            return ("lseek", r.choice(reg_slots), r.randint(0, 70000),
                    r.choice([os.SEEK_SET, os.SEEK_CUR, os.SEEK_END]))
        if op == "ftruncate":
            return ("ftruncate", slot, self.roff())
        if op == "truncate":
            return ("truncate", self.rpath(), self.roff())
        if op in ("fsync", "fdatasync", "fstat", "close"):
            return (op, slot)
        if op == "fallocate":
            return ("fallocate", slot, self.roff(), r.choice([0, 1, 100, 4096, 65536, 1 << 20]))
        if op in ("seek_data", "seek_hole"):
            return (op, r.choice(reg_slots), self.roff())
        if op == "mkdir":
            return ("mkdir", self.rpath(), self.rmode(True))
        if op in ("rmdir", "unlink", "readlink", "listdir"):
            return (op, self.rpath())
        if op == "rename":
            return ("rename", self.rpath(), self.rpath())
        if op == "link":
            return ("link", self.rpath(), self.rpath())
        if op == "symlink":
            return ("symlink", self.rtarget(), self.rpath())
        if op == "chmod":
            return ("chmod", self.rpath(), self.rmode())
        if op == "utime":
            if r.random() < 0.3:
                return ("utime", self.rpath(), None, r.random() < 0.7)
            ns = tuple(r.randint(0, 2_000_000_000) * 1_000_000_000 + r.randint(0, 999_999_999)
                       for _ in range(2))
            return ("utime", self.rpath(), ns, r.random() < 0.7)
        if op == "setxattr":
            v = r.choice([b"", b"v", r.randbytes(r.randint(1, 200))])
            fl = r.choice([0, 0, os.XATTR_CREATE, os.XATTR_REPLACE])
            return ("setxattr", self.rpath(), r.choice(XATTR_NAMES), v, fl, r.random() < 0.8)
        if op in ("getxattr", "removexattr"):
            return (op, self.rpath(), r.choice(XATTR_NAMES), r.random() < 0.8)
        if op == "listxattr":
            return ("listxattr", self.rpath(), r.random() < 0.8)
        if op == "statvfs":
            return ("statvfs",)
        if op == "stat":
            return ("stat", self.rpath(), r.random() < 0.5)
        if op == "copy_file_range":
            return ("copy_file_range", slot, r.choice(open_slots), r.choice([1, 100, 4096, 1 << 20]),
                    self.roff(), self.roff())
        if op == "longname":
            n = r.choice([255, 256])
            return ("longname", r.choice(["", "d0/"]) + "z" * n, r.choice(["creat", "mkdir", "symlink", "rename"]))
        raise AssertionError(op)

    # ------------------------------------------------------------------ apply
    def apply(self, S, op):
        """Run op on side S; returns a comparable result."""
        k = op[0]
        p = S.p
        if k == "open":
            _, path, flags, mode, slot = op
            res = call(os.open, p(path), flags, mode)
            if res[0] == "ok":
                S.fds[slot] = res[1]
                return ("ok",)
            return res
        if k == "close":
            fd = S.fds[op[1]]
            S.fds[op[1]] = None
            return call(os.close, fd)
        if k == "write":
            return call(os.write, S.fds[op[1]], op[2])
        if k == "pwrite":
            return call(os.pwrite, S.fds[op[1]], op[3], op[2])
        if k == "read":
            return call(os.read, S.fds[op[1]], op[2])
        if k == "pread":
            return call(os.pread, S.fds[op[1]], op[2], op[3])
        if k == "lseek":
            return call(os.lseek, S.fds[op[1]], op[2], op[3])
        if k == "ftruncate":
            return call(os.ftruncate, S.fds[op[1]], op[2])
        if k == "truncate":
            return call(os.truncate, p(op[1]), op[2])
        if k == "fsync":
            return call(os.fsync, S.fds[op[1]])
        if k == "fdatasync":
            return call(os.fdatasync, S.fds[op[1]])
        if k == "fstat":
            res = call(os.fstat, S.fds[op[1]])
            return ("ok", stat_view(res[1])) if res[0] == "ok" else res
        if k == "fallocate":
            return call(os.posix_fallocate, S.fds[op[1]], op[2], op[3])
        if k == "seek_data":
            return call(os.lseek, S.fds[op[1]], op[2], os.SEEK_DATA)
        if k == "seek_hole":
            return call(os.lseek, S.fds[op[1]], op[2], os.SEEK_HOLE)
        if k == "mkdir":
            return call(os.mkdir, p(op[1]), op[2])
        if k == "rmdir":
            return call(os.rmdir, p(op[1]))
        if k == "unlink":
            return call(os.unlink, p(op[1]))
        if k == "rename":
            return call(os.rename, p(op[1]), p(op[2]))
        if k == "link":
            return call(os.link, p(op[1]), p(op[2]), follow_symlinks=False)
        if k == "symlink":
            return call(os.symlink, op[1], p(op[2]))
        if k == "readlink":
            return call(os.readlink, p(op[1]))
        if k == "chmod":
            return call(os.chmod, p(op[1]), op[2])
        if k == "utime":
            _, path, ns, follow = op
            if ns is None:
                return call(os.utime, p(path), None, follow_symlinks=follow)
            return call(os.utime, p(path), ns=ns, follow_symlinks=follow)
        if k == "setxattr":
            _, path, name, v, fl, follow = op
            if S is self.R:
                old = call(os.getxattr, p(path), name, follow_symlinks=follow)
                self.same_xattr = old == ("ok", v)
            return call(os.setxattr, p(path), name, v, fl, follow_symlinks=follow)
        if k == "getxattr":
            return call(os.getxattr, p(op[1]), op[2], follow_symlinks=op[3])
        if k == "removexattr":
            return call(os.removexattr, p(op[1]), op[2], follow_symlinks=op[3])
        if k == "listxattr":
            res = call(os.listxattr, p(op[1]), follow_symlinks=op[2])
            if res[0] == "ok":
                return ("ok", sorted(x for x in res[1] if x.startswith("user.")))
            return res
        if k == "statvfs":
            res = call(os.statvfs, S.root)
            return ("ok", res[1].f_namemax) if res[0] == "ok" else res
        if k == "stat":
            res = call(os.stat, p(op[1]), follow_symlinks=op[2])
            return ("ok", stat_view(res[1])) if res[0] == "ok" else res
        if k == "listdir":
            res = call(os.listdir, p(op[1]))
            return ("ok", sorted(res[1])) if res[0] == "ok" else res
        if k == "copy_file_range":
            _, src, dst, n, offs, offd = op
            return call(os.copy_file_range, S.fds[src], S.fds[dst], n, offs, offd)
        if k == "longname":
            _, path, what = op
            if what == "creat":
                res = call(os.open, p(path), os.O_CREAT | os.O_WRONLY, 0o644)
                if res[0] == "ok":
                    os.close(res[1])
                    return ("ok",)
                return res
            if what == "mkdir":
                return call(os.mkdir, p(path))
            if what == "symlink":
                return call(os.symlink, "a", p(path))
            return call(os.rename, p("a"), p(path))
        raise AssertionError(k)

    # ------------------------------------------------------------------ touched objects
    def touched(self, op):
        """Paths (relative) whose lstat is compared after op; fd slots whose fstat is."""
        k = op[0]
        paths, slots = [], []

        def with_parent(x):
            paths.append(x)
            paths.append(os.path.dirname(x))
        if k in ("open", "truncate", "mkdir", "rmdir", "unlink", "symlink", "readlink", "chmod",
                 "utime", "setxattr", "getxattr", "removexattr", "listxattr", "stat", "listdir"):
            with_parent(op[1] if k != "symlink" else op[2])
        elif k in ("rename", "link"):
            with_parent(op[1])
            with_parent(op[2])
        elif k == "longname":
            with_parent(op[1])
            paths.append("a")
        if k == "open":
            slots.append(op[4])
        elif k in ("write", "pwrite", "read", "pread", "lseek", "ftruncate", "fsync",
                   "fdatasync", "fstat", "fallocate", "seek_data", "seek_hole"):
            slots.append(op[1])
        elif k == "copy_file_range":
            slots.extend([op[1], op[2]])
        seen, out = set(), []
        for x in paths:
            if x not in seen:
                seen.add(x)
                out.append(x)
        return out, slots

    # ------------------------------------------------------------------ comparisons
    def fail(self, what):
        raise Mismatch(what)

    def identity(self, ir, ib, where):
        """Pair ext4 inode ir with birch inode ib. Returns True when the pairing is old (so a
        'changed or not' comparison of times is meaningful)."""
        old_b = self.e2b.get(ir)
        old_r = self.b2e.get(ib)
        if old_r is not None and old_r != ir:
            # birch never reuses inode numbers: the same birch object must stay the same ext4
            # object (unless ext4 reused... which cannot make one birch inode two ext4 ones).
            self.fail(f"{where}: inode identity: birch inode {ib} was ext4 inode {old_r}, now {ir}")
        if old_b is not None and old_b == ib:
            return True
        if old_b is not None:
            # ext4 reused a freed inode number for a new object: forget the stale pairing.
            self.b2e.pop(old_b, None)
            self.R.times.pop(ir, None)
        self.e2b[ir] = ib
        self.b2e[ib] = ir
        return False

    def compare_times(self, sr, sb, where, known):
        tr = (sr.st_mtime_ns, sr.st_ctime_ns)
        tb = (sb.st_mtime_ns, sb.st_ctime_ns)
        pr = self.R.times.get(sr.st_ino)
        pb = self.B.times.get(sb.st_ino)
        self.R.times[sr.st_ino] = tr
        self.B.times[sb.st_ino] = tb
        if not known or pr is None or pb is None:
            return
        for i, nm in ((0, "mtime"), (1, "ctime")):
            cr, cb = pr[i] != tr[i], pb[i] != tb[i]
            if cr and not cb and WRITEBACK_CACHE and stat.S_ISREG(sb.st_mode):
                if getattr(self, "cur_op", ("",))[0] in ("truncate", "ftruncate", "fallocate"):
                    self.count(f"allowed: {nm} kept by the kernel's writeback cache")
                    continue
            if cr and not cb and 0 <= tr[i] - tb[i] < COARSE_TICK_NS:
                self.count(f"allowed: {nm} within one coarse clock tick")
                continue
            if cr != cb and (cr or MULTIGRAIN):
                self.fail(f"{where}: {nm} {'changed' if cr else 'unchanged'} on ext4 "
                          f"({pr[i]} -> {tr[i]}) but {'changed' if cb else 'unchanged'} on birch "
                          f"({pb[i]} -> {tb[i]})")

    def rebaseline(self, rel, follow):
        """Accept a ctime change on birch that ext4 skipped (setxattr of the same value): take
        the object's current times as the new 'last observed' on both sides."""
        sr = os.stat(self.R.p(rel), follow_symlinks=follow)
        sb = os.stat(self.B.p(rel), follow_symlinks=follow)
        if (sr.st_mtime_ns, sr.st_ctime_ns) == self.R.times.get(sr.st_ino) and \
                (sb.st_mtime_ns, sb.st_ctime_ns) != self.B.times.get(sb.st_ino):
            self.count("allowed: ctime after setxattr of the same value")
        self.R.times[sr.st_ino] = (sr.st_mtime_ns, sr.st_ctime_ns)
        self.B.times[sb.st_ino] = (sb.st_mtime_ns, sb.st_ctime_ns)

    def compare_stat(self, sr, sb, where):
        vr, vb = stat_view(sr), stat_view(sb)
        if vr != vb:
            self.fail(f"{where}: stat differs: ext4 {vr} birch {vb}")
        known = self.identity(sr.st_ino, sb.st_ino, where)
        self.compare_times(sr, sb, where, known)

    def check_touched(self, op):
        self.cur_op = op
        paths, slots = self.touched(op)
        for rel in paths:
            rr = call(os.lstat, self.R.p(rel))
            rb = call(os.lstat, self.B.p(rel))
            if rr[0] != rb[0] or (rr[0] == "err" and rr != rb):
                self.fail(f"lstat {rel!r}: ext4 {self.short(rr)} birch {self.short(rb)}")
            if rr[0] == "ok":
                self.compare_stat(rr[1], rb[1], f"lstat {rel!r}")
        for s in slots:
            fr, fb = self.R.fds[s], self.B.fds[s]
            if (fr is None) != (fb is None):
                self.fail(f"slot {s}: open on one side only")
            if fr is None:
                continue
            sr, sb = os.fstat(fr), os.fstat(fb)
            self.compare_stat(sr, sb, f"fstat slot {s}")
            if ftype(sr.st_mode) == "reg":
                pr, pb = os.lseek(fr, 0, os.SEEK_CUR), os.lseek(fb, 0, os.SEEK_CUR)
                if pr != pb:
                    self.fail(f"slot {s}: file offset ext4 {pr} birch {pb}")

    def seek_valid(self, S, fd0, off, whence, res):
        """Is res a valid SEEK_DATA/SEEK_HOLE answer on side S (holes read as zeros)?"""
        # the descriptor may be write-only: read through a fresh one (works unlinked too)
        fd = os.open(f"/proc/self/fd/{fd0}", os.O_RDONLY)
        try:
            return self._seek_valid(fd, off, whence, res)
        finally:
            os.close(fd)

    def _seek_valid(self, fd, off, whence, res):
        size = os.fstat(fd).st_size
        if off >= size:
            return res == ("err", "ENXIO")
        if res[0] == "err":
            # SEEK_DATA with no data up to EOF
            return whence == os.SEEK_DATA and res[1] == "ENXIO" and \
                not any(os.pread(fd, size - off, off))
        r = res[1]
        if whence == os.SEEK_DATA:
            return off <= r < size and not any(os.pread(fd, r - off, off))
        if not (off <= r <= size):
            return False
        return r == size or os.pread(fd, 1, r) == b"\0"

    def compare_result(self, op, rr, rb):
        k = op[0]
        if k in ("seek_data", "seek_hole") and rr != rb:
            whence = os.SEEK_DATA if k == "seek_data" else os.SEEK_HOLE
            fb = self.B.fds[op[1]]
            okr = self.seek_valid(self.R, self.R.fds[op[1]], op[2], whence, rr)
            okb = self.seek_valid(self.B, fb, op[2], whence, rb)
            if okr and okb and os.fstat(fb).st_ino in self.fallocated:
                self.count("allowed: seek on fallocated file")
                # the descriptors' offsets now differ by design: re-align them
                pos = os.lseek(self.R.fds[op[1]], 0, os.SEEK_CUR)
                os.lseek(fb, pos, os.SEEK_SET)
                return
            self.fail(f"result differs: ext4 {self.short(rr)} birch {self.short(rb)}"
                      f" (valid answer: ext4 {okr}, birch {okb})")
        if rr != rb:
            self.fail(f"result differs: ext4 {self.short(rr)} birch {self.short(rb)}")

    def count(self, what):
        self.counts[what] = self.counts.get(what, 0) + 1

    @staticmethod
    def short(x):
        s = repr(x)
        if isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], bytes):
            b = x[1]
            s = f"({x[0]!r}, <{len(b)} bytes, crc32 {zlib.crc32(b):08x}, head {b[:16]!r}>)"
        return s if len(s) < 300 else s[:300] + "..."

    def op_str(self, op):
        parts = []
        for x in op:
            if isinstance(x, bytes):
                parts.append(f"<{len(x)} bytes>")
            elif isinstance(x, int) and op[0] == "open" and x is op[2]:
                parts.append(self.flags_str(x))
            else:
                parts.append(repr(x) if len(repr(x)) < 60 else repr(x)[:57] + "...")
        return parts[0] + "(" + ", ".join(parts[1:]) + ")"

    @staticmethod
    def flags_str(f):
        names = [["O_RDONLY", "O_WRONLY", "O_RDWR"][f & 3]]
        for n in ("O_CREAT", "O_EXCL", "O_TRUNC", "O_APPEND", "O_DIRECTORY", "O_NOFOLLOW"):
            if f & getattr(os, n):
                names.append(n)
        return "|".join(names)

    # ------------------------------------------------------------------ whole trees
    def walk(self, S):
        """rel path -> (lstat, d_ino); and dir -> sorted names."""
        ents, dirs = {}, {}
        todo = [""]
        while todo:
            d = todo.pop()
            names = []
            with os.scandir(S.top + "/" + d if d else S.top) as it:
                for e in it:
                    rel = (d + "/" + e.name) if d else e.name
                    names.append(e.name)
                    st = os.lstat(e.path)
                    if e.inode() != st.st_ino:
                        self.fail(f"{S.name}: readdir d_ino {e.inode()} != lstat st_ino "
                                  f"{st.st_ino} for {rel!r}")
                    ents[rel] = st
                    if stat.S_ISDIR(st.st_mode):
                        todo.append(rel)
            dirs[d] = sorted(names)
        return ents, dirs

    def xattrs(self, path):
        out = {}
        for n in os.listxattr(path, follow_symlinks=False):
            if n.startswith("user."):
                out[n] = os.getxattr(path, n, follow_symlinks=False)
        return out

    def compare_trees(self):
        self.cur_op = ("tree",)
        er, dr = self.walk(self.R)
        eb, db = self.walk(self.B)
        if dr != db:
            for d in sorted(set(dr) | set(db)):
                if dr.get(d) != db.get(d):
                    self.fail(f"tree: directory {d!r}: ext4 {dr.get(d)} birch {db.get(d)}")
        rst = os.lstat(self.R.top)
        bst = os.lstat(self.B.top)
        self.compare_stat(rst, bst, "tree: top")
        groups_r, groups_b = {}, {}
        for rel in sorted(er):
            sr, sb = er[rel], eb[rel]
            self.compare_stat(sr, sb, f"tree: {rel!r}")
            groups_r.setdefault(sr.st_ino, []).append(rel)
            groups_b.setdefault(sb.st_ino, []).append(rel)
            pr, pb = self.R.top + "/" + rel, self.B.top + "/" + rel
            t = ftype(sr.st_mode)
            if t == "lnk":
                a, b = os.readlink(pr), os.readlink(pb)
                if a != b:
                    self.fail(f"tree: {rel!r}: symlink target ext4 {a!r} birch {b!r}")
            if t == "reg":
                with open(pr, "rb") as f:
                    a = f.read()
                with open(pb, "rb") as f:
                    b = f.read()
                if a != b:
                    i = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]),
                             min(len(a), len(b)))
                    self.fail(f"tree: {rel!r}: contents differ (sizes ext4 {len(a)} birch "
                              f"{len(b)}), first difference at byte {i}: ext4 {a[i:i+8]!r} "
                              f"birch {b[i:i+8]!r}")
            xa, xb = self.xattrs(pr), self.xattrs(pb)
            if xa != xb:
                self.fail(f"tree: {rel!r}: xattrs ext4 {xa} birch {xb}")
        gr = sorted(sorted(g) for g in groups_r.values())
        gb = sorted(sorted(g) for g in groups_b.values())
        if gr != gb:
            self.fail(f"tree: hard-link groups differ: ext4 {[g for g in gr if g not in gb]} "
                      f"birch {[g for g in gb if g not in gr]}")
        return len(er)

    # ------------------------------------------------------------------ main loop
    def post(self, op, rr, rb):
        """Bookkeeping after both sides ran op with equal results."""
        k = op[0]
        if k == "open" and rr[0] == "ok":
            st = os.fstat(self.R.fds[op[4]])
            self.slot_info[op[4]] = (op[1], op[2], stat.S_ISDIR(st.st_mode))
        if k == "close":
            self.slot_info[op[1]] = None
        if k == "fallocate" and rr[0] == "ok":
            self.fallocated.add(os.fstat(self.B.fds[op[1]]).st_ino)
        if k == "utime" and rr[0] == "ok" and op[2] is not None:
            # explicit times: compare them exactly, atime included (nothing read it since)
            sr = os.stat(self.R.p(op[1]), follow_symlinks=op[3])
            sb = os.stat(self.B.p(op[1]), follow_symlinks=op[3])
            want = op[2]
            for side, s in (("ext4", sr), ("birch", sb)):
                # a symlink's atime moves when a later path walk follows it (even the stat
                # here, when the path goes through the link itself): mtime only there
                got, w = (s.st_atime_ns, s.st_mtime_ns), want
                if stat.S_ISLNK(s.st_mode):
                    got, w = got[1], w[1]
                if got != w:
                    self.fail(f"utime: {side} has atime/mtime {(s.st_atime_ns, s.st_mtime_ns)}"
                              f", set {want}")

    def run(self):
        print(f"differential: seed {self.seed}, {self.nops} ops, ref {self.R.root}, "
              f"birch {self.B.root}", flush=True)
        t0 = time.monotonic()
        for S in (self.R, self.B):
            os.makedirs(S.root, exist_ok=True)
        try:
            self.compare_trees()
            for self.step in range(1, self.nops + 1):
                op = self.gen()
                rr = self.apply(self.R, op)
                rb = self.apply(self.B, op)
                self.hist.append((self.step, op, rr, rb))
                if self.verbose:
                    print(f"  {self.step:6d} {self.op_str(op)} -> {self.short(rr)}", flush=True)
                if self.trace:
                    print(f"{self.step:6d} {self.op_str(op)} -> {self.short(rr)}", file=self.trace)
                self.count(op[0] + (":" + rr[1] if rr[0] == "err" else ":ok"))
                self.compare_result(op, rr, rb)
                self.post(op, rr, rb)
                if op[0] == "setxattr" and rr[0] == "ok" and self.same_xattr:
                    self.rebaseline(op[1], op[5])
                self.check_touched(op)
                if self.step % self.check_every == 0:
                    self.compare_trees()
            for s in range(SLOTS):
                if self.slot_info[s] is not None:
                    op = ("close", s)
                    self.step += 1
                    rr, rb = self.apply(self.R, op), self.apply(self.B, op)
                    self.hist.append((self.step, op, rr, rb))
                    self.compare_result(op, rr, rb)
                    self.post(op, rr, rb)
            n = self.compare_trees()
        except Mismatch as m:
            self.report(str(m))
            return 1
        except OSError as e:
            # an unexpected failure of a bookkeeping call (fstat, lstat of the tree...) on one side
            import traceback
            traceback.print_exc(file=sys.stdout)
            self.report(f"unexpected {e!r} while checking")
            return 1
        secs = time.monotonic() - t0
        errs = sum(v for k, v in self.counts.items() if ":E" in k)
        print(f"differential: seed {self.seed}: {self.nops} ops identical ({errs} errno results, "
              f"{n} objects in the final tree, {secs:.1f}s)", flush=True)
        allowed = {k: v for k, v in self.counts.items() if k.startswith("allowed")}
        if allowed:
            print(f"  allowed differences used: {allowed}")
        return 0

    def report(self, msg):
        print(f"differential: seed {self.seed}: MISMATCH at step {self.step}: {msg}", flush=True)
        print("  last operations (step, op, ext4 result, birch result):")
        for step, op, rr, rb in self.hist[-25:]:
            mark = "" if rr == rb else "   <-- differs"
            print(f"  {step:6d} {self.op_str(op)}\n         ext4 {self.short(rr)}"
                  f"{'' if rr == rb else chr(10) + '         birch ' + self.short(rb)}{mark}")
        print(f"  replay: tests/posix/differential.sh {self.nops} {self.seed}")
        print(f"     or: {sys.argv[0]} --ref EMPTY_EXT4_DIR --birch EMPTY_BIRCH_DIR "
              f"--seed {self.seed} --ops {self.nops} --check-every {self.check_every}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", required=True, help="empty directory on the reference (ext4) fs")
    ap.add_argument("--birch", required=True, help="empty directory on the birch mount")
    ap.add_argument("--seed", type=int, default=None, help="seed (default: random, printed)")
    ap.add_argument("--ops", type=int, default=1000, help="operations (default 1000)")
    ap.add_argument("--check-every", type=int, default=100,
                    help="whole-tree compare every N ops (default 100)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every operation")
    ap.add_argument("--list-allowed", action="store_true", help="print the allowed differences")
    ap.add_argument("--verify-only", action="store_true",
                    help="no operations: only compare the two existing trees (after a remount)")
    a = ap.parse_args()
    if a.list_allowed:
        for what, why in ALLOWED_DIFFERENCES:
            print(f"- {what}: {why}")
        return 0
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1 << 32)
    if a.verify_only:
        d = Differential(a.ref, a.birch, seed, 0, 1, a.verbose)
        try:
            n = d.compare_trees()
        except Mismatch as m:
            print(f"differential: verify {a.birch}: MISMATCH: {m}", flush=True)
            return 1
        print(f"differential: verify {a.birch}: {n} objects identical", flush=True)
        return 0
    for d in (a.ref, a.birch):
        if not os.path.isdir(d) or os.listdir(d):
            print(f"differential: {d} must be an existing empty directory", file=sys.stderr)
            return 2
    os.umask(0o022)
    return Differential(a.ref, a.birch, seed, a.ops, max(1, a.check_every), a.verbose).run()


if __name__ == "__main__":
    sys.exit(main())
