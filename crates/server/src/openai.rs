//! OpenAI request bodies and their translation into runtime requests. Fields OpenAI defines keep
//! their meaning; llama.cpp's extensions (`top_k`, `min_p`, `repeat_penalty`, `repeat_last_n`,
//! `ignore_eos`) are accepted too. Absent sampling fields take llama.cpp's defaults.

use runtime::{Priority, RouteHints, SamplingParams};
use serde::Deserialize;

use crate::error::ApiError;

/// Most messages in one chat request.
pub const MAX_MESSAGES: usize = 1024;

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and routing fields shared by both endpoints.
#[derive(Debug, Default, Deserialize)]
pub struct Common {
    pub model: Option<String>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<i64>,
    pub ignore_eos: Option<bool>,
    pub logprobs: Option<serde_json::Value>,
    pub priority: Option<Priority>,
    pub batch: Option<bool>,
}

/// Message content: a string or a list of parts (only text parts are supported).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Content>,
}

/// `POST /v1/chat/completions`.
#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub tools: Option<Vec<serde_json::Value>>,
    #[serde(flatten)]
    pub common: Common,
}

/// `prompt` of a completion: a string, a one-element list of strings, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<i64>),
}

/// `POST /v1/completions`.
#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    /// llama.cpp's extension: match control tokens written in the prompt text (`false` unless
    /// asked: prompt text is tokenized as text).
    pub parse_special: Option<bool>,
    #[serde(flatten)]
    pub common: Common,
}

impl ChatRequest {
    /// The conversation as the chat template wants it.
    pub fn messages(&self) -> Result<Vec<tokenizer::ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid(
                "messages must not be empty",
                Some("messages"),
            ));
        }
        if self.messages.len() > MAX_MESSAGES {
            return Err(ApiError::invalid(
                format!(
                    "at most {MAX_MESSAGES} messages are allowed, got {}",
                    self.messages.len()
                ),
                Some("messages"),
            ));
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ApiError::invalid("tools are not supported", Some("tools")));
        }
        let mut out = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            let text = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut t = String::new();
                    for (j, p) in parts.iter().enumerate() {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(s)) => t.push_str(s),
                            _ => {
                                return Err(ApiError::invalid(
                                    format!("content part of type {:?} is not supported", p.kind),
                                    Some(&format!("messages[{i}].content[{j}]")),
                                ))
                            }
                        }
                    }
                    t
                }
            };
            out.push(tokenizer::ChatMessage::new(m.role.clone(), text));
        }
        Ok(out)
    }
}

fn non_negative(v: i64, field: &str) -> Result<usize, ApiError> {
    usize::try_from(v)
        .map_err(|_| ApiError::invalid(format!("{field} must be >= 0, got {v}"), Some(field)))
}

impl Common {
    /// Reject what is not supported (n > 1, logprobs).
    pub fn check_supported(&self) -> Result<(), ApiError> {
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid(
                    format!("only n = 1 is supported, got {n}"),
                    Some("n"),
                ));
            }
        }
        match &self.logprobs {
            None | Some(serde_json::Value::Null) | Some(serde_json::Value::Bool(false)) => Ok(()),
            Some(_) => Err(ApiError::invalid(
                "logprobs are not supported",
                Some("logprobs"),
            )),
        }
    }

    /// Sampling parameters: given fields over llama.cpp's defaults, validated.
    pub fn sampling(&self) -> Result<SamplingParams, ApiError> {
        let mut p = SamplingParams::default();
        if let Some(t) = self.temperature {
            p.temperature = t;
        }
        if let Some(v) = self.top_p {
            p.top_p = v;
        }
        if let Some(k) = self.top_k {
            // llama.cpp: <= 0 means the whole vocabulary.
            p.top_k = usize::try_from(k).unwrap_or(0);
        }
        if let Some(v) = self.min_p {
            p.min_p = v;
        }
        for (v, field) in [
            (self.presence_penalty, "presence_penalty"),
            (self.frequency_penalty, "frequency_penalty"),
        ] {
            if let Some(x) = v {
                if !(-2.0..=2.0).contains(&x) {
                    return Err(ApiError::invalid(
                        format!("{field} must be in [-2, 2], got {x}"),
                        Some(field),
                    ));
                }
            }
        }
        if let Some(v) = self.presence_penalty {
            p.presence_penalty = v;
        }
        if let Some(v) = self.frequency_penalty {
            p.frequency_penalty = v;
        }
        if let Some(v) = self.repeat_penalty {
            p.repeat_penalty = v;
        }
        if let Some(n) = self.repeat_last_n {
            p.repeat_last_n = non_negative(n, "repeat_last_n")?;
        }
        // Like llama.cpp, a negative seed asks for a random one.
        p.seed = self.seed.and_then(|s| u64::try_from(s).ok());
        let max = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => Some((m, "max_completion_tokens")),
            (None, Some(m)) => Some((m, "max_tokens")),
            _ => None,
        };
        if let Some((m, field)) = max {
            if m < 1 {
                return Err(ApiError::invalid(
                    format!("{field} must be at least 1, got {m}"),
                    Some(field),
                ));
            }
            p.max_tokens = Some(non_negative(m, field)?);
        }
        p.stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        p.ignore_eos = self.ignore_eos.unwrap_or(false);
        p.validate().map_err(runtime::RuntimeError::InvalidParams)?;
        Ok(p)
    }

    /// Routing hints.
    pub fn hints(&self) -> RouteHints {
        RouteHints {
            priority: self.priority.unwrap_or_default(),
            batch: self.batch.unwrap_or(false),
        }
    }

    /// Whether the final usage chunk is wanted in a stream.
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> ChatRequest {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn chat_fields_map_to_sampling() {
        let r = parse(
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0,
                "top_p":0.5,"top_k":7,"seed":42,"stop":"x","max_tokens":9,
                "stream":true,"stream_options":{"include_usage":true}}"#,
        );
        let p = r.common.sampling().unwrap();
        assert_eq!(
            (p.temperature, p.top_p, p.top_k, p.seed),
            (0.0, 0.5, 7, Some(42))
        );
        assert_eq!(
            (p.max_tokens, p.stop.clone()),
            (Some(9), vec!["x".to_string()])
        );
        assert!(r.common.stream && r.common.include_usage());
        // Absent fields: llama.cpp's defaults.
        let d = parse(r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#);
        assert_eq!(d.common.sampling().unwrap(), SamplingParams::default());
    }

    #[test]
    fn bad_fields_name_the_parameter() {
        let cases = [
            (r#""temperature":-1"#, "temperature"),
            (r#""top_p":3"#, "top_p"),
            (r#""max_tokens":0"#, "max_tokens"),
            (r#""presence_penalty":5"#, "presence_penalty"),
            (r#""stop":["a",""]"#, "stop"),
            (r#""n":2"#, "n"),
            (r#""logprobs":true"#, "logprobs"),
        ];
        for (field, param) in cases {
            let r = parse(&format!(
                r#"{{"messages":[{{"role":"user","content":"hi"}}],{field}}}"#
            ));
            let e = r
                .common
                .check_supported()
                .and_then(|_| r.common.sampling())
                .unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{field}: {e:?}");
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn content_parts_and_prompts() {
        let r = parse(
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        );
        assert_eq!(r.messages().unwrap()[0].content, "ab");
        let r = parse(r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#);
        assert_eq!(
            r.messages().unwrap_err().param.as_deref(),
            Some("messages[0].content[0]")
        );
        let c: CompletionRequest = serde_json::from_str(r#"{"prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(c.prompt, Prompt::Tokens(ref t) if t == &[1, 2, 3]));
        let c: CompletionRequest = serde_json::from_str(r#"{"prompt":["x"]}"#).unwrap();
        assert!(matches!(c.prompt, Prompt::Texts(_)));
    }
}
