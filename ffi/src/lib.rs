//! C API (stub).
