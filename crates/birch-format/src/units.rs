//! Typed numbers: the `u64`s of the format that must not be mixed up, each as its own type.
//!
//! Owns: [`InodeNo`] (an inode's object id), [`BlockAddr`] (a byte address on the device,
//! block aligned where it names a block), [`BlockCount`] (a number of [`BLOCK_SIZE`] blocks),
//! [`Generation`] (a transaction or commit number) and [`Lsn`] (a byte position in the fsync
//! log's sequence of batches), with the few conversions between them that make sense (an
//! address plus a block count is an address; a block count has a size in bytes).
//!
//! Must not touch: the byte layouts. Every type is a `#[repr(transparent)]` wrapper of a
//! `u64`, encoded and decoded as that `u64`; the on-disk structs keep their plain fields, and
//! the engine's APIs convert at their edges. `Display` and `Debug` print the bare number (and
//! `LowerHex` the address) exactly as the `u64` did, so messages and logs read as before.

use std::fmt;
use std::ops::{Add, AddAssign, Sub, SubAssign};

use crate::BLOCK_SIZE;

/// Defines a `#[repr(transparent)]` newtype of `u64` with `new`, `get`, `From<T> for u64`,
/// and `Display`/`Debug` that print the number alone.
macro_rules! typed_u64 {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(u64);

        impl $name {
            /// The value `raw` as this type.
            pub const fn new(raw: u64) -> Self {
                $name(raw)
            }

            /// The plain number.
            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl From<$name> for u64 {
            fn from(value: $name) -> u64 {
                value.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::LowerHex for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::LowerHex::fmt(&self.0, f)
            }
        }
    };
}

typed_u64!(
    /// A byte address on the device. Where it names a block (an allocation, a node, an
    /// extent's disk address) it is a multiple of [`BLOCK_SIZE`].
    BlockAddr
);

typed_u64!(
    /// A number of [`BLOCK_SIZE`] blocks: a run's length, a count of free or pinned space.
    BlockCount
);

typed_u64!(
    /// A transaction's number: the generation a change belongs to, that a commit makes
    /// durable, that a node or a freed range was born or freed in.
    Generation
);

typed_u64!(
    /// A log sequence number: a byte position in the fsync log's unbounded sequence of
    /// batches (the area holds it modulo its size).
    Lsn
);

typed_u64!(
    /// An inode number: the object id its items are keyed by (the FUSE node id).
    InodeNo
);

impl BlockAddr {
    /// The address of block `index` (its byte address, `index * BLOCK_SIZE`).
    pub const fn from_block_index(index: u64) -> BlockAddr {
        BlockAddr(index * BLOCK_SIZE)
    }

    /// The index of the block this address falls in.
    pub const fn block_index(self) -> u64 {
        self.0 / BLOCK_SIZE
    }

    /// Whether the address starts a block.
    pub const fn is_block_aligned(self) -> bool {
        self.0 % BLOCK_SIZE == 0
    }
}

/// The address `blocks` blocks further on.
impl Add<BlockCount> for BlockAddr {
    type Output = BlockAddr;

    fn add(self, blocks: BlockCount) -> BlockAddr {
        BlockAddr(self.0 + blocks.bytes())
    }
}

impl BlockCount {
    /// The size of this many blocks in bytes.
    pub const fn bytes(self) -> u64 {
        self.0 * BLOCK_SIZE
    }

    /// `self - other`, or zero when `other` is more.
    pub const fn saturating_sub(self, other: BlockCount) -> BlockCount {
        BlockCount(self.0.saturating_sub(other.0))
    }
}

impl Add for BlockCount {
    type Output = BlockCount;

    fn add(self, other: BlockCount) -> BlockCount {
        BlockCount(self.0 + other.0)
    }
}

impl AddAssign for BlockCount {
    fn add_assign(&mut self, other: BlockCount) {
        self.0 += other.0;
    }
}

impl Sub for BlockCount {
    type Output = BlockCount;

    fn sub(self, other: BlockCount) -> BlockCount {
        BlockCount(self.0 - other.0)
    }
}

impl SubAssign for BlockCount {
    fn sub_assign(&mut self, other: BlockCount) {
        self.0 -= other.0;
    }
}

impl std::iter::Sum for BlockCount {
    fn sum<I: Iterator<Item = BlockCount>>(iter: I) -> BlockCount {
        BlockCount(iter.map(|b| b.0).sum())
    }
}

impl<'a> std::iter::Sum<&'a BlockCount> for BlockCount {
    fn sum<I: Iterator<Item = &'a BlockCount>>(iter: I) -> BlockCount {
        BlockCount(iter.map(|b| b.0).sum())
    }
}

impl Generation {
    /// The generation after this one.
    pub const fn next(self) -> Generation {
        Generation(self.0 + 1)
    }

    /// The generation `count` after this one, stopping at the largest.
    pub const fn saturating_add(self, count: u64) -> Generation {
        Generation(self.0.saturating_add(count))
    }
}

// Zero-cost: each type is exactly its u64, checked in every build.
const _: () = assert!(std::mem::size_of::<BlockAddr>() == std::mem::size_of::<u64>());
const _: () = assert!(std::mem::size_of::<BlockCount>() == std::mem::size_of::<u64>());
const _: () = assert!(std::mem::size_of::<Generation>() == std::mem::size_of::<u64>());
const _: () = assert!(std::mem::size_of::<Lsn>() == std::mem::size_of::<u64>());
const _: () = assert!(std::mem::size_of::<InodeNo>() == std::mem::size_of::<u64>());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn print_like_the_numbers_they_wrap() {
        assert_eq!(format!("{}", Generation::new(41)), "41");
        assert_eq!(format!("{:?}", InodeNo::new(257)), "257");
        assert_eq!(format!("{:#x}", BlockAddr::new(0x3a000)), "0x3a000");
        assert_eq!(
            format!("{:?}", (BlockAddr::new(8), BlockCount::new(2))),
            "(8, 2)"
        );
    }

    #[test]
    fn addresses_and_counts_convert_through_the_block_size() {
        let addr = BlockAddr::from_block_index(3);
        assert_eq!(addr.get(), 3 * BLOCK_SIZE);
        assert_eq!((addr + BlockCount::new(2)).block_index(), 5);
        assert_eq!(BlockCount::new(2).bytes(), 2 * BLOCK_SIZE);
        assert!(addr.is_block_aligned() && !BlockAddr::new(1).is_block_aligned());
    }
}
