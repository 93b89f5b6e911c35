//! The flat little-endian form of what crosses between scheduler and worker (a [`crate::StepPlan`], a
//! [`crate::HeatSummary`]): one byte string that pickles, crosses processes and is copied to a device as
//! it is. A header of `u32` counts, then sections of `u32` words, then sections of `u64` words starting
//! at an 8-byte boundary, so a device kernel can read every section in place.

use crate::error::{invalid, Result};

pub(crate) struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    pub fn with_capacity(bytes: usize) -> Self {
        Writer { buf: Vec::with_capacity(bytes) }
    }

    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }

    /// Pads to an 8-byte boundary, where the `u64` sections start.
    pub fn align8(&mut self) {
        while self.buf.len() % 8 != 0 {
            self.buf.push(0);
        }
    }

    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads what a [`Writer`] wrote, refusing truncated or malformed input with `InvalidArgument`.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str, magic: u32, version: u32) -> Result<Self> {
        let mut r = Reader { buf, at: 0, what };
        let (m, v) = (r.u32()?, r.u32()?);
        if m != magic {
            return invalid(format!("this is not an encoded {what} (bad magic {m:#010x})"));
        }
        if v != version {
            return invalid(format!("encoded {what} version {v}; this hisparse reads version {version}"));
        }
        Ok(r)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        match self.at.checked_add(n).filter(|&end| end <= self.buf.len()) {
            Some(end) => {
                let s = &self.buf[self.at..end];
                self.at = end;
                Ok(s)
            }
            None => invalid(format!("the encoded {} is truncated", self.what)),
        }
    }

    pub fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes")))
    }

    pub fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes")))
    }

    /// A count from the header, checked against what the buffer could possibly hold so that a corrupt
    /// count fails here and never becomes a huge allocation.
    pub fn count(&mut self, words_each: usize) -> Result<usize> {
        let n = self.u32()? as usize;
        if n.saturating_mul(words_each.max(1) * 4) > self.buf.len() {
            return invalid(format!("the encoded {} is truncated", self.what));
        }
        Ok(n)
    }

    /// Skips to an 8-byte boundary over the zeros [`Writer::align8`] pads with: anything else there is bytes
    /// no writer made.
    pub fn align8(&mut self) -> Result<()> {
        let pad = (8 - self.at % 8) % 8;
        if self.take(pad)?.iter().any(|&b| b != 0) {
            return invalid(format!(
                "the encoded {}'s padding before byte {} is not zero",
                self.what, self.at
            ));
        }
        Ok(())
    }

    pub fn finish(self) -> Result<()> {
        if self.at != self.buf.len() {
            return invalid(format!(
                "the encoded {} has {} trailing bytes",
                self.what,
                self.buf.len() - self.at
            ));
        }
        Ok(())
    }
}

/// Every single-bit change of `bytes` (an encoding) is refused by `decode` or is the encoding of the value it
/// decodes to (`reencode` gives that encoding, `None` for a refusal): one value, one encoding.
#[cfg(test)]
pub(crate) fn assert_one_encoding(bytes: &[u8], reencode: impl Fn(&[u8]) -> Option<Vec<u8>>) {
    for bit in 0..bytes.len() * 8 {
        let mut changed = bytes.to_vec();
        changed[bit / 8] ^= 1 << (bit % 8);
        if let Some(again) = reencode(&changed) {
            assert_eq!(again, changed, "bit {bit} decodes to a value that encodes otherwise");
        }
    }
}
