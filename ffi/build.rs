//! Builds `src/oom_shim.cpp` (the C++ half of `gpu_arena_torch_malloc`, see
//! `src/torch_api.rs`) into the library with the `cc` crate: a C++ compiler and libstdc++
//! are needed, nothing from PyTorch or CUDA.

fn main() {
    println!("cargo::rerun-if-changed=src/oom_shim.cpp");
    // fuzz/capi (src/lib.rs as an rlib for cargo-fuzz) compiles the same file with its own
    // build script: keep the two in step.
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .file("src/oom_shim.cpp")
        .compile("gpu_arena_oom_shim");
}
