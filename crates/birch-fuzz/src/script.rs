//! The fuzz input read as a script of choices: every target draws the values it builds and
//! the mutations it applies from the input bytes, so a fuzzer's byte-level mutations become
//! structure-level ones. An exhausted script answers zeros, so every input, even empty, is a
//! valid script (an empty one builds the plain valid structure).

/// Reads choices from the input bytes, front to back.
pub struct Script<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Script<'a> {
    /// A script over `data`.
    pub fn new(data: &'a [u8]) -> Script<'a> {
        Script { data, at: 0 }
    }

    /// Whether every byte has been used.
    pub fn is_empty(&self) -> bool {
        self.at >= self.data.len()
    }

    /// The next byte, 0 once exhausted.
    pub fn u8(&mut self) -> u8 {
        let b = self.data.get(self.at).copied().unwrap_or(0);
        self.at = self.at.saturating_add(1);
        b
    }

    /// A little-endian u16.
    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }

    /// A little-endian u32.
    pub fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }

    /// A little-endian u64.
    pub fn u64(&mut self) -> u64 {
        (u64::from(self.u32())) | (u64::from(self.u32()) << 32)
    }

    /// A value in `0..n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let v = if n <= 256 {
            usize::from(self.u8())
        } else {
            self.u32() as usize
        };
        v % n
    }

    /// A coin: true for an odd byte.
    pub fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }

    /// `n` bytes (zeros past the end).
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.u8()).collect()
    }

    /// A value of `width` bytes (1, 2, 4 or 8) that decoders find interesting: the bounds,
    /// the block and node sizes, small numbers, or any value.
    pub fn interesting(&mut self, width: usize) -> u64 {
        let max = if width >= 8 {
            u64::MAX
        } else {
            (1u64 << (width * 8)) - 1
        };
        let v = match self.u8() % 12 {
            0 => 0,
            1 => 1,
            2 => max,
            3 => max - 1,
            4 => max / 2 + 1,
            5 => 4096,
            6 => 16384,
            7 => 1 << 20,
            8 => u64::from(self.u8()),
            9 => 1 << 32,
            10 => u64::from(self.u16()),
            _ => self.u64(),
        };
        v & max
    }
}

/// A field of an encoded structure: byte offset and width (1, 2, 4 or 8).
#[derive(Debug, Clone, Copy)]
pub struct Field {
    /// Byte offset in the buffer.
    pub at: usize,
    /// Width in bytes.
    pub width: usize,
}

/// Writes `value` little-endian into `buf[at..at + width]`, if it fits.
pub fn put(buf: &mut [u8], at: usize, width: usize, value: u64) {
    if let Some(slot) = at.checked_add(width).and_then(|end| buf.get_mut(at..end)) {
        slot.copy_from_slice(&value.to_le_bytes()[..width]);
    }
}

/// Reads a little-endian field, 0 if it does not fit.
pub fn get(buf: &[u8], at: usize, width: usize) -> u64 {
    let mut out = [0u8; 8];
    if let Some(slot) = at.checked_add(width).and_then(|end| buf.get(at..end)) {
        out[..width].copy_from_slice(slot);
    }
    u64::from_le_bytes(out)
}

/// Applies up to `max_steps` script-chosen mutations to `buf`: a named field set to an
/// interesting value or nudged by a small delta, or one byte anywhere replaced.
pub fn mutate_fields(buf: &mut [u8], fields: &[Field], script: &mut Script<'_>, max_steps: usize) {
    let steps = script.below(max_steps + 1);
    for _ in 0..steps {
        if buf.is_empty() {
            return;
        }
        match script.u8() % 4 {
            0 | 1 if !fields.is_empty() => {
                let f = fields[script.below(fields.len())];
                let v = script.interesting(f.width);
                put(buf, f.at, f.width, v);
            }
            2 if !fields.is_empty() => {
                let f = fields[script.below(fields.len())];
                let delta = u64::from(script.u8() % 8) + 1;
                let old = get(buf, f.at, f.width);
                let v = if script.bool() {
                    old.wrapping_add(delta)
                } else {
                    old.wrapping_sub(delta)
                };
                put(buf, f.at, f.width, v);
            }
            _ => {
                let at = script.below(buf.len());
                buf[at] = script.u8();
            }
        }
    }
}
