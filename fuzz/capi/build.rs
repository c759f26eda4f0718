//! `ffi/build.rs` for this rlib copy of the C API: the C++ half of `gpu_arena_torch_malloc`.

fn main() {
    println!("cargo::rerun-if-changed=../../ffi/src/oom_shim.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .file("../../ffi/src/oom_shim.cpp")
        .compile("gpu_arena_oom_shim");
}
