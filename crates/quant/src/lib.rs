//! Quantized block formats: dequantize, quantize, and CPU dot-product kernels.
pub mod blocks;
