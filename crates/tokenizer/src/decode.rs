//! Token ids back to text: per-token pieces, llama.cpp's whole-sequence detokenizer, and a
//! streaming decoder that never splits a UTF-8 character.

use crate::{bytes, TokenAttr, Tokenizer, TokenizerError, TokenizerKind, SPACE_ESCAPE};

/// The rendering of one token with special tokens shown (llama.cpp's `token_to_piece` with
/// `special = true`, before any leading-space stripping).
pub(crate) fn piece(tok: &Tokenizer, id: u32) -> Vec<u8> {
    let Some(text) = tok.tokens.get(id as usize) else {
        return Vec::new();
    };
    let attr = tok.attrs[id as usize];
    let verbatim =
        TokenAttr(TokenAttr::UNKNOWN.0 | TokenAttr::CONTROL.0 | TokenAttr::USER_DEFINED.0);
    if attr.intersects(verbatim) {
        return text.as_bytes().to_vec();
    }
    if attr.intersects(TokenAttr::NORMAL) {
        return match tok.kind {
            TokenizerKind::Spm => text.replace(SPACE_ESCAPE, " ").into_bytes(),
            TokenizerKind::Bpe if tok.escape_whitespaces => {
                text.replace(SPACE_ESCAPE, " ").into_bytes()
            }
            TokenizerKind::Bpe => decode_byte_level(text),
        };
    }
    if attr.intersects(TokenAttr::BYTE) {
        return byte_token_value(text).map(|b| vec![b]).unwrap_or_default();
    }
    Vec::new()
}

/// The byte of a `<0xXX>` token.
fn byte_token_value(text: &str) -> Option<u8> {
    let hex = text.get(3..5)?;
    u8::from_str_radix(hex, 16).ok()
}

/// Maps GPT-2 byte characters back to bytes. A character outside the mapping is written the
/// way llama.cpp writes it: `[UNK_BYTE_0x<its utf-8 in hex><the token text>]`.
fn decode_byte_level(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match bytes::char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// llama.cpp's `llama_detokenize`: pieces concatenated, the first piece's leading space
/// removed when the vocabulary adds a space prefix, then the clean-up passes of
/// `clean_up_tokenization_spaces` when the vocabulary uses them.
pub(crate) fn detokenize(
    tok: &Tokenizer,
    ids: &[u32],
    remove_special: bool,
    unparse_special: bool,
) -> Result<Vec<u8>, TokenizerError> {
    let n_vocab = tok.vocab_size();
    if let Some((index, &id)) = ids
        .iter()
        .enumerate()
        .find(|(_, &id)| id as usize >= n_vocab)
    {
        return Err(TokenizerError::InvalidTokenId { id, index, n_vocab });
    }
    let mut ids = ids;
    let mut remove_space = tok.add_space_prefix;
    if remove_special && tok.add_bos {
        if let (Some(&first), Some(bos)) = (ids.first(), tok.special.bos) {
            if first == bos {
                remove_space = false;
                ids = &ids[1..];
            }
        }
    }
    if remove_special && tok.add_eos {
        if let (Some(&last), Some(eos)) = (ids.last(), tok.special.eos) {
            if last == eos {
                ids = &ids[..ids.len() - 1];
            }
        }
    }
    let mut text = Vec::with_capacity(ids.len() * 4);
    for &id in ids {
        let p = tok.token_to_piece(id, unparse_special).unwrap_or_default();
        let p = if remove_space {
            p.strip_prefix(b" ").unwrap_or(p)
        } else {
            p
        };
        remove_space = false;
        text.extend_from_slice(p);
    }
    if tok.clean_spaces {
        clean_up_spaces(&mut text);
    }
    Ok(text)
}

/// The three in-place passes of llama.cpp's detokenizer clean-up, kept literally (including
/// how the second pass blanks the space it skips, which the next comparison then sees).
fn clean_up_spaces(t: &mut Vec<u8>) {
    // " ?", " !", " .", " ,"
    let total1 = t.len();
    let mut total = usize::from(total1 > 0);
    for i in 1..total1 {
        let x = t[i];
        if t[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            total -= 1;
        }
        t[total] = x;
        total += 1;
    }
    // " ' " -> "'"
    let total2 = total;
    total = usize::from(total2 > 0);
    let mut i = 1;
    while i < total2 {
        let x = t[i];
        if x == b'\'' && i + 1 < total2 && t[i - 1] == b' ' && t[i + 1] == b' ' {
            total -= 1;
            i += 1;
            t[i] = 0;
        }
        t[total] = x;
        total += 1;
        i += 1;
    }
    // " 's", " 'm", " 're", " 've"
    let total3 = total;
    total = usize::from(total3 > 0);
    for i in 1..total3 {
        let x = t[i];
        if t[i - 1] == b' ' && x == b'\'' && i + 1 < total3 {
            let x1 = t[i + 1];
            if x1 == b't' || x1 == b'd' {
                // kept: " 't", " 'd"
            } else if x1 == b's' || x1 == b'm' {
                total -= 1;
            } else if i + 2 < total3 {
                let x2 = t[i + 2];
                if x2 == b'e' && (x1 == b'r' || x1 == b'v') {
                    total -= 1;
                }
            }
        }
        t[total] = x;
        total += 1;
    }
    t.truncate(total);
}

/// Streams token ids to text. Each [`push`](IncrementalDecoder::push) returns the text that is
/// complete so far; bytes of a UTF-8 character split across tokens are held back until the
/// character is whole, and invalid sequences become U+FFFD exactly as
/// `String::from_utf8_lossy` would render the whole byte stream. [`finish`](IncrementalDecoder::finish)
/// flushes what is left.
///
/// Pieces are concatenated as llama.cpp's server streams them (no clean-up passes). Control
/// tokens render as nothing unless [`with_special`](IncrementalDecoder::with_special) is set.
#[derive(Debug)]
pub struct IncrementalDecoder<'a> {
    tok: &'a Tokenizer,
    pending: Vec<u8>,
    special: bool,
    strip_space: bool,
}

impl<'a> IncrementalDecoder<'a> {
    /// A decoder for tokens that continue a text (e.g. generated after a prompt): every
    /// piece is emitted as is.
    pub fn new(tok: &'a Tokenizer) -> IncrementalDecoder<'a> {
        IncrementalDecoder {
            tok,
            pending: Vec::new(),
            special: false,
            strip_space: false,
        }
    }

    /// A decoder for a sequence that starts the text: like llama.cpp's detokenizer, the first
    /// token's leading space is removed when the vocabulary adds a space prefix (SentencePiece).
    pub fn new_sequence(tok: &'a Tokenizer) -> IncrementalDecoder<'a> {
        IncrementalDecoder {
            strip_space: tok.add_space_prefix,
            ..IncrementalDecoder::new(tok)
        }
    }

    /// Render control tokens as their text (`<|im_end|>`) instead of nothing.
    pub fn with_special(mut self, special: bool) -> IncrementalDecoder<'a> {
        self.special = special;
        self
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let piece =
            self.tok
                .token_to_piece(id, self.special)
                .ok_or(TokenizerError::InvalidTokenId {
                    id,
                    index: 0,
                    n_vocab: self.tok.vocab_size(),
                })?;
        let piece = if self.strip_space {
            piece.strip_prefix(b" ").unwrap_or(piece)
        } else {
            piece
        };
        self.strip_space = false;
        self.pending.extend_from_slice(piece);
        Ok(self.drain_complete())
    }

    /// Flushes held-back bytes (an incomplete character at the very end becomes U+FFFD).
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Whether bytes of an incomplete character are being held back.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            let rest = &self.pending[start..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if let Ok(s) = std::str::from_utf8(&rest[..valid]) {
                        out.push_str(s);
                    }
                    match e.error_len() {
                        // An incomplete character at the end: wait for the next token.
                        None => {
                            start += valid;
                            break;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            start += valid + bad;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cleaned(s: &str) -> String {
        let mut v = s.as_bytes().to_vec();
        clean_up_spaces(&mut v);
        String::from_utf8_lossy(&v).into_owned()
    }

    #[test]
    fn clean_up_follows_llama_cpp() {
        assert_eq!(cleaned("Hello , world !"), "Hello, world!");
        assert_eq!(cleaned("it 's me"), "it's me");
        assert_eq!(
            cleaned("we 're here , they 've gone"),
            "we're here, they've gone"
        );
        assert_eq!(cleaned("don 't"), "don 't");
        assert_eq!(cleaned("a ' b"), "a'b");
        assert_eq!(cleaned(""), "");
        assert_eq!(cleaned(" ."), ".");
    }
}
