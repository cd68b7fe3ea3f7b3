//! The one error type of the core, its single mapping to errno and the level it is logged at.
//!
//! Owns: every failure kind the core reports, [`Error::errno`] (the only errno mapping) and
//! [`Error::log_level`] (how loudly a caller that logs it should). Failure sites attach what
//! they were doing (operation, inode, block); the FUSE adapter and tools only print, log at
//! the error's level or call [`Error::errno`].
//!
//! Must not touch: I/O, engine state. Corruption found on disk is [`Error::Corrupt`] (`EIO`,
//! the message names the block and says to run `birch fsck`); a broken invariant of the core's
//! own state is [`Error::Bug`] (`EIO`, logged as an error where it is made), never
//! [`Error::Invalid`], which is for arguments and requests the caller may not make.

use std::io;

use birch_format::FormatError;

use crate::readonly::ReadOnlyCause;

/// Result alias of the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every failure the core reports.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device (or the fsync log) failed a read, write or flush. Maps to `EIO`.
    #[error("{context}: I/O error: {source}")]
    Io {
        /// What was being done: operation, inode, block.
        context: String,
        /// The error the device returned.
        source: io::Error,
    },
    /// Metadata read from the device failed to decode or verify (checksum, magic, bounds), or
    /// the tree read at open breaks a rule of the format (a block referenced twice, an extent
    /// past the device, no root directory). Maps to `EIO` (not `EUCLEAN`: FUSE passes any
    /// errno, but `EIO` is what every caller already handles); fsck is the remedy, and the
    /// message says so.
    #[error("{context}: corrupt metadata: {source}; run `birch fsck` on the image")]
    Corrupt {
        /// What was being read: operation, inode, block.
        context: String,
        /// The decoding failure from `birch-format`.
        source: FormatError,
    },
    /// A file data block failed its checksum on read. Maps to `EIO`.
    #[error("{0}: data checksum mismatch")]
    DataChecksum(String),
    /// The allocator (or an inode's xattr space) cannot satisfy the request. Maps to `ENOSPC`.
    #[error("{0}: no space left on device")]
    NoSpace(String),
    /// The filesystem is mounted read-only or was forced read-only after a failed commit or
    /// log write; the cause says which (and whether a remount may undo it). Maps to `EROFS`.
    #[error("filesystem is read-only: {0}")]
    ReadOnly(ReadOnlyCause),
    /// A name, inode or item does not exist. Maps to `ENOENT`.
    #[error("{0}: no such file or directory")]
    NotFound(String),
    /// The target name already exists (create, mkdir, link, `RENAME_NOREPLACE`). Maps to `EEXIST`.
    #[error("{0}: file exists")]
    Exists(String),
    /// rmdir or rename over a directory that still has entries. Maps to `ENOTEMPTY`.
    #[error("{0}: directory not empty")]
    NotEmpty(String),
    /// A directory operation on something that is not a directory. Maps to `ENOTDIR`.
    #[error("{0}: not a directory")]
    NotDir(String),
    /// A file operation (or unlink) on a directory. Maps to `EISDIR`.
    #[error("{0}: is a directory")]
    IsDir(String),
    /// A file name longer than the format allows, or a symlink target of `PATH_MAX` bytes or
    /// more. Maps to `ENAMETOOLONG`.
    #[error("{0}: file name too long")]
    NameTooLong(String),
    /// A malformed argument, option or on-disk state the operation refuses. Maps to `EINVAL`.
    #[error("{0}: invalid argument")]
    Invalid(String),
    /// The link count (or a directory's subdirectory count) would overflow. Maps to `EMLINK`.
    #[error("{0}: too many links")]
    TooManyLinks(String),
    /// An offset or size beyond the maximum file size. Maps to `EFBIG`.
    #[error("{0}: file too large")]
    TooBig(String),
    /// The requested extended attribute does not exist. Maps to `ENODATA`.
    #[error("{0}: no such attribute")]
    NoData(String),
    /// An xattr name that is empty or longer than the format allows. Maps to `ERANGE`.
    #[error("{0}: result does not fit the buffer")]
    Range(String),
    /// An xattr value larger than `XATTR_SIZE_MAX` bytes (an ACL: `XATTR_VALUE_MAX`). Maps to
    /// `E2BIG`.
    #[error("{0}: argument list too long")]
    TooLong(String),
    /// An operation forbidden regardless of permissions (e.g. hard link to a directory).
    /// Maps to `EPERM`.
    #[error("{0}: operation not permitted")]
    NotPermitted(String),
    /// Permission denied. Not produced by the core today (the kernel checks permissions);
    /// kept for the errno mapping. Maps to `EACCES`.
    #[error("{0}: permission denied")]
    Access(String),
    /// A link or rename across filesystems. Not produced by the core today. Maps to `EXDEV`.
    #[error("{0}: cross-device link")]
    CrossDevice(String),
    /// Path resolution too deep (directory tree deeper than 4096 levels). Maps to `ELOOP`.
    #[error("{0}: too many levels of symbolic links")]
    Loop(String),
    /// An unsupported operation or mode (e.g. an fallocate mode). Maps to `EOPNOTSUPP`.
    #[error("{0}: operation not supported")]
    NotSupported(String),
    /// An unknown or stale file handle. Not produced by the core today. Maps to `EBADF`.
    #[error("{0}: bad file handle")]
    BadHandle(String),
    /// The target is in use or changed underneath the operation (rename of `.`/`..`, an entry
    /// replaced during unlink). Maps to `EBUSY`.
    #[error("{0}: device or resource busy")]
    Busy(String),
    /// An earlier write-back of this file failed; fsync keeps reporting it. Maps to `EIO`.
    #[error("{0}: earlier write failed")]
    StickyIo(String),
    /// SEEK_DATA / SEEK_HOLE at or past the end of the file, or no data after the offset.
    /// Maps to `ENXIO`.
    #[error("{0}: no such device or address")]
    NoSuchAddress(String),
    /// The filesystem was shut down (`Filesystem::shutdown`, `birch shutdown`, the
    /// `FS_IOC_SHUTDOWN` ioctl): every operation fails and nothing more reaches the image
    /// until it is opened again. Maps to `EIO`.
    #[error("the filesystem is shut down")]
    Shutdown,
    /// fallocate on a special file. Maps to `ENODEV`.
    #[error("{0}: no such device")]
    NoDevice(String),
    /// A change asked of a snapshot (under `/.snapshot`, or a snapshot mounted alone):
    /// snapshots are read-only. Maps to `EROFS`.
    #[error("{0}: a snapshot is read-only")]
    SnapshotReadOnly(String),
    /// An invariant of the core's own state does not hold (a job of the parallel apply
    /// panicked, a node the writer made does not fit, an inode a rename locked is not in its
    /// lock set): a bug in birchfs, not damage on disk and not a bad request. Made with
    /// [`Error::bug`], which logs it as an error. Maps to `EIO`.
    #[error("internal error (a bug in birchfs, please report it): {0}")]
    Bug(String),
}

impl Error {
    /// The errno a POSIX caller sees. The only place this mapping is made.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { .. }
            | Error::Corrupt { .. }
            | Error::DataChecksum(_)
            | Error::StickyIo(_)
            | Error::Shutdown
            | Error::Bug(_) => libc::EIO,
            Error::NoSpace(_) => libc::ENOSPC,
            Error::ReadOnly(_) | Error::SnapshotReadOnly(_) => libc::EROFS,
            Error::NotFound(_) => libc::ENOENT,
            Error::Exists(_) => libc::EEXIST,
            Error::NotEmpty(_) => libc::ENOTEMPTY,
            Error::NotDir(_) => libc::ENOTDIR,
            Error::IsDir(_) => libc::EISDIR,
            Error::NameTooLong(_) => libc::ENAMETOOLONG,
            Error::Invalid(_) => libc::EINVAL,
            Error::TooManyLinks(_) => libc::EMLINK,
            Error::TooBig(_) => libc::EFBIG,
            Error::NoData(_) => libc::ENODATA,
            Error::Range(_) => libc::ERANGE,
            Error::TooLong(_) => libc::E2BIG,
            Error::NotPermitted(_) => libc::EPERM,
            Error::Access(_) => libc::EACCES,
            Error::CrossDevice(_) => libc::EXDEV,
            Error::Loop(_) => libc::ELOOP,
            Error::NotSupported(_) => libc::EOPNOTSUPP,
            Error::BadHandle(_) => libc::EBADF,
            Error::Busy(_) => libc::EBUSY,
            Error::NoSuchAddress(_) => libc::ENXIO,
            Error::NoDevice(_) => libc::ENODEV,
        }
    }

    /// The level a caller that logs this error should use: `Debug` for the answers a
    /// filesystem gives in normal use (a missing name, an existing one, a full buffer, no such
    /// xattr, a seek past the data), `Error` for damage on disk and bugs, `Warn` for the rest
    /// (device errors, read-only, no space, refused requests).
    pub fn log_level(&self) -> log::Level {
        match self {
            Error::NotFound(_)
            | Error::Exists(_)
            | Error::NotEmpty(_)
            | Error::NoData(_)
            | Error::NameTooLong(_)
            | Error::NotDir(_)
            | Error::IsDir(_)
            | Error::Range(_)
            | Error::SnapshotReadOnly(_)
            | Error::NoSuchAddress(_) => log::Level::Debug,
            Error::Corrupt { .. } | Error::DataChecksum(_) | Error::Bug(_) => log::Level::Error,
            _ => log::Level::Warn,
        }
    }

    /// A broken invariant of the core's own state: logged as an error here, where it is
    /// found, so it is seen even when the caller only maps it to `EIO`. A build with debug
    /// assertions (`cargo test` without `--release`) stops here instead, so a test that
    /// reaches a bug fails at the bug rather than at a later `EIO`.
    pub fn bug(what: impl Into<String>) -> Error {
        let what = what.into();
        log::error!("internal error (a bug in birchfs, please report it): {what}");
        debug_assert!(false, "internal error: {what}");
        Error::Bug(what)
    }

    /// An I/O error with context.
    pub fn io(context: impl Into<String>, source: io::Error) -> Error {
        Error::Io {
            context: context.into(),
            source,
        }
    }

    /// A corruption error with context.
    pub fn corrupt(context: impl Into<String>, source: FormatError) -> Error {
        Error::Corrupt {
            context: context.into(),
            source,
        }
    }
}
