//! Compiles the small C++ layer (csrc/: aten ops tch lacks, DAR split-merge autograd function, the fused projection's heads, c10d's TCPStore, the profiler) against libtorch's headers and sets a RUNPATH to
//! the build machine's libtorch, so binaries and tests run without environment variables
//! (../shared/GPU.md §3). On the GPU host, LD_LIBRARY_PATH points at the host's own libtorch instead.
use std::{env, path::PathBuf};

fn main() {
    let lib = PathBuf::from(env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys exports DEP_TCH_LIBTORCH_LIB"));
    let torch = lib.parent().expect("libtorch lib dir has a parent");
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-O2")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .file("csrc/attn_ops.cpp")
        .file("csrc/dar_attention.cpp")
        .file("csrc/dar_band.cpp")
        .file("csrc/distributed.cpp")
        .file("csrc/profile.cpp")
        .file("csrc/heads.cpp")
        .file("csrc/flash.cpp")
        .compile("attn_ops");
    println!("cargo:rerun-if-changed=csrc/attn_ops.cpp");
    println!("cargo:rerun-if-changed=csrc/dar_attention.cpp");
    println!("cargo:rerun-if-changed=csrc/dar_band.cpp");
    println!("cargo:rerun-if-changed=csrc/distributed.cpp");
    println!("cargo:rerun-if-changed=csrc/profile.cpp");
    println!("cargo:rerun-if-changed=csrc/heads.cpp");
    println!("cargo:rerun-if-changed=csrc/flash.cpp");
    println!("cargo:rerun-if-changed=csrc/flash_call.h");
    println!("cargo:rustc-link-arg=-Wl,--enable-new-dtags");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
}
