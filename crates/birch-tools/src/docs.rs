//! Man pages and shell completions, generated from the clap definitions (`birch gen-docs DIR`,
//! which `scripts/package.sh` runs to fill the Debian package; `main` takes it before clap,
//! so no help, page or completion offers it).
//!
//! Owns only the rendering: the words come from the commands' own help and from
//! [`crate::mount::MOUNT_OPTIONS`], so a page cannot drift from what the binary accepts. Writes
//! nothing outside the directory it is given.

use std::io::Write;
use std::path::Path;

use clap::{Arg, Command, CommandFactory};
use clap_complete::Shell;

use crate::mount::MOUNT_OPTIONS;
use crate::Cli;

/// Where each page or script goes under the output directory, by the path Debian installs
/// it at (`scripts/package.sh` and the package's assets follow this layout).
const MAN1: &str = "man/man1";
const MAN5: &str = "man/man5";
const MAN8: &str = "man/man8";
const COMPLETIONS: &str = "completions";

/// Writes every man page and completion script under `out`:
/// `man/man1/birch*.1`, `man/man8/{mkfs,fsck,mount.fuse}.birch.8`, `man/man5/birchfs.5`,
/// `completions/{birch.bash,_birch,birch.fish}`.
pub fn generate(out: &Path) -> Result<(), String> {
    for dir in [MAN1, MAN5, MAN8, COMPLETIONS] {
        let path = out.join(dir);
        std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let birch = Cli::command();
    // birch(1) and one page per visible subcommand (birch-mkfs(1), birch-mount(1), ...).
    clap_mangen::generate_to(birch.clone(), out.join(MAN1))
        .map_err(|e| format!("{}: {e}", out.join(MAN1).display()))?;
    // The names mkfs(8), fsck(8) and mount(8) run: the same subcommands under those names.
    for (sub, name, notes) in [
        ("mkfs", "mkfs.birch", MKFS_NOTES),
        ("fsck", "fsck.birch", FSCK_NOTES),
    ] {
        let cmd = birch
            .find_subcommand(sub)
            .ok_or_else(|| format!("no subcommand {sub}"))?
            .clone()
            .name(name)
            .bin_name(name)
            .display_name(name)
            .after_long_help(notes);
        write_man(&out.join(MAN8), cmd, "8")?;
    }
    write_man(&out.join(MAN8), mount_helper_command(), "8")?;
    let path = out.join(MAN5).join("birchfs.5");
    std::fs::write(&path, birchfs_5()).map_err(|e| format!("{}: {e}", path.display()))?;
    for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
        let mut cmd = Cli::command();
        clap_complete::generate_to(shell, &mut cmd, "birch", out.join(COMPLETIONS))
            .map_err(|e| format!("{} completions: {e}", shell))?;
    }
    Ok(())
}

/// How mkfs(8) runs mkfs.birch (the extra section of mkfs.birch(8)).
const MKFS_NOTES: &str = "mkfs -t birch DEVICE [BLOCKS] runs mkfs.birch DEVICE [BLOCKS], BLOCKS \
in 1 KiB blocks. On an image file, make the file first (truncate -s 4G disk.img), or give \
BLOCKS or --size. An existing filesystem is not overwritten without --force (-f). See also \
birch(1), fsck.birch(8), birchfs(5).";

/// How fsck(8) runs fsck.birch (the extra section of fsck.birch(8)).
const FSCK_NOTES: &str = "fsck -t birch IMAGE runs fsck.birch IMAGE, passing -a, -p, -n, -y or -r \
on. Without them fsck.birch only checks. -p and -a preen: they fix only what loses nothing (link \
counts, directory sizes, sizes that must cover their extents, stale orphan items, the missing \
half of a name, a bad superblock copy) and leave the rest (exit 4). -y and -r (also --repair) \
repair everything the check finds: a damaged newest tree falls back to the newest whole backup \
root of the three each superblock keeps (with none whole, every leaf that reads is salvaged \
into a new tree and the key ranges lost are printed), names of missing inodes, undecodable items, misaligned \
extents and extents on blocks outside the image are dropped, and with --data so are data \
blocks that cannot be read or fail their checksum (every path and byte range that lost data is \
printed; the range reads as zeros), inodes without names go to /lost+found, a missing root \
directory is made anew; a pending fsync log is replayed first. Every repair is a copy-on-write commit: a crash during it leaves \
the image as it was. -n repairs a copy in memory and writes nothing. Exit codes follow \
fsck(8): 0 no errors, 1 errors corrected, 4 errors left uncorrected, 8 operational error \
(image missing, or held by a live mount). For an \
image that /etc/fstab lists, fsck(8) uses the type fstab gives, fuse.birch, and runs \
fsck.fuse.birch (the same program); it skips such an image silently, with exit 0, when asked \
for another type with -t birch. systemd runs no boot-time fsck for a source that is not a \
block device: use fsck pass 0 for image files. See also birch(1), birchfs(5).";

fn write_man(dir: &Path, cmd: Command, section: &str) -> Result<(), String> {
    let man = clap_mangen::Man::new(cmd).section(section);
    let path = dir.join(man.get_filename());
    let mut file = std::fs::File::create(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    man.render(&mut file)
        .and_then(|()| file.flush())
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// `mount.fuse.birch IMAGE MOUNTPOINT [-o OPTIONS]`, as mount(8) calls it (the helper parses
/// its arguments by hand, `mount::helper_main`; this describes them for the man page).
fn mount_helper_command() -> Command {
    Command::new("mount.fuse.birch")
        .about("mount helper for birchfs, called by mount(8) for type fuse.birch")
        .long_about(
            "mount(8) runs this helper for `mount -t fuse.birch IMAGE MOUNTPOINT` and for fstab \
             lines of type fuse.birch, such as\n\n    /var/lib/birch.img  /mnt/birch  fuse.birch  \
             defaults  0  0\n\nIt mounts as `birch mount` does and returns once the mount is \
             live; a daemon serves it until it is unmounted. `mount -o remount,ro` and \
             `remount,rw` go through it too. The mount options are described in birchfs(5). \
             Image files are not block devices, so use fsck pass 0 (the sixth field) for them.",
        )
        .version(env!("CARGO_PKG_VERSION"))
        .arg(Arg::new("image").value_name("IMAGE").required(true).help(
            "The birchfs image file or block device (made with mkfs -t birch or birch mkfs).",
        ))
        .arg(
            Arg::new("mountpoint")
                .value_name("MOUNTPOINT")
                .required(true)
                .help("An existing directory."),
        )
        .arg(
            Arg::new("options")
                .short('o')
                .value_name("OPTIONS")
                .help("Comma-separated mount options; see birchfs(5)."),
        )
        .after_help("See also: birch(1), birchfs(5), mount(8), fstab(5).")
}

/// Escapes text for a roff line: backslashes, and a leading dot or quote.
fn roff_text(text: &str) -> String {
    let escaped = text.replace('\\', "\\e").replace('-', "\\-");
    if escaped.starts_with('.') || escaped.starts_with('\'') {
        format!("\\&{escaped}")
    } else {
        escaped
    }
}

/// birchfs(5): the filesystem, its mount options, and how fstab mounts it.
fn birchfs_5() -> String {
    let mut page = String::new();
    page.push_str(&format!(
        ".TH BIRCHFS 5 \"\" \"birchfs {}\" \"File Formats\"\n",
        env!("CARGO_PKG_VERSION")
    ));
    page.push_str(
        ".SH NAME\nbirchfs \\- mount options of the birchfs copy\\-on\\-write filesystem\n",
    );
    page.push_str(&format!(
        ".SH DESCRIPTION\n{}\n",
        roff_text(
            "birchfs is a copy-on-write B-tree filesystem served in userspace through FUSE, \
             over one image file or a block device. It is mounted with birch mount, or by \
             mount(8) with type fuse.birch, which runs mount.fuse.birch(8). Options are given \
             with -o, comma-separated; an unknown option is an error."
        )
    ));
    page.push_str(".SH MOUNT OPTIONS\n");
    for (name, text) in MOUNT_OPTIONS {
        page.push_str(&format!(
            ".TP\n.B {}\n{}\n",
            roff_text(name),
            roff_text(text)
        ));
    }
    page.push_str(&format!(
        ".SH FSTAB\n{}\n.PP\n.nf\n/var/lib/birch.img  /mnt/birch  fuse.birch  defaults,noatime  0  0\n.fi\n.PP\n{}\n",
        roff_text(
            "A line of type fuse.birch mounts an image at boot or with mount -a. The source is \
             the image file's path:"
        ),
        roff_text(
            "Use 0 in the sixth field (fsck pass) for an image file: systemd runs no boot-time \
             fsck for a source that is not a block device. Check an image by hand with \
             fsck -t birch IMAGE (fsck.birch(8)) while it is not mounted."
        )
    ));
    page.push_str(&format!(
        ".SH STATISTICS\n{}\n",
        roff_text(
            "birch stats MOUNTPOINT prints the live counters of a mount (see birch-stats(1))."
        )
    ));
    page.push_str(&format!(
        ".SH SCRUB\n{}\n",
        roff_text(
            "birch scrub IMAGE (unmounted) or birch scrub MOUNTPOINT (online, as root) reads \
             every node and data block of the live tree and of every snapshot once and \
             verifies its checksum, naming the inodes and paths of each damaged block (a \
             snapshot's under /.snapshot/NAME); an interrupted scrub prints a position for \
             --resume; it cannot heal, as birchfs keeps one copy of each block. Exit 0 clean, \
             1 damage found, 2 error (see birch-scrub(1))."
        )
    ));
    page.push_str(
        ".SH SEE ALSO\n.BR birch (1),\n.BR mkfs.birch (8),\n.BR fsck.birch (8),\n.BR mount.fuse.birch (8),\n.BR fstab (5),\n.BR mount (8)\n",
    );
    page
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_every_page_and_completion() {
        let dir = std::env::temp_dir().join(format!("birch-docs-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(e) = generate(&dir) {
            panic!("generate: {e}");
        }
        for file in [
            "man/man1/birch.1",
            "man/man1/birch-mount.1",
            "man/man1/birch-fsck.1",
            "man/man8/mkfs.birch.8",
            "man/man8/fsck.birch.8",
            "man/man8/mount.fuse.birch.8",
            "man/man5/birchfs.5",
            "completions/birch.bash",
            "completions/_birch",
            "completions/birch.fish",
        ] {
            let path = dir.join(file);
            let len = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
            assert!(len > 100, "{file}: missing or nearly empty ({len} bytes)");
        }
        assert!(
            !dir.join("man/man1/birch-gen-docs.1").exists(),
            "hidden command got a page"
        );
        let options = std::fs::read_to_string(dir.join("man/man5/birchfs.5")).unwrap_or_default();
        assert!(
            options.contains("fsync=log"),
            "birchfs(5) lists the mount options"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn roff_escapes_leading_dot_and_dashes() {
        assert_eq!(roff_text(".hidden -o"), "\\&.hidden \\-o");
        assert_eq!(roff_text("a\\b"), "a\\eb");
    }
}
