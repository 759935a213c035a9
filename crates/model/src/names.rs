//! Tensor names as llama.cpp's converter writes them for the Llama family (`LLM_TN` in llama-arch.cpp).

/// Token embedding table, `[n_embd, n_vocab]`.
pub const TOKEN_EMBD: &str = "token_embd.weight";
/// Final RMSNorm weight, `[n_embd]`.
pub const OUTPUT_NORM: &str = "output_norm.weight";
/// Output projection (LM head), `[n_embd, n_vocab]`; absent when tied to the token embedding.
pub const OUTPUT: &str = "output.weight";
/// Llama 3 RoPE frequency factors, `[n_rot / 2]`; absent for models without llama3 rope scaling.
pub const ROPE_FREQS: &str = "rope_freqs.weight";

/// A per-layer tensor, named `blk.{i}.{suffix}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerTensor {
    AttnNorm,
    AttnQ,
    AttnK,
    AttnV,
    AttnOutput,
    AttnQBias,
    AttnKBias,
    AttnVBias,
    FfnNorm,
    FfnGate,
    FfnUp,
    FfnDown,
}

impl LayerTensor {
    /// Every per-layer tensor, in the order a forward pass uses them.
    pub const ALL: [LayerTensor; 12] = [
        LayerTensor::AttnNorm,
        LayerTensor::AttnQ,
        LayerTensor::AttnQBias,
        LayerTensor::AttnK,
        LayerTensor::AttnKBias,
        LayerTensor::AttnV,
        LayerTensor::AttnVBias,
        LayerTensor::AttnOutput,
        LayerTensor::FfnNorm,
        LayerTensor::FfnGate,
        LayerTensor::FfnUp,
        LayerTensor::FfnDown,
    ];

    /// The part of the name after `blk.{i}.`.
    pub fn suffix(self) -> &'static str {
        match self {
            LayerTensor::AttnNorm => "attn_norm.weight",
            LayerTensor::AttnQ => "attn_q.weight",
            LayerTensor::AttnK => "attn_k.weight",
            LayerTensor::AttnV => "attn_v.weight",
            LayerTensor::AttnOutput => "attn_output.weight",
            LayerTensor::AttnQBias => "attn_q.bias",
            LayerTensor::AttnKBias => "attn_k.bias",
            LayerTensor::AttnVBias => "attn_v.bias",
            LayerTensor::FfnNorm => "ffn_norm.weight",
            LayerTensor::FfnGate => "ffn_gate.weight",
            LayerTensor::FfnUp => "ffn_up.weight",
            LayerTensor::FfnDown => "ffn_down.weight",
        }
    }

    /// The full name in layer `layer`.
    pub fn name(self, layer: usize) -> String {
        format!("blk.{layer}.{}", self.suffix())
    }

    /// Whether this is a Q/K/V bias (present only in some models, e.g. Qwen2).
    pub fn is_bias(self) -> bool {
        matches!(
            self,
            LayerTensor::AttnQBias | LayerTensor::AttnKBias | LayerTensor::AttnVBias
        )
    }

    /// The tensor for a suffix such as `attn_q.weight`.
    pub fn from_suffix(suffix: &str) -> Option<LayerTensor> {
        LayerTensor::ALL
            .iter()
            .copied()
            .find(|t| t.suffix() == suffix)
    }
}

/// Splits `blk.{i}.{suffix}` into the layer index and the suffix; `None` for any other name.
pub fn split_layer_name(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("blk.")?;
    let (num, suffix) = rest.split_once('.')?;
    if num.is_empty() || !num.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((num.parse().ok()?, suffix))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_names_round_trip() {
        for t in LayerTensor::ALL {
            let n = t.name(17);
            assert_eq!(split_layer_name(&n), Some((17, t.suffix())));
            assert_eq!(LayerTensor::from_suffix(t.suffix()), Some(t));
        }
        assert_eq!(split_layer_name("token_embd.weight"), None);
        assert_eq!(split_layer_name("blk.x.attn_q.weight"), None);
        assert_eq!(split_layer_name("blk..attn_q.weight"), None);
        assert_eq!(split_layer_name("blk.99999999999999999999999.a"), None);
    }
}
