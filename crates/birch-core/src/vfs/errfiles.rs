//! The files this mount found damaged, what `zpool status -v` calls permanent errors: every
//! inode whose data read failed (the device answered EIO, or a block failed its checksum),
//! whose written data the device lost (a failed write or flush of it), or whose blocks the
//! online scrub found damaged; with counts and, when asked, their paths
//! ([`Filesystem::files_with_errors`], the root's `trusted.birch.errors` xattr, `birch errors
//! MNT`).
//!
//! Owns: the list, in memory for the life of the mount (the device's error counts across
//! mounts are in the superblock, `Engine::device_stats`; after a remount a scrub finds the
//! damage again), and turning its inodes into paths. Must not touch: what a failed read or
//! write does (the read and write paths answer the error; `Filesystem::data_lost` applies the
//! `errors=` policy), the scrub itself.

use std::collections::BTreeMap;

use birch_format::items::decode_inode_refs;
use birch_format::{InodeNo, ItemType, ROOT_INO};
use parking_lot::Mutex;

use super::Filesystem;
use crate::error::Error;
use crate::scrub::json_string;

/// At most this many files are listed; the rest are counted (`not_listed`).
pub const ERROR_FILES_MAX: usize = 10_000;

/// What went wrong with one file's data.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FileErrors {
    /// Reads the device answered with an error.
    pub read_errors: u64,
    /// Reads that met a block failing its checksum.
    pub checksum_errors: u64,
    /// Writes or flushes of its data the device failed: written data lost.
    pub lost_writes: u64,
    /// Damaged blocks of it the last online scrub found (in the live tree).
    pub scrub_damaged_blocks: u64,
    /// The file offset of the first failed read, if one failed.
    pub first_offset: Option<u64>,
}

/// One file of [`Filesystem::files_with_errors`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFile {
    /// The inode.
    pub ino: InodeNo,
    /// Its paths now (one per hard link); empty when it has no name any more.
    pub paths: Vec<String>,
    /// What went wrong.
    pub errors: FileErrors,
}

/// The files with errors of one mount.
#[derive(Default)]
pub(crate) struct ErrorFiles {
    files: Mutex<BTreeMap<u64, FileErrors>>,
    /// Files not listed because the list was full.
    dropped: Mutex<u64>,
}

/// The kind of error [`ErrorFiles::note`] records.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ErrorKind {
    Read,
    Checksum,
    LostWrite,
}

impl ErrorFiles {
    /// Records an error of `kind` on inode `ino` (at file `offset` for a read).
    pub(crate) fn note(&self, ino: u64, kind: ErrorKind, offset: Option<u64>) {
        let mut files = self.files.lock();
        if !files.contains_key(&ino) && files.len() >= ERROR_FILES_MAX {
            *self.dropped.lock() += 1;
            return;
        }
        let e = files.entry(ino).or_default();
        match kind {
            ErrorKind::Read => e.read_errors += 1,
            ErrorKind::Checksum => e.checksum_errors += 1,
            ErrorKind::LostWrite => e.lost_writes += 1,
        }
        if e.first_offset.is_none() {
            e.first_offset = offset;
        }
    }

    /// Records the error a read of `ino` at `offset` answered, if it is one of the data.
    pub(crate) fn note_read(&self, ino: u64, offset: u64, error: &Error) {
        match error {
            Error::Io { .. } | Error::StickyIo(_) => self.note(ino, ErrorKind::Read, Some(offset)),
            Error::DataChecksum(_) => self.note(ino, ErrorKind::Checksum, Some(offset)),
            _ => {}
        }
    }
}

impl Filesystem {
    /// The files this mount found damaged, in inode order, with their paths now: data reads
    /// that failed, written data the device lost, blocks the last online scrub found damaged
    /// in the live tree (see the module doc). At most [`ERROR_FILES_MAX`]; the second value
    /// counts those left out.
    pub fn files_with_errors(&self) -> (Vec<ErrorFile>, u64) {
        let mut files = self.inner.error_files.files.lock().clone();
        let mut dropped = *self.inner.error_files.dropped.lock();
        let report = self.inner.scrub.lock().as_ref().and_then(|j| j.report());
        if let Some(report) = report {
            for damage in &report.damage {
                for owner in damage.owners.iter().filter(|o| o.snapshot.is_none()) {
                    if !files.contains_key(&owner.inode) && files.len() >= ERROR_FILES_MAX {
                        dropped += 1;
                        continue;
                    }
                    files.entry(owner.inode).or_default().scrub_damaged_blocks += 1;
                }
            }
        }
        let out = files
            .into_iter()
            .map(|(ino, errors)| ErrorFile {
                ino: InodeNo::new(ino),
                paths: self.paths_of(ino),
                errors,
            })
            .collect();
        (out, dropped)
    }

    /// Forgets the files with errors (a finished online scrub's report with them) and sets
    /// the lifetime device error counts to zero, written by the next commit
    /// ([`crate::Engine::clear_device_stats`]): `birch errors --clear`, after the damage was
    /// dealt with (the files restored, the disk replaced), as `zpool clear` does.
    pub fn clear_errors(&self) {
        self.inner.error_files.files.lock().clear();
        *self.inner.error_files.dropped.lock() = 0;
        let mut scrub = self.inner.scrub.lock();
        if scrub.as_ref().is_some_and(|job| !job.is_running()) {
            *scrub = None;
        }
        drop(scrub);
        self.inner.engine.clear_device_stats();
    }

    /// [`Filesystem::files_with_errors`] as JSON: `files` (each `inode`, `paths`,
    /// `read_errors`, `checksum_errors`, `lost_writes`, `scrub_damaged_blocks`,
    /// `first_offset` or null) and `not_listed`; files are left out (and counted there) to
    /// keep the text under `max_bytes`.
    pub fn files_with_errors_json(&self, max_bytes: usize) -> String {
        let (files, mut not_listed) = self.files_with_errors();
        let mut entries: Vec<String> = Vec::new();
        let mut len = 64;
        for f in &files {
            let paths: Vec<String> = f.paths.iter().map(|p| json_string(p)).collect();
            let e = &f.errors;
            let entry = format!(
                "{{\"inode\": {}, \"paths\": [{}], \"read_errors\": {}, \"checksum_errors\": {}, \"lost_writes\": {}, \"scrub_damaged_blocks\": {}, \"first_offset\": {}}}",
                f.ino,
                paths.join(", "),
                e.read_errors,
                e.checksum_errors,
                e.lost_writes,
                e.scrub_damaged_blocks,
                e.first_offset
                    .map_or_else(|| "null".to_string(), |o| o.to_string())
            );
            if len + entry.len() + 2 > max_bytes {
                not_listed += 1;
                continue;
            }
            len += entry.len() + 2;
            entries.push(entry);
        }
        format!(
            "{{\"files\": [{}], \"not_listed\": {not_listed}}}",
            entries.join(", ")
        )
    }

    /// Every path of inode `ino` in the live state (one per name; each directory by its one
    /// name), empty when it has none or a name cannot be read.
    fn paths_of(&self, ino: u64) -> Vec<String> {
        let engine = &*self.inner.engine;
        let mut out = Vec::new();
        for (parent, name) in names_of(engine, ino) {
            if let Some(dir) = dir_path(engine, parent) {
                let sep = if dir.ends_with('/') { "" } else { "/" };
                out.push(format!("{dir}{sep}{name}"));
            }
        }
        out
    }
}

/// The (parent, name) pairs of `ino`'s refs; empty when they cannot be read.
fn names_of(engine: &crate::Engine, ino: u64) -> Vec<(u64, String)> {
    let (lo, hi) = crate::items::inode_refs_range(InodeNo::new(ino));
    let Ok(items) = engine.range(&lo, &hi, usize::MAX) else {
        return Vec::new();
    };
    items
        .iter()
        .filter(|(k, _)| k.item_type == ItemType::InodeRef as u8)
        .filter_map(|(_, v)| decode_inode_refs(v).ok())
        .flatten()
        .map(|r| (r.parent, String::from_utf8_lossy(&r.name).into_owned()))
        .collect()
}

/// The path of directory `dir` by its names up to the root; `None` when a name is missing or
/// the chain is longer than any real tree (a loop in damaged refs).
fn dir_path(engine: &crate::Engine, dir: u64) -> Option<String> {
    let mut parts: Vec<String> = Vec::new();
    let mut at = dir;
    for _ in 0..4096 {
        if at == ROOT_INO.get() {
            parts.reverse();
            return Some(format!("/{}", parts.join("/")));
        }
        let (parent, name) = names_of(engine, at).into_iter().next()?;
        parts.push(name);
        at = parent;
    }
    None
}
