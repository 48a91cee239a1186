//! A run's model on input given on the command line: `attnlab forward` (the logits of given token
//! ids, written as safetensors, for comparing against another implementation) and `attnlab
//! generate` (continue a prompt with the model's decode cache).
use super::generate::{self, Generated, Sampling};
use crate::{Error, Result};
use std::path::Path;

/// Whitespace-separated token ids from `text` (read from `origin`), each inside `[0, vocab)`.
pub fn parse_token_ids(text: &str, origin: &Path, vocab: i64) -> Result<Vec<i64>> {
    let ids: Vec<i64> = text
        .split_whitespace()
        .enumerate()
        .map(|(i, w)| w.parse::<i64>().map_err(|e| Error::Data(format!("{}: token {} (`{w}`) is not an integer: {e}", origin.display(), i + 1))))
        .collect::<Result<_>>()?;
    if let Some(bad) = ids.iter().find(|&&i| i < 0 || i >= vocab) {
        return Err(Error::Data(format!("{}: token id {bad} is outside the vocabulary [0, {vocab})", origin.display())));
    }
    Ok(ids)
}

/// The prompt's ids (from `tokenizer`) all rows of the model's embedding table (`vocab` rows): a
/// tokenizer larger than the model it came with would otherwise fail inside torch at the first forward.
pub fn check_prompt_ids(ids: &[u32], vocab: usize, tokenizer: &str) -> Result<()> {
    match ids.iter().find(|&&i| i as usize >= vocab) {
        Some(bad) => Err(Error::Data(format!("the prompt has token id {bad} (tokenizer {tokenizer}), outside the model's embedding table of {vocab} rows: the tokenizer does not belong to the model"))),
        None => Ok(()),
    }
}

/// `attnlab forward`: float32 logits `[n, vocab]` of the ids in `tokens` under `run` (anything
/// `generate::load` reads; checkpoint `step`, default the newest) into the safetensors file `out` (tensor `logits`). Returns its shape.
pub fn forward_file(run: &Path, tokens: &Path, out: &Path, step: Option<u64>, device: Option<&str>) -> Result<Vec<i64>> {
    let loaded = generate::load(run, step, device)?;
    let text = std::fs::read_to_string(tokens).map_err(|e| Error::io(tokens, e))?;
    let ids = parse_token_ids(&text, tokens, loaded.model.vocab() as i64)?;
    let x = tch::Tensor::from_slice(&ids).view([1, -1]).to_device(loaded.device);
    let logits = tch::no_grad(|| loaded.model.forward(&x)).squeeze_dim(0).to_kind(tch::Kind::Float).to_device(tch::Device::Cpu);
    tch::Tensor::write_safetensors(&[("logits", &logits)], out)?;
    Ok(logits.size())
}

/// What `attnlab generate` produced.
pub struct Continuation {
    /// The prompt as the model saw it (wrapped in the chat template with `chat`).
    pub prompt: String,
    /// The generated tokens, decoded (the prompt not included).
    pub text: String,
    pub stats: Generated,
}

/// `attnlab generate`: continue `prompt` with the model of `run` (a train or linearize run
/// directory, or a linearize export folder; see `generate::load`). The tokenizer's BOS goes first
/// when it has one (Llama), as Hugging Face and `eval --task` do; generation stops at its EOS. With
/// `chat` the prompt is a user turn of the model's chat template, with the assistant's generation prompt.
pub fn continue_prompt(run: &Path, prompt: &str, chat: bool, max_new_tokens: usize, sampling: Sampling, step: Option<u64>, device: Option<&str>) -> Result<Continuation> {
    let loaded = generate::load(run, step, device)?;
    let prompt = if chat {
        let template = loaded.chat.as_ref().ok_or_else(|| Error::Other(format!("--chat: {} has no chat template", run.display())))?;
        template.render(&[crate::data::chat::Message { role: "user".into(), content: prompt.into() }], true)?
    } else {
        prompt.to_string()
    };
    let mut ids: Vec<u32> = crate::data::tokenizer::bos_id(&loaded.tok).into_iter().collect();
    ids.extend(loaded.tok.encode(&prompt)?);
    if ids.is_empty() {
        return Err(Error::Other("the prompt encodes to no tokens".into()));
    }
    check_prompt_ids(&ids, loaded.model.vocab(), &loaded.tok.origin)?;
    let stats = generate::generate(&loaded.model, &ids, max_new_tokens, sampling, Some(loaded.eos), loaded.device);
    Ok(Continuation { text: loaded.tok.decode(&stats.tokens)?, prompt, stats })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_ids_are_integers_inside_the_vocabulary() {
        let f = Path::new("ids.txt");
        assert_eq!(parse_token_ids(" 1 2\n3 ", f, 4).unwrap(), [1, 2, 3]);
        let e = parse_token_ids("1 x 3", f, 4).unwrap_err().to_string();
        assert!(e.contains("ids.txt: token 2 (`x`) is not an integer"), "{e}");
        let e = parse_token_ids("1 4", f, 4).unwrap_err().to_string();
        assert!(e.contains("token id 4 is outside the vocabulary [0, 4)"), "{e}");
        assert!(parse_token_ids("0 -1", f, 4).is_err());
        assert!(check_prompt_ids(&[0, 3], 4, "t.json").is_ok());
        let e = check_prompt_ids(&[0, 4, 1], 4, "t.json").unwrap_err().to_string();
        assert!(e.contains("token id 4 (tokenizer t.json), outside the model's embedding table of 4 rows"), "{e}");
    }
}
