use super::*;
use crate::finetune::FinetuneSpec;
use crate::linearize::LinearizeSpec;
use crate::train::stages::prepare_dir;

const FINETUNE: &str = "base: some/llama\nattention: {kind: dar, d_down: 16, window: 8}\ndata: {train: {path: chat.jsonl}}\noutput: OUT\n";
const LINEARIZE: &str = "{teacher: t, attention: {kind: still}, data: {train: {alpaca: a.jsonl}}, output: OUT}";

fn tiny_spec(out: &Path) -> crate::spec::Spec {
    crate::spec::from_str(crate::spec::BUILTIN_TINY, "tiny.yaml", &[format!("output={}", out.display())]).unwrap()
}

/// Each command's run directory is told apart: train and finetune by the `command:` they record
/// (and the directory reopens: the recorded key does not make the config differ), linearize by its
/// teacher; config.yaml still reads back as the command's spec.
#[test]
fn dispatch_on_every_run_kind() {
    let tmp = tempfile::tempdir().unwrap();
    let train = tmp.path().join("train");
    let spec = tiny_spec(&train);
    crate::train::run::RunDir::prepare(&spec).unwrap();
    let text = std::fs::read_to_string(train.join("config.yaml")).unwrap();
    assert!(text.starts_with("command: train\n"), "{text}");
    assert_eq!(RunKind::of(&train).unwrap(), RunKind::Train);
    assert_eq!(crate::spec::from_str(&text, "config.yaml", &[]).unwrap(), spec);
    crate::train::run::RunDir::prepare(&spec).expect("reopens its own run directory");

    let ft = tmp.path().join("ft");
    let ft_spec = FinetuneSpec::from_yaml(&FINETUNE.replace("OUT", &ft.display().to_string())).unwrap();
    prepare_dir(&ft, &ft_spec, |_| {}, "finetune").unwrap();
    let text = std::fs::read_to_string(ft.join("config.yaml")).unwrap();
    assert!(text.starts_with("command: finetune\n"), "{text}");
    assert_eq!(RunKind::of(&ft).unwrap(), RunKind::Finetune);
    assert_eq!(FinetuneSpec::from_yaml(&text).unwrap(), ft_spec);
    prepare_dir(&ft, &ft_spec, |_| {}, "finetune").expect("reopens its own run directory");
    assert!(crate::spec::from_str(&text, "config.yaml", &[]).is_err(), "a finetune config is no train spec");

    let lin = tmp.path().join("lin");
    let lin_spec = LinearizeSpec::from_yaml(&LINEARIZE.replace("OUT", &lin.display().to_string())).unwrap();
    prepare_dir(&lin, &lin_spec, |_| {}, "linearize").unwrap();
    let text = std::fs::read_to_string(lin.join("config.yaml")).unwrap();
    assert!(text.starts_with("command: linearize\n"), "{text}");
    assert_eq!(RunKind::of(&lin).unwrap(), RunKind::Linearize);
    assert_eq!(LinearizeSpec::from_yaml(&text).unwrap(), lin_spec);
    assert_eq!(LinearizeSpec::from_file(&lin.join("config.yaml")).unwrap(), lin_spec, "the file reader takes it too");
    prepare_dir(&lin, &lin_spec, |_| {}, "linearize").expect("reopens its own run directory");

    let bad = tmp.path().join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    std::fs::write(bad.join("config.yaml"), "command: evaluate\n").unwrap();
    let e = RunKind::of(&bad).unwrap_err().to_string();
    assert!(e.contains("command") && e.contains("evaluate"), "{e}");
}

/// Run directories written before `command:` existed: the kind comes from which spec the config is.
#[test]
fn old_run_directories_without_command() {
    let tmp = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let d = tmp.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("config.yaml"), text).unwrap();
        d
    };
    let train = write("train", &tiny_spec(Path::new("o")).to_yaml());
    let ft = write("ft", &FINETUNE.replace("OUT", "o"));
    let lin = write("lin", &LINEARIZE.replace("OUT", "o"));
    assert_eq!([train, ft, lin].map(|d| RunKind::of(&d).unwrap()), [RunKind::Train, RunKind::Finetune, RunKind::Linearize]);
}

/// A sweep whose base is a finetune spec plans `attnlab finetune` runs.
#[test]
fn sweep_of_a_finetune_base_runs_finetune() {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("base.yaml"), FINETUNE.replace("output: OUT\n", "")).unwrap();
    let file = tmp.path().join("sweep.yaml");
    std::fs::write(&file, format!("base: base.yaml\noutput: {}\nname: \"w{{attention.window}}\"\ngrid: {{attention.window: [4, 8]}}\n", tmp.path().join("out").display())).unwrap();
    let plan = crate::sweep::plan(&file, &[], None).unwrap();
    assert_eq!(plan.runs.len(), 2);
    for r in &plan.runs {
        assert_eq!(r.spec.command(), "finetune", "{}", r.name);
        let crate::sweep::RunSpec::Finetune(s) = &r.spec else { panic!("{} is not a finetune run", r.name) };
        assert_eq!(s.output, r.dir);
    }
}
