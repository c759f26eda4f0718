//! The pool from Rust: allocate, free, record_stream, empty_cache, stats.
//!
//! `cargo run --example 01_alloc` (sim backend unless `GPU_ARENA_BACKEND=cuda`).

use gpu_arena::{Config, StreamId};

fn main() -> gpu_arena::Result<()> {
    let mut config = Config::parse("backend=sim,arena_size=256MiB")?;
    if let Ok(b) = std::env::var("GPU_ARENA_BACKEND") {
        config.backend = b.parse()?;
    }
    let pool = config.build_pool()?;
    let stream = StreamId(0); // the default stream; pass your cudaStream_t as an integer
    let a = pool.alloc(0, 3 << 20, stream)?; // 3 MiB on device 0
    let b = pool.alloc(0, 1000, stream)?; // rounded up to 1024 bytes
    println!(
        "a = {:#x} ({} bytes), b = {:#x} ({} bytes)",
        a.ptr, a.bytes, b.ptr, b.bytes
    );
    pool.record_stream(a.ptr, StreamId(42))?; // `a` is also used on stream 42
    pool.free(a.ptr)?; // reused only after stream 42's work so far completes
    pool.free(b.ptr)?;
    println!("{:?}", pool.stats(0)?);
    let released = pool.empty_cache(None)?;
    println!("empty_cache released {released} bytes");
    Ok(())
}
