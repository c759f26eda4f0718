//! Simulated device (stub).
