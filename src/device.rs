//! Device selection. One binary serves CPU machines and the GPU host: libtorch_cuda.so is loaded at
//! run time (../shared/GPU.md §4) because the linker drops it when Rust references none of its symbols.
use std::sync::OnceLock;
use tch::Device;

static CUDA_LOAD: OnceLock<Result<String, String>> = OnceLock::new();

/// dlopen libtorch_cuda.so from the folder libtorch_cpu.so was loaded from (then by plain name).
/// Idempotent; Err on CPU-only machines, where everything then runs on CPU.
pub fn preload_torch_cuda() -> &'static Result<String, String> {
    CUDA_LOAD.get_or_init(|| {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
        let mut candidates: Vec<String> = maps
            .lines()
            .filter_map(|l| l.split_whitespace().nth(5))
            .filter(|p| p.ends_with("/libtorch_cpu.so"))
            .take(1)
            .map(|p| p.replace("/libtorch_cpu.so", "/libtorch_cuda.so"))
            .collect();
        candidates.push("libtorch_cuda.so".into());
        let mut err = String::new();
        for c in candidates {
            let cs = std::ffi::CString::new(c.clone()).expect("path has no NUL");
            // SAFETY: dlopen/dlerror are thread-safe libc calls; the handle is intentionally leaked.
            let h = unsafe { libc::dlopen(cs.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if !h.is_null() {
                return Ok(c);
            }
            err = unsafe { std::ffi::CStr::from_ptr(libc::dlerror()) }.to_string_lossy().into_owned();
        }
        Err(err)
    })
}

/// Resolve a device name from a spec: `auto` (CUDA when present), `cpu`, `cuda`, `cuda:N`.
pub fn parse_device(name: &str) -> crate::Result<Device> {
    let _ = preload_torch_cuda();
    match name {
        "auto" => Ok(Device::cuda_if_available()),
        "cpu" => Ok(Device::Cpu),
        "cuda" => cuda(0),
        s if s.starts_with("cuda:") => {
            let n: usize = s[5..].parse().map_err(|_| crate::Error::Other(format!("bad device `{s}`")))?;
            cuda(n)
        }
        s => Err(crate::Error::Other(format!("unknown device `{s}` (use auto, cpu, cuda or cuda:N)"))),
    }
}

fn cuda(n: usize) -> crate::Result<Device> {
    if !tch::Cuda::is_available() || n >= tch::Cuda::device_count() as usize {
        let why = match preload_torch_cuda() {
            Err(e) => format!(" (libtorch_cuda could not be loaded: {e})"),
            Ok(_) => String::new(),
        };
        return Err(crate::Error::Other(format!("device cuda:{n} requested but not available{why}")));
    }
    Ok(Device::Cuda(n))
}

/// Peak memory allocated on a CUDA device since the last reset, in bytes (0 on CPU).
pub fn peak_memory(device: Device) -> u64 {
    crate::kernels::cuda_peak_memory(device).unwrap_or(0)
}
