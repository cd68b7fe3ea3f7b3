//! The one error type of the core, and its single mapping to errno.
//!
//! Failure sites attach what they were doing (operation, inode, block); the FUSE adapter and
//! tools only print or call [`Error::errno`].

use std::io;

use birch_format::FormatError;

/// Result alias of the core.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Every failure the core reports.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{context}: I/O error: {source}")]
    Io { context: String, source: io::Error },
    #[error("{context}: corrupt metadata: {source}")]
    Corrupt {
        context: String,
        source: FormatError,
    },
    #[error("{0}: data checksum mismatch")]
    DataChecksum(String),
    #[error("{0}: no space left on device")]
    NoSpace(String),
    #[error("filesystem is read-only: {0}")]
    ReadOnly(String),
    #[error("{0}: no such file or directory")]
    NotFound(String),
    #[error("{0}: file exists")]
    Exists(String),
    #[error("{0}: directory not empty")]
    NotEmpty(String),
    #[error("{0}: not a directory")]
    NotDir(String),
    #[error("{0}: is a directory")]
    IsDir(String),
    #[error("{0}: file name too long")]
    NameTooLong(String),
    #[error("{0}: invalid argument")]
    Invalid(String),
    #[error("{0}: too many links")]
    TooManyLinks(String),
    #[error("{0}: file too large")]
    TooBig(String),
    #[error("{0}: no such attribute")]
    NoData(String),
    #[error("{0}: result does not fit the buffer")]
    Range(String),
    #[error("{0}: argument list too long")]
    TooLong(String),
    #[error("{0}: operation not permitted")]
    NotPermitted(String),
    #[error("{0}: permission denied")]
    Access(String),
    #[error("{0}: cross-device link")]
    CrossDevice(String),
    #[error("{0}: too many levels of symbolic links")]
    Loop(String),
    #[error("{0}: operation not supported")]
    NotSupported(String),
    #[error("{0}: bad file handle")]
    BadHandle(String),
    #[error("{0}: device or resource busy")]
    Busy(String),
    #[error("{0}: earlier write failed")]
    StickyIo(String),
    #[error("{0}: no such device or address")]
    NoSuchAddress(String),
    #[error("{0}: no such device")]
    NoDevice(String),
}

impl Error {
    /// The errno a POSIX caller sees. The only place this mapping is made.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { .. }
            | Error::Corrupt { .. }
            | Error::DataChecksum(_)
            | Error::StickyIo(_) => libc::EIO,
            Error::NoSpace(_) => libc::ENOSPC,
            Error::ReadOnly(_) => libc::EROFS,
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
