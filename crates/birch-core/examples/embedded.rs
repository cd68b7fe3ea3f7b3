//! Embedded use: make an image, write files, reopen it and read them back.
//!
//! Run: `cargo run --example embedded -p birch-core -- /tmp/embedded.img`

use std::path::PathBuf;

use birch_core::vfs::Caller;
use birch_core::{Filesystem, MkfsOptions, OpenOptions};
use birch_format::ROOT_INO;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let path: PathBuf = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "/tmp/birch-embedded.img".into())
        .into();
    let _ = std::fs::remove_file(&path);
    Filesystem::mkfs_path(&path, Some(64 << 20), &MkfsOptions::default())?;
    {
        let fs = Filesystem::open(&path, OpenOptions::default())?;
        fs.mkdir(Caller::default(), ROOT_INO, b"docs", 0o755)?;
        fs.write_file("/docs/hello.txt", b"hello from an embedded birchfs")?;
        fs.close()?;
    }
    let fs = Filesystem::open(&path, OpenOptions::default())?;
    let text = fs.read_file("/docs/hello.txt")?;
    println!("{}", String::from_utf8_lossy(&text));
    fs.close()?;
    Ok(())
}
