//! The IPC part of the C API (share, unshare, import, close).
