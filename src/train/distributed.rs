//! Data parallelism: the `Communicator` interface, its two engines and bucketed gradient averaging.
//!
//! - `StoreComm` (CPU workers on loopback; CI): libtorch's own c10d::TCPStore (csrc/distributed.cpp)
//!   carries each rank's bucket; every rank sums all ranks' buckets in rank order, so all ranks get
//!   bit-identical results and their parameters never drift apart.
//! - `NcclComm` (GPUs): NCCL from the PyTorch install, loaded at run time; the TCPStore on rank 0 is
//!   the rendezvous that carries the NCCL unique id, nothing else.
//!
//! Ranks come from the torchrun / Slurm convention: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
//! MASTER_PORT (set by `attnlab train --gpus`, torchrun, or the sbatch script around `srun`).
use crate::{Error, Result};
use std::ffi::{c_char, c_int, c_void, CString};
use std::time::Duration;
use tch::{Device, Kind, Tensor};

/// Where this process sits in a data-parallel job.
#[derive(Debug, Clone, PartialEq)]
pub struct DistEnv {
    pub rank: usize,
    pub world: usize,
    pub local_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
}

impl DistEnv {
    /// The job described by RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, or None
    /// when WORLD_SIZE is unset or 1 (a plain single-process run).
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let num = |k: &str| -> Result<Option<usize>> {
            get(k).map(|v| v.trim().parse::<usize>().map_err(|_| Error::Other(format!("environment variable {k}={v:?} is not a number")))).transpose()
        };
        let Some(world) = num("WORLD_SIZE")? else { return Ok(None) };
        if world <= 1 {
            return Ok(None);
        }
        let rank = num("RANK")?.ok_or_else(|| Error::Other("WORLD_SIZE is set but RANK is not (set both, as torchrun and srun do)".into()))?;
        if rank >= world {
            return Err(Error::Other(format!("RANK {rank} is not below WORLD_SIZE {world}")));
        }
        let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
        let master_addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        let master_port = num("MASTER_PORT")?.unwrap_or(29500);
        let master_port = u16::try_from(master_port).map_err(|_| Error::Other(format!("MASTER_PORT {master_port} is not a port")))?;
        Ok(Some(DistEnv { rank, world, local_rank, master_addr, master_port }))
    }
}

/// Make the GPU of this worker the only visible one, before CUDA starts: a worker then always
/// trains on `cuda:0`. Under torchrun (all GPUs visible, LOCAL_RANK set) it picks entry LOCAL_RANK
/// of CUDA_VISIBLE_DEVICES (or GPU LOCAL_RANK); a list of one (our launcher, `srun
/// --gpus-per-task=1`) is left alone. Call first thing in `main`, before any thread starts.
pub fn pin_local_gpu() {
    let Ok(Some(env)) = DistEnv::from_env() else { return };
    let visible: Vec<String> = std::env::var("CUDA_VISIBLE_DEVICES").ok().map(|v| v.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect()).unwrap_or_default();
    let pick = match visible.len() {
        1 => return,
        0 => env.local_rank.to_string(),
        n => visible[env.local_rank % n].clone(),
    };
    std::env::set_var("CUDA_VISIBLE_DEVICES", pick);
}

/// Collective operations over the ranks of a job. Every rank must call the same operations in
/// the same order with tensors of the same shapes and kinds.
/// Where a worker stands in the job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Place {
    pub rank: usize,
    pub world: usize,
    /// The device its collectives run on.
    pub device: Device,
}

pub trait Communicator {
    fn place(&self) -> Place;
    fn rank(&self) -> usize {
        self.place().rank
    }
    fn world(&self) -> usize {
        self.place().world
    }
    fn device(&self) -> Device {
        self.place().device
    }
    /// Replace `t` (contiguous, on this worker's device) by the sum of every rank's `t`.
    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<()>;
    /// Replace `t` by rank `root`'s `t`.
    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<()>;
    /// Return once every rank has reached this point.
    fn barrier(&mut self) -> Result<()> {
        let mut t = Tensor::zeros([1], (Kind::Float, self.device()));
        self.all_reduce_sum(&mut t)
    }
}

/// Open the communicator for `env` on `device` (NCCL for CUDA, the store for CPU). Blocks until
/// every rank has joined, for at most `timeout`.
pub fn connect(env: &DistEnv, device: Device, timeout: Duration) -> Result<Box<dyn Communicator>> {
    let store = Store::connect(&env.master_addr, env.master_port, env.rank == 0, env.world, timeout)?;
    if device.is_cuda() {
        Ok(Box::new(NcclComm::new(store, env.rank, env.world, device)?))
    } else {
        Ok(Box::new(StoreComm { store, rank: env.rank, world: env.world, seq: 0, own_keys: Vec::new() }))
    }
}

// ---------------------------------------------------------------------------------------------
// c10d::TCPStore through csrc/distributed.cpp

extern "C" {
    fn attnlab_store_new(host: *const c_char, port: c_int, is_server: c_int, world: c_int, timeout_ms: i64, out: *mut *mut c_void) -> *mut c_char;
    fn attnlab_store_free(s: *mut c_void);
    fn attnlab_store_set(s: *mut c_void, key: *const c_char, data: *const u8, len: i64) -> *mut c_char;
    fn attnlab_store_get(s: *mut c_void, key: *const c_char, data: *mut *mut u8, len: *mut i64) -> *mut c_char;
    fn attnlab_store_delete(s: *mut c_void, key: *const c_char) -> *mut c_char;
    fn attnlab_store_add(s: *mut c_void, key: *const c_char, delta: i64, out: *mut i64) -> *mut c_char;
}

fn store_check(what: &str, err: *mut c_char) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: the shim returns a strdup'ed NUL-terminated string that we own and free here.
    let msg = unsafe { std::ffi::CStr::from_ptr(err) }.to_string_lossy().into_owned();
    unsafe { libc::free(err as *mut c_void) };
    Err(Error::Other(format!("distributed {what}: {}", msg.lines().next().unwrap_or(""))))
}

/// A client of the job's TCPStore (rank 0 also runs the server). Every blocking call gives up
/// after the timeout given at connection, so a dead or hung peer becomes an error.
pub struct Store {
    ptr: *mut c_void,
}

// SAFETY: c10d::TCPStore is used from one thread at a time (the owner's).
unsafe impl Send for Store {}

impl Store {
    pub fn connect(host: &str, port: u16, is_server: bool, world: usize, timeout: Duration) -> Result<Store> {
        let h = CString::new(host).map_err(|_| Error::Other("MASTER_ADDR contains NUL".into()))?;
        let mut ptr = std::ptr::null_mut();
        store_check(
            &format!("rendezvous at {host}:{port}"),
            unsafe { attnlab_store_new(h.as_ptr(), port as c_int, is_server as c_int, world as c_int, timeout.as_millis() as i64, &mut ptr) },
        )?;
        Ok(Store { ptr })
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let k = CString::new(key).expect("key has no NUL");
        store_check("set", unsafe { attnlab_store_set(self.ptr, k.as_ptr(), value.as_ptr(), value.len() as i64) })
    }

    /// The value of `key`, waiting for another rank to set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        let k = CString::new(key).expect("key has no NUL");
        let (mut data, mut len) = (std::ptr::null_mut(), 0i64);
        store_check(&format!("wait for `{key}`"), unsafe { attnlab_store_get(self.ptr, k.as_ptr(), &mut data, &mut len) })?;
        // SAFETY: the shim malloc'ed `len` bytes (at least 1) for us.
        let v = unsafe { std::slice::from_raw_parts(data, len as usize) }.to_vec();
        unsafe { libc::free(data as *mut c_void) };
        Ok(v)
    }

    /// Add `delta` to the counter `key` (created at 0); returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let k = CString::new(key).expect("key has no NUL");
        let mut out = 0;
        store_check("add", unsafe { attnlab_store_add(self.ptr, k.as_ptr(), delta, &mut out) })?;
        Ok(out)
    }

    pub fn delete(&self, key: &str) -> Result<()> {
        let k = CString::new(key).expect("key has no NUL");
        store_check("delete", unsafe { attnlab_store_delete(self.ptr, k.as_ptr()) })
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        unsafe { attnlab_store_free(self.ptr) }
    }
}

fn to_bytes(t: &Tensor) -> Vec<u8> {
    let t = t.to_device(Device::Cpu).contiguous();
    let n = t.numel();
    let mut buf = vec![0u8; n * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut buf, n);
    buf
}

/// CPU collectives through the store: each rank publishes its tensor under a per-operation key
/// and reads the others'. Meant for tests and small CPU jobs, not for GPU-sized models.
pub struct StoreComm {
    store: Store,
    rank: usize,
    world: usize,
    /// Collective operations done so far: keys are `op<seq>/<rank>`.
    seq: u64,
    /// Keys this rank published and has not deleted yet.
    own_keys: Vec<String>,
}

impl StoreComm {
    fn publish(&mut self, t: &Tensor) -> Result<String> {
        let key = format!("op{}/{}", self.seq, self.rank);
        self.store.set(&key, &to_bytes(t))?;
        self.own_keys.push(key.clone());
        Ok(key)
    }

    /// After an operation every rank took part in, every rank has read all keys of earlier
    /// operations (each published this operation's key only after finishing the previous one).
    fn forget_older(&mut self, current: &str) -> Result<()> {
        for k in std::mem::take(&mut self.own_keys) {
            if k == current {
                self.own_keys.push(k);
            } else {
                self.store.delete(&k)?;
            }
        }
        Ok(())
    }
}

impl Drop for StoreComm {
    /// Rank 0 hosts the store: it must outlive the other ranks' reads of the last operation, so
    /// every rank checks out and rank 0 waits (at most 60 s) until all have.
    fn drop(&mut self) {
        if self.store.add("left", 1).is_err() || self.rank != 0 {
            return;
        }
        let t = std::time::Instant::now();
        while self.store.add("left", 0).is_ok_and(|n| (n as usize) < self.world) && t.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Communicator for StoreComm {
    fn place(&self) -> Place {
        Place { rank: self.rank, world: self.world, device: Device::Cpu }
    }

    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<()> {
        let mine = self.publish(t)?;
        let (shape, kind) = (t.size(), t.kind());
        // Sum in rank order on every rank: the same float operations, so bit-identical results.
        let mut acc: Option<Tensor> = None;
        for r in 0..self.world {
            let x = if r == self.rank { t.to_device(Device::Cpu).contiguous() } else { Tensor::from_data_size(&self.store.get(&format!("op{}/{r}", self.seq))?, &shape, kind) };
            acc = Some(match acc {
                None => x,
                Some(a) => a + x,
            });
        }
        tch::no_grad(|| t.copy_(&acc.expect("world > 0")));
        self.seq += 1;
        self.forget_older(&mine)
    }

    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<()> {
        let key = format!("op{}/{root}", self.seq);
        if self.rank == root {
            self.publish(t)?;
        } else {
            let v = Tensor::from_data_size(&self.store.get(&key)?, &t.size(), t.kind());
            tch::no_grad(|| t.copy_(&v));
        }
        self.seq += 1;
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// NCCL, loaded at run time. cudarc's loader tries `libnccl.so` and `libnccl.so.<cuda major>`
// but not `libnccl.so.2`, the only name the PyTorch wheel ships; so the handful of NCCL entry
// points (a stable C ABI) are looked up here. On the GPU host libtorch_cuda.so has already loaded
// libnccl.so.2, and dlopen by that soname returns the loaded copy.

#[repr(C)]
#[derive(Clone, Copy)]
struct NcclUniqueId {
    internal: [u8; 128],
}
type RawComm = *mut c_void;
const NCCL_FLOAT32: c_int = 7;
const NCCL_BFLOAT16: c_int = 9;
const NCCL_SUM: c_int = 0;

struct NcclLib {
    get_unique_id: unsafe extern "C" fn(*mut NcclUniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut RawComm, c_int, NcclUniqueId, c_int) -> c_int,
    all_reduce: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> c_int,
    broadcast: unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, *mut c_void) -> c_int,
    comm_abort: unsafe extern "C" fn(RawComm) -> c_int,
    error_string: unsafe extern "C" fn(c_int) -> *const c_char,
}

impl NcclLib {
    fn load() -> Result<NcclLib> {
        let mut handle = std::ptr::null_mut();
        let mut why = String::new();
        for name in ["libnccl.so.2", "libnccl.so"] {
            let c = CString::new(name).expect("no NUL");
            handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
            if !handle.is_null() {
                break;
            }
            why = unsafe { std::ffi::CStr::from_ptr(libc::dlerror()) }.to_string_lossy().into_owned();
        }
        if handle.is_null() {
            return Err(Error::Other(format!("NCCL not found ({why}); GPU data parallelism needs the PyTorch install's libnccl.so.2 on LD_LIBRARY_PATH")));
        }
        let sym = |name: &str| -> Result<*mut c_void> {
            let c = CString::new(name).expect("no NUL");
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            if p.is_null() {
                Err(Error::Other(format!("libnccl lacks {name}")))
            } else {
                Ok(p)
            }
        };
        // SAFETY: the signatures are NCCL's documented C API (nccl.h, NCCL 2.x).
        unsafe {
            Ok(NcclLib {
                get_unique_id: std::mem::transmute::<*mut c_void, _>(sym("ncclGetUniqueId")?),
                comm_init_rank: std::mem::transmute::<*mut c_void, _>(sym("ncclCommInitRank")?),
                all_reduce: std::mem::transmute::<*mut c_void, _>(sym("ncclAllReduce")?),
                broadcast: std::mem::transmute::<*mut c_void, _>(sym("ncclBroadcast")?),
                comm_abort: std::mem::transmute::<*mut c_void, _>(sym("ncclCommAbort")?),
                error_string: std::mem::transmute::<*mut c_void, _>(sym("ncclGetErrorString")?),
            })
        }
    }

    fn check(&self, what: &str, code: c_int) -> Result<()> {
        if code == 0 {
            return Ok(());
        }
        let msg = unsafe { std::ffi::CStr::from_ptr((self.error_string)(code)) }.to_string_lossy().into_owned();
        Err(Error::Other(format!("NCCL {what}: {msg} (code {code})")))
    }
}

/// NCCL collectives on the legacy default CUDA stream, the stream libtorch runs on: they are
/// ordered after the backward pass that produced the gradients and before the optimizer step,
/// with no host synchronisation.
pub struct NcclComm {
    lib: NcclLib,
    comm: RawComm,
    rank: usize,
    world: usize,
    device: Device,
    _store: Store,
}

impl NcclComm {
    fn new(store: Store, rank: usize, world: usize, device: Device) -> Result<NcclComm> {
        let lib = NcclLib::load()?;
        let id = if rank == 0 {
            let mut id = NcclUniqueId { internal: [0; 128] };
            lib.check("get unique id", unsafe { (lib.get_unique_id)(&mut id) })?;
            store.set("nccl_id", &id.internal)?;
            id
        } else {
            let v = store.get("nccl_id")?;
            let mut id = NcclUniqueId { internal: [0; 128] };
            id.internal.copy_from_slice(&v);
            id
        };
        // NCCL picks the current CUDA device: creating a tensor makes `device` current.
        let _ = Tensor::zeros([1], (Kind::Float, device));
        let mut comm = std::ptr::null_mut();
        lib.check("init", unsafe { (lib.comm_init_rank)(&mut comm, world as c_int, id, rank as c_int) })?;
        Ok(NcclComm { lib, comm, rank, world, device, _store: store })
    }

    fn dtype(t: &Tensor) -> Result<c_int> {
        match t.kind() {
            Kind::Float => Ok(NCCL_FLOAT32),
            Kind::BFloat16 => Ok(NCCL_BFLOAT16),
            k => Err(Error::Other(format!("NCCL all-reduce of {k:?} tensors is not supported (fp32 or bf16)"))),
        }
    }
}

impl Communicator for NcclComm {
    fn place(&self) -> Place {
        Place { rank: self.rank, world: self.world, device: self.device }
    }

    fn all_reduce_sum(&mut self, t: &mut Tensor) -> Result<()> {
        assert!(t.is_contiguous() && t.device() == self.device, "all-reduce needs a contiguous tensor on the worker's GPU");
        let p = t.data_ptr();
        self.lib.check("all-reduce", unsafe { (self.lib.all_reduce)(p, p, t.numel(), Self::dtype(t)?, NCCL_SUM, self.comm, std::ptr::null_mut()) })
    }

    /// NCCL calls return at once (the GPU waits, not the host): synchronise so that the host
    /// really waits for every rank, as a barrier must.
    fn barrier(&mut self) -> Result<()> {
        let mut t = Tensor::zeros([1], (Kind::Float, self.device));
        self.all_reduce_sum(&mut t)?;
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
        Ok(())
    }

    fn broadcast(&mut self, t: &mut Tensor, root: usize) -> Result<()> {
        assert!(t.is_contiguous() && t.device() == self.device, "broadcast needs a contiguous tensor on the worker's GPU");
        let p = t.data_ptr();
        // NCCL writes the tensor (parameters, at the start) without moving its version counter.
        crate::util::parameters_written();
        self.lib.check("broadcast", unsafe { (self.lib.broadcast)(p, p, t.numel(), Self::dtype(t)?, root as c_int, self.comm, std::ptr::null_mut()) })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        // Let this rank's last collectives finish first (the host runs ahead of the GPU), then
        // abort, not destroy: destroy waits for peers that may be gone.
        if let Device::Cuda(i) = self.device {
            tch::Cuda::synchronize(i as i64);
        }
        unsafe { (self.lib.comm_abort)(self.comm) };
    }
}

// ---------------------------------------------------------------------------------------------

/// Averages gradients across ranks in buckets of about `bucket_bytes` (parameters in optimizer
/// order), each bucket flattened into one tensor of the reduction kind (fp32 or bf16).
pub struct GradSync {
    buckets: Vec<Vec<usize>>,
    kind: Kind,
}

impl GradSync {
    pub fn new(params: &[Tensor], bucket_bytes: usize, kind: Kind) -> GradSync {
        let mut buckets: Vec<Vec<usize>> = vec![Vec::new()];
        let mut bytes = 0;
        for (i, p) in params.iter().enumerate() {
            let b = p.numel() * kind.elt_size_in_bytes();
            if bytes > 0 && bytes + b > bucket_bytes {
                buckets.push(Vec::new());
                bytes = 0;
            }
            buckets.last_mut().expect("one bucket").push(i);
            bytes += b;
        }
        GradSync { buckets, kind }
    }

    pub fn buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Replace every gradient of `params` by its mean over the ranks.
    pub fn average(&self, comm: &mut dyn Communicator, params: &[Tensor]) -> Result<()> {
        let scale = 1.0 / comm.world() as f64;
        tch::no_grad(|| -> Result<()> {
            for bucket in &self.buckets {
                let grads: Vec<Tensor> = bucket.iter().map(|&i| params[i].grad()).collect();
                if let Some(i) = grads.iter().position(|g| !g.defined()) {
                    return Err(Error::Other(format!("parameter {} has no gradient; data parallelism needs every parameter to take part in the loss", bucket[i])));
                }
                let mut flat = Tensor::cat(&grads.iter().map(|g| g.reshape([-1]).to_kind(self.kind)).collect::<Vec<_>>(), 0);
                comm.all_reduce_sum(&mut flat)?;
                let mut off = 0;
                for g in &grads {
                    let n = g.numel() as i64;
                    let mut g = g.shallow_clone();
                    g.copy_(&(flat.narrow(0, off, n).view(g.size().as_slice()).to_kind(g.kind()) * scale));
                    off += n;
                }
            }
            Ok(())
        })
    }
}

/// Exits the process when no training step completes within `timeout`: a hung peer (or an NCCL
/// collective waiting for a dead one) cannot be interrupted from inside, and the launcher (ours,
/// torchrun or srun) then stops the other workers.
pub struct Watchdog {
    beat: std::sync::Arc<std::sync::atomic::AtomicU64>,
    start: std::time::Instant,
}

impl Watchdog {
    pub fn start(rank: usize, timeout: Duration) -> Watchdog {
        use std::sync::atomic::Ordering;
        let beat = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let start = std::time::Instant::now();
        let b = beat.clone();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(500).min(timeout));
            let last = b.load(Ordering::Relaxed);
            if last == u64::MAX {
                return;
            }
            if start.elapsed().saturating_sub(Duration::from_millis(last)) > timeout {
                eprintln!("error: data-parallel rank {rank}: no training step finished in {:.0} s (train.dist_timeout_s); a peer is hung or dead; stopping", timeout.as_secs_f64());
                // _exit: no atexit handlers, which could block on a GPU stuck in a collective.
                unsafe { libc::_exit(3) };
            }
        });
        Watchdog { beat, start }
    }

    pub fn beat(&self) {
        self.beat.store(self.start.elapsed().as_millis() as u64, std::sync::atomic::Ordering::Relaxed);
    }

    /// No more collectives follow (rank 0's final evaluation may take long): stop watching.
    pub fn stop(&self) {
        self.beat.store(u64::MAX, std::sync::atomic::Ordering::Relaxed);
    }
}

/// How this rank's micro-batches tile a global batch of `batch` sequences that one process would
/// split into `accum` micro-batches: rank r owns rows `[r·batch/world, (r+1)·batch/world)`, cut into
/// micro-batches no larger than the single-process ones. Returns (first row, rows) per micro-batch.
pub fn rank_micro_batches(batch: usize, accum: usize, rank: usize, world: usize) -> Result<Vec<(usize, usize)>> {
    if batch % world != 0 {
        return Err(Error::Other(format!("{world} workers do not divide the global batch of {batch} sequences (train.batch_size); use a world size that divides it")));
    }
    let rows = batch / world;
    let micro = gcd(batch / accum, rows);
    Ok((0..rows / micro).map(|j| (rank * rows + j * micro, micro)).collect())
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_follows_the_torchrun_convention() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| move |k: &str| pairs.iter().find(|p| p.0 == k).map(|p| p.1.to_string());
        assert_eq!(DistEnv::from_vars(vars(&[])).unwrap(), None);
        assert_eq!(DistEnv::from_vars(vars(&[("WORLD_SIZE", "1"), ("RANK", "0")])).unwrap(), None);
        let e = DistEnv::from_vars(vars(&[("WORLD_SIZE", "4"), ("RANK", "3"), ("LOCAL_RANK", "1"), ("MASTER_ADDR", "node7"), ("MASTER_PORT", "1234")])).unwrap().unwrap();
        assert_eq!(e, DistEnv { rank: 3, world: 4, local_rank: 1, master_addr: "node7".into(), master_port: 1234 });
        assert!(DistEnv::from_vars(vars(&[("WORLD_SIZE", "2")])).unwrap_err().to_string().contains("RANK"));
        assert!(DistEnv::from_vars(vars(&[("WORLD_SIZE", "2"), ("RANK", "2")])).is_err());
    }

    #[test]
    fn rank_slices_tile_the_global_batch_once() {
        // (batch, accum, world): every row of the global batch is owned by exactly one rank.
        for (batch, accum, world) in [(8, 2, 2), (8, 1, 2), (8, 4, 2), (12, 3, 2), (12, 2, 3), (8, 8, 4), (6, 1, 1)] {
            let mut seen = vec![0; batch];
            for r in 0..world {
                let mbs = rank_micro_batches(batch, accum, r, world).unwrap();
                let size = mbs[0].1;
                assert!(size <= batch / accum, "micro-batch grew: {batch} {accum} {world}");
                for (first, n) in mbs {
                    assert_eq!(n, size, "unequal micro-batches make the mean loss differ");
                    assert!(first >= r * batch / world && first + n <= (r + 1) * batch / world);
                    (first..first + n).for_each(|i| seen[i] += 1);
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{batch} {accum} {world}: {seen:?}");
        }
        assert_eq!(rank_micro_batches(8, 2, 1, 2).unwrap(), vec![(4, 4)]);
        assert_eq!(rank_micro_batches(12, 3, 1, 2).unwrap(), vec![(6, 2), (8, 2), (10, 2)]);
        assert!(rank_micro_batches(8, 1, 0, 3).unwrap_err().to_string().contains("divide"));
    }

    /// Two ranks as two threads on loopback: all-reduce sums, broadcast copies, bucketed averaging
    /// equals the mean computed directly.
    #[test]
    fn store_collectives_on_loopback() {
        let _rng = crate::testutil::rng();
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let worker = move |rank: usize| {
            let env = DistEnv { rank, world: 2, local_rank: rank, master_addr: "127.0.0.1".into(), master_port: port };
            let mut comm = connect(&env, Device::Cpu, Duration::from_secs(20)).unwrap();
            let mut t = Tensor::from_slice(&[1.0f32, 2.0, 3.0]) * (rank as f64 + 1.0);
            comm.all_reduce_sum(&mut t).unwrap();
            let mut b = Tensor::from_slice(&[rank as f32 + 10.0; 2]);
            comm.broadcast(&mut b, 1).unwrap();
            // Gradients 1..=7 (rank 0) and 10·(1..=7) (rank 1) over two parameters, 2 buckets.
            let params = [Tensor::zeros([3], (Kind::Float, Device::Cpu)).set_requires_grad(true), Tensor::zeros([2, 2], (Kind::Float, Device::Cpu)).set_requires_grad(true)];
            let scale = if rank == 0 { 1.0 } else { 10.0 };
            let target = Tensor::arange_start(1, 8, (Kind::Float, Device::Cpu)) * scale;
            let flat = Tensor::cat(&[params[0].shallow_clone(), params[1].reshape([-1])], 0);
            (&flat * &target).sum(Kind::Float).backward();
            let sync = GradSync::new(&params, 12, Kind::Float);
            assert_eq!(sync.buckets(), 2);
            sync.average(comm.as_mut(), &params).unwrap();
            // bf16 reduction (these values are exact in bf16): the mean of equal gradients is
            // themselves, and the gradients stay fp32.
            GradSync::new(&params, 1 << 20, Kind::BFloat16).average(comm.as_mut(), &params).unwrap();
            assert_eq!(params[1].grad().kind(), Kind::Float);
            comm.barrier().unwrap();
            (Vec::<f32>::try_from(&t).unwrap(), Vec::<f32>::try_from(&b).unwrap(), Vec::<f32>::try_from(params[0].grad()).unwrap(), Vec::<f32>::try_from(params[1].grad().reshape([-1])).unwrap())
        };
        let h1 = std::thread::spawn(move || worker(1));
        let r0 = worker(0);
        let r1 = h1.join().unwrap();
        assert_eq!(r0, r1);
        assert_eq!(r0.0, vec![3.0, 6.0, 9.0]);
        assert_eq!(r0.1, vec![11.0, 11.0]);
        // mean of k and 10k = 5.5k
        assert_eq!(r0.2, vec![5.5, 11.0, 16.5]);
        assert_eq!(r0.3, vec![22.0, 27.5, 33.0, 38.5]);
    }
}
