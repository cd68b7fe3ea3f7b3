//! The seeded generator of the crash matrix.
//!
//! Owns: one small deterministic generator (xorshift64*). Its sequence is fixed here, not by a
//! crate's version, so a seed printed by `birch crashtest` or a test replays the same workload
//! choices and the same crash cuts in every build. Must not touch: anything else; it is not
//! for production use and not cryptographic.

/// A small deterministic generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`; the same seed always gives the same sequence. Any seed
    /// works (0 included): the state is forced odd, never zero.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// The next pseudo-random 64-bit number. Not cryptographic.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// A number in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    /// True with probability `percent`/100 (100 or more: always).
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}
