//! The filesystem API against a simple in-memory reference model.
//!
//! Random sequences of namespace, data, attribute and xattr operations run on a real
//! [`Filesystem`] (on a [`MemDevice`]) and on the model: a tree of directories holding
//! name → inode maps, and inodes with kind, permission bits, link count, content bytes, rdev,
//! xattrs and the times the last operation must have set. Every result is compared, every
//! errno exactly ([`birch_core::Error::errno`], Linux's choice where several apply). The
//! namespace is small (names `a`..`e` in a few directories) so collisions, renames over
//! existing names, ENOTEMPTY, EEXIST, ENOENT, ENOTDIR and EISDIR come up all the time;
//! over-long names, dot names, bad flags and stale inode numbers come up now and then. Data
//! writes use offsets around the 2,048-byte inline limit, 4 KiB block boundaries and far
//! sparse offsets; truncates go up and down; fallocate runs in every Linux mode;
//! copy_file_range between and within files (offsets mostly equal within a block, so whole
//! blocks are shared as clones and the unaligned ends copied; overlapping ranges are EINVAL).
//!
//! Times: after each successful operation, the mtime/ctime it must set are checked to lie
//! between the clocks read before and after it, and then remembered exactly; every other
//! time must never move (checked on each full comparison).
//!
//! Every ~50 operations the filesystem is synced, or closed, dropped, fsck'd and reopened on
//! the same device (files unlinked but still known die then); the whole tree is compared
//! (readdir with "." and "..", paged readdir, d_ino = st_ino, kinds, sizes, contents, modes,
//! link counts, rdev, times, xattrs). After each sequence fsck (with data) must be clean.
//!
//! A concurrent variant runs 2-4 threads on one filesystem, each in its own directory with
//! its own model, then compares every subtree after a reopen and runs fsck.
//!
//! Seeds: each case prints its seed; `BIRCH_SEED=N` replays one case, `BIRCH_FS_CASES` and
//! `BIRCH_FS_OPS` scale the run, `BIRCH_FS_CONCURRENT_CASES` the concurrent one, and
//! `BIRCH_FS_TRACE=1` prints every operation. CI: 30 cases x 2,000 ops plus 4 concurrent cases
//! of 2-4 threads x 2,000 ops (about 10 s in release). Long run (500,000 operations, about
//! 3 minutes): `BIRCH_FS_CASES=100 BIRCH_FS_OPS=5000 cargo test --release -p birch-core
//! --test fs_model fs_matches_model`.
//!
//! Bugs the generator found are kept as `#[ignore]`d tests with a fixed operation list at the
//! end of this file; the generator avoids only those exact constructs.

#![allow(clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use birch_core::check::{check, CheckOptions};
use birch_core::device::MemDevice;
use birch_core::vfs::{Attr, Caller, FileKind, OpenOptions, SetAttr, SetTime};
use birch_core::{Filesystem, MkfsOptions};
use birch_format::items::Timespec;
use birch_format::InodeNo;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const ROOT: birch_format::InodeNo = birch_format::ROOT_INO;
const NAME_MAX: usize = 255;
const INLINE_MAX: u64 = 2048;
const BLOCK: u64 = 4096;
const MAX_FILE_BYTES: u64 = 1 << 62;
/// The largest value in one item; larger ones go out of line, up to XATTR_SIZE_MAX.
const XATTR_VALUE_MAX: usize = 7168;
const XATTR_SIZE_MAX: usize = 65536;
const PATH_MAX: usize = 4096;
const FAR: u64 = 4 << 20;
const DEVICE_BYTES: u64 = 256 << 20;

const NOREPLACE: u32 = 1;
const EXCHANGE: u32 = 2;
const KEEP_SIZE: i32 = 0x01;
const PUNCH_HOLE: i32 = 0x02;
const ZERO_RANGE: i32 = 0x10;
const XATTR_CREATE: i32 = 1;
const XATTR_REPLACE: i32 = 2;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn quiet() -> OpenOptions {
    OpenOptions {
        commit_interval: None,
        ..Default::default()
    }
}

/// The clock birchfs stamps times from (the kernel's coarse clock): an operation's times lie
/// between this clock read before and after it.
fn now() -> Timespec {
    birch_core::vfs::clock()
}

fn assert_clean(dev: &MemDevice, what: &str) {
    let report = check(dev, CheckOptions { data: true }).expect("fsck runs");
    assert!(
        report.is_clean(),
        "{what}: fsck findings: {:#?}",
        report.findings
    );
}

/// A file name, printed short.
#[derive(Clone, PartialEq, Eq)]
struct Name(Vec<u8>);

impl std::fmt::Debug for Name {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.len() > 12 {
            write!(f, "<{} bytes>", self.0.len())
        } else {
            write!(f, "{:?}", String::from_utf8_lossy(&self.0))
        }
    }
}

fn n(s: &str) -> Name {
    Name(s.as_bytes().to_vec())
}

/// Deterministic, never-zero content (so a lost write never reads back as a hole).
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            1 + ((seed as usize)
                .wrapping_mul(31)
                .wrapping_add(i * 7 + i / 253)
                % 255) as u8
        })
        .collect()
}

#[derive(Debug, Clone)]
enum Op {
    Lookup {
        dir: u64,
        name: Name,
    },
    Mkdir {
        dir: u64,
        name: Name,
        mode: u32,
    },
    Create {
        dir: u64,
        name: Name,
        mode: u32,
    },
    Mknod {
        dir: u64,
        name: Name,
        mode: u32,
        rdev: u64,
    },
    Symlink {
        dir: u64,
        name: Name,
        target_len: usize,
        seed: u8,
    },
    Readlink {
        ino: u64,
    },
    Link {
        ino: u64,
        dir: u64,
        name: Name,
    },
    Unlink {
        dir: u64,
        name: Name,
    },
    Rmdir {
        dir: u64,
        name: Name,
    },
    Rename {
        dir: u64,
        name: Name,
        newdir: u64,
        newname: Name,
        flags: u32,
    },
    Write {
        ino: u64,
        off: u64,
        len: usize,
        seed: u8,
        append: bool,
    },
    Read {
        ino: u64,
        off: u64,
        len: usize,
    },
    Truncate {
        ino: u64,
        size: u64,
        mode: Option<u32>,
    },
    Chmod {
        ino: u64,
        mode: u32,
    },
    SetMtime {
        ino: u64,
        mtime: Timespec,
    },
    Fallocate {
        ino: u64,
        off: u64,
        len: u64,
        mode: i32,
    },
    SetXattr {
        ino: u64,
        name: Name,
        len: usize,
        seed: u8,
        flags: i32,
    },
    GetXattr {
        ino: u64,
        name: Name,
    },
    ListXattr {
        ino: u64,
    },
    RemoveXattr {
        ino: u64,
        name: Name,
    },
    Readdir {
        dir: u64,
    },
    Getattr {
        ino: u64,
    },
    /// copy_file_range between two regular files (or within one): shares whole blocks when
    /// the offsets agree within a block (a clone), copies bytes otherwise.
    CopyRange {
        ino_in: u64,
        off_in: u64,
        ino_out: u64,
        off_out: u64,
        len: u64,
    },
    Lseek {
        ino: u64,
        off: u64,
        whence: i32,
    },
    Forget {
        ino: u64,
    },
    Sync,
    Reopen,
}

impl Op {
    fn kind(&self) -> String {
        let s = format!("{self:?}");
        s.split([' ', '{']).next().unwrap_or("").to_string()
    }
}

#[derive(Debug, Clone)]
struct MNode {
    kind: FileKind,
    perm: u32,
    nlink: u32,
    rdev: u64,
    /// File content or symlink target.
    data: Vec<u8>,
    children: BTreeMap<Vec<u8>, u64>,
    /// Parent of a directory.
    parent: u64,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
    mtime: Timespec,
    ctime: Timespec,
    /// Test-side shadow: fallocate KEEP_SIZE once reached past the end (bugs 7 and 8).
    prealloc_past_eof: bool,
}

impl MNode {
    fn new(kind: FileKind, perm: u32, rdev: u64, parent: u64) -> MNode {
        MNode {
            kind,
            perm,
            nlink: if kind == FileKind::Dir { 2 } else { 1 },
            rdev,
            data: Vec::new(),
            children: BTreeMap::new(),
            parent,
            xattrs: BTreeMap::new(),
            mtime: Timespec::default(),
            ctime: Timespec::default(),
            prealloc_past_eof: false,
        }
    }
}

/// Which times an operation must set on an inode.
#[derive(Debug, Clone, Copy)]
struct Touch {
    ino: u64,
    mtime: bool,
}

fn touch(ino: u64, mtime: bool) -> Touch {
    Touch { ino, mtime }
}

/// The reference model of one subtree (the whole filesystem when `top` is the root).
struct Model {
    top: u64,
    nodes: BTreeMap<u64, MNode>,
    /// Inode numbers that existed once and are gone (freed): ENOENT.
    dead: Vec<u64>,
}

impl Model {
    fn new(top: u64, parent: u64, attr: &Attr) -> Model {
        let mut root = MNode::new(FileKind::Dir, attr.perm, 0, parent);
        root.mtime = attr.mtime;
        root.ctime = attr.ctime;
        let mut nodes = BTreeMap::new();
        nodes.insert(top, root);
        Model {
            top,
            nodes,
            dead: Vec::new(),
        }
    }

    fn node(&self, ino: u64) -> &MNode {
        self.nodes.get(&ino).expect("model node")
    }

    fn node_mut(&mut self, ino: u64) -> &mut MNode {
        self.nodes.get_mut(&ino).expect("model node")
    }

    /// `Err(errno)` when `ino` is gone; the node otherwise.
    fn get(&self, ino: u64) -> Result<&MNode, i32> {
        self.nodes.get(&ino).ok_or(libc::ENOENT)
    }

    /// A directory argument: ENOENT when gone, ENOTDIR when not a directory.
    fn dir(&self, ino: u64) -> Result<&MNode, i32> {
        let d = self.get(ino)?;
        if d.kind != FileKind::Dir {
            return Err(libc::ENOTDIR);
        }
        Ok(d)
    }

    fn is_ancestor(&self, anc: u64, mut dir: u64) -> bool {
        loop {
            if dir == anc {
                return true;
            }
            if dir == self.top || dir == ROOT.get() {
                return false;
            }
            match self.nodes.get(&dir) {
                Some(d) => dir = d.parent,
                None => return false,
            }
        }
    }

    fn subdirs(&self, dir: u64) -> u32 {
        self.node(dir)
            .children
            .values()
            .filter(|c| self.node(**c).kind == FileKind::Dir)
            .count() as u32
    }

    /// Removes a name; the child loses a link (a directory all of them).
    fn remove_name(&mut self, dir: u64, name: &[u8]) -> u64 {
        let child = self
            .node_mut(dir)
            .children
            .remove(name)
            .expect("model entry");
        let is_dir = self.node(child).kind == FileKind::Dir;
        if is_dir {
            self.node_mut(dir).nlink -= 1;
            self.node_mut(child).nlink = 0;
        } else {
            self.node_mut(child).nlink -= 1;
        }
        child
    }

    fn add_name(&mut self, dir: u64, name: &[u8], child: u64) {
        self.node_mut(dir).children.insert(name.to_vec(), child);
        if self.node(child).kind == FileKind::Dir {
            self.node_mut(dir).nlink += 1;
            self.node_mut(child).parent = dir;
        }
    }

    /// What survives a close: inodes without names are freed.
    fn after_close(&mut self) {
        let gone: Vec<u64> = self
            .nodes
            .iter()
            .filter(|(_, n)| n.nlink == 0)
            .map(|(i, _)| *i)
            .collect();
        for ino in gone {
            self.nodes.remove(&ino);
            self.dead.push(ino);
        }
    }

    fn inos_of(&self, f: impl Fn(&MNode) -> bool) -> Vec<u64> {
        self.nodes
            .iter()
            .filter(|(_, n)| f(n))
            .map(|(i, _)| *i)
            .collect()
    }
}

/// Errno of a result.
fn en<T>(r: birch_core::Result<T>) -> Result<T, i32> {
    r.map_err(|e| e.errno())
}

fn errname(e: i32) -> String {
    let s = match e {
        libc::ENOENT => "ENOENT",
        libc::EEXIST => "EEXIST",
        libc::ENOTDIR => "ENOTDIR",
        libc::EISDIR => "EISDIR",
        libc::ENOTEMPTY => "ENOTEMPTY",
        libc::EINVAL => "EINVAL",
        libc::ENAMETOOLONG => "ENAMETOOLONG",
        libc::EPERM => "EPERM",
        libc::EBUSY => "EBUSY",
        libc::EFBIG => "EFBIG",
        libc::ENODATA => "ENODATA",
        libc::ERANGE => "ERANGE",
        libc::E2BIG => "E2BIG",
        libc::EOPNOTSUPP => "EOPNOTSUPP",
        libc::ENXIO => "ENXIO",
        libc::ENODEV => "ENODEV",
        libc::ESPIPE => "ESPIPE",
        libc::EIO => "EIO",
        libc::ENOSPC => "ENOSPC",
        _ => return format!("errno {e}"),
    };
    s.to_string()
}

fn show<T: std::fmt::Debug>(r: &Result<T, i32>) -> String {
    match r {
        Ok(v) => {
            let s = format!("Ok({v:?})");
            if s.len() > 80 {
                format!("{}...", &s[..80])
            } else {
                s
            }
        }
        Err(e) => format!("Err({})", errname(*e)),
    }
}

/// Knobs of the generator: constructs known to hit a reported bug are left out.
/// The bugs at the end of this file are fixed; by default their constructs are generated.
#[derive(Clone, Copy, Default)]
struct Avoid {
    /// Leave out the constructs of the bugs at the end of this file (bug 1: "." and ".."
    /// as the new name of mkdir/create/mknod/symlink/link/rename make a real entry of that
    /// name; the others in `hits_known_bug`).
    dot_names: bool,
}

/// One model and its generator, driving one filesystem (or one subtree of it).
struct Runner {
    seed: u64,
    rng: SmallRng,
    model: Model,
    /// The last operations, for failure messages.
    log: Vec<String>,
    done: u64,
    /// Operations whose errno differed while both sides failed (state still agrees).
    mismatches: BTreeMap<String, String>,
    allow_reopen: bool,
    counts: BTreeMap<String, u64>,
    avoid: Avoid,
}

impl Runner {
    fn new(seed: u64, model: Model, allow_reopen: bool) -> Runner {
        Runner {
            seed,
            rng: SmallRng::seed_from_u64(seed),
            model,
            log: Vec::new(),
            done: 0,
            mismatches: BTreeMap::new(),
            allow_reopen,
            counts: BTreeMap::new(),
            avoid: Avoid::default(),
        }
    }

    fn fail(&self, msg: String) -> ! {
        let tail: Vec<&String> = self.log.iter().rev().take(40).rev().collect();
        panic!(
            "seed {} (replay with BIRCH_SEED={}), after {} ops: {msg}\nlast ops:\n{}",
            self.seed,
            self.seed,
            self.done,
            tail.iter()
                .map(|s| format!("  {s}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }

    /// Compares an expected with an actual result. Returns whether both succeeded; panics
    /// when exactly one did (the states diverge); records differing errnos.
    fn outcome<A: std::fmt::Debug, B: std::fmt::Debug>(
        &mut self,
        op: &Op,
        want: &Result<A, i32>,
        got: &Result<B, i32>,
    ) -> bool {
        match (want, got) {
            (Ok(_), Ok(_)) => true,
            (Err(w), Err(g)) => {
                if w != g {
                    let key = format!(
                        "{}: expected {} got {}",
                        op.kind(),
                        errname(*w),
                        errname(*g)
                    );
                    self.mismatches
                        .entry(key)
                        .or_insert_with(|| format!("{op:?}"));
                }
                false
            }
            _ => self.fail(format!(
                "{op:?}: expected {}, got {}",
                show(want),
                show(got)
            )),
        }
    }

    // ---- generator -------------------------------------------------------------------

    fn pick<T: Copy>(&mut self, v: &[T]) -> Option<T> {
        if v.is_empty() {
            None
        } else {
            Some(v[self.rng.gen_range(0..v.len())])
        }
    }

    /// A name argument; `dots` allows "." and "..".
    fn name_d(&mut self, dots: bool) -> Name {
        let r = self.rng.gen_range(0..1000);
        if r < 15 {
            Name(vec![b'n'; NAME_MAX + 1 + self.rng.gen_range(0..3)])
        } else if r < 22 {
            Name(vec![b'a' + self.rng.gen_range(0..2u8); NAME_MAX])
        } else if r < 30 && dots {
            if self.rng.gen_bool(0.5) {
                n(".")
            } else {
                n("..")
            }
        } else {
            let c = b'a' + self.rng.gen_range(0..5u8);
            Name(vec![c])
        }
    }

    /// A name argument of an operation that makes a name: no dot names (bug 1).
    fn name(&mut self) -> Name {
        let dots = !self.avoid.dot_names;
        self.name_d(dots)
    }

    fn xname(&mut self) -> Name {
        let r = self.rng.gen_range(0..100);
        if r < 3 {
            Name(Vec::new())
        } else if r < 6 {
            let mut v = b"user.".to_vec();
            v.resize(NAME_MAX + 1, b'x');
            Name(v)
        } else if r < 10 {
            n("trusted.t")
        } else {
            Name(format!("user.{}", (b'a' + self.rng.gen_range(0..4u8)) as char).into_bytes())
        }
    }

    /// A directory argument: mostly live directories, sometimes a removed one, a file
    /// (ENOTDIR) or a freed inode (ENOENT).
    fn dir_arg(&mut self) -> u64 {
        let r = self.rng.gen_range(0..100);
        if r < 3 {
            let files = self.model.inos_of(|n| n.kind != FileKind::Dir);
            if let Some(f) = self.pick(&files) {
                return f;
            }
        } else if r < 5 {
            let dead_dirs = self
                .model
                .inos_of(|n| n.kind == FileKind::Dir && n.nlink == 0);
            if let Some(d) = self.pick(&dead_dirs) {
                return d;
            }
        } else if r < 6 {
            let dead = self.model.dead.clone();
            if let Some(d) = self.pick(&dead) {
                return d;
            }
        }
        let dirs = self
            .model
            .inos_of(|n| n.kind == FileKind::Dir && n.nlink > 0);
        self.pick(&dirs).unwrap_or(self.model.top)
    }

    /// Any inode: mostly named ones, sometimes orphans (unlinked, still known) or freed ones.
    fn ino_arg(&mut self, want: impl Fn(&MNode) -> bool) -> u64 {
        let r = self.rng.gen_range(0..100);
        if r < 2 {
            let dead = self.model.dead.clone();
            if let Some(d) = self.pick(&dead) {
                return d;
            }
        }
        if r < 12 {
            let any = self.model.inos_of(|_| true);
            if let Some(i) = self.pick(&any) {
                return i;
            }
        }
        let good = self.model.inos_of(want);
        match self.pick(&good) {
            Some(i) => i,
            None => self.model.top,
        }
    }

    fn file_arg(&mut self) -> u64 {
        let r = self.rng.gen_range(0..100);
        if r < 3 {
            let dirs = self.model.inos_of(|n| n.kind == FileKind::Dir);
            if let Some(d) = self.pick(&dirs) {
                return d;
            }
        }
        if r < 5 {
            let dead = self.model.dead.clone();
            if let Some(d) = self.pick(&dead) {
                return d;
            }
        }
        let files = self.model.inos_of(|n| n.kind == FileKind::File);
        match self.pick(&files) {
            Some(f) => f,
            None => self.model.top,
        }
    }

    fn offset(&mut self, size: u64) -> u64 {
        match self.rng.gen_range(0..10) {
            0 => self.rng.gen_range(0..64),
            1 => INLINE_MAX - 8 + self.rng.gen_range(0..16),
            2 => BLOCK * self.rng.gen_range(1..5) - 8 + self.rng.gen_range(0..16),
            3 => self.rng.gen_range(0..FAR),
            4 => size,
            5 => size.saturating_sub(self.rng.gen_range(0..5000)),
            _ => self.rng.gen_range(0..3 * BLOCK + 100),
        }
    }

    fn length(&mut self) -> u64 {
        match self.rng.gen_range(0..10) {
            0 => self.rng.gen_range(2000..2100),
            1 => BLOCK - 8 + self.rng.gen_range(0..16),
            2 => 2 * BLOCK + self.rng.gen_range(0..BLOCK),
            3 => self.rng.gen_range(1..70_000),
            _ => self.rng.gen_range(1..300),
        }
    }

    fn mode(&mut self) -> u32 {
        self.rng.gen_range(0..0o1777) | if self.rng.gen_bool(0.7) { 0o600 } else { 0 }
    }

    /// The next operation, skipping the exact constructs of known bugs.
    fn gen(&mut self) -> Op {
        loop {
            let op = self.gen_any();
            if !self.avoid.dot_names || !self.hits_known_bug(&op) {
                return op;
            }
        }
    }

    /// Whether `op`, in the model's current state, is one of the reported bugs' constructs.
    fn hits_known_bug(&self, op: &Op) -> bool {
        let dots = |s: &Name| s.0 == b"." || s.0 == b"..";
        let m = &self.model;
        let live_dir = |d: u64| m.nodes.get(&d).filter(|n| n.kind == FileKind::Dir);
        match op {
            // Bug 2: a dot name as the entry to remove or move is looked up as a plain name
            // (ENOENT instead of EISDIR / EBUSY).
            Op::Unlink { name, .. } => dots(name),
            Op::Rmdir { dir, name } => dots(name) && live_dir(*dir).is_none_or(|d| d.nlink == 0),
            Op::Rename {
                dir,
                name,
                newdir,
                newname,
                flags,
            } => {
                if dots(name) {
                    return true;
                }
                // Bug 11: names are checked before the flags.
                let bad_flags = flags & !(NOREPLACE | EXCHANGE) != 0 || *flags == 3;
                if bad_flags && (name.0.len() > NAME_MAX || newname.0.len() > NAME_MAX) {
                    return true;
                }
                // Bug 10: rename into a removed directory succeeds.
                if dir != newdir
                    && m.nodes
                        .get(newdir)
                        .is_some_and(|n| n.kind == FileKind::Dir && n.nlink == 0)
                {
                    return true;
                }
                // Bug 3: a non-directory renamed over a directory that is an ancestor of its
                // own parent: EISDIR instead of ENOTEMPTY.
                let (Some(d), Some(nd)) = (live_dir(*dir), live_dir(*newdir)) else {
                    return false;
                };
                let (Some(src), Some(dst)) = (d.children.get(&name.0), nd.children.get(&newname.0))
                else {
                    return false;
                };
                flags & EXCHANGE == 0
                    && dir != newdir
                    && m.node(*src).kind != FileKind::Dir
                    && m.node(*dst).kind == FileKind::Dir
                    && m.is_ancestor(*dst, *dir)
                    && !newname.0.is_empty()
                    && !dots(newname)
            }
            // Bug 4: link checks the source (directory: EPERM; unlinked: ENOENT) before the
            // target directory's state and name (removed directory: ENOENT; EEXIST).
            Op::Link { ino, dir, name } => {
                let exists = live_dir(*dir)
                    .is_some_and(|d| d.children.contains_key(&name.0) || d.nlink == 0);
                let src_bad = m
                    .nodes
                    .get(ino)
                    .is_some_and(|n| n.kind == FileKind::Dir || n.nlink == 0);
                exists && src_bad
            }
            // Bug 7: preallocation past the end of an empty file, then a write while the size
            // is 0: the write goes inline next to the preallocated extent (fsck
            // InlineExtentInvalid). Bug 8: a truncate down when one extent reaches past the
            // end: both drop ranges are planned from the same old extent (double free).
            Op::Write { ino, .. } => m
                .nodes
                .get(ino)
                .is_some_and(|n| n.prealloc_past_eof && n.data.is_empty()),
            Op::Truncate { ino, size, .. } => m
                .nodes
                .get(ino)
                .is_some_and(|n| n.prealloc_past_eof && *size < n.data.len() as u64),
            // Bug 9: fallocate checks EFBIG before the inode (ENOENT, EISDIR) and the
            // PUNCH_HOLE mode rules after the inode type; Linux checks the modes first, then
            // the type, then the size.
            Op::Fallocate {
                ino,
                off,
                len,
                mode,
            } => {
                let regular = m.nodes.get(ino).is_some_and(|n| n.kind == FileKind::File);
                let too_big = off.checked_add(*len).is_none_or(|e| e > MAX_FILE_BYTES);
                let bad_mode =
                    mode & PUNCH_HOLE != 0 && (mode & KEEP_SIZE == 0 || mode & ZERO_RANGE != 0);
                // Bug 11: the mode bits are checked before a zero length.
                let unknown = mode & !(KEEP_SIZE | PUNCH_HOLE | ZERO_RANGE) != 0;
                ((too_big || bad_mode) && !(regular && !(too_big && bad_mode)))
                    || (unknown && *len == 0)
            }
            // Bug 5: mknod of S_IFDIR is EINVAL, not EPERM.
            Op::Mknod { mode, .. } => mode & libc::S_IFMT == libc::S_IFDIR,
            // Bug 6: an empty xattr name is EINVAL, not ERANGE.
            Op::SetXattr { name, .. }
            | Op::GetXattr { name, .. }
            | Op::RemoveXattr { name, .. } => name.0.is_empty(),
            _ => false,
        }
    }

    fn gen_any(&mut self) -> Op {
        let crowded = self.model.nodes.len() > 250;
        let r = self.rng.gen_range(0..1000);
        match r {
            0..=39 => Op::Lookup {
                dir: self.dir_arg(),
                name: self.name_d(true),
            },
            40..=99 => Op::Mkdir {
                dir: self.dir_arg(),
                name: self.name(),
                mode: self.mode(),
            },
            100..=179 => Op::Create {
                dir: self.dir_arg(),
                name: self.name(),
                mode: self.mode(),
            },
            180..=199 => {
                let kinds = [
                    libc::S_IFIFO,
                    libc::S_IFSOCK,
                    libc::S_IFCHR,
                    libc::S_IFBLK,
                    0,
                    libc::S_IFREG,
                    libc::S_IFDIR,
                    libc::S_IFLNK,
                ];
                let k = if self.rng.gen_bool(0.9) {
                    kinds[self.rng.gen_range(0..6)]
                } else {
                    kinds[self.rng.gen_range(6..8)]
                };
                let rdev = if k == libc::S_IFCHR || k == libc::S_IFBLK {
                    self.rng.gen_range(1..1 << 20)
                } else {
                    0
                };
                Op::Mknod {
                    dir: self.dir_arg(),
                    name: self.name(),
                    mode: k | self.mode(),
                    rdev,
                }
            }
            200..=219 => {
                let target_len = match self.rng.gen_range(0..20) {
                    0 => 0,
                    1 => PATH_MAX + self.rng.gen_range(0..3) - 1,
                    2 => self.rng.gen_range(2000..3000),
                    _ => self.rng.gen_range(1..40),
                };
                Op::Symlink {
                    dir: self.dir_arg(),
                    name: self.name(),
                    target_len,
                    seed: self.rng.gen(),
                }
            }
            220..=229 => Op::Readlink {
                ino: self.ino_arg(|n| n.kind == FileKind::Symlink),
            },
            230..=269 => Op::Link {
                ino: {
                    let i = self.ino_arg(|n| n.kind != FileKind::Dir && n.nlink > 0);
                    if self.model.nodes.contains_key(&i) {
                        i
                    } else {
                        self.model.top
                    }
                },
                dir: self.dir_arg(),
                name: self.name(),
            },
            270..=339 => Op::Unlink {
                dir: self.dir_arg(),
                name: self.name_d(true),
            },
            340..=389 => Op::Rmdir {
                dir: self.dir_arg(),
                name: self.name_d(true),
            },
            390..=489 => {
                let flags = match self.rng.gen_range(0..40) {
                    0 => 3,
                    // RENAME_WHITEOUT | RENAME_EXCHANGE: EINVAL. The model has no whiteouts
                    // (tests/whiteout.rs checks them), so a valid whiteout rename is not drawn.
                    1 => 6,
                    2..=7 => NOREPLACE,
                    8..=15 => EXCHANGE,
                    _ => 0,
                };
                Op::Rename {
                    dir: self.dir_arg(),
                    name: self.name_d(true),
                    newdir: self.dir_arg(),
                    newname: self.name(),
                    flags,
                }
            }
            _ if crowded && r < 600 => Op::Unlink {
                dir: self.dir_arg(),
                name: self.name(),
            },
            490..=609 => {
                let ino = self.file_arg();
                let size = self
                    .model
                    .nodes
                    .get(&ino)
                    .map_or(0, |n| n.data.len() as u64);
                let (off, len) = if self.rng.gen_range(0..100) == 0 {
                    (MAX_FILE_BYTES - self.rng.gen_range(0..2), 10)
                } else {
                    (self.offset(size), self.length())
                };
                Op::Write {
                    ino,
                    off,
                    len: len as usize,
                    seed: self.rng.gen(),
                    append: self.rng.gen_range(0..8) == 0,
                }
            }
            610..=659 => {
                let ino = self.file_arg();
                let size = self
                    .model
                    .nodes
                    .get(&ino)
                    .map_or(0, |n| n.data.len() as u64);
                Op::Read {
                    ino,
                    off: self.offset(size),
                    len: self.length() as usize,
                }
            }
            660..=699 => {
                let ino = if self.rng.gen_range(0..10) == 0 {
                    self.ino_arg(|_| true)
                } else {
                    self.file_arg()
                };
                let size = self
                    .model
                    .nodes
                    .get(&ino)
                    .map_or(0, |n| n.data.len() as u64);
                let new = match self.rng.gen_range(0..12) {
                    0 => 0,
                    1 => INLINE_MAX - 1 + self.rng.gen_range(0..3),
                    2 => BLOCK * self.rng.gen_range(1..4) - 1 + self.rng.gen_range(0..3),
                    3 => self.rng.gen_range(0..FAR),
                    4 => size / 2,
                    5 => size + self.rng.gen_range(0..5000),
                    6 => size,
                    7 if self.rng.gen_range(0..4) == 0 => MAX_FILE_BYTES + 1,
                    _ => self.rng.gen_range(0..3 * BLOCK),
                };
                let mode = if self.rng.gen_range(0..5) == 0 {
                    Some(self.mode())
                } else {
                    None
                };
                Op::Truncate {
                    ino,
                    size: new,
                    mode,
                }
            }
            700..=714 => Op::Chmod {
                ino: self.ino_arg(|_| true),
                mode: self.mode(),
            },
            715..=724 => Op::SetMtime {
                ino: self.ino_arg(|_| true),
                mtime: Timespec {
                    sec: self.rng.gen_range(0..2_000_000_000),
                    nsec: self.rng.gen_range(0..1_000_000_000),
                },
            },
            725..=779 => {
                let ino = self.file_arg();
                let size = self
                    .model
                    .nodes
                    .get(&ino)
                    .map_or(0, |n| n.data.len() as u64);
                let mode = match self.rng.gen_range(0..40) {
                    0 => PUNCH_HOLE,
                    1 => PUNCH_HOLE | ZERO_RANGE | KEEP_SIZE,
                    2 => 0x08,
                    3..=8 => 0,
                    9..=15 => KEEP_SIZE,
                    16..=27 => PUNCH_HOLE | KEEP_SIZE,
                    28..=33 => ZERO_RANGE,
                    _ => ZERO_RANGE | KEEP_SIZE,
                };
                let len = match self.rng.gen_range(0..30) {
                    0 => 0,
                    1 => MAX_FILE_BYTES + 1,
                    _ => self.length(),
                };
                Op::Fallocate {
                    ino,
                    off: self.offset(size),
                    len,
                    mode,
                }
            }
            780..=829 => {
                let len = match self.rng.gen_range(0..30) {
                    0 => XATTR_VALUE_MAX + self.rng.gen_range(0..2),
                    1 => 0,
                    3 => XATTR_SIZE_MAX + self.rng.gen_range(0..2),
                    4 => self.rng.gen_range(XATTR_VALUE_MAX..XATTR_SIZE_MAX),
                    2 => self.rng.gen_range(1000..XATTR_VALUE_MAX),
                    _ => self.rng.gen_range(1..200),
                };
                Op::SetXattr {
                    ino: self.ino_arg(|n| matches!(n.kind, FileKind::File | FileKind::Dir)),
                    name: self.xname(),
                    len,
                    seed: self.rng.gen(),
                    flags: self.rng.gen_range(0..4),
                }
            }
            830..=854 => Op::GetXattr {
                ino: self.ino_arg(|n| matches!(n.kind, FileKind::File | FileKind::Dir)),
                name: self.xname(),
            },
            855..=864 => Op::ListXattr {
                ino: self.ino_arg(|n| matches!(n.kind, FileKind::File | FileKind::Dir)),
            },
            865..=889 => Op::RemoveXattr {
                ino: self.ino_arg(|n| matches!(n.kind, FileKind::File | FileKind::Dir)),
                name: self.xname(),
            },
            890..=919 => Op::Readdir {
                dir: self.dir_arg(),
            },
            920..=949 => Op::Getattr {
                ino: self.ino_arg(|_| true),
            },
            960..=969 => {
                // Regular files only (the kernel refuses other kinds before a FUSE server
                // sees the call); offsets that agree within a block most of the time, so the
                // clone path runs, and block-aligned ones often.
                let files = self.model.inos_of(|n| n.kind == FileKind::File);
                let (Some(ino_in), Some(ino_out)) = (self.pick(&files), self.pick(&files)) else {
                    return Op::Sync;
                };
                let size_in = self
                    .model
                    .nodes
                    .get(&ino_in)
                    .map_or(0, |n| n.data.len() as u64);
                let off_in = match self.rng.gen_range(0..4) {
                    0 => 0,
                    1 => self.rng.gen_range(0..4) * BLOCK,
                    _ => self.offset(size_in),
                };
                let off_out = match self.rng.gen_range(0..6) {
                    0 => self.rng.gen_range(0..3 * BLOCK),
                    1 => off_in,
                    _ => off_in % BLOCK + self.rng.gen_range(0..6) * BLOCK,
                };
                let len = match self.rng.gen_range(0..5) {
                    0 => size_in.saturating_sub(off_in) + self.rng.gen_range(0..3),
                    1 => self.rng.gen_range(1..4) * BLOCK,
                    _ => self.length(),
                };
                Op::CopyRange {
                    ino_in,
                    off_in,
                    ino_out,
                    off_out,
                    len,
                }
            }
            950..=959 => {
                let files = self.model.inos_of(|n| n.kind == FileKind::File);
                let Some(ino) = self.pick(&files) else {
                    return Op::Sync;
                };
                let size = self
                    .model
                    .nodes
                    .get(&ino)
                    .map_or(0, |n| n.data.len() as u64);
                Op::Lseek {
                    ino,
                    off: self.offset(size),
                    whence: if self.rng.gen_bool(0.5) {
                        libc::SEEK_DATA
                    } else {
                        libc::SEEK_HOLE
                    },
                }
            }
            970..=979 => Op::Forget {
                ino: self.ino_arg(|n| n.nlink == 0),
            },
            980..=989 => Op::Sync,
            _ => {
                if self.allow_reopen {
                    Op::Reopen
                } else {
                    Op::Sync
                }
            }
        }
    }

    // ---- execution -------------------------------------------------------------------

    /// Checks and records the times an operation set, and the attributes it returned.
    fn touched(&mut self, fs: &Filesystem, op: &Op, t0: Timespec, touches: &[Touch]) {
        let t1 = now();
        for t in touches {
            if !self.model.nodes.contains_key(&t.ino) {
                continue;
            }
            let attr = match fs.getattr(InodeNo::new(t.ino)) {
                Ok(a) => a,
                Err(e) => self.fail(format!("{op:?}: getattr of touched {}: {e}", t.ino)),
            };
            if attr.ctime < t0 || attr.ctime > t1 {
                self.fail(format!(
                    "{op:?}: ctime of {} is {:?}, not between {t0:?} and {t1:?}",
                    t.ino, attr.ctime
                ));
            }
            if t.mtime && (attr.mtime < t0 || attr.mtime > t1) {
                self.fail(format!(
                    "{op:?}: mtime of {} is {:?}, not between {t0:?} and {t1:?}",
                    t.ino, attr.mtime
                ));
            }
            let m = self.model.node_mut(t.ino);
            m.ctime = attr.ctime;
            if t.mtime {
                m.mtime = attr.mtime;
            }
        }
    }

    /// Compares one inode's attributes with the model.
    fn compare_attr(&self, what: &str, ino: u64, a: &Attr, times: bool) {
        let m = self.model.node(ino);
        let size_ok = match m.kind {
            FileKind::File | FileKind::Symlink => a.size == m.data.len() as u64,
            FileKind::Dir => true,
            _ => a.size == 0,
        };
        if a.ino != InodeNo::new(ino)
            || a.kind != m.kind
            || a.perm != m.perm
            || a.nlink != m.nlink
            || !size_ok
            || a.rdev != m.rdev
            || (times && (a.mtime != m.mtime || a.ctime != m.ctime))
        {
            self.fail(format!(
                "{what}: attributes of inode {ino} differ:\n  got   ino {} {:?} perm {:o} nlink {} size {} rdev {} mtime {:?} ctime {:?}\n  model {:?} perm {:o} nlink {} size {} rdev {} mtime {:?} ctime {:?}",
                a.ino, a.kind, a.perm, a.nlink, a.size, a.rdev, a.mtime, a.ctime,
                m.kind, m.perm, m.nlink, m.data.len(), m.rdev, m.mtime, m.ctime
            ));
        }
    }

    fn new_node(&mut self, fs: &Filesystem, dir: u64, name: &[u8], attr: &Attr, node: MNode) {
        let ino = attr.ino;
        if self.model.nodes.contains_key(&ino.get()) {
            self.fail(format!("new inode number {ino} is already in use"));
        }
        self.model.dead.retain(|d| *d != ino.get());
        let mut node = node;
        node.mtime = attr.mtime;
        node.ctime = attr.ctime;
        self.model.nodes.insert(ino.get(), node);
        self.model.add_name(dir, name, ino.get());
        self.compare_attr("new inode", ino.get(), attr, true);
        let _ = fs;
    }

    /// Name checks shared by the entry-making operations; `Ok` carries the parent.
    fn expect_make(&self, dir: u64, name: &[u8]) -> Result<(), i32> {
        if name.len() > NAME_MAX {
            return Err(libc::ENAMETOOLONG);
        }
        let d = self.model.dir(dir)?;
        if name == b"." || name == b".." {
            return Err(libc::EEXIST);
        }
        if d.nlink == 0 {
            return Err(libc::ENOENT);
        }
        if d.children.contains_key(name) {
            return Err(libc::EEXIST);
        }
        Ok(())
    }

    fn step(&mut self, fs: &Filesystem, op: &Op) {
        self.done += 1;
        *self.counts.entry(op.kind()).or_default() += 1;
        self.log.push(format!("{op:?}"));
        if std::env::var_os("BIRCH_FS_TRACE").is_some() {
            eprintln!("op {}: {op:?}", self.done);
        }
        if self.log.len() > 200 {
            self.log.drain(..100);
        }
        let c = Caller::default();
        let t0 = now();
        match op {
            Op::Lookup { dir, name } => {
                let want = (|| {
                    if name.0.len() > NAME_MAX {
                        return Err(libc::ENAMETOOLONG);
                    }
                    if name.0 == b"." {
                        // "." names any inode with names left, not only a directory (file
                        // handles: the kernel resolves one with LOOKUP(ino, ".")).
                        let n = self.model.get(*dir)?;
                        return if n.nlink > 0 {
                            Ok(*dir)
                        } else {
                            Err(libc::ENOENT)
                        };
                    }
                    let d = self.model.dir(*dir)?;
                    match &name.0[..] {
                        b"." if d.nlink > 0 => Ok(*dir),
                        b".." if d.nlink > 0 => Ok(d.parent),
                        b"." | b".." => Err(libc::ENOENT),
                        nm => d.children.get(nm).copied().ok_or(libc::ENOENT),
                    }
                })();
                let got = en(fs.lookup(InodeNo::new(*dir), &name.0));
                if self.outcome(op, &want, &got) {
                    if let (Ok(w), Ok(g)) = (&want, &got) {
                        if *w != g.ino.get() {
                            self.fail(format!("{op:?}: found inode {}, model {w}", g.ino));
                        }
                        if self.model.nodes.contains_key(w) {
                            self.compare_attr("lookup", *w, g, true);
                        }
                    }
                }
            }
            Op::Mkdir { dir, name, mode } => {
                let want = self.expect_make(*dir, &name.0);
                let got = en(fs.mkdir(c, InodeNo::new(*dir), &name.0, *mode));
                if self.outcome(op, &want, &got) {
                    let attr = got.expect("ok");
                    let node = MNode::new(FileKind::Dir, mode & 0o7777, 0, *dir);
                    self.new_node(fs, *dir, &name.0, &attr, node);
                    self.touched(
                        fs,
                        op,
                        t0,
                        &[touch(*dir, true), touch(attr.ino.get(), true)],
                    );
                }
            }
            Op::Create { dir, name, mode } => {
                let want = self.expect_make(*dir, &name.0);
                let got = en(fs.create(c, InodeNo::new(*dir), &name.0, *mode, libc::O_RDWR));
                if self.outcome(op, &want, &got) {
                    let (attr, fh) = got.expect("ok");
                    if let Err(e) = fs.release(attr.ino, fh) {
                        self.fail(format!("release after create: {e}"));
                    }
                    let node = MNode::new(FileKind::File, mode & 0o7777, 0, *dir);
                    self.new_node(fs, *dir, &name.0, &attr, node);
                    self.touched(
                        fs,
                        op,
                        t0,
                        &[touch(*dir, true), touch(attr.ino.get(), true)],
                    );
                }
            }
            Op::Mknod {
                dir,
                name,
                mode,
                rdev,
            } => {
                let want = (|| {
                    match mode & libc::S_IFMT {
                        0
                        | libc::S_IFREG
                        | libc::S_IFIFO
                        | libc::S_IFSOCK
                        | libc::S_IFCHR
                        | libc::S_IFBLK => {}
                        libc::S_IFDIR => return Err(libc::EPERM),
                        _ => return Err(libc::EINVAL),
                    }
                    self.expect_make(*dir, &name.0)
                })();
                let got = en(fs.mknod(c, InodeNo::new(*dir), &name.0, *mode, *rdev));
                if self.outcome(op, &want, &got) {
                    let attr = got.expect("ok");
                    let kind = FileKind::from_mode(*mode);
                    let node = MNode::new(kind, mode & 0o7777, *rdev, *dir);
                    self.new_node(fs, *dir, &name.0, &attr, node);
                    self.touched(
                        fs,
                        op,
                        t0,
                        &[touch(*dir, true), touch(attr.ino.get(), true)],
                    );
                }
            }
            Op::Symlink {
                dir,
                name,
                target_len,
                seed,
            } => {
                let target = pattern(*seed, *target_len)
                    .into_iter()
                    .map(|b| b'!' + b % 90)
                    .map(|b| if b == b'/' { b'_' } else { b })
                    .collect::<Vec<u8>>();
                let want = (|| {
                    if target.len() >= PATH_MAX {
                        return Err(libc::ENAMETOOLONG);
                    }
                    if target.is_empty() {
                        return Err(libc::ENOENT);
                    }
                    self.expect_make(*dir, &name.0)
                })();
                let got = en(fs.symlink(c, InodeNo::new(*dir), &name.0, &target));
                if self.outcome(op, &want, &got) {
                    let attr = got.expect("ok");
                    let mut node = MNode::new(FileKind::Symlink, 0o777, 0, *dir);
                    node.data = target;
                    self.new_node(fs, *dir, &name.0, &attr, node);
                    self.touched(
                        fs,
                        op,
                        t0,
                        &[touch(*dir, true), touch(attr.ino.get(), true)],
                    );
                }
            }
            Op::Readlink { ino } => {
                let want = (|| {
                    let m = self.model.get(*ino)?;
                    if m.kind != FileKind::Symlink {
                        return Err(libc::EINVAL);
                    }
                    Ok(m.data.clone())
                })();
                let got = en(fs.readlink(InodeNo::new(*ino)));
                if self.outcome(op, &want, &got) && want != got {
                    self.fail(format!("{op:?}: target differs"));
                }
            }
            Op::Link { ino, dir, name } => {
                let want = (|| {
                    if name.0.len() > NAME_MAX {
                        return Err(libc::ENAMETOOLONG);
                    }
                    let d = self.model.dir(*dir)?;
                    if name.0 == b"." || name.0 == b".." {
                        return Err(libc::EEXIST);
                    }
                    if d.nlink == 0 {
                        return Err(libc::ENOENT);
                    }
                    if d.children.contains_key(&name.0) {
                        return Err(libc::EEXIST);
                    }
                    let m = self.model.get(*ino)?;
                    if m.kind == FileKind::Dir {
                        return Err(libc::EPERM);
                    }
                    if m.nlink == 0 {
                        return Err(libc::ENOENT);
                    }
                    Ok(())
                })();
                let got = en(fs.link(InodeNo::new(*ino), InodeNo::new(*dir), &name.0));
                if self.outcome(op, &want, &got) {
                    self.model.node_mut(*ino).nlink += 1;
                    self.model.add_name(*dir, &name.0, *ino);
                    let attr = got.expect("ok");
                    self.touched(fs, op, t0, &[touch(*dir, true), touch(*ino, false)]);
                    self.compare_attr("link", *ino, &attr, true);
                }
            }
            Op::Unlink { dir, name } => {
                let want = (|| {
                    if name.0.len() > NAME_MAX {
                        return Err(libc::ENAMETOOLONG);
                    }
                    let d = self.model.dir(*dir)?;
                    if name.0 == b"." || name.0 == b".." {
                        return Err(libc::EISDIR);
                    }
                    let child = *d.children.get(&name.0).ok_or(libc::ENOENT)?;
                    if self.model.node(child).kind == FileKind::Dir {
                        return Err(libc::EISDIR);
                    }
                    Ok(child)
                })();
                let got = en(fs.unlink(InodeNo::new(*dir), &name.0));
                if self.outcome(op, &want, &got) {
                    let child = self.model.remove_name(*dir, &name.0);
                    self.touched(fs, op, t0, &[touch(*dir, true), touch(child, false)]);
                }
            }
            Op::Rmdir { dir, name } => {
                let want = (|| {
                    if name.0.len() > NAME_MAX {
                        return Err(libc::ENAMETOOLONG);
                    }
                    let d = self.model.dir(*dir)?;
                    if name.0 == b"." {
                        return Err(libc::EINVAL);
                    }
                    if name.0 == b".." {
                        return Err(libc::ENOTEMPTY);
                    }
                    let child = *d.children.get(&name.0).ok_or(libc::ENOENT)?;
                    let cm = self.model.node(child);
                    if cm.kind != FileKind::Dir {
                        return Err(libc::ENOTDIR);
                    }
                    if !cm.children.is_empty() {
                        return Err(libc::ENOTEMPTY);
                    }
                    Ok(child)
                })();
                let got = en(fs.rmdir(InodeNo::new(*dir), &name.0));
                if self.outcome(op, &want, &got) {
                    let child = self.model.remove_name(*dir, &name.0);
                    self.touched(fs, op, t0, &[touch(*dir, true), touch(child, false)]);
                }
            }
            Op::Rename {
                dir,
                name,
                newdir,
                newname,
                flags,
            } => self.rename(fs, op, t0, *dir, &name.0, *newdir, &newname.0, *flags),
            Op::Write {
                ino,
                off,
                len,
                seed,
                append,
            } => {
                let bytes = pattern(*seed, *len);
                let want = (|| {
                    let m = self.model.get(*ino)?;
                    if m.kind == FileKind::Dir {
                        return Err(libc::EISDIR);
                    }
                    let at = if *append { m.data.len() as u64 } else { *off };
                    if at + bytes.len() as u64 > MAX_FILE_BYTES {
                        return Err(libc::EFBIG);
                    }
                    Ok(bytes.len() as u32)
                })();
                let got = en(fs.write(InodeNo::new(*ino), *off, &bytes, *append));
                if self.outcome(op, &want, &got) {
                    if want != got {
                        self.fail(format!("{op:?}: wrote {got:?}, expected {want:?}"));
                    }
                    let m = self.model.node_mut(*ino);
                    let at = if *append { m.data.len() } else { *off as usize };
                    if m.data.len() < at + bytes.len() {
                        m.data.resize(at + bytes.len(), 0);
                    }
                    m.data[at..at + bytes.len()].copy_from_slice(&bytes);
                    self.touched(fs, op, t0, &[touch(*ino, true)]);
                }
            }
            Op::Read { ino, off, len } => {
                let want = (|| {
                    let m = self.model.get(*ino)?;
                    if m.kind == FileKind::Dir {
                        return Err(libc::EISDIR);
                    }
                    let size = m.data.len() as u64;
                    if *off >= size {
                        return Ok(Vec::new());
                    }
                    let end = size.min(off + *len as u64);
                    Ok(m.data[*off as usize..end as usize].to_vec())
                })();
                let got = en(fs.read(InodeNo::new(*ino), *off, *len));
                if self.outcome(op, &want, &got) && want != got {
                    let w = want.expect("ok");
                    let g = got.expect("ok");
                    let first = w.iter().zip(g.iter()).position(|(a, b)| a != b);
                    self.fail(format!(
                        "{op:?}: read {} bytes, expected {}; first difference at +{first:?}",
                        g.len(),
                        w.len()
                    ));
                }
            }
            Op::Truncate { ino, size, mode } => {
                let want = (|| {
                    let m = self.model.get(*ino)?;
                    match m.kind {
                        FileKind::Dir => return Err(libc::EISDIR),
                        FileKind::File => {}
                        _ => return Err(libc::EINVAL),
                    }
                    if *size > MAX_FILE_BYTES {
                        return Err(libc::EFBIG);
                    }
                    Ok(())
                })();
                let set = SetAttr {
                    size: Some(*size),
                    mode: *mode,
                    ..Default::default()
                };
                let got = en(fs.setattr(InodeNo::new(*ino), &set));
                if self.outcome(op, &want, &got) {
                    let m = self.model.node_mut(*ino);
                    m.data.resize(*size as usize, 0);
                    if let Some(mode) = mode {
                        m.perm = mode & 0o7777;
                    }
                    self.touched(fs, op, t0, &[touch(*ino, true)]);
                    self.compare_attr("setattr", *ino, &got.expect("ok"), true);
                }
            }
            Op::Chmod { ino, mode } => {
                let want = self.model.get(*ino).map(|_| ());
                let set = SetAttr {
                    mode: Some(*mode),
                    ..Default::default()
                };
                let got = en(fs.setattr(InodeNo::new(*ino), &set));
                if self.outcome(op, &want, &got) {
                    self.model.node_mut(*ino).perm = mode & 0o7777;
                    self.touched(fs, op, t0, &[touch(*ino, false)]);
                    self.compare_attr("chmod", *ino, &got.expect("ok"), true);
                }
            }
            Op::SetMtime { ino, mtime } => {
                let want = self.model.get(*ino).map(|_| ());
                let set = SetAttr {
                    mtime: Some(SetTime::At(*mtime)),
                    ..Default::default()
                };
                let got = en(fs.setattr(InodeNo::new(*ino), &set));
                if self.outcome(op, &want, &got) {
                    self.model.node_mut(*ino).mtime = *mtime;
                    self.touched(fs, op, t0, &[touch(*ino, false)]);
                    self.compare_attr("utimes", *ino, &got.expect("ok"), true);
                }
            }
            Op::Fallocate {
                ino,
                off,
                len,
                mode,
            } => {
                let want = (|| {
                    if *len == 0 {
                        return Err(libc::EINVAL);
                    }
                    if mode & !(KEEP_SIZE | PUNCH_HOLE | ZERO_RANGE) != 0 {
                        return Err(libc::EOPNOTSUPP);
                    }
                    if mode & PUNCH_HOLE != 0 && mode & ZERO_RANGE != 0 {
                        return Err(libc::EOPNOTSUPP);
                    }
                    if mode & PUNCH_HOLE != 0 && mode & KEEP_SIZE == 0 {
                        return Err(libc::EOPNOTSUPP);
                    }
                    let m = self.model.get(*ino)?;
                    if m.kind == FileKind::Dir {
                        return Err(libc::EISDIR);
                    }
                    if off.checked_add(*len).is_none_or(|e| e > MAX_FILE_BYTES) {
                        return Err(libc::EFBIG);
                    }
                    Ok(())
                })();
                let got = en(fs.fallocate(InodeNo::new(*ino), *off, *len, *mode));
                if self.outcome(op, &want, &got) {
                    let m = self.model.node_mut(*ino);
                    let size = m.data.len() as u64;
                    let end = off + len;
                    if mode & (PUNCH_HOLE | ZERO_RANGE) != 0 {
                        let hi = end.min(size);
                        if *off < hi {
                            m.data[*off as usize..hi as usize].fill(0);
                        }
                    }
                    if mode & KEEP_SIZE == 0 && end > size {
                        m.data.resize(end as usize, 0);
                    }
                    if *mode == KEEP_SIZE && end > size {
                        m.prealloc_past_eof = true;
                    }
                    self.touched(fs, op, t0, &[touch(*ino, true)]);
                }
            }
            Op::SetXattr {
                ino,
                name,
                len,
                seed,
                flags,
            } => {
                let value = pattern(*seed, *len);
                let want = (|| {
                    if name.0.is_empty() || name.0.len() > NAME_MAX {
                        return Err(libc::ERANGE);
                    }
                    if value.len() > XATTR_SIZE_MAX {
                        return Err(libc::E2BIG);
                    }
                    let m = self.model.get(*ino)?;
                    let exists = m.xattrs.contains_key(&name.0);
                    if flags & XATTR_CREATE != 0 && exists {
                        return Err(libc::EEXIST);
                    }
                    if flags & XATTR_REPLACE != 0 && !exists {
                        return Err(libc::ENODATA);
                    }
                    Ok(())
                })();
                let got = en(fs.setxattr(InodeNo::new(*ino), &name.0, &value, *flags));
                if self.outcome(op, &want, &got) {
                    self.model
                        .node_mut(*ino)
                        .xattrs
                        .insert(name.0.clone(), value);
                    self.touched(fs, op, t0, &[touch(*ino, false)]);
                }
            }
            Op::GetXattr { ino, name } => {
                let want = (|| {
                    if name.0.is_empty() || name.0.len() > NAME_MAX {
                        return Err(libc::ERANGE);
                    }
                    let m = self.model.get(*ino)?;
                    m.xattrs.get(&name.0).cloned().ok_or(libc::ENODATA)
                })();
                let got = en(fs.getxattr(InodeNo::new(*ino), &name.0));
                if self.outcome(op, &want, &got) && want != got {
                    self.fail(format!("{op:?}: value differs"));
                }
            }
            Op::ListXattr { ino } => {
                let want = self
                    .model
                    .get(*ino)
                    .map(|m| m.xattrs.keys().cloned().collect::<BTreeSet<_>>());
                let got = en(fs.listxattr(InodeNo::new(*ino))).map(|l| split_names(&l));
                if self.outcome(op, &want, &got) && want != got {
                    self.fail(format!("{op:?}: names {got:?}, expected {want:?}"));
                }
            }
            Op::RemoveXattr { ino, name } => {
                let want = (|| {
                    if name.0.is_empty() || name.0.len() > NAME_MAX {
                        return Err(libc::ERANGE);
                    }
                    let m = self.model.get(*ino)?;
                    if m.xattrs.contains_key(&name.0) {
                        Ok(())
                    } else {
                        Err(libc::ENODATA)
                    }
                })();
                let got = en(fs.removexattr(InodeNo::new(*ino), &name.0));
                if self.outcome(op, &want, &got) {
                    self.model.node_mut(*ino).xattrs.remove(&name.0);
                    self.touched(fs, op, t0, &[touch(*ino, false)]);
                }
            }
            Op::Readdir { dir } => {
                let want = (|| {
                    let d = self.model.dir(*dir)?;
                    if d.nlink == 0 {
                        return Err(libc::ENOENT);
                    }
                    Ok(())
                })();
                let got = en(fs.readdir(InodeNo::new(*dir), 0, 10_000));
                if self.outcome(op, &want, &got) {
                    self.compare_dir(fs, *dir);
                }
            }
            Op::Getattr { ino } => {
                let want = self.model.get(*ino).map(|_| ());
                let got = en(fs.getattr(InodeNo::new(*ino)));
                if self.outcome(op, &want, &got) {
                    self.compare_attr("getattr", *ino, &got.expect("ok"), true);
                }
            }
            Op::CopyRange {
                ino_in,
                off_in,
                ino_out,
                off_out,
                len,
            } => {
                let want = (|| {
                    let size_in = self.model.get(*ino_in)?.data.len() as u64;
                    self.model.get(*ino_out)?;
                    if *len == 0 || *off_in >= size_in {
                        return Ok(0u64);
                    }
                    let n = (*len).min(size_in - off_in);
                    if off_out.checked_add(n).is_none_or(|e| e > MAX_FILE_BYTES) {
                        return Err(libc::EFBIG);
                    }
                    if ino_in == ino_out && *off_in < off_out + n && *off_out < off_in + n {
                        return Err(libc::EINVAL);
                    }
                    Ok(n)
                })();
                let got = en(fs.copy_file_range(
                    InodeNo::new(*ino_in),
                    *off_in,
                    InodeNo::new(*ino_out),
                    *off_out,
                    *len,
                ));
                if self.outcome(op, &want, &got) {
                    if want != got {
                        self.fail(format!("{op:?}: copied {got:?}, expected {want:?}"));
                    }
                    let n = want.unwrap_or(0) as usize;
                    if n > 0 {
                        let bytes = self.model.nodes[ino_in].data
                            [*off_in as usize..*off_in as usize + n]
                            .to_vec();
                        let m = self.model.node_mut(*ino_out);
                        let at = *off_out as usize;
                        if m.data.len() < at + n {
                            m.data.resize(at + n, 0);
                        }
                        m.data[at..at + n].copy_from_slice(&bytes);
                        self.touched(fs, op, t0, &[touch(*ino_out, true)]);
                    }
                }
            }
            Op::Lseek { ino, off, whence } => {
                let want = (|| {
                    let m = self.model.get(*ino)?;
                    if m.kind == FileKind::Dir {
                        return Err(libc::EISDIR);
                    }
                    if *off >= m.data.len() as u64 {
                        return Err(libc::ENXIO);
                    }
                    Ok(())
                })();
                let got = en(fs.lseek(InodeNo::new(*ino), *off, *whence));
                let m_ok = want.is_ok();
                // SEEK_DATA may find no data before the end: ENXIO is right when the rest is
                // all zeros.
                let tail_zero = m_ok && {
                    let d = &self.model.node(*ino).data;
                    d[*off as usize..].iter().all(|b| *b == 0)
                };
                if *whence == libc::SEEK_DATA && tail_zero && got == Err(libc::ENXIO) {
                    return;
                }
                if self.outcome(op, &want, &got) {
                    let r = got.expect("ok");
                    let d = &self.model.node(*ino).data;
                    let size = d.len() as u64;
                    let ok = if *whence == libc::SEEK_DATA {
                        r >= *off
                            && r < size
                            && d[*off as usize..r as usize].iter().all(|b| *b == 0)
                    } else {
                        r >= *off
                            && r <= size
                            && (r == size
                                || d[r as usize..((r / BLOCK + 1) * BLOCK).min(size) as usize]
                                    .iter()
                                    .all(|b| *b == 0))
                    };
                    if !ok {
                        self.fail(format!("{op:?}: answered {r} (size {size})"));
                    }
                }
            }
            Op::Forget { ino } => {
                fs.forget(InodeNo::new(*ino), u64::MAX);
                if let Some(m) = self.model.nodes.get(ino) {
                    if m.nlink == 0 {
                        self.model.nodes.remove(ino);
                        self.model.dead.push(*ino);
                    }
                }
            }
            Op::Sync => {
                if let Err(e) = fs.sync() {
                    self.fail(format!("sync: {e}"));
                }
                self.compare_all(fs, "after sync");
            }
            Op::Reopen => unreachable!("handled by the driver"),
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn rename(
        &mut self,
        fs: &Filesystem,
        op: &Op,
        t0: Timespec,
        dir: u64,
        name: &[u8],
        newdir: u64,
        newname: &[u8],
        flags: u32,
    ) {
        let model = &self.model;
        let want: Result<Option<(u64, Option<u64>)>, i32> = (|| {
            // RENAME_WHITEOUT (4) is valid alone or with NOREPLACE; never with EXCHANGE.
            if flags & !(NOREPLACE | EXCHANGE | 4) != 0
                || (flags & (NOREPLACE | 4) != 0 && flags & EXCHANGE != 0)
            {
                return Err(libc::EINVAL);
            }
            if name.len() > NAME_MAX || newname.len() > NAME_MAX {
                return Err(libc::ENAMETOOLONG);
            }
            let d = model.dir(dir)?;
            let nd = model.dir(newdir)?;
            let dots = |s: &[u8]| s == b"." || s == b"..";
            if dots(name) {
                return Err(libc::EBUSY);
            }
            if dots(newname) {
                return Err(if flags & NOREPLACE != 0 {
                    libc::EEXIST
                } else {
                    libc::EBUSY
                });
            }
            let src = *d.children.get(name).ok_or(libc::ENOENT)?;
            if nd.nlink == 0 {
                return Err(libc::ENOENT);
            }
            let dst = nd.children.get(newname).copied();
            if flags & NOREPLACE != 0 && dst.is_some() {
                return Err(libc::EEXIST);
            }
            if flags & EXCHANGE != 0 && dst.is_none() {
                return Err(libc::ENOENT);
            }
            let src_dir = model.node(src).kind == FileKind::Dir;
            if dir != newdir {
                if src_dir && model.is_ancestor(src, newdir) {
                    return Err(libc::EINVAL);
                }
                if let Some(t) = dst {
                    if model.node(t).kind == FileKind::Dir && model.is_ancestor(t, dir) {
                        return Err(if flags & EXCHANGE != 0 {
                            libc::EINVAL
                        } else {
                            libc::ENOTEMPTY
                        });
                    }
                }
            }
            if dst == Some(src) {
                return Ok(None);
            }
            if let (Some(t), true) = (dst, flags & EXCHANGE == 0) {
                let tm = model.node(t);
                let dst_dir = tm.kind == FileKind::Dir;
                if src_dir && !dst_dir {
                    return Err(libc::ENOTDIR);
                }
                if !src_dir && dst_dir {
                    return Err(libc::EISDIR);
                }
                if dst_dir && !tm.children.is_empty() {
                    return Err(libc::ENOTEMPTY);
                }
            }
            Ok(Some((src, dst)))
        })();
        let got = en(fs.rename(
            InodeNo::new(dir),
            name,
            InodeNo::new(newdir),
            newname,
            flags,
        ));
        if !self.outcome(op, &want, &got) {
            return;
        }
        let Some((src, dst)) = want.expect("ok") else {
            return;
        };
        let mut touches = vec![touch(dir, true), touch(newdir, true), touch(src, false)];
        if flags & EXCHANGE != 0 {
            let dst = dst.expect("exchange target");
            let m = &mut self.model;
            m.node_mut(dir).children.insert(name.to_vec(), dst);
            m.node_mut(newdir).children.insert(newname.to_vec(), src);
            for (ino, from, to) in [(src, dir, newdir), (dst, newdir, dir)] {
                if m.node(ino).kind == FileKind::Dir {
                    m.node_mut(ino).parent = to;
                    m.node_mut(from).nlink -= 1;
                    m.node_mut(to).nlink += 1;
                }
            }
            touches.push(touch(dst, false));
        } else {
            if let Some(t) = dst {
                self.model.remove_name(newdir, newname);
                touches.push(touch(t, false));
            }
            self.model.remove_name(dir, name);
            // remove_name dropped the moved inode's link; give it back.
            if self.model.node(src).kind == FileKind::Dir {
                self.model.node_mut(src).nlink = 2 + self.model.subdirs(src);
            } else {
                self.model.node_mut(src).nlink += 1;
            }
            self.model.add_name(newdir, newname, src);
        }
        self.touched(fs, op, t0, &touches);
    }

    // ---- whole-tree comparison ---------------------------------------------------------

    fn compare_dir(&self, fs: &Filesystem, dir: u64) {
        let m = self.model.node(dir);
        let full = match fs.readdir(InodeNo::new(dir), 0, 100_000) {
            Ok(v) => v,
            Err(e) => self.fail(format!("readdir {dir}: {e}")),
        };
        if full.len() < 2
            || full[0].name != b"."
            || full[0].ino != InodeNo::new(dir)
            || full[1].name != b".."
            || full[1].ino != InodeNo::new(m.parent)
            || full[0].kind != FileKind::Dir
            || full[1].kind != FileKind::Dir
        {
            self.fail(format!(
                "readdir {dir}: dot entries {:?}, parent should be {}",
                &full[..full.len().min(2)],
                m.parent
            ));
        }
        let got: BTreeMap<Vec<u8>, (u64, FileKind)> = full[2..]
            .iter()
            .map(|e| (e.name.clone(), (e.ino.get(), e.kind)))
            .collect();
        if got.len() != full.len() - 2 {
            self.fail(format!("readdir {dir}: duplicate names in {full:?}"));
        }
        let want: BTreeMap<Vec<u8>, (u64, FileKind)> = m
            .children
            .iter()
            .map(|(k, v)| (k.clone(), (*v, self.model.node(*v).kind)))
            .collect();
        if got != want {
            let show = |m: &BTreeMap<Vec<u8>, (u64, FileKind)>| {
                m.iter()
                    .map(|(k, v)| format!("{}={}:{:?}", String::from_utf8_lossy(k), v.0, v.1))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            self.fail(format!(
                "readdir {dir}: got [{}], model [{}]",
                show(&got),
                show(&want)
            ));
        }
        // Paged: every page continues at the cookie of the last entry.
        let mut paged = Vec::new();
        let mut offset = 0;
        let limit = 1 + (dir as usize % 3);
        loop {
            let page = match fs.readdir(InodeNo::new(dir), offset, limit) {
                Ok(v) => v,
                Err(e) => self.fail(format!("readdir {dir} at {offset}: {e}")),
            };
            if page.is_empty() {
                break;
            }
            if page.len() > limit {
                self.fail(format!(
                    "readdir {dir}: {} entries past limit {limit}",
                    page.len()
                ));
            }
            offset = page.last().map_or(offset, |e| e.next_offset);
            paged.extend(page);
            if paged.len() > full.len() + 5 {
                self.fail(format!("readdir {dir}: paging does not end"));
            }
        }
        if paged != full {
            self.fail(format!(
                "readdir {dir}: paged listing differs from one-shot"
            ));
        }
    }

    fn compare_all(&self, fs: &Filesystem, what: &str) {
        for (&ino, m) in &self.model.nodes {
            let attr = match fs.getattr(InodeNo::new(ino)) {
                Ok(a) => a,
                Err(e) => self.fail(format!("{what}: getattr {ino}: {e}")),
            };
            self.compare_attr(what, ino, &attr, true);
            match m.kind {
                FileKind::Dir if m.nlink > 0 => {
                    if m.nlink != 2 + self.model.subdirs(ino) {
                        self.fail(format!("{what}: model nlink of dir {ino} is off"));
                    }
                    self.compare_dir(fs, ino);
                    for (name, child) in &m.children {
                        match fs.lookup(InodeNo::new(ino), name) {
                            Ok(a) if a.ino == InodeNo::new(*child) => {}
                            other => self.fail(format!(
                                "{what}: lookup {:?} in {ino}: {other:?}, expected {child}",
                                String::from_utf8_lossy(name)
                            )),
                        }
                    }
                }
                FileKind::File => match fs.read(InodeNo::new(ino), 0, m.data.len() + 100) {
                    Ok(d) if d == m.data => {}
                    Ok(d) => {
                        let first = d.iter().zip(m.data.iter()).position(|(a, b)| a != b);
                        self.fail(format!(
                            "{what}: content of {ino}: {} bytes, expected {}; first difference at {first:?}",
                            d.len(),
                            m.data.len()
                        ))
                    }
                    Err(e) => self.fail(format!("{what}: read {ino}: {e}")),
                },
                FileKind::Symlink => match fs.readlink(InodeNo::new(ino)) {
                    Ok(t) if t == m.data => {}
                    other => self.fail(format!("{what}: readlink {ino}: {other:?}")),
                },
                _ => {}
            }
            let names = match fs.listxattr(InodeNo::new(ino)) {
                Ok(l) => split_names(&l),
                Err(e) => self.fail(format!("{what}: listxattr {ino}: {e}")),
            };
            let want: BTreeSet<Vec<u8>> = m.xattrs.keys().cloned().collect();
            if names != want {
                self.fail(format!(
                    "{what}: xattr names of {ino}: {names:?}, expected {want:?}"
                ));
            }
            for (k, v) in &m.xattrs {
                match fs.getxattr(InodeNo::new(ino), k) {
                    Ok(g) if g == *v => {}
                    other => self.fail(format!(
                        "{what}: xattr {:?} of {ino}: {:?}",
                        String::from_utf8_lossy(k),
                        other.map(|g| g.len())
                    )),
                }
            }
        }
        for &ino in &self.model.dead {
            if !self.model.nodes.contains_key(&ino) {
                if let Ok(a) = fs.getattr(InodeNo::new(ino)) {
                    self.fail(format!(
                        "{what}: freed inode {ino} still has attributes {a:?}"
                    ));
                }
            }
        }
    }
}

fn split_names(list: &[u8]) -> BTreeSet<Vec<u8>> {
    list.split(|b| *b == 0)
        .filter(|s| !s.is_empty())
        .map(|s| s.to_vec())
        .collect()
}

fn new_device() -> Arc<MemDevice> {
    let dev = Arc::new(MemDevice::new(DEVICE_BYTES));
    Filesystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
    dev
}

/// Opens with a parallel-apply threshold of 16 changed items, so commits of these small trees
/// take the parallel path (plan, jobs, assembly; helpers in the concurrent variant) too.
fn open(dev: &Arc<MemDevice>) -> Filesystem {
    let fs = Filesystem::open_device(dev.clone(), quiet()).expect("open");
    fs.engine().set_parallel_apply_min(16);
    fs
}

fn reopen(fs: Filesystem, dev: &Arc<MemDevice>, what: &str) -> Filesystem {
    fs.close().expect("close");
    drop(fs);
    assert_clean(dev, what);
    open(dev)
}

/// Runs `ops` generated operations on a fresh filesystem; returns the runner (its counts
/// and errno mismatches).
fn run_case(seed: u64, ops: u64) -> Runner {
    let dev = new_device();
    let mut fs = open(&dev);
    let root = fs.getattr(ROOT).expect("root");
    let mut r = Runner::new(seed, Model::new(ROOT.get(), ROOT.get(), &root), true);
    for _ in 0..ops {
        let op = r.gen();
        if let Op::Reopen = op {
            r.done += 1;
            *r.counts.entry("Reopen".into()).or_default() += 1;
            r.log.push("Reopen".into());
            if std::env::var_os("BIRCH_FS_TRACE").is_some() {
                eprintln!("op {}: Reopen", r.done);
            }
            fs = reopen(fs, &dev, &format!("seed {seed} after {} ops", r.done));
            r.model.after_close();
            r.compare_all(&fs, "after reopen");
        } else {
            r.step(&fs, &op);
        }
    }
    r.compare_all(&fs, "end of sequence");
    fs = reopen(fs, &dev, &format!("seed {seed} at the end"));
    r.model.after_close();
    r.compare_all(&fs, "after the final reopen");
    fs.close().expect("close");
    drop(fs);
    assert_clean(&dev, &format!("seed {seed} final"));
    r
}

fn report(name: &str, runners: &[Runner]) {
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    let mut mismatches: BTreeMap<String, String> = BTreeMap::new();
    for r in runners {
        for (k, v) in &r.counts {
            *counts.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &r.mismatches {
            mismatches
                .entry(k.clone())
                .or_insert_with(|| format!("seed {}: {v}", r.seed));
        }
    }
    eprintln!(
        "{name}: operations by kind: {}",
        counts
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    assert!(
        mismatches.is_empty(),
        "{name}: errno differs from Linux:\n{}",
        mismatches
            .iter()
            .map(|(k, v)| format!("  {k}  (e.g. {v})"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn fs_matches_model() {
    let ops = env("BIRCH_FS_OPS", 2000);
    let seeds = birch_testkit::seeds::cases("fs_model", 0xf5_0000, env("BIRCH_FS_CASES", 30));
    let cases = seeds.len() as u64;
    let mut runners = Vec::new();
    for (case, seed) in seeds.into_iter().enumerate() {
        eprintln!("fs_model: case {case} seed {seed} ({ops} ops); replay with BIRCH_SEED={seed}");
        runners.push(run_case(seed, ops));
    }
    report("fs_model", &runners);
    eprintln!(
        "fs_model: {cases} cases x {ops} ops = {} operations, all matched; fsck clean",
        cases * ops
    );
}

/// Threads in disjoint subtrees of one filesystem, each with its own model.
fn run_concurrent(seed: u64, threads: u64, ops: u64) -> Vec<Runner> {
    let dev = new_device();
    let fs = open(&dev);
    let mut runners = Vec::new();
    for t in 0..threads {
        let top = fs
            .mkdir(Caller::default(), ROOT, format!("t{t}").as_bytes(), 0o755)
            .expect("mkdir");
        runners.push(Runner::new(
            seed.wrapping_add(t * 1_000_003),
            Model::new(top.ino.get(), ROOT.get(), &top),
            false,
        ));
    }
    let fs_ref = &fs;
    std::thread::scope(|s| {
        for r in runners.iter_mut() {
            s.spawn(move || {
                for _ in 0..ops {
                    let op = r.gen();
                    r.step(fs_ref, &op);
                }
            });
        }
    });
    for r in &runners {
        r.compare_all(&fs, "concurrent: end");
    }
    let fs = reopen(fs, &dev, &format!("concurrent seed {seed}"));
    for r in runners.iter_mut() {
        r.model.after_close();
        r.compare_all(&fs, "concurrent: after reopen");
    }
    fs.close().expect("close");
    drop(fs);
    assert_clean(&dev, &format!("concurrent seed {seed} final"));
    runners
}

#[test]
fn fs_concurrent_subtrees_match_models() {
    let ops = env("BIRCH_FS_OPS", 2000);
    let seeds = birch_testkit::seeds::cases(
        "fs_model concurrent",
        0xf5c0_0000,
        env("BIRCH_FS_CONCURRENT_CASES", 4),
    );
    let mut all = Vec::new();
    for seed in seeds {
        let threads = 2 + seed % 3;
        eprintln!(
            "fs_model concurrent: seed {seed}, {threads} threads x {ops} ops; replay with BIRCH_SEED={seed}"
        );
        all.extend(run_concurrent(seed, threads, ops));
    }
    report("fs_model concurrent", &all);
}

// ---- bugs found by the model, each with a fixed operation list ---------------------------

fn errno_of<T: std::fmt::Debug>(r: birch_core::Result<T>) -> Result<T, String> {
    r.map_err(|e| errname(e.errno()))
}

#[test]
// Regression (was bug 1): "." and ".." are accepted as new entry names (mkdir/create/mknod/symlink/link/rename)
fn bug_dot_names_become_entries() {
    let dev = new_device();
    let fs = open(&dev);
    let c = Caller::default();
    let f = fs.create(c, ROOT, b"f", 0o644, 0).expect("create").0;
    assert_eq!(
        errno_of(fs.mkdir(c, ROOT, b".", 0o755)).err().as_deref(),
        Some("EEXIST")
    );
    assert_eq!(
        errno_of(fs.mkdir(c, ROOT, b"..", 0o755)).err().as_deref(),
        Some("EEXIST")
    );
    assert_eq!(
        errno_of(fs.link(f.ino, ROOT, b".")).err().as_deref(),
        Some("EEXIST")
    );
    assert_eq!(
        errno_of(fs.rename(ROOT, b"f", ROOT, b"..", 0))
            .err()
            .as_deref(),
        Some("EBUSY")
    );
    fs.close().expect("close");
    drop(fs);
    assert_clean(&dev, "bug 1");
}

#[test]
// Regression (was bug 2): unlink/rename of "." or ".." give ENOENT, Linux EISDIR / EBUSY
fn bug_dot_names_removed_or_moved() {
    let dev = new_device();
    let fs = open(&dev);
    let c = Caller::default();
    fs.mkdir(c, ROOT, b"d", 0o755).expect("mkdir");
    assert_eq!(
        errno_of(fs.unlink(ROOT, b".")).err().as_deref(),
        Some("EISDIR")
    );
    assert_eq!(
        errno_of(fs.unlink(ROOT, b"..")).err().as_deref(),
        Some("EISDIR")
    );
    assert_eq!(
        errno_of(fs.rename(ROOT, b".", ROOT, b"x", 0))
            .err()
            .as_deref(),
        Some("EBUSY")
    );
}

#[test]
// Regression (was bug 3): a file renamed over a directory that is an ancestor of its parent gives EISDIR, Linux ENOTEMPTY
fn bug_rename_file_over_ancestor() {
    let dev = new_device();
    let fs = open(&dev);
    let c = Caller::default();
    let x = fs.mkdir(c, ROOT, b"x", 0o755).expect("mkdir x");
    let y = fs.mkdir(c, x.ino, b"y", 0o755).expect("mkdir y");
    fs.create(c, y.ino, b"f", 0o644, 0).expect("create");
    // rename("/x/y/f", "/x"): the target is an ancestor of the source.
    assert_eq!(
        errno_of(fs.rename(y.ino, b"f", ROOT, b"x", 0))
            .err()
            .as_deref(),
        Some("ENOTEMPTY")
    );
}

#[test]
// Regression (was bug 4): link checks its source (EPERM for a directory, ENOENT for an unlinked file) before EEXIST
fn bug_link_error_order() {
    let dev = new_device();
    let fs = open(&dev);
    let c = Caller::default();
    let d = fs.mkdir(c, ROOT, b"d", 0o755).expect("mkdir");
    fs.create(c, ROOT, b"f", 0o644, 0).expect("create f");
    let g = fs.create(c, ROOT, b"g", 0o644, 0).expect("create g").0;
    fs.unlink(ROOT, b"g").expect("unlink g");
    assert_eq!(
        errno_of(fs.link(d.ino, ROOT, b"f")).err().as_deref(),
        Some("EEXIST")
    );
    assert_eq!(
        errno_of(fs.link(g.ino, ROOT, b"f")).err().as_deref(),
        Some("EEXIST")
    );
}

#[test]
// Regression (was bug 5): mknod with S_IFDIR gives EINVAL, Linux EPERM
fn bug_mknod_dir_errno() {
    let dev = new_device();
    let fs = open(&dev);
    let r = fs.mknod(Caller::default(), ROOT, b"x", libc::S_IFDIR | 0o755, 0);
    assert_eq!(errno_of(r).err().as_deref(), Some("EPERM"));
}

#[test]
// Regression (was bug 6): an empty xattr name gives EINVAL, Linux ERANGE
fn bug_empty_xattr_name_errno() {
    let dev = new_device();
    let fs = open(&dev);
    assert_eq!(
        errno_of(fs.setxattr(ROOT, b"", b"v", 0)).err().as_deref(),
        Some("ERANGE")
    );
    assert_eq!(
        errno_of(fs.getxattr(ROOT, b"")).err().as_deref(),
        Some("ERANGE")
    );
    assert_eq!(
        errno_of(fs.removexattr(ROOT, b"")).err().as_deref(),
        Some("ERANGE")
    );
}

#[test]
// Regression (was bug 7): fallocate KEEP_SIZE on an empty file, then a small write: inline extent next to the preallocated one (fsck InlineExtentInvalid)
fn bug_inline_write_beside_prealloc() {
    let dev = new_device();
    let fs = open(&dev);
    let f = fs
        .create(Caller::default(), ROOT, b"f", 0o644, 0)
        .expect("create")
        .0;
    fs.fallocate(f.ino, 4096, 12000, KEEP_SIZE)
        .expect("fallocate");
    fs.write(f.ino, 0, &[7u8; 100], false).expect("write");
    assert_eq!(fs.read(f.ino, 0, 200).expect("read"), vec![7u8; 100]);
    fs.close().expect("close");
    drop(fs);
    assert_clean(&dev, "bug 7");
}

#[test]
// Regression (was bug 8): truncate down with an extent reaching past the end frees blocks twice (allocator panic "release of free block")
fn bug_truncate_over_prealloc_past_eof() {
    let dev = new_device();
    let fs = open(&dev);
    let f = fs
        .create(Caller::default(), ROOT, b"f", 0o644, 0)
        .expect("create")
        .0;
    let size = |n: u64| SetAttr {
        size: Some(n),
        ..Default::default()
    };
    fs.setattr(f.ino, &size(5000)).expect("truncate up");
    fs.fallocate(f.ino, 2049, 20000, KEEP_SIZE)
        .expect("fallocate");
    fs.setattr(f.ino, &size(4096)).expect("truncate down");
    fs.setattr(f.ino, &size(2047)).expect("truncate down again");
    fs.close().expect("close");
    drop(fs);
    assert_clean(&dev, "bug 8");
}

#[test]
// Regression (was bug 9): fallocate checks EFBIG before the inode and the PUNCH_HOLE mode rules after its type
fn bug_fallocate_error_order() {
    let dev = new_device();
    let fs = open(&dev);
    let d = fs
        .mkdir(Caller::default(), ROOT, b"d", 0o755)
        .expect("mkdir");
    // Linux: mode rules (EOPNOTSUPP), then the type (EISDIR), then the size (EFBIG).
    let r = fs.fallocate(d.ino, 0, 100, PUNCH_HOLE);
    assert_eq!(errno_of(r).err().as_deref(), Some("EOPNOTSUPP"));
    let r = fs.fallocate(d.ino, 0, MAX_FILE_BYTES + 1, KEEP_SIZE);
    assert_eq!(errno_of(r).err().as_deref(), Some("EISDIR"));
}

#[test]
// Regression (was bug 10): rename into a removed directory succeeds (Linux ENOENT); the entry is lost at close
fn bug_rename_into_removed_dir() {
    let dev = new_device();
    let fs = open(&dev);
    let c = Caller::default();
    let a = fs.mkdir(c, ROOT, b"a", 0o755).expect("mkdir");
    fs.create(c, ROOT, b"f", 0o644, 0).expect("create");
    fs.rmdir(ROOT, b"a").expect("rmdir");
    let r = fs.rename(ROOT, b"f", a.ino, b"g", 0);
    assert_eq!(errno_of(r).err().as_deref(), Some("ENOENT"));
    fs.close().expect("close");
    drop(fs);
    assert_clean(&dev, "bug 10");
}

#[test]
// Regression (was bug 11): argument checks in the wrong order: rename checks names before flags, fallocate mode bits before a zero length
fn bug_argument_check_order() {
    let dev = new_device();
    let fs = open(&dev);
    let f = fs
        .create(Caller::default(), ROOT, b"f", 0o644, 0)
        .expect("create")
        .0;
    let long = vec![b'n'; 300];
    assert_eq!(
        errno_of(fs.rename(ROOT, &long, ROOT, b"x", 3))
            .err()
            .as_deref(),
        Some("EINVAL")
    );
    assert_eq!(
        errno_of(fs.fallocate(f.ino, 0, 0, 0x08)).err().as_deref(),
        Some("EINVAL")
    );
}
