//! Our own CUDA kernels (csrc/cuda/*.cu), built by `make gpu-kernels` into `libattnlab_kernels.so`
//! and loaded at run time: the binary builds and runs without them (CPU machines, or a GPU host where
//! the library was not carried), and every caller has an aten path that computes the same function.
//! Looked up in `$ATTNLAB_KERNELS` (a file), then next to the running binary.
use super::check;
use crate::Result;
use std::sync::OnceLock;
use tch::Tensor;
use torch_sys::C_tensor;

type CeGradInPlace = unsafe extern "C" fn(*mut C_tensor, *mut C_tensor, f64, *mut *mut C_tensor) -> *mut libc::c_char;

/// The entry points of a loaded library.
struct Library {
    ce_grad_in_place: CeGradInPlace,
}

/// The file name `make gpu-kernels` writes (into `.gpu/`, beside the lean binary).
pub const FILE_NAME: &str = "libattnlab_kernels.so";

fn candidates() -> Vec<std::path::PathBuf> {
    let mut c: Vec<std::path::PathBuf> = std::env::var_os("ATTNLAB_KERNELS").map(Into::into).into_iter().collect();
    if let Some(dir) = std::env::current_exe().ok().and_then(|e| e.parent().map(|p| p.to_path_buf())) {
        c.push(dir.join(FILE_NAME));
    }
    c
}

fn open(path: &std::path::Path) -> std::result::Result<Library, String> {
    let cs = std::ffi::CString::new(path.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen / dlsym with NUL-terminated names; the handle is never closed (the functions
    // live as long as the process).
    unsafe {
        let h = libc::dlopen(cs.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL);
        if h.is_null() {
            return Err(std::ffi::CStr::from_ptr(libc::dlerror()).to_string_lossy().into_owned());
        }
        let sym = libc::dlsym(h, c"attnlab_ce_grad_in_place".as_ptr());
        if sym.is_null() {
            return Err("no symbol attnlab_ce_grad_in_place (a library from another attnlab version?)".into());
        }
        Ok(Library { ce_grad_in_place: std::mem::transmute::<*mut libc::c_void, CeGradInPlace>(sym) })
    }
}

/// The library, loaded once (by a CUDA path, so libtorch_cuda is already loaded: device parsing
/// preloads it); `None` (after one line on stderr naming where it looked) when it is not there.
fn library() -> Option<&'static Library> {
    static LIB: OnceLock<Option<Library>> = OnceLock::new();
    LIB.get_or_init(|| {
        let mut why = Vec::new();
        for p in candidates() {
            if !p.exists() {
                why.push(format!("{}: not there", p.display()));
                continue;
            }
            match open(&p) {
                Ok(lib) => return Some(lib),
                Err(e) => why.push(format!("{}: {e}", p.display())),
            }
        }
        eprintln!("attnlab: no CUDA kernel library ({}); the loss head runs through aten, slower (`make gpu-bin` builds it)", why.join("; "));
        None
    })
    .as_ref()
}

/// Whether the kernels are loaded (asks for them: the first call on a GPU host loads the library).
pub fn available() -> bool {
    library().is_some()
}

/// Cross-entropy of each row of `logits` `[N, V]` (CUDA, bf16 / fp16, unit column stride) against
/// `targets` `[N]`, the rows overwritten in place with `scale·(softmax − onehot)`: per-row losses
/// `[N]` fp32. `None` when the library is not loaded (the caller's aten path computes the same).
pub fn ce_grad_in_place(logits: &mut Tensor, targets: &Tensor, scale: f64) -> Option<Result<Tensor>> {
    let lib = library()?;
    let mut out: *mut C_tensor = std::ptr::null_mut();
    let p = |t: &Tensor| t.as_ptr() as *mut C_tensor;
    // SAFETY: valid tensor handles; on success the shim hands over a new tensor we then own.
    Some(check(unsafe { (lib.ce_grad_in_place)(p(logits), p(targets), scale, &mut out) }).map(|_| unsafe { Tensor::from_ptr(out) }))
}
