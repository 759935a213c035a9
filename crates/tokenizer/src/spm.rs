//! SentencePiece-style tokenization (llama.cpp's `llm_tokenizer_spm_session`): start from UTF-8
//! characters and repeatedly merge the adjacent pair whose concatenation is the vocabulary token
//! with the highest score; characters left without a token fall back to `<0xXX>` byte tokens.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::{Tokenizer, TokenizerError};

const NONE: usize = usize::MAX;

#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

#[derive(Clone, Copy, Debug)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

// Highest score first; among equal scores the leftmost pair.
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}

/// Encodes `text` (spaces already written as U+2581) and appends the ids to `out`.
/// `base` is the byte offset of the fragment in the caller's text, for error messages.
///
/// The merge loop is greedy over the whole text, but when no vocabulary token joins a character
/// to a following U+2581 (`Tokenizer::spm_word_split`), no merge can cross the start of a word
/// (a U+2581 after a non-U+2581 character). Merges in different words then never interact, and
/// each word's merges happen in the same relative order (score, then position) as in the
/// global loop, so merging word by word gives the same tokens with small heaps.
pub(crate) fn encode(
    tok: &Tokenizer,
    text: &str,
    base: usize,
    out: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    let mut work = Work::default();
    if !tok.spm_word_split {
        return encode_segment(tok, text, 0, text.len(), base, out, &mut work);
    }
    let mut seg_start = 0;
    let mut prev_is_space = true;
    for (i, c) in text.char_indices() {
        let is_space = c == '\u{2581}';
        if is_space && !prev_is_space && i > seg_start {
            encode_segment(tok, text, seg_start, i, base, out, &mut work)?;
            seg_start = i;
        }
        prev_is_space = is_space;
    }
    encode_segment(tok, text, seg_start, text.len(), base, out, &mut work)
}

#[derive(Default)]
struct Work {
    symbols: Vec<Symbol>,
    heap: BinaryHeap<Bigram>,
}

fn encode_segment(
    tok: &Tokenizer,
    text: &str,
    from: usize,
    to: usize,
    base: usize,
    out: &mut Vec<u32>,
    work: &mut Work,
) -> Result<(), TokenizerError> {
    let Some(seg) = text.get(from..to) else {
        return Ok(());
    };
    let symbols = &mut work.symbols;
    let heap = &mut work.heap;
    symbols.clear();
    heap.clear();
    for (off, c) in seg.char_indices() {
        let len = c.len_utf8();
        let idx = symbols.len();
        symbols.push(Symbol {
            start: from + off,
            len,
            prev: if idx == 0 { NONE } else { idx - 1 },
            next: if off + len == seg.len() {
                NONE
            } else {
                idx + 1
            },
        });
    }
    let try_add = |symbols: &[Symbol], heap: &mut BinaryHeap<Bigram>, left: usize, right: usize| {
        if left == NONE || right == NONE {
            return;
        }
        let (l, r) = (symbols[left], symbols[right]);
        // Adjacent symbols are contiguous in the text, so the pair's text is one slice.
        let Some(s) = text.get(l.start..r.start + r.len) else {
            return;
        };
        if let Some(id) = tok.token_to_id.get(&tok.tokens, s) {
            heap.push(Bigram {
                score: tok.scores[id as usize],
                left,
                right,
                size: s.len(),
            });
        }
    };
    for i in 1..symbols.len() {
        try_add(symbols, heap, i - 1, i);
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (symbols[b.left], symbols[b.right]);
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        symbols[b.left].len += r.len;
        symbols[b.right].len = 0;
        symbols[b.left].next = r.next;
        if r.next != NONE {
            symbols[r.next].prev = b.left;
        }
        try_add(symbols, heap, symbols[b.left].prev, b.left);
        try_add(symbols, heap, b.left, symbols[b.left].next);
    }

    let mut i = if symbols.is_empty() { NONE } else { 0 };
    while i != NONE {
        let s = symbols[i];
        i = s.next;
        let piece = text.get(s.start..s.start + s.len).unwrap_or_default();
        if let Some(id) = tok.token_to_id.get(&tok.tokens, piece) {
            out.push(id);
            continue;
        }
        for b in piece.bytes() {
            match tok.byte_tokens[b as usize] {
                Some(id) => out.push(id),
                None => {
                    return Err(TokenizerError::MissingByteToken {
                        byte: b,
                        offset: base,
                    })
                }
            }
        }
    }
    Ok(())
}
