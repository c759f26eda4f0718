//! Pure offset sub-allocator (stub).
#![forbid(unsafe_code)]
