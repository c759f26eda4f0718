//! KV-cache trace generation and replay (stub).
