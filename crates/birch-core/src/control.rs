//! Control commands: what the mount helper and the `birch` CLI ask of a mounted filesystem's
//! daemon, as one typed enum with its wire form (the text written to the root's
//! `trusted.birch.control` xattr) parsed and formatted here and nowhere else.
//! [`crate::Filesystem::control`] parses and runs them; senders format them with `Display`.
//! Must not touch: what a command does (the vfs layer's `Filesystem::control`) or how it
//! travels (the FUSE adapter's xattr, the CLI's setxattr).
//!
//! The wire strings are a compatibility surface: tools of another version send them as text,
//! so a change here must keep every string below parsing to the same command.

use std::fmt;

use crate::error::{Error, Result};
use crate::vfs::AtimeMode;

/// A control command and its wire string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlCommand {
    /// `shutdown`: commit, then shut down ([`crate::vfs::ShutdownMode::Commit`]).
    Shutdown,
    /// `shutdown-log`: write the log, then shut down ([`crate::vfs::ShutdownMode::Log`]).
    ShutdownLog,
    /// `shutdown-now`: shut down at once ([`crate::vfs::ShutdownMode::Now`]).
    ShutdownNow,
    /// `ro`: commit and stop writing (`mount -o remount,ro`).
    ReadOnly,
    /// `rw`: allow writes again (`mount -o remount,rw`).
    ReadWrite,
    /// `sync`: commit.
    Sync,
    /// `scrub-start [rate=BYTES_PER_SEC] [resume=POSITION]`: start an online scrub at `rate`
    /// bytes per second, `None` unlimited (`rate=0`), from `resume` (a
    /// [`crate::scrub::ScrubPosition`] a cancelled scrub reported) or from the start. Without
    /// `rate=` the rate is [`crate::scrub::ONLINE_RATE_DEFAULT_BYTES_PER_SEC`]; formatted,
    /// the rate is always given.
    ScrubStart {
        /// Bytes per second, `None` unlimited.
        rate: Option<u64>,
        /// Where to start; `None`: at the start of the live tree.
        resume: Option<crate::scrub::ScrubPosition>,
    },
    /// `scrub-cancel`: stop the online scrub.
    ScrubCancel,
    /// `snapshot-create NAME`.
    SnapshotCreate(String),
    /// `snapshot-delete NAME`.
    SnapshotDelete(String),
    /// `atime=noatime|relatime|strictatime`: when reads move atime (after a remount).
    Atime(AtimeMode),
    /// `errors-clear`: forget the files with errors this mount listed and set the lifetime
    /// device error counts to zero (`birch errors --clear`), then commit.
    ErrorsClear,
    /// `fault TEXT`: a command for the daemon's fault-injecting device (`birch fault`): a
    /// rule to add, `clear` or `release`. Only a daemon built with the `fault-injection`
    /// feature (test builds) runs it; the filesystem itself answers EOPNOTSUPP.
    Fault(String),
}

impl ControlCommand {
    /// Parses a wire string. Errors are [`Error::Invalid`] naming the command (or the
    /// snapshot name's own error), as the daemon answers them (EINVAL).
    pub fn parse(command: &[u8]) -> Result<ControlCommand> {
        Ok(match command {
            b"shutdown" => ControlCommand::Shutdown,
            b"shutdown-log" => ControlCommand::ShutdownLog,
            b"shutdown-now" => ControlCommand::ShutdownNow,
            b"ro" => ControlCommand::ReadOnly,
            b"rw" => ControlCommand::ReadWrite,
            b"sync" => ControlCommand::Sync,
            b"errors-clear" => ControlCommand::ErrorsClear,
            b"scrub-cancel" => ControlCommand::ScrubCancel,
            other if other.starts_with(b"scrub-start") => scrub_start(other)?,
            other if other.starts_with(b"fault ") => ControlCommand::Fault(
                std::str::from_utf8(&other[6..])
                    .map_err(|_| Error::Invalid("control command fault: not UTF-8".into()))?
                    .to_string(),
            ),
            other if other.starts_with(b"snapshot-create ") => {
                ControlCommand::SnapshotCreate(snapshot_name(&other[16..])?)
            }
            other if other.starts_with(b"snapshot-delete ") => {
                ControlCommand::SnapshotDelete(snapshot_name(&other[16..])?)
            }
            other if other.starts_with(b"atime=") => ControlCommand::Atime(
                std::str::from_utf8(&other[6..])
                    .ok()
                    .and_then(AtimeMode::from_option)
                    .ok_or_else(|| {
                        Error::Invalid(format!(
                            "control command {:?}: expected atime=noatime, relatime or strictatime",
                            String::from_utf8_lossy(other)
                        ))
                    })?,
            ),
            other => {
                return Err(Error::Invalid(format!(
                    "control command {:?}",
                    String::from_utf8_lossy(other)
                )))
            }
        })
    }
}

impl fmt::Display for ControlCommand {
    /// The wire string, as [`ControlCommand::parse`] reads it back.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ControlCommand::Shutdown => f.write_str("shutdown"),
            ControlCommand::ShutdownLog => f.write_str("shutdown-log"),
            ControlCommand::ShutdownNow => f.write_str("shutdown-now"),
            ControlCommand::ReadOnly => f.write_str("ro"),
            ControlCommand::ReadWrite => f.write_str("rw"),
            ControlCommand::Sync => f.write_str("sync"),
            ControlCommand::ScrubStart { rate, resume } => {
                write!(f, "scrub-start rate={}", rate.unwrap_or(0))?;
                match resume {
                    Some(position) => write!(f, " resume={position}"),
                    None => Ok(()),
                }
            }
            ControlCommand::ScrubCancel => f.write_str("scrub-cancel"),
            ControlCommand::SnapshotCreate(name) => write!(f, "snapshot-create {name}"),
            ControlCommand::SnapshotDelete(name) => write!(f, "snapshot-delete {name}"),
            ControlCommand::Atime(mode) => write!(f, "atime={}", mode.option()),
            ControlCommand::ErrorsClear => f.write_str("errors-clear"),
            ControlCommand::Fault(text) => write!(f, "fault {text}"),
        }
    }
}

/// `scrub-start [rate=BYTES_PER_SEC] [resume=POSITION]` (the last of each given; rate 0 is
/// unlimited).
fn scrub_start(command: &[u8]) -> Result<ControlCommand> {
    let text = String::from_utf8_lossy(command);
    let bad = || {
        Error::Invalid(format!(
            "control command {text:?}: expected scrub-start [rate=BYTES_PER_SEC] \
             [resume=POSITION]"
        ))
    };
    // The first word is the command (as before, not checked further).
    let words = text.split_whitespace().skip(1);
    let mut rate = Some(crate::scrub::ONLINE_RATE_DEFAULT_BYTES_PER_SEC);
    let mut resume = None;
    for word in words {
        if let Some(value) = word.strip_prefix("rate=") {
            let value = value.parse::<u64>().map_err(|_| bad())?;
            rate = (value > 0).then_some(value);
        } else if let Some(value) = word.strip_prefix("resume=") {
            resume = Some(value.parse().map_err(|_| bad())?);
        } else {
            return Err(bad());
        }
    }
    Ok(ControlCommand::ScrubStart { rate, resume })
}

/// The snapshot name of `snapshot-create NAME` or `snapshot-delete NAME`, checked.
fn snapshot_name(bytes: &[u8]) -> Result<String> {
    let name = std::str::from_utf8(bytes)
        .map_err(|_| Error::Invalid("snapshot name: not UTF-8".into()))?;
    crate::snapshot::check_name(name)?;
    Ok(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every wire string today's tools send parses to its command and formats back to itself.
    #[test]
    fn wire_strings_round_trip() {
        let cases: &[(&str, ControlCommand)] = &[
            ("shutdown", ControlCommand::Shutdown),
            ("shutdown-log", ControlCommand::ShutdownLog),
            ("shutdown-now", ControlCommand::ShutdownNow),
            ("ro", ControlCommand::ReadOnly),
            ("rw", ControlCommand::ReadWrite),
            ("sync", ControlCommand::Sync),
            ("scrub-cancel", ControlCommand::ScrubCancel),
            (
                "scrub-start rate=1000000",
                ControlCommand::ScrubStart {
                    rate: Some(1_000_000),
                    resume: None,
                },
            ),
            (
                "scrub-start rate=0",
                ControlCommand::ScrubStart {
                    rate: None,
                    resume: None,
                },
            ),
            (
                "scrub-start rate=0 resume=snapshot-3@256:1:0",
                ControlCommand::ScrubStart {
                    rate: None,
                    resume: Some(crate::scrub::ScrubPosition {
                        tree: crate::scrub::ScrubTree::Snapshot(3),
                        key: birch_format::Key::new(256, birch_format::ItemType::InodeItem, 0),
                    }),
                },
            ),
            (
                "snapshot-create s1",
                ControlCommand::SnapshotCreate("s1".into()),
            ),
            (
                "fault write:eio,percent=5",
                ControlCommand::Fault("write:eio,percent=5".into()),
            ),
            (
                "snapshot-delete s1",
                ControlCommand::SnapshotDelete("s1".into()),
            ),
            ("atime=noatime", ControlCommand::Atime(AtimeMode::NoAtime)),
            ("atime=relatime", ControlCommand::Atime(AtimeMode::Relatime)),
            (
                "atime=strictatime",
                ControlCommand::Atime(AtimeMode::StrictAtime),
            ),
            ("errors-clear", ControlCommand::ErrorsClear),
        ];
        for (wire, command) in cases {
            assert_eq!(
                &ControlCommand::parse(wire.as_bytes()).expect(wire),
                command
            );
            assert_eq!(&command.to_string(), wire);
        }
    }

    /// What the receiver accepted before the enum, it still accepts the same way.
    #[test]
    fn older_forms_parse_as_before() {
        let default = Some(crate::scrub::ONLINE_RATE_DEFAULT_BYTES_PER_SEC);
        assert_eq!(
            ControlCommand::parse(b"scrub-start").expect("bare"),
            ControlCommand::ScrubStart {
                rate: default,
                resume: None
            }
        );
        assert_eq!(
            ControlCommand::parse(b"scrub-start rate=5 rate=7").expect("last wins"),
            ControlCommand::ScrubStart {
                rate: Some(7),
                resume: None
            }
        );
        assert_eq!(
            ControlCommand::parse(b"atime=atime").expect("atime is relatime"),
            ControlCommand::Atime(AtimeMode::Relatime)
        );
        for bad in [
            &b"nonsense"[..],
            b"scrub-start rate=x",
            b"scrub-start resume=nowhere",
            b"scrub-start resume=live@1:2",
            b"atime=sometimes",
            b"snapshot-create a/b",
            b"snapshot-create ",
            b"snapshot-delete \xff",
            b"ro ",
        ] {
            assert!(
                matches!(ControlCommand::parse(bad), Err(Error::Invalid(_))),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
