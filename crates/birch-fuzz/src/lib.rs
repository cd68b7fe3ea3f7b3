//! Fuzz targets for birchfs's on-disk format and recovery paths (issue 41, item 4), on the
//! stable toolchain.
//!
//! Every on-disk structure is crc32c-gated, so random bytes would only test the checksum
//! check. The targets are therefore structure-aware: each reads its input as a [`Script`] of
//! choices, builds a valid structure from it with the format's own encoders, damages named
//! fields (the layout's lengths, counts, offsets, keys, addresses), re-seals the checksum as
//! the corruption sweeps do (crates/birch-core/tests/corrupt.rs), and feeds the result to the
//! decoder or to the whole open, replay, walk and fsck. A byte-level fuzzer's mutations of the
//! input thus become mutations of the structure.
//!
//! The promise under test: bad input never panics, hangs or corrupts; it gives a clear error.
//! A target returns a short *outcome class* (`ok`, or the error without its numbers); the
//! [`runner`] keeps inputs that reach a class not seen before, a cheap stand-in for coverage
//! feedback, and stops at the first panic or hang, saving the input under `crashes/`.
//!
//! - `cargo test -p birch-fuzz` replays `corpus/<target>/` (and fixed `crashes/`) and runs
//!   each target for a few hundred seeded iterations;
//! - `birch-fuzz run` (the CI tier "fuzz (short)") runs every target for a time budget;
//! - `birch-fuzz replay TARGET FILE|-` runs one input, from a file or standard input: the
//!   entry point for an external coverage-guided engine (docs/TESTING.md, "Fuzzing").

pub mod coverage;
pub mod format;
pub mod image;
pub mod runner;
pub mod script;

pub use script::Script;

/// A fuzz target: a name (its corpus folder) and the function that runs one input.
#[derive(Clone, Copy)]
pub struct Target {
    /// Name, as on the command line and the corpus folder.
    pub name: &'static str,
    /// Runs one input; returns its outcome class. A panic is a finding.
    pub run: fn(&[u8]) -> String,
    /// Whether one input runs a whole image (slow: tens of milliseconds).
    pub whole_image: bool,
}

/// Every target.
pub const TARGETS: [Target; 7] = [
    Target {
        name: "node_decode",
        run: format::node_decode,
        whole_image: false,
    },
    Target {
        name: "item_decode",
        run: format::item_decode,
        whole_image: false,
    },
    Target {
        name: "superblock_decode",
        run: format::superblock_decode,
        whole_image: false,
    },
    Target {
        name: "log_batch_decode",
        run: format::log_batch_decode,
        whole_image: false,
    },
    Target {
        name: "blob_decode",
        run: format::blob_decode,
        whole_image: false,
    },
    Target {
        name: "log_replay",
        run: image::log_replay,
        whole_image: true,
    },
    Target {
        name: "image_open_walk",
        run: image::image_open_walk,
        whole_image: true,
    },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<Target> {
    TARGETS.iter().copied().find(|t| t.name == name)
}
