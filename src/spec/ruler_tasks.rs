//! RULER's needle-in-a-haystack tasks by name (evaluation.md §3.2's table): what a spec may name in
//! `needles: {tasks}` and `eval --task ruler:NAME`. The sample generator is `crate::data::niah`.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Haystack {
    Noise,
    Needle,
    Essay,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Words,
    Numbers,
    Uuids,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NiahTask {
    pub haystack: Haystack,
    pub key: Kind,
    pub value: Kind,
    pub num_keys: usize,
    pub num_values: usize,
    pub num_queries: usize,
}

/// The RULER task of that name (evaluation.md §3.2's table).
pub fn task(name: &str) -> Option<NiahTask> {
    use Haystack::*;
    use Kind::*;
    let t = |haystack, key, value, num_keys, num_values, num_queries| NiahTask { haystack, key, value, num_keys, num_values, num_queries };
    Some(match name {
        "niah_single_1" => t(Noise, Words, Numbers, 1, 1, 1),
        "niah_single_2" => t(Essay, Words, Numbers, 1, 1, 1),
        "niah_single_3" => t(Essay, Words, Uuids, 1, 1, 1),
        "niah_multikey_1" => t(Essay, Words, Numbers, 4, 1, 1),
        "niah_multikey_2" => t(Needle, Words, Numbers, 1, 1, 1),
        "niah_multikey_3" => t(Needle, Uuids, Uuids, 1, 1, 1),
        "niah_multivalue" => t(Essay, Words, Numbers, 1, 4, 1),
        "niah_multiquery" => t(Essay, Words, Numbers, 4, 1, 4),
        _ => return None,
    })
}

pub const TASKS: [&str; 8] = ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery"];
