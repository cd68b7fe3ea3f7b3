//! `birch errors MNT`: the files a mount found damaged (data reads that failed their device
//! read or checksum, written data the device lost, blocks the last online scrub found damaged),
//! from the root's `trusted.birch.errors` xattr. What `zpool status -v` lists as permanent
//! errors. Must not touch: how the daemon finds them (birch-core's `vfs::errfiles`).

use std::path::Path;
use std::process::ExitCode;

use birch_core::control::ControlCommand;
use serde_json::Value;

const ERRORS_XATTR: &str = "trusted.birch.errors";

/// Prints the list (a line a file, or the JSON with `json`). Exit 0 when no file has an
/// error, 1 when some do, 2 when the list cannot be read. With `clear`, clears the list and
/// the lifetime counts instead (exit 0, or 2).
pub(crate) fn errors_main(mountpoint: &Path, json: bool, clear: bool) -> ExitCode {
    let show = mountpoint.display();
    if clear {
        return match crate::mount::control(mountpoint, &ControlCommand::ErrorsClear) {
            Ok(()) => {
                println!("{show}: the list of files with errors and the lifetime device error counts are cleared");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("birch: {show}: errors --clear: {e}");
                ExitCode::from(2)
            }
        };
    }
    let raw = match crate::stats::getxattr(mountpoint, ERRORS_XATTR) {
        Ok(raw) => raw,
        Err(e) => {
            let why = match e.raw_os_error() {
                Some(libc::ENODATA) | Some(libc::ENOTSUP) => {
                    "not the root of a birchfs mount, or a daemon too old to list errors".into()
                }
                Some(libc::EPERM) => "the list of files with errors needs root".into(),
                _ => format!("reading {ERRORS_XATTR}: {e}"),
            };
            eprintln!("birch: {show}: {why}");
            return ExitCode::from(2);
        }
    };
    let text = String::from_utf8_lossy(&raw);
    let value: Value = match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("birch: {show}: {ERRORS_XATTR} is not JSON: {e}");
            return ExitCode::from(2);
        }
    };
    let files = value["files"].as_array().cloned().unwrap_or_default();
    let not_listed = value["not_listed"].as_u64().unwrap_or(0);
    if json {
        println!("{text}");
    } else {
        print!("{}", table(&files, not_listed));
    }
    if files.is_empty() && not_listed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The text `birch errors` prints for `files` (entries of the xattr's JSON).
fn table(files: &[Value], not_listed: u64) -> String {
    if files.is_empty() && not_listed == 0 {
        return "no file has a data error on this mount\n".into();
    }
    let mut out = String::new();
    for f in files {
        let paths: Vec<&str> = f["paths"]
            .as_array()
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let name = if paths.is_empty() {
            format!("(inode {}, no name)", f["inode"])
        } else {
            paths.join(" ")
        };
        let mut what = Vec::new();
        for (key, label) in [
            ("read_errors", "read errors"),
            ("checksum_errors", "checksum errors"),
            ("lost_writes", "lost writes"),
            ("scrub_damaged_blocks", "damaged blocks (scrub)"),
        ] {
            let n = f[key].as_u64().unwrap_or(0);
            if n > 0 {
                what.push(format!("{n} {label}"));
            }
        }
        if let Some(at) = f["first_offset"].as_u64() {
            what.push(format!("first at offset {at}"));
        }
        out.push_str(&format!(
            "{name}: inode {}: {}\n",
            f["inode"],
            what.join(", ")
        ));
    }
    if not_listed > 0 {
        out.push_str(&format!("... and {not_listed} more files not listed\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_names_each_file_and_what_went_wrong() {
        let value: Value = serde_json::from_str(
            r#"{"files": [{"inode": 257, "paths": ["/a", "/b/c"], "read_errors": 2, "checksum_errors": 0, "lost_writes": 1, "scrub_damaged_blocks": 0, "first_offset": 4096},
                          {"inode": 300, "paths": [], "read_errors": 0, "checksum_errors": 1, "lost_writes": 0, "scrub_damaged_blocks": 3, "first_offset": null}], "not_listed": 2}"#,
        )
        .expect("json");
        let files = value["files"].as_array().cloned().expect("files");
        assert_eq!(
            table(&files, 2),
            "/a /b/c: inode 257: 2 read errors, 1 lost writes, first at offset 4096\n\
             (inode 300, no name): inode 300: 1 checksum errors, 3 damaged blocks (scrub)\n\
             ... and 2 more files not listed\n"
        );
        assert_eq!(table(&[], 0), "no file has a data error on this mount\n");
    }
}
