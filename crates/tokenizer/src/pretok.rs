//! Pre-tokenizers: the regex splits a byte-level BPE vocabulary applies before merging.
//!
//! The pre-tokenizer is named by `tokenizer.ggml.pre`. Each name maps to a list of regexes (the
//! ones llama.cpp's `llm_tokenizer_bpe` uses for it, which are the Hugging Face `tokenizer.json`
//! regexes, sometimes rewritten for `std::regex`) plus a few flags llama.cpp attaches to the name.
//! The regexes are applied one after the other: each one splits every piece the previous one left,
//! and both the matches and the text between them become pieces (llama.cpp's
//! `unicode_regex_split`). A regex sees only its piece, so a lookahead at a piece's end sees the
//! end of the input.
//!
//! Matching uses `fancy-regex` (backtracking, lookaround) with real Unicode classes. Where
//! llama.cpp had to approximate a regex for `std::regex` (upper/lower case classes emulated with
//! `[^a-z]` lookaheads), the original Hugging Face regex is used here instead, which is what the
//! model was trained with.

use crate::TokenizerError;

/// The regex list and flags of one pre-tokenizer kind.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PreConfig {
    /// Canonical kind name (llama.cpp's `LLAMA_VOCAB_PRE_TYPE_*`, lower case).
    pub kind: &'static str,
    pub regexes: &'static [&'static str],
    /// Emit a whole pre-token as one token when it is in the vocabulary (HF `ignore_merges`).
    pub ignore_merges: bool,
    /// llama.cpp turns `add_bos` on for this kind (metadata may still override it).
    pub add_bos: bool,
    /// llama.cpp's `clean_spaces` for this kind (the detokenizer's space clean-up).
    pub clean_spaces: bool,
    /// The kind has no BOS token by default.
    pub no_bos: bool,
    /// Pieces are BPE-merged on their raw UTF-8 (SPM-style BPE) instead of GPT-2 byte symbols.
    pub raw_utf8: bool,
    /// Spaces are written as U+2581 before splitting (SPM-style BPE).
    pub escape_whitespace: bool,
}

const LLAMA3: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const JAIS2: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}";
const GPT2: &str =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
const QWEN2: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const QWEN35: &str = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const BLOOM: &str = " ?[^(\\s|.,!?\u{2026}\u{3002}\u{FF0C}\u{3001}\u{964}\u{6D4}\u{60C})]+";
const TEKKEN: &str = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const GPT4O: &str = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const GRANITE_EMB_MULTI: &str = "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
const DEEPSEEK3_MAIN: &str = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+";
const NEWLINES: &str = "[^\\n]+|[\\n]+";

const fn cfg(kind: &'static str, regexes: &'static [&'static str]) -> PreConfig {
    PreConfig {
        kind,
        regexes,
        ignore_merges: false,
        add_bos: false,
        clean_spaces: true,
        no_bos: false,
        raw_utf8: false,
        escape_whitespace: false,
    }
}

impl PreConfig {
    const fn ignore_merges(mut self) -> Self {
        self.ignore_merges = true;
        self
    }
    const fn add_bos(mut self) -> Self {
        self.add_bos = true;
        self
    }
    const fn no_clean(mut self) -> Self {
        self.clean_spaces = false;
        self
    }
    const fn no_bos(mut self) -> Self {
        self.no_bos = true;
        self
    }
    const fn spm_style(mut self) -> Self {
        self.raw_utf8 = true;
        self.escape_whitespace = true;
        self
    }
}

const R_DEFAULT: &[&str] = &[
    "[\\p{P}\\$\\+<=>\\^~\\|]+",
    GPT2,
    "\\p{N}+",
    "[0-9][0-9][0-9]",
];
const R_LLAMA3: &[&str] = &[LLAMA3];
const R_JAIS2: &[&str] = &[JAIS2];
const R_GPT2: &[&str] = &[GPT2];
const R_STARCODER: &[&str] = &["\\p{N}", GPT2];
const R_QWEN2: &[&str] = &[QWEN2];
const R_QWEN35: &[&str] = &[QWEN35];
const R_FALCON: &[&str] = &["[\\p{P}\\$\\+<=>\\^~\\|`]+", GPT2, "[0-9][0-9][0-9]"];
const R_DEEPSEEK_LLM: &[&str] = &[
    "[\r\n]",
    "\\s?[A-Za-z\u{B5}\u{C0}-\u{D6}\u{D8}-\u{F6}\u{F8}-\u{1BA}\u{1BC}-\u{1BF}\u{1C4}-\u{293}\u{295}-\u{2AF}\u{370}-\u{373}\u{376}\u{377}\u{37B}-\u{37D}\u{37F}\u{386}\u{388}-\u{38A}\u{38C}\u{38E}-\u{3A1}\u{3A3}-\u{3F5}\u{3F7}-\u{481}\u{48A}-\u{52F}\u{531}-\u{556}\u{10A0}-\u{10C5}\u{13A0}-\u{13F5}\u{13F8}-\u{13FD}\u{1C90}-\u{1CBA}\u{1CBD}-\u{1CBF}\u{1D00}-\u{1D2B}\u{1D6B}-\u{1D77}\u{1D79}-\u{1D9A}\u{1E00}-\u{1F15}\u{1F18}-\u{1F1D}\u{1F20}-\u{1F45}\u{1F48}-\u{1F4D}\u{1F50}-\u{1F57}\u{1F59}\u{1F5B}\u{1F5D}\u{1F5F}-\u{1F7D}\u{1F80}-\u{1FB4}\u{1FB6}-\u{1FBC}\u{1FBE}\u{1FC2}-\u{1FC4}\u{1FC6}-\u{1FCC}\u{1FD0}-\u{1FD3}\u{1FD6}-\u{1FDB}\u{1FE0}-\u{1FEC}\u{1FF2}-\u{1FF4}\u{1FF6}-\u{1FFC}\u{2102}\u{2107}\u{210A}-\u{2113}\u{2115}\u{2119}-\u{211D}\u{2124}\u{2126}\u{2128}\u{212A}-\u{212D}\u{212F}-\u{2134}\u{2139}\u{213C}-\u{213F}\u{2145}-\u{2149}\u{214E}\u{2183}\u{2184}\u{2C00}-\u{2C7B}\u{2C7E}-\u{2CE4}\u{2CEB}-\u{2CEE}\u{2CF2}\u{2CF3}\u{A640}-\u{A66D}\u{A680}-\u{A69B}\u{A722}-\u{A76F}\u{A771}-\u{A787}\u{A78B}-\u{A78E}\u{AB70}-\u{ABBF}\u{FB00}-\u{FB06}\u{FB13}-\u{FB17}\u{FF21}-\u{FF3A}\u{FF41}-\u{FF5A}\u{10400}-\u{1044F}\u{104B0}-\u{104D3}\u{104D8}-\u{104FB}\u{10C80}-\u{10CB2}\u{10CC0}-\u{10CF2}\u{118A0}-\u{118DF}\u{1E900}-\u{1E943}]+",
    "\\s?[!-/:-~\u{FF01}-\u{FF0F}\u{FF1A}-\u{FF5E}\u{2018}-\u{201F}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
    "\\p{N}+",
];
const R_DEEPSEEK3: &[&str] = &[
    "\\p{N}{1,3}",
    "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
    DEEPSEEK3_MAIN,
];
const R_SPARK2_5: &[&str] = &[
    "\\p{N}{1,3}",
    "[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+",
    "\\p{N}",
];
const R_YOUTU: &[&str] = &[
    "[\u{AC00}-\u{D7A3}\u{3131}-\u{318E}]+|[\u{FF01}\u{2026}\u{201C}\u{201D}\u{2018}\u{2019}\u{2014}\u{FF1A}\u{FF1B}\u{FF0C}\u{3001}-\u{303F}\u{FE30}-\u{FE4F}]+|[\u{3105}-\u{312F}]+|[\u{4E00}-\u{9FA5}\u{3040}-\u{309F}\u{30A0}-\u{30FF}]+",
    "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
];
const R_DEEPSEEK_CODER: &[&str] = &[
    "[\r\n]",
    "\\s?\\p{L}+",
    "\\s?\\p{P}+",
    "[\u{4E00}-\u{9FA5}\u{800}-\u{4E00}\u{AC00}-\u{D7FF}]+",
    "\\p{N}",
];
const R_BLOOM: &[&str] = &[BLOOM];
const R_VIKING: &[&str] = &[BLOOM, "\\p{N}"];
const R_TEKKEN: &[&str] = &[TEKKEN];
const R_CHAMELEON: &[&str] = &[
    "<sentinel:[0-9]+>",
    "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
    "([\\t\\n]|    |  )",
    "\\p{N}",
    "[\\p{P}!-/:-@\\[-`{-~]",
    GPT2,
];
const R_GPT4O: &[&str] = &[GPT4O];
const R_GRANITE_EMB_MULTI: &[&str] = &[GRANITE_EMB_MULTI];
const R_TINY_AYA: &[&str] = &["\\d{1,3}(?=(?:\\d{3})*\\b)", GPT4O];
const R_SUPERBPE: &[&str] = &["\\p{N}+", "(?=(\\d{3})+(?!\\d))"];
const R_BAILINGMOE: &[&str] = &["'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"];
const R_SEED_CODER: &[&str] = &["(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"];
const R_UFAKZEKA: &[&str] = &["[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"];
const R_LAGUNA: &[&str] = &[NEWLINES, QWEN2];
const R_EXAONE_MOE: &[&str] = &["(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+"];
const R_NEWLINES: &[&str] = &[NEWLINES];
const R_MINICPM5: &[&str] = &["\\p{N}{1,3}", "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"];

/// The pre-tokenizer llama.cpp uses for a `tokenizer.ggml.pre` name (`None` means the name is
/// missing, which llama.cpp treats as `default`). `Err` for names it does not know, or whose
/// splitting llama.cpp implements with bespoke code that is not reproduced here.
pub(crate) fn pre_config(name: Option<&str>) -> Result<PreConfig, TokenizerError> {
    let Some(name) = name else {
        return Ok(cfg("default", R_DEFAULT));
    };
    let c = match name {
        "default" => cfg("default", R_DEFAULT),
        "minicpm5" => cfg("minicpm5", R_MINICPM5).ignore_merges(),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => cfg("llama3", R_LLAMA3).ignore_merges().add_bos(),
        "deepseek-llm" => cfg("deepseek-llm", R_DEEPSEEK_LLM).no_clean(),
        "deepseek-coder" => cfg("deepseek-coder", R_DEEPSEEK_CODER).no_clean(),
        "deepseek-v3" => cfg("deepseek3-llm", R_DEEPSEEK3).no_clean(),
        "spark2_5" => cfg("spark2_5", R_SPARK2_5).no_clean(),
        "youtu" => cfg("youtu", R_YOUTU).no_clean().ignore_merges(),
        "falcon" => cfg("falcon", R_FALCON),
        "mpt" => cfg("mpt", R_GPT2),
        "starcoder" => cfg("starcoder", R_STARCODER),
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "modern-bert" => cfg("gpt2", R_GPT2),
        "jais-2" => cfg("jais2", R_JAIS2),
        "gemma4" | "granite-embed-multi-311m" => cfg("gemma4", R_NEWLINES).spm_style(),
        "sarvam-moe" => cfg("sarvam-moe", R_NEWLINES).spm_style().no_clean(),
        "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => cfg("gpt2", R_GPT2),
        "refact" => cfg("refact", R_STARCODER),
        "command-r" => cfg("command-r", R_STARCODER).no_clean(),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" => cfg("qwen2", R_QWEN2).no_clean(),
        "qwen35" => cfg("qwen35", R_QWEN35).no_clean(),
        "stablelm2" => cfg("stablelm2", R_QWEN2),
        "olmo" => cfg("olmo", R_GPT2),
        "dbrx" => cfg("dbrx", R_LLAMA3),
        "smaug-bpe" => cfg("smaug", R_LLAMA3),
        "poro-chat" => cfg("poro", R_BLOOM).no_clean(),
        "chatglm-bpe" => cfg("chatglm4", R_LLAMA3).no_bos(),
        "glm4" | "glm5" => cfg("chatglm4", R_LLAMA3).no_bos().ignore_merges(),
        "viking" => cfg("viking", R_VIKING).no_clean(),
        "jais" => cfg("jais", R_GPT2),
        "tekken" => cfg("tekken", R_TEKKEN).no_clean().ignore_merges().add_bos(),
        "smollm" => cfg("smollm", R_STARCODER).no_clean(),
        "codeshell" => cfg("codeshell", R_STARCODER),
        "bloom" => cfg("bloom", R_BLOOM),
        "gpt3-finnish" => cfg("gpt3-finnish", R_BLOOM),
        "exaone" => cfg("exaone", R_STARCODER),
        "exaone4" => cfg("gpt2", R_GPT2),
        "exaone-moe" => cfg("exaone-moe", R_EXAONE_MOE),
        "chameleon" => cfg("chameleon", R_CHAMELEON).add_bos().no_clean(),
        "minerva-7b" => cfg("minerva", R_STARCODER),
        "megrez" => cfg("qwen2", R_QWEN2),
        "gpt-4o" | "llama4" | "kanana2" | "talkie" => cfg("gpt4o", R_GPT4O).no_clean(),
        "granite-embed-multi-97m" => cfg("granite-emb-multi", R_GRANITE_EMB_MULTI)
            .no_clean()
            .ignore_merges(),
        "tiny_aya" | "cohere2moe" => cfg("tiny-aya", R_TINY_AYA).no_clean(),
        "superbpe" => cfg("superbpe", R_SUPERBPE).no_clean(),
        "trillion" => cfg("trillion", R_GPT2).no_clean(),
        "granite-docling" => cfg("granite-docling", R_GPT2).no_clean(),
        "bailingmoe" | "bailingmoe2" | "llada-moe" => cfg("bailingmoe", R_BAILINGMOE).no_clean(),
        "seed-coder" => cfg("seed-coder", R_SEED_CODER).no_clean(),
        "hunyuan" => cfg("hunyuan", R_QWEN2).no_clean(),
        "hunyuan-dense" => cfg("hunyuan-dense", R_DEEPSEEK3).no_clean(),
        "hy_v4" => cfg("hy-v4", R_DEEPSEEK3).no_clean(),
        "joyai-llm" => cfg("joyai-llm", R_DEEPSEEK3).no_clean(),
        "ufakzeka" => cfg("ufakzeka", R_UFAKZEKA).no_clean(),
        "grok-2" => cfg("grok-2", R_QWEN2).no_clean(),
        "laguna" => cfg("laguna", R_LAGUNA).no_clean(),
        "minimax-m2" => cfg("minimax-m2", R_GPT4O).no_clean(),
        "solar-open" => cfg("solar-open", R_QWEN2).no_clean(),
        "mellum2" => cfg("mellum2", R_STARCODER),
        other => {
            return Err(TokenizerError::UnsupportedPre {
                pre: other.to_owned(),
            })
        }
    };
    Ok(c)
}

/// The ranges for a `\p{..}` class name, from the Unicode version llama.cpp uses.
fn category_ranges(name: &str) -> Option<&'static [(u32, u32)]> {
    use crate::unicode_tables as t;
    Some(match name {
        "L" => t::L,
        "Lu" => t::LU,
        "Ll" => t::LL,
        "Lt" => t::LT,
        "Lm" => t::LM,
        "Lo" => t::LO,
        "M" => t::M,
        "N" => t::N,
        "P" => t::P,
        "S" => t::S,
        _ => return None,
    })
}

/// Rewrites a regex so its Unicode classes mean what they mean to llama.cpp: each `\p{X}` of
/// a general category becomes the explicit ranges of that category in Unicode 15.1 (the
/// engine's built-in tables follow a newer Unicode), and `\d` becomes `[0-9]` (`std::regex`'s
/// meaning). Other escapes are kept. Bracket classes are not nested in these patterns.
pub(crate) fn expand_classes(pattern: &str) -> String {
    use std::fmt::Write as _;
    let chars: Vec<char> = pattern.chars().collect();
    let mut out = String::with_capacity(pattern.len());
    let mut in_class = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\\' && i + 1 < chars.len() {
            let next = chars[i + 1];
            if next == 'p' && chars.get(i + 2) == Some(&'{') {
                if let Some(len) = chars[i + 3..].iter().position(|&x| x == '}') {
                    let name: String = chars[i + 3..i + 3 + len].iter().collect();
                    if let Some(ranges) = category_ranges(&name) {
                        if !in_class {
                            out.push('[');
                        }
                        for &(a, b) in ranges {
                            if a == b {
                                let _ = write!(out, "\\x{{{a:X}}}");
                            } else {
                                let _ = write!(out, "\\x{{{a:X}}}-\\x{{{b:X}}}");
                            }
                        }
                        if !in_class {
                            out.push(']');
                        }
                        i += 3 + len + 1;
                        continue;
                    }
                }
            }
            if next == 'd' {
                out.push_str(if in_class { "0-9" } else { "[0-9]" });
                i += 2;
                continue;
            }
            out.push(c);
            out.push(next);
            i += 2;
            continue;
        }
        if c == '[' && !in_class {
            in_class = true;
        } else if c == ']' && in_class {
            in_class = false;
        }
        out.push(c);
        i += 1;
    }
    out
}

/// A compiled pre-tokenizer: the regexes of one [`PreConfig`], applied in order.
#[derive(Debug)]
pub(crate) struct Splitter {
    regexes: Vec<fancy_regex::Regex>,
}

impl Splitter {
    pub fn new(config: &PreConfig) -> Result<Splitter, TokenizerError> {
        let mut regexes = Vec::with_capacity(config.regexes.len());
        for (i, r) in config.regexes.iter().enumerate() {
            let re =
                fancy_regex::Regex::new(&expand_classes(r)).map_err(|e| TokenizerError::Regex {
                    pre: config.kind.to_owned(),
                    index: i,
                    message: e.to_string(),
                })?;
            regexes.push(re);
        }
        Ok(Splitter { regexes })
    }

    /// Splits `text` into pre-tokens, returned as byte ranges of `text` in order. Together they
    /// cover the text exactly. `base` is added to the offsets named in errors.
    pub fn split(
        &self,
        text: &str,
        base: usize,
    ) -> Result<Vec<std::ops::Range<usize>>, TokenizerError> {
        let mut pieces: Vec<std::ops::Range<usize>> = Vec::new();
        if text.is_empty() {
            return Ok(pieces);
        }
        pieces.push(0..text.len());
        for re in &self.regexes {
            let mut next = Vec::with_capacity(pieces.len() * 2);
            for piece in &pieces {
                let Some(sub) = text.get(piece.clone()) else {
                    continue;
                };
                let mut last = 0;
                for m in re.find_iter(sub) {
                    let m = m.map_err(|e| TokenizerError::RegexRuntime {
                        offset: base + piece.start,
                        message: e.to_string(),
                    })?;
                    if m.start() > last {
                        next.push(piece.start + last..piece.start + m.start());
                    }
                    if m.end() > m.start() {
                        next.push(piece.start + m.start()..piece.start + m.end());
                    }
                    last = m.end();
                }
                if last < sub.len() {
                    next.push(piece.start + last..piece.end);
                }
            }
            pieces = next;
        }
        Ok(pieces)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(pre: &str, text: &str) -> Vec<String> {
        let c = pre_config(Some(pre)).unwrap();
        let s = Splitter::new(&c).unwrap();
        s.split(text, 0)
            .unwrap()
            .into_iter()
            .map(|r| text[r].to_owned())
            .collect()
    }

    #[test]
    fn every_known_regex_compiles() {
        let names = [
            "default",
            "minicpm5",
            "llama-bpe",
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "spark2_5",
            "youtu",
            "falcon",
            "mpt",
            "starcoder",
            "gpt-2",
            "jais-2",
            "gemma4",
            "sarvam-moe",
            "refact",
            "command-r",
            "qwen2",
            "qwen35",
            "stablelm2",
            "olmo",
            "dbrx",
            "smaug-bpe",
            "poro-chat",
            "chatglm-bpe",
            "glm4",
            "viking",
            "jais",
            "tekken",
            "smollm",
            "codeshell",
            "bloom",
            "gpt3-finnish",
            "exaone",
            "exaone4",
            "exaone-moe",
            "chameleon",
            "minerva-7b",
            "megrez",
            "gpt-4o",
            "granite-embed-multi-97m",
            "tiny_aya",
            "superbpe",
            "trillion",
            "granite-docling",
            "bailingmoe",
            "seed-coder",
            "hunyuan",
            "hunyuan-dense",
            "hy_v4",
            "joyai-llm",
            "ufakzeka",
            "grok-2",
            "laguna",
            "minimax-m2",
            "solar-open",
            "mellum2",
        ];
        for n in names {
            let c = pre_config(Some(n)).unwrap();
            Splitter::new(&c).unwrap_or_else(|e| panic!("{n}: {e}"));
        }
        assert!(matches!(
            pre_config(Some("no-such-pre")),
            Err(TokenizerError::UnsupportedPre { .. })
        ));
    }

    #[test]
    fn classes_follow_unicode_15_1() {
        // U+13558 was assigned (as a letter) in Unicode 16; llama.cpp's tables predate it.
        let letters = Splitter::new(&cfg("t", &["\\p{L}+"])).unwrap();
        let text = "ab\u{13558}cd";
        let parts: Vec<&str> = letters
            .split(text, 0)
            .unwrap()
            .into_iter()
            .map(|r| &text[r])
            .collect();
        assert_eq!(parts, ["ab", "\u{13558}", "cd"]);
        assert_eq!(expand_classes("[^\\d]\\d"), "[^0-9][0-9]");
        assert_eq!(expand_classes("\\p{Han}\\s"), "\\p{Han}\\s");
        assert_eq!(crate::unicode_tables::UNICODE_VERSION, "15.1.0");
    }

    #[test]
    fn llama3_split_follows_the_regex() {
        // Digits go in groups of three, a run of spaces leaves its last space to the next word,
        // and contractions split off case-insensitively.
        assert_eq!(
            split("llama-bpe", "I'M 12345  ok\n\n x"),
            ["I", "'M", " ", "123", "45", " ", " ok", "\n\n", " x"]
        );
    }

    #[test]
    fn pieces_cover_the_text() {
        let text = "  Hello, wörld!! 3.14159\t\n\r\n  🚀🚀 日本語テキスト  ";
        for pre in [
            "gpt-2",
            "llama-bpe",
            "qwen2",
            "smollm",
            "default",
            "deepseek-llm",
        ] {
            let parts = split(pre, text);
            assert_eq!(parts.concat(), text, "{pre}");
            assert!(parts.iter().all(|p| !p.is_empty()), "{pre}");
        }
    }
}
