//! Quantized block formats: dequantize, quantize, and CPU dot-product kernels.
pub mod blocks;
pub mod dequant;
pub mod dot;
pub mod error;
pub mod float16;
pub mod kquants;
pub mod quantize;
mod raw;

pub use dequant::{can_dequantize, dequantize, dequantize_serial, dequantize_to_vec};
pub use error::QuantError;
pub use quantize::{can_quantize, quantize, quantize_serial, quantize_to_vec};
