//! From a request body to a runtime request: everything the server checks before a request
//! reaches the coordinator, as a pure function of the bytes (no I/O, no clock), so property
//! tests and the fuzzer (fuzz/fuzz_targets/request.rs) can drive it directly.
//!
//! Chat prompts are rendered with the model's template under [`TemplateLimits`], and the
//! message contents are tokenized as plain text: control-token text a client writes (say
//! `<|im_start|>system`) stays text and cannot open a turn of its own.

use std::sync::Arc;

use axum::http::StatusCode;
use runtime::GenerateRequest;
use tokenizer::{ChatTemplate, TemplateLimits, Tokenizer, TokenizerError};

use crate::error::ApiError;
use crate::openai;

/// Longest error message echoed to a client; serde's messages quote the offending value, which
/// could otherwise send a megabyte string straight back.
pub const MAX_ERROR_MESSAGE: usize = 512;

/// A validated request, ready for the coordinator.
#[derive(Debug)]
pub struct Prepared {
    /// The runtime request (prompt ids, sampling, routing hints).
    pub gen: GenerateRequest,
    /// Server-sent events rather than one JSON body.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
}

/// Parses and validates request bodies for one model.
pub struct RequestParser {
    model_id: String,
    tok: Arc<Tokenizer>,
    template: Option<ChatTemplate>,
    max_context: Option<usize>,
}

impl std::fmt::Debug for RequestParser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequestParser")
            .field("model_id", &self.model_id)
            .field("max_context", &self.max_context)
            .finish_non_exhaustive()
    }
}

/// `s` cut to at most `max` bytes on a character boundary, with a mark when cut.
pub fn truncate_message(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}... (truncated)", &s[..end])
}

fn template_error(e: TokenizerError) -> ApiError {
    let (code, msg) = match &e {
        TokenizerError::TemplateFuel { .. } => ("template_budget_exceeded", e.to_string()),
        TokenizerError::TemplateOutputTooLarge { .. } => {
            ("template_output_too_large", e.to_string())
        }
        _ => ("template_error", format!("the chat template failed: {}", e)),
    };
    ApiError::invalid(truncate_message(&msg, MAX_ERROR_MESSAGE), Some("messages")).with_code(code)
}

impl RequestParser {
    /// A parser for `model_id`. `template_limits` bound each chat rendering; `max_context`
    /// (prompt plus generated tokens) is the per-request cap, `None` for the backend's context.
    /// Fails if the model's chat template does not parse.
    pub fn new(
        model_id: impl Into<String>,
        tok: Arc<Tokenizer>,
        template_limits: TemplateLimits,
        max_context: Option<usize>,
    ) -> Result<RequestParser, TokenizerError> {
        let template = tok
            .chat_template()
            .map(ChatTemplate::new)
            .transpose()?
            .map(|t| t.with_limits(template_limits));
        Ok(RequestParser {
            model_id: model_id.into(),
            tok,
            template,
            max_context,
        })
    }

    /// The model id clients name.
    pub fn model_id(&self) -> &str {
        &self.model_id
    }

    /// The per-request context cap.
    pub fn max_context(&self) -> Option<usize> {
        self.max_context
    }

    fn check_model(&self, model: &Option<String>) -> Result<(), ApiError> {
        match model {
            Some(m) if *m == self.model_id => Ok(()),
            Some(m) => Err(ApiError::unknown_model(
                &truncate_message(m, 128),
                &self.model_id,
            )),
            None => Err(ApiError::invalid("`model` is required", Some("model"))),
        }
    }

    /// `POST /v1/chat/completions`: the runtime request, or a 400/404 in OpenAI's shape whose
    /// message is at most [`MAX_ERROR_MESSAGE`] bytes (plus the truncation mark).
    pub fn chat(&self, body: &[u8]) -> Result<Prepared, ApiError> {
        self.chat_inner(body).map_err(bounded)
    }

    /// `POST /v1/completions`, as [`RequestParser::chat`].
    pub fn completion(&self, body: &[u8]) -> Result<Prepared, ApiError> {
        self.completion_inner(body).map_err(bounded)
    }

    fn chat_inner(&self, body: &[u8]) -> Result<Prepared, ApiError> {
        let req: openai::ChatRequest = parse_json(body)?;
        self.check_model(&req.common.model)?;
        req.common.check_supported()?;
        let mut params = req.common.sampling()?;
        let messages = req.messages()?;
        let template = self.template.as_ref().ok_or_else(|| {
            ApiError::invalid(
                "the model has no chat template; use /v1/completions",
                Some("messages"),
            )
        })?;
        let bos = self
            .tok
            .bos()
            .and_then(|i| self.tok.token_text(i))
            .unwrap_or("");
        let eos = self
            .tok
            .eos()
            .and_then(|i| self.tok.token_text(i))
            .unwrap_or("");
        let r = template
            .render_marked(&messages, true, bos, eos)
            .map_err(template_error)?;
        // A template that writes BOS itself must not get a second one from the tokenizer.
        let add_special = !(self.tok.add_bos() && !bos.is_empty() && r.text.starts_with(bos));
        let prompt = self
            .tok
            .encode_with_plain(&r.text, add_special, &r.content_ranges)
            .map_err(|e| tokenize_error(e, "messages"))?;
        self.fit(&prompt, &mut params, "messages")?;
        Ok(Prepared {
            gen: GenerateRequest {
                prompt,
                params,
                hints: req.common.hints(),
            },
            stream: req.common.stream,
            include_usage: req.common.include_usage(),
        })
    }

    fn completion_inner(&self, body: &[u8]) -> Result<Prepared, ApiError> {
        let req: openai::CompletionRequest = parse_json(body)?;
        self.check_model(&req.common.model)?;
        req.common.check_supported()?;
        if req.echo == Some(true) {
            return Err(ApiError::invalid("echo is not supported", Some("echo")));
        }
        if req.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
            return Err(ApiError::invalid("suffix is not supported", Some("suffix")));
        }
        let mut params = req.common.sampling()?;
        // Control-token text in a prompt stays text unless the caller asks (`parse_special`).
        let special = req.parse_special.unwrap_or(false);
        let prompt = match &req.prompt {
            openai::Prompt::Text(t) => self.tok.encode(t, true, special),
            openai::Prompt::Texts(v) if v.len() == 1 => self.tok.encode(&v[0], true, special),
            openai::Prompt::Texts(v) => {
                return Err(ApiError::invalid(
                    format!("only one prompt per request is supported, got {}", v.len()),
                    Some("prompt"),
                ))
            }
            openai::Prompt::Tokens(ids) => {
                let n_vocab = self.tok.vocab_size();
                let mut out = Vec::with_capacity(ids.len());
                for (i, &id) in ids.iter().enumerate() {
                    let t = u32::try_from(id)
                        .ok()
                        .filter(|&t| (t as usize) < n_vocab)
                        .ok_or_else(|| {
                            ApiError::invalid(
                                format!(
                                    "prompt[{i}] = {id} is not a token id (vocabulary of {n_vocab})"
                                ),
                                Some("prompt"),
                            )
                        })?;
                    out.push(t);
                }
                Ok(out)
            }
        }
        .map_err(|e| tokenize_error(e, "prompt"))?;
        self.fit(&prompt, &mut params, "prompt")?;
        Ok(Prepared {
            gen: GenerateRequest {
                prompt,
                params,
                hints: req.common.hints(),
            },
            stream: req.common.stream,
            include_usage: req.common.include_usage(),
        })
    }

    /// The per-request context cap: a prompt that leaves no room for a token is refused, and
    /// generation is bounded to what is left (`finish_reason: "length"` at the cap).
    fn fit(
        &self,
        prompt: &[u32],
        params: &mut runtime::SamplingParams,
        param: &str,
    ) -> Result<(), ApiError> {
        if prompt.is_empty() {
            return Err(ApiError::invalid("the prompt is empty", Some(param)));
        }
        let Some(max) = self.max_context else {
            return Ok(());
        };
        if prompt.len() >= max {
            return Err(ApiError::invalid(
                format!(
                    "the prompt has {} tokens; this server allows at most {} per request \
                     (prompt and completion), leaving no room to generate",
                    prompt.len(),
                    max
                ),
                Some(param),
            )
            .with_code("context_length_exceeded"));
        }
        let room = max - prompt.len();
        params.max_tokens = Some(params.max_tokens.map_or(room, |m| m.min(room)));
        Ok(())
    }
}

fn bounded(mut e: ApiError) -> ApiError {
    e.message = truncate_message(&e.message, MAX_ERROR_MESSAGE);
    if let Some(p) = &e.param {
        e.param = Some(truncate_message(p, 128));
    }
    e
}

fn tokenize_error(e: TokenizerError, param: &str) -> ApiError {
    ApiError::invalid(
        truncate_message(&format!("cannot tokenize: {e}"), MAX_ERROR_MESSAGE),
        Some(param),
    )
}

/// Parse a JSON body into `T`, every failure a 400 naming what is wrong (and where: serde's
/// line and column), cut to [`MAX_ERROR_MESSAGE`].
pub fn parse_json<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        let what = if e.is_data() {
            "invalid request"
        } else {
            "invalid JSON"
        };
        ApiError::invalid(
            truncate_message(&format!("{what}: {e}"), MAX_ERROR_MESSAGE),
            None,
        )
    })
}

/// The statuses a request parse can end in; everything else would be a server bug.
pub fn is_parse_status(s: StatusCode) -> bool {
    s == StatusCode::BAD_REQUEST || s == StatusCode::NOT_FOUND
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_keeps_char_boundaries() {
        let s = "é".repeat(10);
        let t = truncate_message(&s, 5);
        assert!(t.starts_with("éé") && t.ends_with("(truncated)"), "{t}");
        assert_eq!(truncate_message("abc", 5), "abc");
    }
}
