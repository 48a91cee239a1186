//! The trainer on a toy model (x·A·B, MSE): a two-stage plateau-scheduled task and a one-stage
//! cosine task through the same loop, interrupted mid-stage and at a stage boundary, resume
//! bit-identically; rows carry what each command logs.
use super::*;
use crate::train::optim::Plateau;
use crate::train::schedule::Schedule;
use std::collections::BTreeMap;
use tch::{nn::Init, Device};

struct Toy {
    a: Tensor,
    b: Tensor,
    /// Two stages (stage 1 trains A, stage 2 B) or one (both).
    staged: bool,
}

/// A batch of update `step` of `stage`: 4 rows of 3 features, targets of a fixed linear map.
fn data(stage: usize, step: u64, shift: f64) -> (Tensor, Tensor) {
    let x: Vec<f32> = (0..12).map(|i| ((step * 12 + i) as f64 * 0.37 + stage as f64 + shift).sin() as f32).collect();
    let x = Tensor::from_slice(&x).view([4, 3]);
    let y = x.matmul(&Tensor::from_slice(&[1.5f32, -2.0, 0.5]).view([3, 1]));
    (x, y)
}

impl Toy {
    fn new(vs: &VarStore, staged: bool) -> Toy {
        let root = vs.root();
        let a = (&root / "a").var("weight", &[3, 2], Init::Const(0.3));
        let b = (&root / "b").var("weight", &[2, 1], Init::Const(-0.2));
        Toy { a, b, staged }
    }

    fn loss(&self, x: &Tensor, y: &Tensor) -> Tensor {
        (x.matmul(&self.a).matmul(&self.b) - y).square().mean(Kind::Float)
    }
}

impl StagedTask for Toy {
    fn trains(&self, stage: usize, name: &str) -> bool {
        !self.staged || name == if stage == 1 { "a.weight" } else { "b.weight" }
    }
    fn hyper(&self, _stage: usize) -> Hyper {
        Hyper { betas: (0.9, 0.999), eps: 1e-8, weight_decay: 0.01 }
    }
    fn step(&mut self, stage: usize, step: u64, _log: bool) -> Result<(Tensor, Map<String, Value>)> {
        let (x, y) = data(stage, step, 0.0);
        let l = self.loss(&x, &y);
        l.backward();
        Ok((l.detach(), Map::new()))
    }
    fn evaluate(&mut self, _stage: usize, _at: &Progress) -> Result<Option<Evaluation>> {
        let (x, y) = data(9, 0, 0.5);
        let l = tch::no_grad(|| self.loss(&x, &y)).double_value(&[]);
        Ok(Some(Evaluation { val_loss: self.staged.then_some(l), row: Map::new() }))
    }
}

fn plan(staged: bool, stop_after: Option<u64>) -> Plan {
    let stages = if staged {
        let plateau = Lr::of(Schedule::Plateau, 0.2, 0.0, 0.5, 0, 1e-3);
        vec![StagePlan { steps: 4, lr: plateau.clone(), eval_every: 1 }, StagePlan { steps: 3, lr: plateau, eval_every: 1 }]
    } else {
        vec![StagePlan { steps: 6, lr: Lr::Neox { max: 0.1, min: 0.01, warmup: 2, decay: 6 }, eval_every: 0 }]
    };
    let rows = if staged { Rows::Staged } else { Rows::Throughput };
    Plan { stages, clip: if staged { 0.0 } else { 1.0 }, log_every: 1, checkpoint_every: 2, keep: 10, tokens_per_step: 12, label: "test", quiet: true, stop_after, rows }
}

/// One session in `dir`, resuming from its newest checkpoint; the weights afterwards.
fn session(dir: &Path, staged: bool, stop_after: Option<u64>) -> (u64, BTreeMap<String, Tensor>) {
    std::fs::create_dir_all(dir).unwrap();
    let vs = VarStore::new(Device::Cpu);
    let mut task = Toy::new(&vs, staged);
    let resume = checkpoint::resume_point(dir).unwrap();
    let ran = run(&RunDir { path: dir.into() }, &vs, &plan(staged, stop_after), &mut task, resume, None).unwrap();
    (ran.end, vs.variables().into_iter().collect())
}

fn rows(dir: &Path) -> Vec<Map<String, Value>> {
    crate::train::metrics::read(&dir.join("metrics.jsonl")).unwrap().rows.into_iter().map(|r| r.1).collect()
}

/// (loss, lr) of every update, the last logged row per step (a resumed session logs some again).
fn curve(dir: &Path) -> BTreeMap<u64, (f64, f64)> {
    rows(dir).iter().filter(|r| r.contains_key("loss")).map(|r| (r["step"].as_u64().unwrap(), (r["loss"].as_f64().unwrap(), r["lr"].as_f64().unwrap()))).collect()
}

#[test]
fn plateau_two_stage_and_cosine_one_stage_runs_resume_bit_identically() {
    let _rng = crate::testutil::rng();
    let tmp = tempfile::tempdir().unwrap();
    for (staged, stops) in [(true, vec![3, 4, 6]), (false, vec![3, 4])] {
        let name = if staged { "staged" } else { "one" };
        let straight = tmp.path().join(format!("{name}-straight"));
        let (end, want) = session(&straight, staged, None);
        assert_eq!(end, if staged { 7 } else { 6 });
        for stop in stops {
            // Stopped after `stop` updates (3: resumes from the checkpoint at 2, logging step 3
            // again; 4: at the stage boundary; 6: inside stage 2), then run to the end.
            let dir = tmp.path().join(format!("{name}-{stop}"));
            assert_eq!(session(&dir, staged, Some(stop)).0, stop);
            let (end2, got) = session(&dir, staged, None);
            assert_eq!(end2, end);
            for (n, t) in &want {
                assert!(t.equal(&got[n]), "{name}: {n} differs after stopping at {stop}");
            }
            assert_eq!(curve(&straight), curve(&dir), "{name}: losses or lrs differ after stopping at {stop}");
            // The rows logged past the resume point were set aside, not logged twice.
            let steps: Vec<u64> = rows(&dir).iter().filter(|r| r.contains_key("loss")).map(|r| r["step"].as_u64().unwrap()).collect();
            assert_eq!(steps, (1..=end).collect::<Vec<_>>(), "{name}: training rows after stopping at {stop}");
        }
        let c = curve(&straight);
        assert_eq!(c.keys().copied().collect::<Vec<_>>(), (1..=end).collect::<Vec<_>>());
        let all = rows(&straight);
        let train_rows: Vec<&Map<String, Value>> = all.iter().filter(|r| r.contains_key("loss")).collect();
        if staged {
            assert!(train_rows.iter().all(|r| r["stage"].as_u64().is_some() && !r.contains_key("grad_norm")));
            assert_eq!((train_rows[3]["stage"].as_u64(), train_rows[4]["stage"].as_u64()), (Some(1), Some(2)));
            // Every update is evaluated; each stage's plateau (patience 0, factor 0.5) steps on its
            // own evaluations, and the next update trains with the rate it set.
            let evals: Vec<(u64, u64, f64, f64)> = all.iter().filter(|r| r.contains_key("val_loss")).map(|r| (r["step"].as_u64().unwrap(), r["stage"].as_u64().unwrap(), r["val_loss"].as_f64().unwrap(), r["lr"].as_f64().unwrap())).collect();
            assert_eq!(evals.iter().map(|e| e.0).collect::<Vec<_>>(), (1..=7).collect::<Vec<_>>());
            let mut reduced = 0;
            for stage in [1, 2] {
                let mut p = Plateau::new(0.2, 0.5, 0, 1e-3);
                for &(step, _, val, lr) in evals.iter().filter(|e| e.1 == stage) {
                    assert_eq!(lr, p.observe(val), "lr after the eval at step {step}");
                    reduced += (lr < 0.2) as usize;
                    if let Some(next) = c.get(&(step + 1)).filter(|_| step != 4) {
                        assert_eq!(next.1, lr, "step {} trains with the scheduled lr", step + 1);
                    }
                }
            }
            assert_eq!(c[&5].1, 0.2, "stage 2 starts its own plateau at the stage's lr");
            assert!(reduced > 0, "the plateau never reduced the rate: {evals:?}");
        } else {
            assert!(train_rows.iter().all(|r| !r.contains_key("stage") && r["grad_norm"].as_f64().unwrap() > 0.0 && r.contains_key("tokens_per_s")));
            // GPT-NeoX: warmup max(1, n)/2, then cosine to 0.01 at n = 6.
            let lrs: Vec<f64> = c.values().map(|v| v.1).collect();
            let cos = |n: f64| 0.01 + 0.045 * (1.0 + (std::f64::consts::PI * (n - 2.0) / 4.0).cos());
            let want = [0.05, 0.05, 0.1, cos(3.0), cos(4.0), cos(5.0)];
            for (i, (a, b)) in lrs.iter().zip(want).enumerate() {
                assert!((a - b).abs() < 1e-12, "update {i}: lr {a}, want {b}");
            }
        }
    }
}

/// A run started over in a folder that kept an earlier attempt's rows but lost its checkpoints
/// (a copy without them, a cleared disk) logs one curve: the earlier rows, longer than this run
/// and different, move to metrics.discarded.jsonl instead of being read as part of it.
#[test]
fn a_run_started_over_sets_the_earlier_attempts_rows_aside() {
    let _rng = crate::testutil::rng();
    let tmp = tempfile::tempdir().unwrap();
    let (fresh, over) = (tmp.path().join("fresh"), tmp.path().join("over"));
    session(&fresh, false, None);
    std::fs::create_dir_all(&over).unwrap();
    let earlier: String = (1..=9).map(|s| format!("{{\"step\": {s}, \"loss\": 99.0, \"lr\": 1.0}}\n")).collect();
    std::fs::write(over.join("metrics.jsonl"), &earlier).unwrap();
    session(&over, false, None);
    assert_eq!(curve(&over), curve(&fresh));
    assert_eq!(rows(&over).len(), rows(&fresh).len());
    assert_eq!(std::fs::read_to_string(over.join(crate::train::metrics::DISCARDED)).unwrap(), earlier);
}

/// A finished run is reported with its eval.json, one check for every command.
#[test]
fn finished_reads_eval_json_only_when_done() {
    let _rng = crate::testutil::rng();
    let tmp = tempfile::tempdir().unwrap();
    let dir = RunDir { path: tmp.path().into() };
    std::fs::write(tmp.path().join("eval.json"), r#"{"step": 3}"#).unwrap();
    assert!(finished(&dir).is_none());
    dir.mark_done().unwrap();
    assert_eq!(finished(&dir).unwrap()["step"], 3);
    std::fs::remove_file(tmp.path().join("eval.json")).unwrap();
    assert_eq!(finished(&dir), Some(Value::Null));
}
