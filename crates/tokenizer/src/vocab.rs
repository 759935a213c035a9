//! The tokenizer's input data, as GGUF stores it, before llama.cpp's rules are applied.

use gguf::{Array, Metadata, Value};

use crate::TokenizerError;

/// Per-token attributes (llama.cpp's `llama_token_attr` bit set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct TokenAttr(pub u32);

impl TokenAttr {
    /// No known type (a `token_type` outside the known values).
    pub const UNDEFINED: TokenAttr = TokenAttr(0);
    /// The unknown-token placeholder (`<unk>`).
    pub const UNKNOWN: TokenAttr = TokenAttr(1 << 0);
    /// Reserved, never produced.
    pub const UNUSED: TokenAttr = TokenAttr(1 << 1);
    /// An ordinary piece of text.
    pub const NORMAL: TokenAttr = TokenAttr(1 << 2);
    /// A control token (BOS, EOS, chat markers): only matched in text when special parsing is on.
    pub const CONTROL: TokenAttr = TokenAttr(1 << 3);
    /// A user-defined token: always matched in text, rendered verbatim.
    pub const USER_DEFINED: TokenAttr = TokenAttr(1 << 4);
    /// A byte-fallback token `<0xXX>`.
    pub const BYTE: TokenAttr = TokenAttr(1 << 5);
    /// Normalized (unused by the tokenizers here, kept for completeness).
    pub const NORMALIZED: TokenAttr = TokenAttr(1 << 6);
    /// Whitespace to the left of this special token is removed when it is matched in text.
    pub const LSTRIP: TokenAttr = TokenAttr(1 << 7);
    /// Whitespace to the right of this special token is removed when it is matched in text.
    pub const RSTRIP: TokenAttr = TokenAttr(1 << 8);
    /// Matched only as a whole word (unused here).
    pub const SINGLE_WORD: TokenAttr = TokenAttr(1 << 9);

    /// Whether any bit of `other` is set in `self`.
    pub fn intersects(self, other: TokenAttr) -> bool {
        self.0 & other.0 != 0
    }

    /// `self` with the bits of `other` set.
    pub fn with(self, other: TokenAttr) -> TokenAttr {
        TokenAttr(self.0 | other.0)
    }

    /// `self` with the bits of `other` cleared.
    pub fn without(self, other: TokenAttr) -> TokenAttr {
        TokenAttr(self.0 & !other.0)
    }

    /// The attribute for a GGUF `tokenizer.ggml.token_type` value (llama.cpp's mapping).
    pub fn from_token_type(t: i32) -> TokenAttr {
        match t {
            1 => TokenAttr::NORMAL,
            2 => TokenAttr::UNKNOWN,
            3 => TokenAttr::CONTROL,
            4 => TokenAttr::USER_DEFINED,
            5 => TokenAttr::UNUSED,
            6 => TokenAttr::BYTE,
            _ => TokenAttr::UNDEFINED,
        }
    }
}

/// Special token ids as GGUF states them (`None`: the key is absent).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialIds {
    /// `tokenizer.ggml.bos_token_id`
    pub bos: Option<u32>,
    /// `tokenizer.ggml.eos_token_id`
    pub eos: Option<u32>,
    /// `tokenizer.ggml.eot_token_id`
    pub eot: Option<u32>,
    /// `tokenizer.ggml.eom_token_id`
    pub eom: Option<u32>,
    /// `tokenizer.ggml.unknown_token_id`
    pub unk: Option<u32>,
    /// `tokenizer.ggml.seperator_token_id` (sic)
    pub sep: Option<u32>,
    /// `tokenizer.ggml.padding_token_id`
    pub pad: Option<u32>,
    /// `tokenizer.ggml.mask_token_id`
    pub mask: Option<u32>,
    /// `tokenizer.ggml.fim_pre_token_id` (or the older `prefix_token_id`)
    pub fim_pre: Option<u32>,
    /// `tokenizer.ggml.fim_suf_token_id` (or the older `suffix_token_id`)
    pub fim_suf: Option<u32>,
    /// `tokenizer.ggml.fim_mid_token_id` (or the older `middle_token_id`)
    pub fim_mid: Option<u32>,
    /// `tokenizer.ggml.fim_pad_token_id`
    pub fim_pad: Option<u32>,
    /// `tokenizer.ggml.fim_rep_token_id`
    pub fim_rep: Option<u32>,
    /// `tokenizer.ggml.fim_sep_token_id`
    pub fim_sep: Option<u32>,
}

/// A vocabulary as stored in GGUF metadata: plain data, no rules applied yet.
/// [`crate::Tokenizer::from_vocab`] turns it into a tokenizer the way llama.cpp's loader does.
#[derive(Clone, Debug, Default)]
pub struct Vocab {
    /// `tokenizer.ggml.model`: `llama` (SentencePiece-style), `gpt2` (byte-level BPE), ...
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer name, if given.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores` (SentencePiece merge priorities)
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`, each `"left right"`, in rank order.
    pub merges: Option<Vec<String>>,
    /// Special token ids.
    pub special: SpecialIds,
    /// `tokenizer.ggml.add_bos_token`
    pub add_bos: Option<bool>,
    /// `tokenizer.ggml.add_eos_token`
    pub add_eos: Option<bool>,
    /// `tokenizer.ggml.add_sep_token`
    pub add_sep: Option<bool>,
    /// `tokenizer.ggml.add_space_prefix`
    pub add_space_prefix: Option<bool>,
    /// `general.name` (llama.cpp sets some token attributes by model name, e.g. for Phi-3).
    pub model_name: Option<String>,
    /// `general.architecture`
    pub architecture: Option<String>,
    /// `tokenizer.chat_template`
    pub chat_template: Option<String>,
}

fn opt_id(md: &Metadata, key: &str) -> Result<Option<u32>, TokenizerError> {
    Ok(md.opt_u32(key)?)
}

/// Reads an array of numbers (any integer or float element type) as `f32`s.
fn number_array_f32(md: &Metadata, key: &str) -> Result<Option<Vec<f32>>, TokenizerError> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    match v {
        Value::Array(Array::F32(_)) | Value::Array(Array::F64(_)) => {
            Ok(Some(md.get_f32_array(key)?))
        }
        Value::Array(Array::I32(a)) => Ok(Some(a.iter().map(|&x| x as f32).collect())),
        other => Err(TokenizerError::WrongType {
            key: key.to_owned(),
            expected: "array<f32> or array<i32>",
            found: other.type_name(),
        }),
    }
}

impl Vocab {
    /// Reads the tokenizer keys from GGUF metadata. Keys with a wrong type are errors that name
    /// the key; absent optional keys are `None`.
    pub fn from_metadata(md: &Metadata) -> Result<Vocab, TokenizerError> {
        let model = md.get_str("tokenizer.ggml.model")?.to_owned();
        let pre = md.opt_str("tokenizer.ggml.pre")?.map(str::to_owned);
        let tokens = md
            .opt_str_array("tokenizer.ggml.tokens")?
            .map(<[String]>::to_vec)
            .unwrap_or_default();
        let scores = number_array_f32(md, "tokenizer.ggml.scores")?;
        let token_types = md.opt_i32_array("tokenizer.ggml.token_type")?;
        let merges = md
            .opt_str_array("tokenizer.ggml.merges")?
            .map(<[String]>::to_vec);
        let fim_pre = match opt_id(md, "tokenizer.ggml.fim_pre_token_id")? {
            Some(v) => Some(v),
            None => opt_id(md, "tokenizer.ggml.prefix_token_id")?,
        };
        let fim_suf = match opt_id(md, "tokenizer.ggml.fim_suf_token_id")? {
            Some(v) => Some(v),
            None => opt_id(md, "tokenizer.ggml.suffix_token_id")?,
        };
        let fim_mid = match opt_id(md, "tokenizer.ggml.fim_mid_token_id")? {
            Some(v) => Some(v),
            None => opt_id(md, "tokenizer.ggml.middle_token_id")?,
        };
        let special = SpecialIds {
            bos: opt_id(md, "tokenizer.ggml.bos_token_id")?,
            eos: opt_id(md, "tokenizer.ggml.eos_token_id")?,
            eot: opt_id(md, "tokenizer.ggml.eot_token_id")?,
            eom: opt_id(md, "tokenizer.ggml.eom_token_id")?,
            unk: opt_id(md, "tokenizer.ggml.unknown_token_id")?,
            sep: opt_id(md, "tokenizer.ggml.seperator_token_id")?,
            pad: opt_id(md, "tokenizer.ggml.padding_token_id")?,
            mask: opt_id(md, "tokenizer.ggml.mask_token_id")?,
            fim_pre,
            fim_suf,
            fim_mid,
            fim_pad: opt_id(md, "tokenizer.ggml.fim_pad_token_id")?,
            fim_rep: opt_id(md, "tokenizer.ggml.fim_rep_token_id")?,
            fim_sep: opt_id(md, "tokenizer.ggml.fim_sep_token_id")?,
        };
        Ok(Vocab {
            model,
            pre,
            tokens,
            scores,
            token_types,
            merges,
            special,
            add_bos: md.opt_bool("tokenizer.ggml.add_bos_token")?,
            add_eos: md.opt_bool("tokenizer.ggml.add_eos_token")?,
            add_sep: md.opt_bool("tokenizer.ggml.add_sep_token")?,
            add_space_prefix: md.opt_bool("tokenizer.ggml.add_space_prefix")?,
            model_name: md.opt_str("general.name")?.map(str::to_owned),
            architecture: md.opt_str("general.architecture")?.map(str::to_owned),
            chat_template: md.opt_str("tokenizer.chat_template")?.map(str::to_owned),
        })
    }
}
