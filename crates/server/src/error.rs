//! Errors in OpenAI's JSON shape with the matching HTTP status.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use runtime::{RuntimeError, SamplingError};

/// An HTTP error: status, OpenAI error body, optional Retry-After.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `not_found_error`,
    /// `rate_limit_error`, `server_error`, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    pub retry_after: Option<Duration>,
}

impl ApiError {
    /// 400 invalid request naming the offending parameter.
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
            retry_after: None,
        }
    }

    /// With a machine-readable code.
    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    /// 401.
    pub fn unauthorized(message: &str) -> ApiError {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
            retry_after: None,
        }
    }

    /// 404 for an unknown model.
    pub fn unknown_model(model: &str, available: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist; available: {available}"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
            retry_after: None,
        }
    }

    /// Any other status.
    pub fn status(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(d) = self.retry_after {
            let secs = d.as_secs_f64().ceil().max(1.0) as u64;
            if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
        }
        r
    }
}

fn sampling_param(e: &SamplingError) -> &'static str {
    match e {
        SamplingError::NotFinite { field, .. } | SamplingError::OutOfRange { field, .. } => field,
        SamplingError::ZeroMaxTokens => "max_tokens",
        SamplingError::TooManyStops { .. }
        | SamplingError::EmptyStop { .. }
        | SamplingError::StopTooLong { .. } => "stop",
    }
}

impl From<RuntimeError> for ApiError {
    fn from(e: RuntimeError) -> ApiError {
        let message = e.to_string();
        match &e {
            RuntimeError::EmptyPrompt => ApiError::invalid(message, None),
            RuntimeError::PromptTooLong { .. } => {
                ApiError::invalid(message, Some("messages")).with_code("context_length_exceeded")
            }
            RuntimeError::InvalidToken { .. } => ApiError::invalid(message, Some("prompt")),
            RuntimeError::InvalidParams(se) => ApiError::invalid(message, Some(sampling_param(se))),
            RuntimeError::UnknownBackend { .. } => ApiError::invalid(message, None),
            RuntimeError::Overloaded { retry_after, .. } => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message,
                kind: "rate_limit_error",
                param: None,
                code: Some("overloaded"),
                retry_after: Some(*retry_after),
            },
            RuntimeError::ShuttingDown { .. }
            | RuntimeError::NoBackend { .. }
            | RuntimeError::Unavailable { .. } => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message,
                kind: "server_error",
                param: None,
                code: Some("unavailable"),
                retry_after: Some(Duration::from_secs(5)),
            },
            RuntimeError::Backend { .. }
            | RuntimeError::ActorGone { .. }
            | RuntimeError::StartFailed { .. }
            | RuntimeError::Detokenize { .. } => {
                ApiError::status(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
            }
        }
    }
}
