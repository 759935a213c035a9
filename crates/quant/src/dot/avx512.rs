//! AVX-512 kernels. For now the AVX-512 level runs the AVX2 kernels (correct on every
//! AVX-512 machine); the 512-bit VNNI tiles replace them type by type.

use gguf::GgmlType;

use super::kernels::Kernel;

/// The AVX-512 kernel for `ty`.
pub(crate) fn kernel(ty: GgmlType) -> Option<Kernel> {
    super::avx2::kernel(ty)
}
