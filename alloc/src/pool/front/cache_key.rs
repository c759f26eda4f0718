//! The key of the exact-size caches (the device's and the thread caches'): a block's length
//! with its tag index in the low bits (lengths are multiples of 512, tags below 512).

/// The exact-size cache's key for a block of `len` bytes (a multiple of 512) of tag `tag`:
/// the tag in the low bits, so a lookup stays one hash of two words.
#[inline]
pub(crate) fn cache_len(len: u64, tag: u8) -> u64 {
    len | u64::from(tag)
}

/// The length and tag index of a cache key made by [`cache_len`].
pub(crate) fn cache_key_parts(key: u64) -> (u64, usize) {
    (key & !511, (key & 511) as usize)
}
