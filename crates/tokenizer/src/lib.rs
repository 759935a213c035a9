//! Tokenizers built from GGUF metadata, an incremental detokenizer, and chat templates.
//!
//! The behaviour follows llama.cpp's `llama-vocab.cpp` (the reference the engine is checked
//! against): the same vocabulary types (SentencePiece-style `llama`, byte-level BPE `gpt2`, and
//! SPM-style BPE `gemma4`), the same pre-tokenizer regexes per `tokenizer.ggml.pre`, the same
//! special-token splitting, BOS/EOS rules, byte fallback and detokenizer clean-up, so that token
//! ids match llama.cpp's on its own test vectors (`tests/vocab_vectors.rs`).
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let file = gguf::GgufFile::open("model.gguf")?;
//! let tok = tokenizer::Tokenizer::from_gguf(&file)?;
//! let ids = tok.encode("Hello world", true, false)?;
//! let text = tok.decode(&ids)?;
//! # Ok(()) }
//! ```

mod bpe;
pub mod chat;
mod decode;
mod pretok;
mod spm;
mod unicode_tables;
pub mod vocab;

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

pub use chat::{render_chat, ChatMessage, ChatTemplate, RenderedChat, TemplateLimits};
pub use decode::IncrementalDecoder;
pub use vocab::{SpecialIds, TokenAttr, Vocab};

/// The Unicode version whose general categories the pre-tokenizer classes (`\p{L}`, ...) use:
/// the one llama.cpp's tokenizer tables follow.
pub const UNICODE_VERSION: &str = unicode_tables::UNICODE_VERSION;

/// Everything that can go wrong building or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A metadata key is missing or has the wrong type (the GGUF reader names the key).
    #[error("tokenizer metadata: {0}")]
    Gguf(#[from] gguf::GgufError),
    /// A metadata key holds a type the tokenizer cannot use.
    #[error("tokenizer metadata: key {key} has type {found}, expected {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// What was expected.
        expected: &'static str,
        /// What the file holds.
        found: String,
    },
    /// `tokenizer.ggml.model` names a tokenizer type this crate does not implement.
    #[error("unsupported tokenizer model {model:?} (tokenizer.ggml.model)")]
    UnsupportedModel {
        /// The model name.
        model: String,
    },
    /// `tokenizer.ggml.pre` names a pre-tokenizer this crate does not implement.
    #[error("unsupported pre-tokenizer {pre:?} (tokenizer.ggml.pre)")]
    UnsupportedPre {
        /// The pre-tokenizer name.
        pre: String,
    },
    /// The vocabulary has no tokens.
    #[error("tokenizer.ggml.tokens is missing or empty")]
    EmptyVocab,
    /// A per-token array is shorter than the token list.
    #[error("{key} has {got} entries but tokenizer.ggml.tokens has {want}")]
    ArrayTooShort {
        /// The key of the short array.
        key: &'static str,
        /// Its length.
        got: usize,
        /// The number of tokens.
        want: usize,
    },
    /// A byte-level BPE vocabulary without `tokenizer.ggml.merges`.
    #[error("tokenizer.ggml.merges is missing (required for tokenizer model {model:?})")]
    MissingMerges {
        /// The tokenizer model.
        model: String,
    },
    /// A pre-tokenizer regex failed to compile.
    #[error("pre-tokenizer {pre} regex #{index} does not compile: {message}")]
    Regex {
        /// Pre-tokenizer kind.
        pre: String,
        /// Index of the regex in its list.
        index: usize,
        /// The regex engine's message.
        message: String,
    },
    /// The regex engine gave up on a piece of text (backtracking limit).
    #[error("pre-tokenizer failed on the text at byte offset {offset}: {message}")]
    RegexRuntime {
        /// Byte offset of the piece in the input text.
        offset: usize,
        /// The regex engine's message.
        message: String,
    },
    /// A character has no token and the vocabulary has no byte-fallback token for one of its bytes.
    #[error("no token for byte 0x{byte:02X} of the text at byte offset {offset} (byte fallback)")]
    MissingByteToken {
        /// The byte.
        byte: u8,
        /// Offset of the piece holding it in the input text.
        offset: usize,
    },
    /// A special token the operation needs is not defined by the vocabulary.
    #[error("the vocabulary defines no {which} token, but the operation needs one")]
    MissingSpecial {
        /// Which token (`BOS`, `EOS`).
        which: &'static str,
    },
    /// A token id outside the vocabulary.
    #[error("token id {id} at index {index} is outside the vocabulary of {n_vocab} tokens")]
    InvalidTokenId {
        /// The id.
        id: u32,
        /// Its index in the input sequence.
        index: usize,
        /// The vocabulary size.
        n_vocab: usize,
    },
    /// A chat template failed to parse or render.
    #[error("chat template: {message}")]
    Template {
        /// The template engine's message, with line information.
        message: String,
    },
    /// Input bytes given to [`Tokenizer::encode_bytes`] are not valid UTF-8.
    #[error("the text is not valid UTF-8 at byte offset {offset}")]
    InvalidUtf8 {
        /// Offset of the first byte that is not part of a valid UTF-8 sequence.
        offset: usize,
    },
    /// A chat template ran out of its instruction budget (a template that loops for too long).
    #[error("chat template: rendering exceeded its budget of {fuel} instructions")]
    TemplateFuel {
        /// The budget.
        fuel: u64,
    },
    /// A chat template rendered more text than allowed.
    #[error("chat template: the rendered prompt exceeds {limit} bytes")]
    TemplateOutputTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
}

/// The tokenization algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerKind {
    /// SentencePiece-style (llama.cpp `LLAMA_VOCAB_TYPE_SPM`, GGUF model `llama`): score-driven
    /// merges of UTF-8 characters, spaces as U+2581, byte fallback.
    Spm,
    /// Byte-level BPE (llama.cpp `LLAMA_VOCAB_TYPE_BPE`, GGUF model `gpt2`; also `gemma4`, which
    /// merges raw UTF-8 instead of GPT-2 byte symbols): regex pre-tokenizer, ranked merges.
    Bpe,
}

/// Special token ids after llama.cpp's defaults and detection rules were applied.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// Beginning of sequence.
    pub bos: Option<u32>,
    /// End of sequence.
    pub eos: Option<u32>,
    /// End of turn (`<|eot_id|>`, `<|im_end|>`, ...).
    pub eot: Option<u32>,
    /// End of message (`<|eom_id|>`).
    pub eom: Option<u32>,
    /// Unknown.
    pub unk: Option<u32>,
    /// Separator.
    pub sep: Option<u32>,
    /// Padding.
    pub pad: Option<u32>,
    /// Mask.
    pub mask: Option<u32>,
    /// Fill-in-the-middle prefix.
    pub fim_pre: Option<u32>,
    /// Fill-in-the-middle suffix.
    pub fim_suf: Option<u32>,
    /// Fill-in-the-middle middle.
    pub fim_mid: Option<u32>,
    /// Fill-in-the-middle pad.
    pub fim_pad: Option<u32>,
    /// Fill-in-the-middle repository.
    pub fim_rep: Option<u32>,
    /// Fill-in-the-middle file separator.
    pub fim_sep: Option<u32>,
}

/// A piece of the input after special-token splitting.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Fragment {
    /// Plain text: a byte range of the input.
    Text(std::ops::Range<usize>),
    /// A special token matched in the input.
    Token(u32),
}

const SPACE_ESCAPE: &str = "\u{2581}";

/// A tokenizer: encode text to token ids and back. Immutable after construction, `Send + Sync`;
/// share it with `Arc`.
#[derive(Debug)]
pub struct Tokenizer {
    kind: TokenizerKind,
    model: String,
    pre_name: String,
    pre_kind: &'static str,
    splitter: Option<pretok::Splitter>,
    raw_utf8: bool,
    tokens: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<TokenAttr>,
    token_to_id: TextIndex,
    /// Merge parts that are not token texts, numbered from `tokens.len()` on (a part that is a
    /// token text is numbered by its token id, see [`Tokenizer::merge_part`]).
    merge_parts: HashMap<String, u32>,
    merge_ranks: HashMap<(u32, u32), u32>,
    n_merges: usize,
    special_cache: Vec<u32>,
    pieces: Vec<Vec<u8>>,
    byte_tokens: [Option<u32>; 256],
    /// SentencePiece text can be merged word by word: no token joins a character to a
    /// following U+2581 (see `spm::encode`).
    spm_word_split: bool,
    special: SpecialTokens,
    eog: HashSet<u32>,
    add_bos: bool,
    add_eos: bool,
    add_sep: bool,
    add_space_prefix: bool,
    ignore_merges: bool,
    clean_spaces: bool,
    escape_whitespaces: bool,
    chat_template: Option<String>,
    warnings: Vec<String>,
}

/// Token text -> id without a second copy of the (100k+) texts: open addressing over the ids,
/// each slot `id + 1` (0: empty), compared against `tokens[id]`. A later duplicate text wins,
/// as in llama.cpp's map.
#[derive(Debug, Default)]
pub(crate) struct TextIndex {
    slots: Vec<u32>,
}

impl TextIndex {
    fn hash(s: &str) -> usize {
        use std::hash::{Hash, Hasher};
        let mut h = rustc_hash::FxHasher::default();
        s.hash(&mut h);
        h.finish() as usize
    }

    fn new(tokens: &[String]) -> TextIndex {
        let cap = (tokens.len() * 2).next_power_of_two().max(16);
        let mut slots = vec![0u32; cap];
        for (i, t) in tokens.iter().enumerate() {
            let mut h = Self::hash(t) & (cap - 1);
            loop {
                let s = slots[h] as usize;
                if s == 0 || tokens.get(s - 1) == Some(t) {
                    slots[h] = i as u32 + 1;
                    break;
                }
                h = (h + 1) & (cap - 1);
            }
        }
        TextIndex { slots }
    }

    /// The id of `text` in `tokens` (the vector the index was built over).
    pub(crate) fn get(&self, tokens: &[String], text: &str) -> Option<u32> {
        let cap = self.slots.len();
        if cap == 0 {
            return None;
        }
        let mut h = Self::hash(text) & (cap - 1);
        loop {
            let s = *self.slots.get(h)? as usize;
            if s == 0 {
                return None;
            }
            if tokens.get(s - 1).map(String::as_str) == Some(text) {
                return Some(s as u32 - 1);
            }
            h = (h + 1) & (cap - 1);
        }
    }
}

const EOT_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_NAMES: &[&str] = &["<|eom_id|>"];
const FIM_PRE_NAMES: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_NAMES: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_NAMES: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_NAMES: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_NAMES: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_NAMES: &[&str] = &["<|file_sep|>"];
const EOG_NAMES: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// C's `isspace` in the "C" locale, which llama.cpp uses for LSTRIP/RSTRIP.
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0B | 0x0C | b'\r')
}

impl Tokenizer {
    /// Builds the tokenizer of a GGUF file from its `tokenizer.*` metadata.
    pub fn from_gguf(file: &gguf::GgufFile) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_metadata(file.metadata())
    }

    /// Builds a tokenizer from GGUF metadata.
    pub fn from_metadata(md: &gguf::Metadata) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_vocab(Vocab::from_metadata(md)?)
    }

    /// Builds a tokenizer from vocabulary data, applying llama.cpp's loader rules: default
    /// special ids and flags per tokenizer type and pre-tokenizer, special-token detection by
    /// text (end-of-turn, fill-in-the-middle, end-of-generation), and per-model attributes.
    pub fn from_vocab(v: Vocab) -> Result<Tokenizer, TokenizerError> {
        let n = v.tokens.len();
        if n == 0 {
            return Err(TokenizerError::EmptyVocab);
        }
        let mut warnings = Vec::new();

        // Type and the defaults llama.cpp attaches to it.
        let (kind, mut pre_name, mut defaults) = match v.model.as_str() {
            "llama" => (
                TokenizerKind::Spm,
                v.pre.clone(),
                SpecialTokens {
                    bos: Some(1),
                    eos: Some(2),
                    unk: Some(0),
                    ..SpecialTokens::default()
                },
            ),
            "gpt2" => (
                TokenizerKind::Bpe,
                v.pre.clone(),
                SpecialTokens {
                    bos: Some(11),
                    eos: Some(11),
                    ..SpecialTokens::default()
                },
            ),
            "gemma4" => (
                TokenizerKind::Bpe,
                Some("gemma4".to_owned()),
                SpecialTokens::default(),
            ),
            other => {
                return Err(TokenizerError::UnsupportedModel {
                    model: other.to_owned(),
                })
            }
        };

        let mut add_bos;
        let mut add_eos = false;
        let add_sep = false;
        let mut add_space_prefix;
        let mut ignore_merges = false;
        let clean_spaces;
        let mut escape_whitespaces = true;
        let mut splitter = None;
        let mut raw_utf8 = false;
        let pre_kind;
        match kind {
            TokenizerKind::Bpe => {
                let cfg = pre::config(pre_name.as_deref())?;
                add_space_prefix = false;
                escape_whitespaces = cfg.escape_whitespace;
                clean_spaces = cfg.clean_spaces;
                ignore_merges = cfg.ignore_merges;
                add_bos = cfg.add_bos;
                raw_utf8 = cfg.raw_utf8;
                if cfg.no_bos {
                    defaults.bos = None;
                }
                pre_kind = cfg.kind;
                splitter = Some(pretok::Splitter::new(&cfg)?);
            }
            TokenizerKind::Spm => {
                add_space_prefix = true;
                clean_spaces = false;
                add_bos = true;
                add_eos = false;
                pre_kind = "default";
                pre_name = Some(pre_name.unwrap_or_else(|| "default".to_owned()));
            }
        }
        if let Some(b) = v.add_space_prefix {
            add_space_prefix = b;
        }

        // Tokens, scores, attributes.
        let scores = match &v.scores {
            Some(s) if s.len() < n => {
                return Err(TokenizerError::ArrayTooShort {
                    key: "tokenizer.ggml.scores",
                    got: s.len(),
                    want: n,
                })
            }
            Some(s) => s[..n].to_vec(),
            None => vec![0.0; n],
        };
        let mut attrs = match &v.token_types {
            Some(t) if t.len() < n => {
                return Err(TokenizerError::ArrayTooShort {
                    key: "tokenizer.ggml.token_type",
                    got: t.len(),
                    want: n,
                })
            }
            Some(t) => t[..n]
                .iter()
                .map(|&x| TokenAttr::from_token_type(x))
                .collect(),
            None => vec![TokenAttr::NORMAL; n],
        };
        let mut tokens = v.tokens;
        for (i, t) in tokens.iter_mut().enumerate() {
            if t.is_empty() {
                warnings.push(format!("empty token at index {i}"));
                *t = format!("[EMPTY_{i}]");
            }
        }
        let token_to_id = TextIndex::new(&tokens);

        // Merges: interned parts, (left, right) -> rank; the first occurrence of a pair wins.
        let mut merge_parts: HashMap<String, u32> = HashMap::default();
        let mut merge_ranks: HashMap<(u32, u32), u32> = HashMap::default();
        let mut n_merges = 0;
        if kind == TokenizerKind::Bpe {
            let merges = v
                .merges
                .as_ref()
                .ok_or_else(|| TokenizerError::MissingMerges {
                    model: v.model.clone(),
                })?;
            n_merges = merges.len();
            for (rank, m) in merges.iter().enumerate() {
                // llama.cpp splits at the first space after the first byte; a merge without one
                // becomes the pair ("", "").
                let space = m
                    .as_bytes()
                    .iter()
                    .skip(1)
                    .position(|&b| b == b' ')
                    .map(|p| p + 1);
                let (first, second) = match space {
                    Some(p) => (&m[..p], &m[p + 1..]),
                    None => ("", ""),
                };
                // Parts are numbered by their token id when they are token texts (nearly all
                // are), so only the others need their text kept.
                let mut intern = |s: &str| -> u32 {
                    if let Some(id) = token_to_id.get(&tokens, s) {
                        return id;
                    }
                    let next = (tokens.len() + merge_parts.len()) as u32;
                    *merge_parts.entry(s.to_owned()).or_insert(next)
                };
                let a = intern(first);
                let b = intern(second);
                merge_ranks.entry((a, b)).or_insert(rank as u32);
            }
        }

        // Special ids: defaults out of range are dropped, metadata ids in range replace them.
        let mut special = defaults;
        {
            let sv = &v.special;
            let slots: [(&str, &mut Option<u32>, Option<u32>); 14] = [
                ("bos_token_id", &mut special.bos, sv.bos),
                ("eos_token_id", &mut special.eos, sv.eos),
                ("eot_token_id", &mut special.eot, sv.eot),
                ("eom_token_id", &mut special.eom, sv.eom),
                ("unknown_token_id", &mut special.unk, sv.unk),
                ("seperator_token_id", &mut special.sep, sv.sep),
                ("padding_token_id", &mut special.pad, sv.pad),
                ("mask_token_id", &mut special.mask, sv.mask),
                ("fim_pre_token_id", &mut special.fim_pre, sv.fim_pre),
                ("fim_suf_token_id", &mut special.fim_suf, sv.fim_suf),
                ("fim_mid_token_id", &mut special.fim_mid, sv.fim_mid),
                ("fim_pad_token_id", &mut special.fim_pad, sv.fim_pad),
                ("fim_rep_token_id", &mut special.fim_rep, sv.fim_rep),
                ("fim_sep_token_id", &mut special.fim_sep, sv.fim_sep),
            ];
            for (key, slot, given) in slots {
                if let Some(d) = *slot {
                    if d as usize >= n {
                        warnings.push(format!(
                            "default tokenizer.ggml.{key} = {d} is out of the vocabulary; disabled"
                        ));
                        *slot = None;
                    }
                }
                if let Some(g) = given {
                    if (g as usize) < n {
                        *slot = Some(g);
                    } else {
                        warnings.push(format!(
                            "tokenizer.ggml.{key} = {g} is out of the vocabulary; ignored"
                        ));
                    }
                }
            }
        }
        if let Some(b) = v.add_bos {
            add_bos = b;
        }
        if let Some(b) = v.add_eos {
            add_eos = b;
        }
        let add_sep = v.add_sep.unwrap_or(add_sep);
        if pre_kind == "gemma4" && !add_bos {
            add_bos = true;
        }

        // Detection by token text. llama.cpp walks its text -> id hash map and keeps the first
        // match; libstdc++ walks recently inserted entries first, so with several matches (e.g.
        // `<|end_of_text|>` and `<|eot_id|>` in Llama 3) the highest id tends to win. Walking the
        // ids from the top makes that choice deterministic.
        let canonical = |i: usize, t: &str| token_to_id.get(&tokens, t) == Some(i as u32);
        // Every name looked for below starts with one of these and is short; checking that
        // first keeps the scans over 100k+ tokens cheap.
        let maybe_name = |t: &str| t.len() <= 32 && t.starts_with(['<', '[', '_', '\u{2581}']);
        let detect = |slot: &mut Option<u32>, names: &[&str], attrs: &mut Vec<TokenAttr>| {
            if slot.is_some() {
                return;
            }
            for (i, t) in tokens.iter().enumerate().rev() {
                if maybe_name(t) && names.contains(&t.as_str()) && canonical(i, t) {
                    *slot = Some(i as u32);
                    attrs[i] = attrs[i].with(TokenAttr::CONTROL);
                    return;
                }
            }
        };
        detect(&mut special.eot, EOT_NAMES, &mut attrs);
        detect(&mut special.eom, EOM_NAMES, &mut attrs);
        detect(&mut special.fim_pre, FIM_PRE_NAMES, &mut attrs);
        detect(&mut special.fim_suf, FIM_SUF_NAMES, &mut attrs);
        detect(&mut special.fim_mid, FIM_MID_NAMES, &mut attrs);
        detect(&mut special.fim_pad, FIM_PAD_NAMES, &mut attrs);
        detect(&mut special.fim_rep, FIM_REP_NAMES, &mut attrs);
        detect(&mut special.fim_sep, FIM_SEP_NAMES, &mut attrs);

        // Control tokens named "unused" are unused.
        for (i, t) in tokens.iter().enumerate() {
            if attrs[i].intersects(TokenAttr::CONTROL) && t.contains("unused") && canonical(i, t) {
                attrs[i] = attrs[i].with(TokenAttr::UNUSED);
            }
        }

        // End-of-generation set.
        let mut eog: HashSet<u32> = HashSet::default();
        for id in [special.fim_pad, special.fim_rep, special.fim_sep]
            .into_iter()
            .flatten()
        {
            eog.insert(id);
        }
        for (i, t) in tokens.iter().enumerate() {
            if !maybe_name(t) || !canonical(i, t) {
                continue;
            }
            if EOG_NAMES.contains(&t.as_str()) {
                eog.insert(i as u32);
                attrs[i] = attrs[i].with(TokenAttr::CONTROL);
            }
            // gpt-oss: these chat markers are always rendered.
            if matches!(
                t.as_str(),
                "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>"
            ) {
                attrs[i] = TokenAttr::USER_DEFINED;
            }
        }
        for id in [special.eos, special.eot, special.eom]
            .into_iter()
            .flatten()
        {
            eog.insert(id);
        }
        // o200k_harmony / solar-open: "<|end|>" ends a message, not the generation.
        {
            let text_of = |id: u32| tokens.get(id as usize).map(String::as_str);
            let has = |name: &str| eog.iter().any(|&id| text_of(id) == Some(name));
            let has_return = has("<|return|>");
            let has_call = has("<|call|>") || has("<|calls|>");
            let has_flush = has("<|flush|>");
            let end_id = eog
                .iter()
                .copied()
                .filter(|&id| text_of(id) == Some("<|end|>"))
                .min();
            // gemma4 / plamo: "</s>" is an ordinary token there.
            let has_marker = has("<|tool_response>") || has("<|plamo:eos|>");
            let s_id = eog
                .iter()
                .copied()
                .filter(|&id| text_of(id) == Some("</s>"))
                .min();
            if let Some(end_id) = end_id {
                if has_call && (has_return || has_flush) {
                    eog.remove(&end_id);
                    attrs[end_id as usize] = TokenAttr::USER_DEFINED;
                }
            }
            if let (true, Some(s_id)) = (has_marker, s_id) {
                eog.remove(&s_id);
                attrs[s_id as usize] = TokenAttr::NORMAL;
            }
        }

        // Special tokens matched in text, longest first.
        let mut special_cache: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                attrs[i as usize].intersects(TokenAttr(
                    TokenAttr::CONTROL.0 | TokenAttr::USER_DEFINED.0 | TokenAttr::UNKNOWN.0,
                ))
            })
            .collect();
        special_cache.sort_by(|&a, &b| tokens[b as usize].len().cmp(&tokens[a as usize].len()));

        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            *slot = match kind {
                TokenizerKind::Spm => {
                    token_to_id
                        .get(&tokens, &format!("<0x{b:02X}>"))
                        .or_else(|| {
                            (b < 0x80)
                                .then(|| token_to_id.get(&tokens, &(b as u8 as char).to_string()))
                                .flatten()
                        })
                }
                TokenizerKind::Bpe if raw_utf8 => token_to_id.get(&tokens, &format!("<0x{b:02X}>")),
                TokenizerKind::Bpe => {
                    token_to_id.get(&tokens, &bytes::byte_to_char(b as u8).to_string())
                }
            };
        }

        let spm_word_split = kind == TokenizerKind::Spm
            && tokens.iter().all(|t| {
                t.chars().skip(1).all(|c| c != '\u{2581}') || t.chars().all(|c| c == '\u{2581}')
            });

        let mut tok = Tokenizer {
            kind,
            model: v.model,
            pre_name: pre_name.unwrap_or_else(|| "default".to_owned()),
            pre_kind,
            splitter,
            raw_utf8,
            tokens,
            scores,
            attrs,
            token_to_id,
            merge_parts,
            merge_ranks,
            n_merges,
            special_cache,
            pieces: Vec::new(),
            byte_tokens,
            spm_word_split,
            special,
            eog,
            add_bos,
            add_eos,
            add_sep,
            add_space_prefix,
            ignore_merges,
            clean_spaces,
            escape_whitespaces,
            chat_template: v.chat_template,
            warnings,
        };
        tok.pieces = (0..n as u32).map(|i| tok.piece_uncached(i)).collect();

        // Per-model attributes llama.cpp sets by name.
        let pre_raw = v.pre.unwrap_or_default();
        let arch = v.architecture.unwrap_or_default();
        let name = v.model_name.unwrap_or_default().to_lowercase();
        let contains_any = |s: &str, subs: &[&str]| subs.iter().any(|x| s.contains(x));
        if contains_any(&pre_raw, &["jina-v2-de", "jina-v2-es", "jina-v2-code"])
            || contains_any(&arch, &["nomic-bert-moe", "jina-bert-v3"])
        {
            tok.set_attr_by_text("<mask>", TokenAttr::LSTRIP, true);
        } else if contains_any(&name, &["phi-3", "phi3"]) {
            for id in tok.special_cache.clone() {
                tok.attrs[id as usize] = tok.attrs[id as usize].with(TokenAttr::RSTRIP);
            }
            tok.set_attr_by_text("</s>", TokenAttr::RSTRIP, true);
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                tok.set_attr_by_text(t, TokenAttr::RSTRIP, false);
            }
        } else if contains_any(&name, &["modern-bert"]) {
            tok.set_attr_by_text("[MASK]", TokenAttr::LSTRIP, true);
        }
        Ok(tok)
    }

    fn set_attr_by_text(&mut self, text: &str, attr: TokenAttr, on: bool) {
        if let Some(id) = self.token_to_id.get(&self.tokens, text) {
            let a = &mut self.attrs[id as usize];
            *a = if on { a.with(attr) } else { a.without(attr) };
        }
    }

    /// Encodes `text` to token ids, as llama.cpp's `llama_tokenize`.
    ///
    /// `add_special`: add BOS/EOS as the vocabulary's `add_bos_token`/`add_eos_token` say.
    /// `parse_special`: match control tokens (e.g. `<|im_start|>`) written in the text; without
    /// it only user-defined tokens are matched and control-token text is tokenized as text.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_impl(text, add_special, parse_special, &[])
    }

    /// [`Tokenizer::encode`] of raw bytes: bytes that are not valid UTF-8 give
    /// [`TokenizerError::InvalidUtf8`] with the offset of the first bad byte.
    pub fn encode_bytes(
        &self,
        bytes: &[u8],
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let text = std::str::from_utf8(bytes).map_err(|e| TokenizerError::InvalidUtf8 {
            offset: e.valid_up_to(),
        })?;
        self.encode(text, add_special, parse_special)
    }

    /// Encodes a rendered chat prompt: control tokens written by the template are matched
    /// (`parse_special = true`), but not inside `plain` (byte ranges of `text` that hold
    /// user-supplied content), where control-token text is tokenized as text, as
    /// `parse_special = false` would. A control token whose text overlaps a plain range is not
    /// matched. The fragments outside matches are the same as [`Tokenizer::encode`]'s, so a
    /// prompt without control-token text in its plain ranges gets the same ids.
    pub fn encode_with_plain(
        &self,
        text: &str,
        add_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, TokenizerError> {
        self.encode_impl(text, add_special, true, plain)
    }

    fn encode_impl(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, TokenizerError> {
        let fragments = self.partition(text, parse_special, plain);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        match self.kind {
            TokenizerKind::Spm => {
                let mut prev_special = true;
                if add_special && self.add_bos {
                    out.push(self.require_bos()?);
                }
                for f in fragments {
                    match f {
                        Fragment::Text(r) => {
                            let piece = text.get(r.clone()).unwrap_or_default();
                            let mut s = String::with_capacity(piece.len() + 3);
                            if self.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(piece);
                            let s = s.replace(' ', SPACE_ESCAPE);
                            spm::encode(self, &s, r.start, &mut out)?;
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
                if add_special && self.add_eos {
                    out.push(self.require_eos()?);
                }
            }
            TokenizerKind::Bpe => {
                if add_special && self.add_bos {
                    out.push(self.require_bos()?);
                }
                for f in fragments {
                    match f {
                        Fragment::Text(r) => {
                            let piece = text.get(r.clone()).unwrap_or_default();
                            if self.escape_whitespaces {
                                let s = piece.replace(' ', SPACE_ESCAPE);
                                bpe::encode(self, &s, r.start, &mut out)?;
                            } else {
                                bpe::encode(self, piece, r.start, &mut out)?;
                            }
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if add_special && self.add_eos {
                    out.push(self.require_eos()?);
                }
            }
        }
        Ok(out)
    }

    fn require_bos(&self) -> Result<u32, TokenizerError> {
        self.special
            .bos
            .ok_or(TokenizerError::MissingSpecial { which: "BOS" })
    }

    fn require_eos(&self) -> Result<u32, TokenizerError> {
        self.special
            .eos
            .ok_or(TokenizerError::MissingSpecial { which: "EOS" })
    }

    /// Splits the text around special tokens (llama.cpp's `tokenizer_st_partition`): each
    /// special token, longest first, cuts every text fragment at each of its occurrences.
    ///
    /// Control and unknown tokens are not matched where they overlap a range of `plain`.
    fn partition(
        &self,
        text: &str,
        parse_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Vec<Fragment> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(0..text.len()));
        let bytes = text.as_bytes();
        let skip_unless_parsing = TokenAttr(TokenAttr::CONTROL.0 | TokenAttr::UNKNOWN.0);
        for &id in &self.special_cache {
            let attr = self.attrs[id as usize];
            if !parse_special && attr.intersects(skip_unless_parsing) {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            if needle.is_empty() || needle.len() > text.len() {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len());
            for f in frags {
                let Fragment::Text(r) = f else {
                    next.push(f);
                    continue;
                };
                let mut base = r.start;
                let mut search = r.start;
                let end = r.end;
                let guarded = attr.intersects(skip_unless_parsing);
                // Matches of a valid UTF-8 needle in valid UTF-8 text fall on character
                // boundaries, and stripping removes ASCII bytes only, so every cut is a boundary.
                while base < end {
                    let Some(pos) = text.get(search..end).and_then(|h| h.find(needle)) else {
                        next.push(Fragment::Text(base..end));
                        break;
                    };
                    let m = search + pos;
                    if guarded
                        && plain
                            .iter()
                            .any(|p| p.start < m + needle.len() && m < p.end)
                    {
                        // User text: look for the next occurrence, one character further.
                        search = m + needle.chars().next().map_or(1, char::len_utf8);
                        continue;
                    }
                    let mut left_end = m;
                    if attr.intersects(TokenAttr::LSTRIP) {
                        while left_end > base && is_c_space(bytes[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > base {
                        next.push(Fragment::Text(base..left_end));
                    }
                    next.push(Fragment::Token(id));
                    let mut right = m + needle.len();
                    if attr.intersects(TokenAttr::RSTRIP) {
                        while right < end && is_c_space(bytes[right]) {
                            right += 1;
                        }
                    }
                    base = right;
                    search = right;
                }
            }
            frags = next;
        }
        frags
    }

    /// Decodes token ids to text: llama.cpp's `llama_detokenize` with special tokens left out
    /// (`remove_special = false`, `unparse_special = false`), including its space clean-up for
    /// the vocabularies that ask for it. Invalid UTF-8 (from byte tokens) is replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        let bytes = self.detokenize(ids, false, false)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// llama.cpp's `llama_detokenize`, returning raw bytes.
    ///
    /// `remove_special`: drop a leading BOS / trailing EOS that `add_special` would have added.
    /// `unparse_special`: render control tokens as their text (otherwise they vanish).
    pub fn detokenize(
        &self,
        ids: &[u32],
        remove_special: bool,
        unparse_special: bool,
    ) -> Result<Vec<u8>, TokenizerError> {
        decode::detokenize(self, ids, remove_special, unparse_special)
    }

    /// The bytes token `id` stands for when rendered (llama.cpp's `token_to_piece` with
    /// `special = true`: control tokens render as their text). `None` if `id` is out of range.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.pieces.get(id as usize).map(Vec::as_slice)
    }

    /// llama.cpp's `token_to_piece`: with `special = false`, control and unknown tokens render
    /// as nothing.
    pub fn token_to_piece(&self, id: u32, special: bool) -> Option<&[u8]> {
        let attr = *self.attrs.get(id as usize)?;
        if !special && attr.intersects(TokenAttr(TokenAttr::UNKNOWN.0 | TokenAttr::CONTROL.0)) {
            return Some(&[]);
        }
        self.token_bytes(id)
    }

    /// The token's text as stored in the vocabulary (e.g. `▁Hello`, `Ġworld`, `<0x0A>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    /// The number of the merge part `s` (as numbered in `merge_ranks`), if any merge has it.
    pub(crate) fn merge_part(&self, s: &str) -> Option<u32> {
        self.token_to_id
            .get(&self.tokens, s)
            .or_else(|| self.merge_parts.get(s).copied())
    }

    /// The id of a token by its vocabulary text, if present.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(&self.tokens, text)
    }

    /// The token's attributes.
    pub fn token_attr(&self, id: u32) -> Option<TokenAttr> {
        self.attrs.get(id as usize).copied()
    }

    /// The token's SentencePiece score (0 when the vocabulary has none).
    pub fn token_score(&self, id: u32) -> Option<f32> {
        self.scores.get(id as usize).copied()
    }

    /// Whether the token is a control token (BOS, EOS, chat markers).
    pub fn is_control(&self, id: u32) -> bool {
        self.attrs
            .get(id as usize)
            .is_some_and(|a| a.intersects(TokenAttr::CONTROL))
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// Number of BPE merges (0 for SentencePiece).
    pub fn n_merges(&self) -> usize {
        self.n_merges
    }

    /// The algorithm.
    pub fn kind(&self) -> TokenizerKind {
        self.kind
    }

    /// `tokenizer.ggml.model` as given.
    pub fn model_name(&self) -> &str {
        &self.model
    }

    /// The pre-tokenizer name (`tokenizer.ggml.pre`, or `default`).
    pub fn pre_name(&self) -> &str {
        &self.pre_name
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.special.bos
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.special.eos
    }

    /// End-of-turn token.
    pub fn eot(&self) -> Option<u32> {
        self.special.eot
    }

    /// All special ids.
    pub fn special_tokens(&self) -> &SpecialTokens {
        &self.special
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether the vocabulary asks for a separator token (BERT-style; informational).
    pub fn add_sep(&self) -> bool {
        self.add_sep
    }

    /// Whether a space is prepended to the text (SentencePiece) and stripped again on decode.
    pub fn add_space_prefix(&self) -> bool {
        self.add_space_prefix
    }

    /// Whether generation stops at this token (llama.cpp's `llama_vocab_is_eog`: EOS, EOT, EOM,
    /// and tokens such as `<|im_end|>`, `<|eot_id|>`, `<|endoftext|>` found by their text).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// The end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut v: Vec<u32> = self.eog.iter().copied().collect();
        v.sort_unstable();
        v
    }

    /// The model's Jinja chat template (`tokenizer.chat_template`), if any.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders a conversation with the model's chat template, with the BOS/EOS token texts as
    /// `bos_token`/`eos_token`. `system`, if given, is prepended as a `system` message.
    /// `None` if the model has no template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        system: Option<&str>,
        add_generation_prompt: bool,
    ) -> Option<Result<String, TokenizerError>> {
        let template = self.chat_template.as_deref()?;
        let bos = self
            .special
            .bos
            .and_then(|i| self.token_text(i))
            .unwrap_or("");
        let eos = self
            .special
            .eos
            .and_then(|i| self.token_text(i))
            .unwrap_or("");
        let mut all = Vec::with_capacity(messages.len() + 1);
        if let Some(s) = system {
            all.push(ChatMessage::new("system", s));
        }
        all.extend_from_slice(messages);
        Some(render_chat(template, &all, add_generation_prompt, bos, eos))
    }

    /// Warnings raised while loading (out-of-range special ids, empty tokens), as llama.cpp logs
    /// them.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    fn piece_uncached(&self, id: u32) -> Vec<u8> {
        decode::piece(self, id)
    }
}

mod pre {
    pub(crate) use crate::pretok::pre_config as config;
}

/// GPT-2's reversible byte <-> printable character mapping used by byte-level BPE vocabularies.
pub(crate) mod bytes {
    /// The character standing for byte `b`: printable Latin-1 bytes stand for themselves, the
    /// others map in order onto U+0100 and up.
    pub fn byte_to_char(b: u8) -> char {
        BYTE_TO_CHAR[b as usize]
    }

    /// The byte a character stands for, if it is one of the 256 mapped characters.
    pub fn char_to_byte(c: char) -> Option<u8> {
        let c = c as u32;
        if c < 0x100 {
            let b = c as u8;
            if is_direct(b) {
                return Some(b);
            }
            return None;
        }
        if c < 0x100 + 68 {
            return Some(INDIRECT[(c - 0x100) as usize]);
        }
        None
    }

    const fn is_direct(b: u8) -> bool {
        matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
    }

    // 256 - 188 directly mapped bytes = 68 shifted ones.
    const INDIRECT: [u8; 68] = {
        let mut out = [0u8; 68];
        let mut n = 0;
        let mut b = 0usize;
        while b < 256 {
            if !is_direct(b as u8) {
                out[n] = b as u8;
                n += 1;
            }
            b += 1;
        }
        out
    };

    const BYTE_TO_CHAR: [char; 256] = {
        let mut out = ['\0'; 256];
        let mut n = 0u32;
        let mut b = 0usize;
        while b < 256 {
            out[b] = if is_direct(b as u8) {
                match char::from_u32(b as u32) {
                    Some(c) => c,
                    None => '\0',
                }
            } else {
                let c = match char::from_u32(0x100 + n) {
                    Some(c) => c,
                    None => '\0',
                };
                n += 1;
                c
            };
            b += 1;
        }
        out
    };

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn mapping_is_a_bijection() {
            let mut seen = std::collections::HashSet::new();
            for b in 0..=255u8 {
                let c = byte_to_char(b);
                assert!(seen.insert(c));
                assert_eq!(char_to_byte(c), Some(b));
            }
            assert_eq!(byte_to_char(b' '), 'Ġ');
            assert_eq!(byte_to_char(b'\n'), 'Ċ');
            assert_eq!(char_to_byte('a'), Some(b'a'));
            assert_eq!(char_to_byte(' '), None);
            assert_eq!(char_to_byte('\u{0144}'), None);
        }
    }
}

#[cfg(test)]
mod thread_safety {
    fn shareable<T: Send + Sync>() {}

    #[test]
    fn tokenizer_and_templates_can_be_shared_across_threads() {
        shareable::<super::Tokenizer>();
        shareable::<super::ChatTemplate>();
    }
}
