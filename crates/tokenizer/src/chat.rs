//! Chat templates: a model's `tokenizer.chat_template` (Jinja) rendered with `minijinja`, set up
//! the way Hugging Face `transformers` renders them (`trim_blocks`, `lstrip_blocks`, a
//! `raise_exception` function, `strftime_now`, its `tojson`, Python string/dict methods,
//! loop controls), so the prompt text matches what the model was trained on.

use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::TokenizerError;

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, ...
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Bounds on one rendering, so a template that loops, recurses or writes without end fails
/// with a typed error instead of holding a thread or filling memory. Templates come from the
/// model file, not from requests, but message contents (which templates iterate over and copy)
/// do come from requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateLimits {
    /// Instruction budget (minijinja fuel) of one rendering.
    pub fuel: u64,
    /// Largest rendered prompt, in bytes.
    pub max_output_bytes: usize,
}

impl TemplateLimits {
    /// Default instruction budget: real templates spend tens to hundreds of instructions per
    /// message, so even 1024 messages with a tool-heavy template stay far below it.
    pub const DEFAULT_FUEL: u64 = 5_000_000;
    /// Default output bound.
    pub const DEFAULT_MAX_OUTPUT_BYTES: usize = 8 << 20;
}

impl Default for TemplateLimits {
    fn default() -> Self {
        TemplateLimits {
            fuel: TemplateLimits::DEFAULT_FUEL,
            max_output_bytes: TemplateLimits::DEFAULT_MAX_OUTPUT_BYTES,
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    limits: TemplateLimits,
}

/// A rendered conversation with the byte ranges of `text` that hold message contents (the
/// caller's text, which must not be parsed for control tokens; see
/// `Tokenizer::encode_with_plain`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RenderedChat {
    /// The prompt text.
    pub text: String,
    /// Ranges of `text` copied from message contents, in order, not overlapping.
    pub content_ranges: Vec<std::ops::Range<usize>>,
}

/// `io::Write` into a string that refuses to grow past a limit.
struct Bounded {
    out: Vec<u8>,
    limit: usize,
    exceeded: bool,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.limit {
            self.exceeded = true;
            return Err(std::io::Error::other("rendered prompt too large"));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

const NAME: &str = "chat_template";

fn template_error(e: Error) -> TokenizerError {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        let _ = write!(message, ": {s}");
        source = s.source();
    }
    if let Some(line) = e.line() {
        let _ = write!(message, " (template line {line})");
    }
    TokenizerError::Template { message }
}

impl ChatTemplate {
    /// Parses a template. The clock for `strftime_now` is the system's (UTC).
    pub fn new(source: &str) -> Result<ChatTemplate, TokenizerError> {
        ChatTemplate::build(source, None)
    }

    /// Parses a template whose `strftime_now` always reports the given time (seconds since the
    /// Unix epoch, UTC): for reproducible renderings.
    pub fn with_fixed_time(
        source: &str,
        unix_seconds: i64,
    ) -> Result<ChatTemplate, TokenizerError> {
        ChatTemplate::build(source, Some(unix_seconds))
    }

    fn build(source: &str, now: Option<i64>) -> Result<ChatTemplate, TokenizerError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", move |format: String| -> String {
            let t = now.unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs() as i64)
                    .unwrap_or(0)
            });
            strftime(&format, t)
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned())
            .map_err(template_error)?;
        let limits = TemplateLimits::default();
        env.set_fuel(Some(limits.fuel));
        Ok(ChatTemplate { env, limits })
    }

    /// The same template with other rendering bounds.
    pub fn with_limits(mut self, limits: TemplateLimits) -> ChatTemplate {
        self.env.set_fuel(Some(limits.fuel));
        self.limits = limits;
        self
    }

    /// The rendering bounds in force.
    pub fn limits(&self) -> TemplateLimits {
        self.limits
    }

    /// Renders a conversation. `bos`/`eos` are the texts of the BOS/EOS tokens, bound to
    /// `bos_token`/`eos_token`; `tools` and `documents` are bound to none, as `transformers` does
    /// when none are given.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos: &str,
        eos: &str,
    ) -> Result<String, TokenizerError> {
        let t = self.env.get_template(NAME).map_err(template_error)?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => bos,
            eos_token => eos,
            tools => Value::from(()),
            documents => Value::from(()),
        };
        let mut w = Bounded {
            out: Vec::new(),
            limit: self.limits.max_output_bytes,
            exceeded: false,
        };
        match t.render_captured_to(ctx, &mut w) {
            Ok(_) => {}
            Err(_) if w.exceeded => {
                return Err(TokenizerError::TemplateOutputTooLarge {
                    limit: self.limits.max_output_bytes,
                })
            }
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                return Err(TokenizerError::TemplateFuel {
                    fuel: self.limits.fuel,
                })
            }
            Err(e) => return Err(template_error(e)),
        }
        // minijinja writes whole UTF-8 strings, so the bytes are valid; checked all the same.
        String::from_utf8(w.out).map_err(|e| TokenizerError::Template {
            message: format!(
                "rendered text is not UTF-8 at byte {}",
                e.utf8_error().valid_up_to()
            ),
        })
    }

    /// Renders a conversation and reports where the message contents landed in the text, so
    /// the prompt can be tokenized with control tokens matched in the template's text only.
    ///
    /// Each non-empty content is wrapped in markers holding a random nonce for a second
    /// rendering; the markers are then cut out and their positions kept. A template that
    /// rewrites contents (cuts a marker off) cannot be split safely and gives
    /// [`TokenizerError::Template`].
    pub fn render_marked(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos: &str,
        eos: &str,
    ) -> Result<RenderedChat, TokenizerError> {
        let (open, close) = loop {
            let n = nonce();
            let open = format!("\u{E000}{n:016x}\u{E001}");
            let close = format!("\u{E002}{n:016x}\u{E003}");
            let clash = messages
                .iter()
                .any(|m| m.content.contains(&open) || m.content.contains(&close));
            if !clash {
                break (open, close);
            }
        };
        let marked: Vec<ChatMessage> = messages
            .iter()
            .map(|m| {
                if m.content.is_empty() {
                    m.clone()
                } else {
                    ChatMessage::new(m.role.clone(), format!("{open}{}{close}", m.content))
                }
            })
            .collect();
        let raw = self.render(&marked, add_generation_prompt, bos, eos)?;
        split_markers(&raw, &open, &close).ok_or_else(|| TokenizerError::Template {
            message: "the template rewrites message contents, so they cannot be told apart \
                      from its own text"
                .into(),
        })
    }
}

/// A 64-bit value no client can predict.
fn nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// Cuts `open ... close` marker pairs out of `raw`, returning the text and the ranges that were
/// between them; `None` unless the markers pair up, without nesting.
fn split_markers(raw: &str, open: &str, close: &str) -> Option<RenderedChat> {
    let mut text = String::with_capacity(raw.len());
    let mut ranges = Vec::new();
    let mut rest = raw;
    loop {
        let o = rest.find(open);
        let c = rest.find(close);
        match (o, c) {
            (None, None) => {
                text.push_str(rest);
                return Some(RenderedChat {
                    text,
                    content_ranges: ranges,
                });
            }
            (Some(o), c) if c.is_none_or(|c| c > o) => {
                text.push_str(&rest[..o]);
                let inner = &rest[o + open.len()..];
                let end = inner.find(close)?;
                let body = &inner[..end];
                if body.contains(open) {
                    return None;
                }
                let start = text.len();
                text.push_str(body);
                if !body.is_empty() {
                    ranges.push(start..text.len());
                }
                rest = &inner[end + close.len()..];
            }
            _ => return None,
        }
    }
}

/// Renders `messages` with a chat template in one call (see [`ChatTemplate::render`]).
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos: &str,
    eos: &str,
) -> Result<String, TokenizerError> {
    ChatTemplate::new(template)?.render(messages, add_generation_prompt, bos, eos)
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `tojson` as `transformers` defines it for chat templates: Python's
/// `json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)`
/// (no HTML escaping, unlike Jinja2's built-in filter).
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let (item_sep, key_sep) = match separators {
        Some(s) => {
            let a: String = s.get_item_by_index(0)?.to_string();
            let b: String = s.get_item_by_index(1)?.to_string();
            (a, b)
        }
        None if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        None => (", ".to_owned(), ": ".to_owned()),
    };
    let opts = JsonOpts {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    write_json(&mut out, &value, &opts, 0)?;
    Ok(Value::from_safe_string(out))
}

struct JsonOpts {
    ensure_ascii: bool,
    indent: Option<usize>,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

fn write_json_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0C}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{:04x}", u);
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn newline_indent(out: &mut String, opts: &JsonOpts, depth: usize) {
    if let Some(n) = opts.indent {
        out.push('\n');
        out.extend(std::iter::repeat_n(' ', n * depth));
    }
}

fn write_json(out: &mut String, v: &Value, opts: &JsonOpts, depth: usize) -> Result<(), Error> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Undefined => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                "tojson: value is undefined",
            ))
        }
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Some(i) = v.as_i64() {
                let _ = write!(out, "{i}");
            } else {
                let f = f64::try_from(v.clone()).unwrap_or(f64::NAN);
                if f.is_finite() {
                    // Python writes floats with repr(): always a '.' or an exponent.
                    let s = format!("{f:?}");
                    out.push_str(&s);
                } else if f.is_nan() {
                    out.push_str("NaN");
                } else if f > 0.0 {
                    out.push_str("Infinity");
                } else {
                    out.push_str("-Infinity");
                }
            }
        }
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            out.push('[');
            if !items.is_empty() {
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&opts.item_sep);
                    }
                    newline_indent(out, opts, depth + 1);
                    write_json(out, item, opts, depth + 1)?;
                }
                newline_indent(out, opts, depth);
            }
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if opts.sort_keys {
                keys.sort();
            }
            out.push('{');
            if !keys.is_empty() {
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&opts.item_sep);
                    }
                    newline_indent(out, opts, depth + 1);
                    match k.as_str() {
                        Some(s) => write_json_str(out, s, opts.ensure_ascii),
                        None => write_json_str(out, &k.to_string(), opts.ensure_ascii),
                    }
                    out.push_str(&opts.key_sep);
                    let item = v.get_item(k)?;
                    write_json(out, &item, opts, depth + 1)?;
                }
                newline_indent(out, opts, depth);
            }
            out.push('}');
        }
        _ => write_json_str(out, &v.to_string(), opts.ensure_ascii),
    }
    Ok(())
}

/// Civil date from days since 1970-01-01 (proleptic Gregorian).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

fn is_leap(y: i64) -> bool {
    (y % 4 == 0 && y % 100 != 0) || y % 400 == 0
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// C `strftime` in the C locale for a UTC time, for the specifiers chat templates use. Unknown
/// specifiers are copied through.
pub fn strftime(format: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    let (hh, mm, ss) = (secs / 3600, (secs / 60) % 60, secs % 60);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let wday = (days + 3).rem_euclid(7) as usize;
    let cum = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cum[(m - 1) as usize] + d as i64 + i64::from(m > 2 && is_leap(y));
    let month = MONTHS[(m - 1) as usize];
    let day = DAYS[wday];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        let _ = match spec {
            'Y' => write!(out, "{y}"),
            'y' => write!(out, "{:02}", y.rem_euclid(100)),
            'm' => write!(out, "{m:02}"),
            'd' => write!(out, "{d:02}"),
            'e' => write!(out, "{d:2}"),
            'H' => write!(out, "{hh:02}"),
            'I' => write!(out, "{:02}", if hh % 12 == 0 { 12 } else { hh % 12 }),
            'M' => write!(out, "{mm:02}"),
            'S' => write!(out, "{ss:02}"),
            'p' => write!(out, "{}", if hh < 12 { "AM" } else { "PM" }),
            'j' => write!(out, "{yday:03}"),
            'b' | 'h' => write!(out, "{}", &month[..3]),
            'B' => write!(out, "{month}"),
            'a' => write!(out, "{}", &day[..3]),
            'A' => write!(out, "{day}"),
            'F' => write!(out, "{y}-{m:02}-{d:02}"),
            'T' => write!(out, "{hh:02}:{mm:02}:{ss:02}"),
            'Z' => write!(out, "UTC"),
            'z' => write!(out, "+0000"),
            '%' => write!(out, "%"),
            other => write!(out, "%{other}"),
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates_round_trip_through_day_counts() {
        // Walk day by day over four centuries: the calendar must advance by exactly one day,
        // months and years rolling over at their lengths.
        let mut prev = civil_from_days(-146_097);
        for days in -146_096..146_097 {
            let cur = civil_from_days(days);
            let (py, pm, pd) = prev;
            let month_len = match pm {
                1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
                4 | 6 | 9 | 11 => 30,
                _ if is_leap(py) => 29,
                _ => 28,
            };
            let expect = if pd < month_len {
                (py, pm, pd + 1)
            } else if pm < 12 {
                (py, pm + 1, 1)
            } else {
                (py + 1, 1, 1)
            };
            assert_eq!(cur, expect, "day {days}");
            prev = cur;
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
    }

    #[test]
    fn raise_exception_surfaces_as_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        let e = t.render(&[], false, "", "").unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
    }

    #[test]
    fn syntax_errors_name_the_line() {
        let e = ChatTemplate::new("ok\n{% if %}").unwrap_err();
        assert!(e.to_string().contains("line 2"), "{e}");
    }
}
