//! The routing policy: data (TOML), evaluated by one pure function, [`decide`].
//!
//! A policy is an ordered list of rules and a default order. A rule names a backend and
//! conditions on the request's shape (prompt tokens, tokens to generate, priority, batch hint)
//! and on that backend's live state (queue depth, free KV blocks); the first rule whose
//! conditions hold and whose backend is eligible (present, healthy, its context holds the
//! prompt) wins. With no rule matching, the first eligible backend of `default` wins; with no
//! `default`, the built-in preference: a GPU before the CPU, then the least loaded.
//!
//! ```toml
//! default = ["cuda:0", "cpu"]
//!
//! [[rule]]
//! name = "short-on-cpu"
//! backend = "cpu"
//! prompt_tokens_max = 64
//! max_new_tokens_max = 64
//!
//! [[rule]]
//! name = "gpu-unless-busy"
//! backend = "cuda:0"
//! queue_depth_max = 8
//! ```

use std::path::Path;

use crate::event::{Priority, RuntimeError};

/// A routing policy.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoutingPolicy {
    /// Backends to prefer, in order, when no rule matches. Empty: the built-in preference.
    #[serde(default)]
    pub default: Vec<String>,
    /// Rules, first match wins.
    #[serde(default, rename = "rule")]
    pub rules: Vec<Rule>,
}

/// One rule: a backend and the conditions under which it is chosen (all must hold; an absent
/// condition always holds).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Shown in the route reason and the metrics label.
    pub name: String,
    /// Backend to choose.
    pub backend: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_min: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_max: Option<usize>,
    /// A request without `max_tokens` counts as unbounded: it never meets a maximum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens_min: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens_max: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<bool>,
    /// The backend's requests in flight (waiting + running) must be at most this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth_max: Option<usize>,
    /// The backend's unreserved KV blocks must be at least this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_kv_blocks_min: Option<usize>,
}

/// A policy file that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    #[error("cannot read routing policy {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("routing policy {path}: {msg}")]
    Parse { path: String, msg: String },
    #[error("routing policy: rule {index} ({name:?}): {why}")]
    Invalid {
        index: usize,
        name: String,
        why: String,
    },
}

impl RoutingPolicy {
    /// Parse TOML text (`origin` names it in errors) and check it.
    pub fn from_toml(text: &str, origin: &str) -> Result<RoutingPolicy, RoutingError> {
        let p: RoutingPolicy = toml::from_str(text).map_err(|e| RoutingError::Parse {
            path: origin.to_string(),
            msg: e.to_string(),
        })?;
        p.validate()?;
        Ok(p)
    }

    /// Read and check a policy file.
    pub fn load(path: &Path) -> Result<RoutingPolicy, RoutingError> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| RoutingError::Io {
            path: shown.clone(),
            source,
        })?;
        Self::from_toml(&text, &shown)
    }

    /// The policy as TOML.
    pub fn to_toml(&self) -> String {
        // Serializing plain structs of strings, numbers and enums cannot fail.
        toml::to_string_pretty(self).unwrap_or_default()
    }

    /// Check ranges (a minimum above its maximum, empty names).
    pub fn validate(&self) -> Result<(), RoutingError> {
        for (index, r) in self.rules.iter().enumerate() {
            let bad = |why: &str| RoutingError::Invalid {
                index,
                name: r.name.clone(),
                why: why.to_string(),
            };
            if r.name.is_empty() {
                return Err(bad("name is empty"));
            }
            if r.backend.is_empty() {
                return Err(bad("backend is empty"));
            }
            if let (Some(a), Some(b)) = (r.prompt_tokens_min, r.prompt_tokens_max) {
                if a > b {
                    return Err(bad("prompt_tokens_min > prompt_tokens_max"));
                }
            }
            if let (Some(a), Some(b)) = (r.max_new_tokens_min, r.max_new_tokens_max) {
                if a > b {
                    return Err(bad("max_new_tokens_min > max_new_tokens_max"));
                }
            }
            if self.rules[..index].iter().any(|o| o.name == r.name) {
                return Err(bad("duplicate rule name"));
            }
        }
        Ok(())
    }

    /// Backend names the policy mentions that are not in `present` (worth a warning: such
    /// rules never fire).
    pub fn unknown_backends(&self, present: &[&str]) -> Vec<String> {
        let mut out: Vec<String> = self
            .rules
            .iter()
            .map(|r| r.backend.as_str())
            .chain(self.default.iter().map(String::as_str))
            .filter(|n| !present.contains(n))
            .map(str::to_string)
            .collect();
        out.sort();
        out.dedup();
        out
    }
}

/// What the router knows about a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestShape {
    pub prompt_tokens: usize,
    /// `None`: generate until the end (or the context is full).
    pub max_new_tokens: Option<usize>,
    pub priority: Priority,
    pub batch: bool,
}

/// What the router knows about a backend at the moment of the decision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendState {
    pub name: String,
    pub healthy: bool,
    /// Requests waiting plus running.
    pub queue_depth: usize,
    /// KV blocks neither used nor promised to running requests.
    pub free_kv_blocks: usize,
    /// Longest sequence it holds.
    pub max_seq_tokens: usize,
}

impl BackendState {
    /// GPUs first: the built-in preference's first key.
    fn kind_rank(&self) -> u8 {
        if self.name.starts_with("cpu") {
            1
        } else {
            0
        }
    }
}

/// A routing decision: the backends to try in order (the first serves; the rest are the
/// failover order) and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub order: Vec<String>,
    /// Human-readable reason (log line, `x-crossover-route-reason`).
    pub reason: String,
    /// Short, bounded label for metrics: `rule:NAME`, `default`, `builtin`.
    pub code: String,
}

impl Decision {
    /// The chosen backend.
    pub fn backend(&self) -> &str {
        self.order.first().map_or("", String::as_str)
    }
}

/// Choose a backend for `req` under `policy` given the backends' live `states`.
pub fn decide(
    policy: &RoutingPolicy,
    req: &RequestShape,
    states: &[BackendState],
) -> Result<Decision, RuntimeError> {
    let eligible: Vec<&BackendState> = states
        .iter()
        .filter(|s| s.healthy && req.prompt_tokens < s.max_seq_tokens)
        .collect();
    if eligible.is_empty() {
        if states.is_empty() {
            return Err(RuntimeError::NoBackend {
                why: "no backend is configured".into(),
            });
        }
        let max_ctx = states.iter().map(|s| s.max_seq_tokens).max().unwrap_or(0);
        if req.prompt_tokens >= max_ctx {
            return Err(RuntimeError::PromptTooLong {
                prompt_tokens: req.prompt_tokens,
                ctx: max_ctx,
            });
        }
        let why = states
            .iter()
            .map(|s| {
                if !s.healthy {
                    format!("{}: unhealthy", s.name)
                } else {
                    format!("{}: context {} too short", s.name, s.max_seq_tokens)
                }
            })
            .collect::<Vec<_>>()
            .join(", ");
        return Err(RuntimeError::NoBackend { why });
    }
    // Failover order: the default list first, then the built-in preference.
    let mut builtin: Vec<&BackendState> = eligible.clone();
    builtin.sort_by(|a, b| {
        (a.kind_rank(), a.queue_depth, &a.name).cmp(&(b.kind_rank(), b.queue_depth, &b.name))
    });
    let mut fallback: Vec<String> = Vec::new();
    for n in &policy.default {
        if eligible.iter().any(|s| &s.name == n) && !fallback.contains(n) {
            fallback.push(n.clone());
        }
    }
    for s in &builtin {
        if !fallback.contains(&s.name) {
            fallback.push(s.name.clone());
        }
    }
    let order_from = |first: &str| -> Vec<String> {
        let mut o = vec![first.to_string()];
        o.extend(fallback.iter().filter(|n| n.as_str() != first).cloned());
        o
    };
    for (i, rule) in policy.rules.iter().enumerate() {
        let Some(s) = eligible.iter().find(|s| s.name == rule.backend) else {
            continue;
        };
        if let Some(why) = rule_holds(rule, req, s) {
            return Ok(Decision {
                order: order_from(&rule.backend),
                reason: format!("rule {} {:?}: {why}", i + 1, rule.name),
                code: format!("rule:{}", rule.name),
            });
        }
    }
    if let Some(n) = policy
        .default
        .iter()
        .find(|n| eligible.iter().any(|s| &s.name == *n))
    {
        let reason = if policy.rules.is_empty() {
            format!("default: {n} is the first eligible backend of the default list")
        } else {
            format!(
                "no rule matched; default: {n} is the first eligible backend of the default list"
            )
        };
        return Ok(Decision {
            order: order_from(n),
            reason,
            code: "default".into(),
        });
    }
    let best = builtin[0];
    let reason = format!(
        "built-in: fastest available ({}), queue depth {}",
        if best.kind_rank() == 0 {
            "GPU before CPU"
        } else {
            "CPU, no GPU eligible"
        },
        best.queue_depth
    );
    Ok(Decision {
        order: order_from(&best.name),
        reason,
        code: "builtin".into(),
    })
}

/// Like [`decide`], for a request whose caller named a backend (`x-crossover-backend`): the named
/// backend serves when it is eligible, with the normal decision's order behind it for failover
/// (code `requested`); when it is not eligible the normal decision stands and its reason says
/// why the caller's choice was not honoured. A name that is not among `states` is an error.
pub fn decide_requested(
    policy: &RoutingPolicy,
    req: &RequestShape,
    states: &[BackendState],
    requested: &str,
) -> Result<Decision, RuntimeError> {
    let Some(s) = states.iter().find(|s| s.name == requested) else {
        return Err(RuntimeError::UnknownBackend {
            name: requested.to_string(),
            available: states
                .iter()
                .map(|s| s.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        });
    };
    let not_eligible = if !s.healthy {
        Some("unhealthy".to_string())
    } else if req.prompt_tokens >= s.max_seq_tokens {
        Some(format!(
            "its context of {} tokens cannot hold a prompt of {}",
            s.max_seq_tokens, req.prompt_tokens
        ))
    } else {
        None
    };
    let normal = decide(policy, req, states);
    match not_eligible {
        None => {
            let mut order = vec![requested.to_string()];
            if let Ok(d) = &normal {
                order.extend(d.order.iter().filter(|n| *n != requested).cloned());
            }
            Ok(Decision {
                order,
                reason: format!("requested: the caller named {requested}"),
                code: "requested".into(),
            })
        }
        Some(why) => {
            let mut d = normal?;
            d.reason = format!(
                "requested {requested} is not eligible ({why}); {}",
                d.reason
            );
            Ok(d)
        }
    }
}

/// `Some(explanation)` when every condition of `rule` holds.
fn rule_holds(rule: &Rule, req: &RequestShape, s: &BackendState) -> Option<String> {
    let mut why: Vec<String> = Vec::new();
    let p = req.prompt_tokens;
    if let Some(m) = rule.prompt_tokens_min {
        if p < m {
            return None;
        }
        why.push(format!("prompt_tokens {p} >= {m}"));
    }
    if let Some(m) = rule.prompt_tokens_max {
        if p > m {
            return None;
        }
        why.push(format!("prompt_tokens {p} <= {m}"));
    }
    if let Some(m) = rule.max_new_tokens_min {
        if req.max_new_tokens.is_some_and(|n| n < m) {
            return None;
        }
        why.push(match req.max_new_tokens {
            Some(n) => format!("max_new_tokens {n} >= {m}"),
            None => format!("max_new_tokens unbounded >= {m}"),
        });
    }
    if let Some(m) = rule.max_new_tokens_max {
        let n = req.max_new_tokens?;
        if n > m {
            return None;
        }
        why.push(format!("max_new_tokens {n} <= {m}"));
    }
    if let Some(pr) = rule.priority {
        if req.priority != pr {
            return None;
        }
        why.push(format!("priority {pr:?}").to_lowercase());
    }
    if let Some(b) = rule.batch {
        if req.batch != b {
            return None;
        }
        why.push(format!("batch {b}"));
    }
    if let Some(m) = rule.queue_depth_max {
        if s.queue_depth > m {
            return None;
        }
        why.push(format!("{} queue depth {} <= {m}", s.name, s.queue_depth));
    }
    if let Some(m) = rule.free_kv_blocks_min {
        if s.free_kv_blocks < m {
            return None;
        }
        why.push(format!(
            "{} free KV blocks {} >= {m}",
            s.name, s.free_kv_blocks
        ));
    }
    if why.is_empty() {
        why.push("unconditional".into());
    }
    Some(why.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(name: &str, healthy: bool, depth: usize, free: usize, ctx: usize) -> BackendState {
        BackendState {
            name: name.into(),
            healthy,
            queue_depth: depth,
            free_kv_blocks: free,
            max_seq_tokens: ctx,
        }
    }

    #[test]
    fn a_requested_backend_serves_when_eligible_and_is_explained_when_not() {
        let policy = RoutingPolicy::from_toml(POLICY, "test").unwrap();
        let states = [
            st("cpu:a", true, 0, 100, 512),
            st("cpu:b", true, 5, 100, 512),
            st("cpu:c", false, 0, 100, 4096),
            st("cpu:d", true, 0, 100, 64),
        ];
        let d = decide_requested(&policy, &shape(10, Some(8)), &states, "cpu:b").unwrap();
        assert_eq!(d.order, ["cpu:b", "cpu:a", "cpu:d"]);
        assert_eq!(d.code, "requested");
        assert!(d.reason.contains("caller named cpu:b"), "{}", d.reason);
        // Unhealthy: the normal decision, saying why.
        let d = decide_requested(&policy, &shape(10, Some(8)), &states, "cpu:c").unwrap();
        let normal = decide(&policy, &shape(10, Some(8)), &states).unwrap();
        assert_eq!(d.order, normal.order);
        assert_eq!(d.code, normal.code);
        assert!(
            d.reason
                .starts_with("requested cpu:c is not eligible (unhealthy); "),
            "{}",
            d.reason
        );
        // Too short a context for the prompt.
        let d = decide_requested(&policy, &shape(100, Some(8)), &states, "cpu:d").unwrap();
        assert_ne!(d.backend(), "cpu:d");
        assert!(d.reason.contains("context of 64 tokens"), "{}", d.reason);
        match decide_requested(&policy, &shape(10, None), &states, "cuda:7") {
            Err(RuntimeError::UnknownBackend { name, available }) => {
                assert_eq!(name, "cuda:7");
                assert_eq!(available, "cpu:a, cpu:b, cpu:c, cpu:d");
            }
            other => panic!("{other:?}"),
        }
    }

    fn shape(p: usize, n: Option<usize>) -> RequestShape {
        RequestShape {
            prompt_tokens: p,
            max_new_tokens: n,
            priority: Priority::Normal,
            batch: false,
        }
    }

    const POLICY: &str = r#"
default = ["cpu:a", "cpu:b"]

[[rule]]
name = "long-prompts"
backend = "cpu:b"
prompt_tokens_min = 256

[[rule]]
name = "batch"
backend = "cpu:b"
batch = true
queue_depth_max = 4

[[rule]]
name = "short"
backend = "cpu:a"
prompt_tokens_max = 32
max_new_tokens_max = 16
free_kv_blocks_min = 10
"#;

    #[test]
    fn toml_round_trip() {
        let p = RoutingPolicy::from_toml(POLICY, "test").unwrap();
        assert_eq!(p.rules.len(), 3);
        assert_eq!(p.rules[1].batch, Some(true));
        assert_eq!(p.rules[2].free_kv_blocks_min, Some(10));
        let again = RoutingPolicy::from_toml(&p.to_toml(), "round trip").unwrap();
        assert_eq!(p, again);
        let with_priority = "[[rule]]\nname = \"x\"\nbackend = \"cpu\"\npriority = \"high\"\n";
        let q = RoutingPolicy::from_toml(with_priority, "t").unwrap();
        assert_eq!(q.rules[0].priority, Some(Priority::High));
        assert_eq!(RoutingPolicy::from_toml(&q.to_toml(), "t").unwrap(), q);
    }

    #[test]
    fn bad_policies_are_refused_with_the_place() {
        let e = RoutingPolicy::from_toml(
            "[[rule]]\nname = \"x\"\nbackend = \"cpu\"\nfoo = 1\n",
            "f.toml",
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("f.toml") && e.to_string().contains("foo"),
            "{e}"
        );
        let e = RoutingPolicy::from_toml(
            "[[rule]]\nname = \"x\"\nbackend = \"cpu\"\nprompt_tokens_min = 9\nprompt_tokens_max = 3\n",
            "f",
        )
        .unwrap_err();
        assert!(matches!(e, RoutingError::Invalid { index: 0, .. }), "{e}");
        let e = RoutingPolicy::from_toml(
            "[[rule]]\nname = \"x\"\nbackend = \"cpu\"\nprompt_tokens_min = -1\n",
            "f",
        )
        .unwrap_err();
        assert!(matches!(e, RoutingError::Parse { .. }), "{e}");
        let p = RoutingPolicy::from_toml(POLICY, "t").unwrap();
        assert_eq!(p.unknown_backends(&["cpu:a"]), vec!["cpu:b".to_string()]);
    }

    #[test]
    fn rules_in_order_with_reasons() {
        let p = RoutingPolicy::from_toml(POLICY, "t").unwrap();
        let states = vec![
            st("cpu:a", true, 0, 100, 2048),
            st("cpu:b", true, 2, 100, 2048),
        ];
        let d = decide(&p, &shape(300, Some(10)), &states).unwrap();
        assert_eq!(d.order, vec!["cpu:b", "cpu:a"]);
        assert_eq!(d.code, "rule:long-prompts");
        assert!(
            d.reason.contains("prompt_tokens 300 >= 256"),
            "{}",
            d.reason
        );

        let d = decide(&p, &shape(20, Some(10)), &states).unwrap();
        assert_eq!((d.backend(), d.code.as_str()), ("cpu:a", "rule:short"));
        assert!(d.reason.contains("max_new_tokens 10 <= 16"), "{}", d.reason);
        assert!(
            d.reason.contains("free KV blocks 100 >= 10"),
            "{}",
            d.reason
        );

        // Unbounded generation never meets a maximum: falls to the default list.
        let d = decide(&p, &shape(20, None), &states).unwrap();
        assert_eq!((d.backend(), d.code.as_str()), ("cpu:a", "default"));

        // Batch hint, live queue depth within bound.
        let mut b = shape(100, Some(100));
        b.batch = true;
        let d = decide(&p, &b, &states).unwrap();
        assert_eq!(d.code, "rule:batch");
        assert!(
            d.reason.contains("cpu:b queue depth 2 <= 4"),
            "{}",
            d.reason
        );
        // ... and beyond it.
        let busy = vec![
            st("cpu:a", true, 0, 100, 2048),
            st("cpu:b", true, 5, 100, 2048),
        ];
        assert_eq!(decide(&p, &b, &busy).unwrap().code, "default");

        // Not enough free KV for the "short" rule.
        let tight = vec![
            st("cpu:a", true, 0, 9, 2048),
            st("cpu:b", true, 0, 100, 2048),
        ];
        assert_eq!(
            decide(&p, &shape(20, Some(10)), &tight).unwrap().code,
            "default"
        );
    }

    #[test]
    fn health_and_context_decide_eligibility() {
        let p = RoutingPolicy::from_toml(POLICY, "t").unwrap();
        // The rule's backend is unhealthy: next matching rule or default, never it.
        let states = vec![
            st("cpu:a", true, 0, 100, 2048),
            st("cpu:b", false, 0, 100, 2048),
        ];
        let d = decide(&p, &shape(300, Some(10)), &states).unwrap();
        assert_eq!(d.order, vec!["cpu:a"]);
        // Context too short on one backend: the other.
        let states = vec![
            st("cpu:a", true, 0, 100, 4096),
            st("cpu:b", true, 0, 100, 256),
        ];
        let d = decide(&p, &shape(300, Some(10)), &states).unwrap();
        assert_eq!(d.order, vec!["cpu:a"]);
        // Too long everywhere: a request error naming the largest context.
        let e = decide(&p, &shape(5000, None), &states).unwrap_err();
        assert!(
            matches!(
                e,
                RuntimeError::PromptTooLong {
                    prompt_tokens: 5000,
                    ctx: 4096
                }
            ),
            "{e}"
        );
        // Nobody healthy.
        let down = vec![st("cpu:a", false, 0, 100, 4096)];
        assert!(matches!(
            decide(&p, &shape(3, None), &down),
            Err(RuntimeError::NoBackend { .. })
        ));
    }

    #[test]
    fn builtin_prefers_gpu_then_least_loaded() {
        let none = RoutingPolicy::default();
        let states = vec![
            st("cpu", true, 0, 100, 2048),
            st("cuda:1", true, 3, 100, 2048),
            st("cuda:0", true, 1, 100, 2048),
        ];
        let d = decide(&none, &shape(10, None), &states).unwrap();
        assert_eq!(d.order, vec!["cuda:0", "cuda:1", "cpu"]);
        assert_eq!(d.code, "builtin");
        assert!(d.reason.contains("GPU before CPU"), "{}", d.reason);
        let cpus = vec![
            st("cpu:0", true, 4, 100, 2048),
            st("cpu:1", true, 1, 100, 2048),
        ];
        let d = decide(&none, &shape(10, None), &cpus).unwrap();
        assert_eq!(d.order, vec!["cpu:1", "cpu:0"]);
    }
}
