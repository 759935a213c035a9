//! Byte-level BPE: pre-tokenize with the regexes, map bytes to GPT-2's printable characters,
//! then merge adjacent symbols lowest rank first (llama.cpp's `llm_tokenizer_bpe_session`).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::{bytes, Tokenizer, TokenizerError};

const NONE: usize = usize::MAX;

/// One symbol of a word being merged: a byte range of the word, linked to its neighbours.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
    /// The interned merge-part id of the symbol's text, if any merge mentions that text.
    part: Option<u32>,
}

/// A candidate merge: lowest rank first, then leftmost. The lengths detect stale entries: a
/// symbol only grows by absorbing its right neighbour, so unchanged lengths mean unchanged text.
type Candidate = Reverse<(u32, usize, usize, usize, usize)>; // (rank, left, right, left_len, right_len)

/// Encodes one text fragment (no special tokens inside) and appends its ids to `out`.
/// `base` is the fragment's byte offset in the caller's text, for error messages.
pub(crate) fn encode(
    tok: &Tokenizer,
    text: &str,
    base: usize,
    out: &mut Vec<u32>,
) -> Result<(), TokenizerError> {
    let Some(splitter) = tok.splitter.as_ref() else {
        return Ok(());
    };
    let pieces = splitter.split(text, base)?;
    let mut word = String::new();
    let mut symbols: Vec<Symbol> = Vec::new();
    let mut heap: BinaryHeap<Candidate> = BinaryHeap::new();
    for r in pieces {
        let Some(piece) = text.get(r) else {
            continue;
        };
        word.clear();
        if tok.raw_utf8 {
            word.push_str(piece);
        } else {
            word.extend(piece.bytes().map(bytes::byte_to_char));
        }
        if word.is_empty() {
            continue;
        }
        if tok.ignore_merges {
            if let Some(id) = tok.token_to_id.get(&tok.tokens, word.as_str()) {
                out.push(id);
                continue;
            }
        }
        if tok.pre_kind == "gemma4" && word.bytes().all(|b| b == b'\n') {
            if let Some(id) = tok.token_to_id.get(&tok.tokens, word.as_str()) {
                out.push(id);
                continue;
            }
        }
        merge_word(tok, &word, &mut symbols, &mut heap);
        emit(tok, &word, &symbols, out);
    }
    Ok(())
}

fn rank(tok: &Tokenizer, a: &Symbol, b: &Symbol) -> Option<u32> {
    let (pa, pb) = (a.part?, b.part?);
    tok.merge_ranks.get(&(pa, pb)).copied()
}

fn push_candidate(
    tok: &Tokenizer,
    symbols: &[Symbol],
    heap: &mut BinaryHeap<Candidate>,
    left: usize,
    right: usize,
) {
    if left == NONE || right == NONE {
        return;
    }
    let (a, b) = (&symbols[left], &symbols[right]);
    if let Some(r) = rank(tok, a, b) {
        heap.push(Reverse((r, left, right, a.len, b.len)));
    }
}

fn merge_word(
    tok: &Tokenizer,
    word: &str,
    symbols: &mut Vec<Symbol>,
    heap: &mut BinaryHeap<Candidate>,
) {
    symbols.clear();
    heap.clear();
    let part_of = |s: &str| tok.merge_part(s);
    for (start, c) in word.char_indices() {
        let len = c.len_utf8();
        let idx = symbols.len();
        symbols.push(Symbol {
            start,
            len,
            prev: if idx == 0 { NONE } else { idx - 1 },
            next: if start + len == word.len() {
                NONE
            } else {
                idx + 1
            },
            part: part_of(&word[start..start + len]),
        });
    }
    for i in 1..symbols.len() {
        push_candidate(tok, symbols, heap, i - 1, i);
    }
    while let Some(Reverse((_, left, right, left_len, right_len))) = heap.pop() {
        let (l, r) = (symbols[left], symbols[right]);
        if l.len == 0 || r.len == 0 || l.len != left_len || r.len != right_len || l.next != right {
            continue;
        }
        let merged_len = l.len + r.len;
        symbols[left].len = merged_len;
        symbols[left].next = r.next;
        symbols[left].part = part_of(&word[l.start..l.start + merged_len]);
        symbols[right].len = 0;
        if r.next != NONE {
            symbols[r.next].prev = left;
        }
        push_candidate(tok, symbols, heap, symbols[left].prev, left);
        push_candidate(tok, symbols, heap, left, symbols[left].next);
    }
}

fn emit(tok: &Tokenizer, word: &str, symbols: &[Symbol], out: &mut Vec<u32>) {
    let mut i = if symbols.is_empty() { NONE } else { 0 };
    while i != NONE {
        let s = symbols[i];
        i = s.next;
        if s.len == 0 {
            continue;
        }
        let text = &word[s.start..s.start + s.len];
        if let Some(id) = tok.token_to_id.get(&tok.tokens, text) {
            out.push(id);
            continue;
        }
        // A symbol that is not a token falls back to smaller units; units missing from the
        // vocabulary are dropped, as llama.cpp does.
        if tok.raw_utf8 {
            out.extend(text.bytes().filter_map(|b| tok.byte_tokens[b as usize]));
        } else {
            let mut buf = [0u8; 4];
            for c in text.chars() {
                if let Some(id) = tok.token_to_id.get(&tok.tokens, &*c.encode_utf8(&mut buf)) {
                    out.push(id);
                }
            }
        }
    }
}
