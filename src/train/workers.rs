//! `attnlab train` over several devices, torchrun-style: with more than one device and no launcher
//! environment, this process launches one worker per device (`launch`) and is done; a worker (or a
//! plain single-device run) trains, its spec narrowed to the one device it owns.
use super::distributed::DistEnv;
use super::launch;
use crate::spec::Spec;
use crate::{Error, Result};

/// What this process does for `attnlab train`.
pub enum Role {
    /// The workers ran (and finished) under this launcher.
    Launched,
    /// Train here: alone (None) or as one worker of a data-parallel run.
    Train(Option<DistEnv>),
}

/// Launch the workers, or narrow `spec` to this worker's device. `args`: this process's arguments,
/// which every worker gets again.
pub fn launch_or_join(spec: &mut Spec, args: &[std::ffi::OsString]) -> Result<Role> {
    let dist = DistEnv::from_env()?;
    let devices = launch::device_names(&spec.train.devices.iter().flatten().map(|d| d.to_string()).collect::<Vec<_>>())?;
    if dist.is_none() && devices.len() > 1 {
        let exe = std::env::current_exe().map_err(|e| Error::Other(format!("locating the attnlab executable: {e}")))?;
        launch::launch(&exe, args, &devices, spec.output.as_deref())?;
        return Ok(Role::Launched);
    }
    if let Some(d) = &dist {
        // A worker trains on the CPU or on the one GPU left visible to it (pin_local_gpu).
        let local = devices.get(d.local_rank).cloned().or(spec.train.device.clone()).unwrap_or_else(|| "auto".into());
        let local = local.as_str();
        spec.train.device = Some(if local == "cpu" { "cpu" } else if local == "auto" { "auto" } else { "cuda:0" }.to_string());
        if local == "cpu" {
            // CPU workers on one machine share its cores instead of each taking all of them.
            let per_node = std::env::var("LOCAL_WORLD_SIZE").ok().and_then(|v| v.parse::<usize>().ok()).unwrap_or(d.world);
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            tch::set_num_threads((cores / per_node.max(1)).max(1) as i32);
        }
    }
    Ok(Role::Train(dist))
}

/// `attnlab train`: `gpus` (the `--gpus` list; replaces `train.devices` when given) decides between
/// launching one worker per device (this executable again, with this process's arguments) and
/// training here. Returns the outcome where one is reported: a single-process run, or rank 0 of a
/// data-parallel one; `None` on the launcher and on the other ranks.
pub fn train_command(mut spec: Spec, gpus: &[String], quiet: bool, stop_after: Option<u64>, finish: Option<super::Finish>) -> Result<Option<super::Outcome>> {
    if !gpus.is_empty() {
        spec.train.devices = Some(gpus.iter().cloned().map(crate::spec::DeviceEntry::Name).collect());
        spec = spec.resolve().map_err(|(key, msg)| Error::Other(format!("--gpus: `{key}`: {msg}")))?;
    }
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let dist = match launch_or_join(&mut spec, &args)? {
        Role::Launched => return Ok(None),
        Role::Train(dist) => dist,
    };
    let rank0 = dist.as_ref().is_none_or(|d| d.rank == 0);
    let o = super::train(spec, &super::TrainOptions { quiet, finish, stop_after, dist })?;
    Ok(rank0.then_some(o))
}
