//! CUDA backend (stub).
