//! Little-endian byte cursors with bounds checks: decoding never indexes out of range.

use crate::FormatError;

/// Reads little-endian values from a slice; every read past the end is a `Truncated` error.
pub struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// A reader over `bytes`; `what` names the structure for error messages.
    pub fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Reader {
            bytes,
            pos: 0,
            what,
        }
    }

    /// Bytes not yet read.
    pub fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    /// Bytes read so far: the offset of the next read from the start of the input.
    pub fn position(&self) -> usize {
        self.pos
    }

    /// Takes the next `len` bytes; `Truncated` (and nothing consumed) if fewer remain.
    pub fn take(&mut self, len: usize) -> Result<&'a [u8], FormatError> {
        let end = self
            .pos
            .checked_add(len)
            .filter(|end| *end <= self.bytes.len())
            .ok_or_else(|| FormatError::Truncated {
                what: self.what.to_string(),
                need: self.pos.saturating_add(len),
                have: self.bytes.len(),
            })?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    /// Reads the next `N` bytes as an array (magics, fsids); `Truncated` if fewer remain.
    pub fn array<const N: usize>(&mut self) -> Result<[u8; N], FormatError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    /// Reads one byte; `Truncated` at the end of the input.
    pub fn u8(&mut self) -> Result<u8, FormatError> {
        Ok(self.array::<1>()?[0])
    }
    /// Reads a little-endian u16 (2 bytes); `Truncated` if fewer remain.
    pub fn u16(&mut self) -> Result<u16, FormatError> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    /// Reads a little-endian u32 (4 bytes); `Truncated` if fewer remain.
    pub fn u32(&mut self) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    /// Reads a little-endian u64 (8 bytes); `Truncated` if fewer remain.
    pub fn u64(&mut self) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// Reads a little-endian two's-complement i64 (8 bytes); `Truncated` if fewer remain.
    pub fn i64(&mut self) -> Result<i64, FormatError> {
        Ok(i64::from_le_bytes(self.array()?))
    }
    /// Skips `len` bytes (reserved zero fields are not checked); `Truncated` if fewer remain.
    pub fn skip(&mut self, len: usize) -> Result<(), FormatError> {
        self.take(len).map(|_| ())
    }
}

/// Appends little-endian values to a vector.
#[derive(Default)]
pub struct Writer {
    /// Everything appended so far, in order.
    pub bytes: Vec<u8>,
}

impl Writer {
    /// An empty writer with room for `capacity` bytes (e.g. [`crate::NODE_SIZE`]); the
    /// output is not limited to it.
    pub fn with_capacity(capacity: usize) -> Self {
        Writer {
            bytes: Vec::with_capacity(capacity),
        }
    }
    /// Appends one byte.
    pub fn u8(&mut self, value: u8) {
        self.bytes.push(value);
    }
    /// Appends a little-endian u16 (2 bytes).
    pub fn u16(&mut self, value: u16) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }
    /// Appends a little-endian u32 (4 bytes).
    pub fn u32(&mut self, value: u32) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }
    /// Appends a little-endian u64 (8 bytes).
    pub fn u64(&mut self, value: u64) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }
    /// Appends a little-endian two's-complement i64 (8 bytes).
    pub fn i64(&mut self, value: i64) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }
    /// Appends raw bytes as they are, with no length prefix.
    pub fn put(&mut self, bytes: &[u8]) {
        self.bytes.extend_from_slice(bytes);
    }
    /// Appends `len` zero bytes: reserved fields and padding.
    pub fn zeros(&mut self, len: usize) {
        self.bytes.resize(self.bytes.len() + len, 0);
    }
    /// The bytes appended, in order.
    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }
}
