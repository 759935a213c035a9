//! The GGUF reader: parses and validates the header, metadata and tensor table of a memory-mapped file
//! (or an owned buffer) so that afterwards every tensor's byte range is known to be sound.
//!
//! Layout (little-endian, versions 2 and 3 are identical on disk):
//! `"GGUF"`, u32 version, u64 tensor count, u64 key/value count, the key/value pairs (string key, u32
//! value type, value), the tensor infos (string name, u32 n_dims, n_dims × u64 dims, u32 ggml type,
//! u64 offset relative to the data section), zero padding to `general.alignment`, then the data section.

use crate::error::GgufError;
use crate::types::GgmlType;
use crate::value::{Array, Metadata, Value, ValueType};
use std::collections::HashMap;
use std::path::Path;

/// The alignment used when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The most dimensions a tensor may have (`GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// How deeply arrays may nest. GGUF allows arrays of arrays; a bound keeps a hostile file from
/// exhausting the stack through recursion.
pub const MAX_ARRAY_DEPTH: usize = 16;
/// Tensor names must be shorter than this many bytes for llama.cpp (`GGML_MAX_NAME`) to load the
/// file. The reader accepts longer names; the writer refuses them.
pub const GGML_MAX_NAME: usize = 64;
/// The key holding the data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

const MAGIC: [u8; 4] = *b"GGUF";
/// Smallest possible key/value pair: empty key (u64 length), u32 type, a one-byte value.
const MIN_KV_BYTES: usize = 8 + 4 + 1;
/// Smallest possible tensor info: empty name (u64 length), u32 n_dims = 0, u32 type, u64 offset.
const MIN_TENSOR_INFO_BYTES: usize = 8 + 4 + 4 + 8;

/// One entry of the tensor table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Shape in ggml order: `dims[0]` is the row length (the fastest-varying dimension).
    pub dims: Vec<u64>,
    /// Storage type.
    pub ty: GgmlType,
    /// Byte offset of the data, relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Number of elements (1 for a tensor with no dimensions). Saturates at `u64::MAX` on overflow,
    /// which cannot happen for an info read from a file (the reader rejects such shapes).
    pub fn n_elements(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }

    /// Bytes the data occupies. Saturates at `u64::MAX` when the shape overflows or is not a whole
    /// number of blocks per row, which cannot happen for an info read from a file.
    pub fn n_bytes(&self) -> u64 {
        tensor_n_bytes(&self.dims, self.ty).unwrap_or(u64::MAX)
    }

    /// The row length (`dims[0]`, or 1 for a tensor with no dimensions).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows: the product of all dimensions but the first.
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .unwrap_or(u64::MAX)
    }
}

/// Why a shape cannot be stored in a type.
pub(crate) enum ShapeError {
    TooManyDims,
    Overflow(&'static str),
    RowNotWholeBlocks { row: u64, block_size: u64 },
}

/// Validates a shape for a type and returns its byte size. The rules are ggml's: at most 4 dims, each
/// dim and the element count within `i64::MAX`, the row a whole number of blocks.
pub(crate) fn check_shape(dims: &[u64], ty: GgmlType) -> Result<u64, ShapeError> {
    if dims.len() > MAX_DIMS {
        return Err(ShapeError::TooManyDims);
    }
    let limit = i64::MAX as u64;
    let mut n: u64 = 1;
    for &d in dims {
        if d > limit {
            return Err(ShapeError::Overflow("a dimension exceeds i64::MAX"));
        }
        n = n
            .checked_mul(d)
            .filter(|&n| n <= limit)
            .ok_or(ShapeError::Overflow("element count exceeds i64::MAX"))?;
    }
    let row = dims.first().copied().unwrap_or(1);
    let bs = ty.block_size() as u64;
    if row % bs != 0 {
        return Err(ShapeError::RowNotWholeBlocks {
            row,
            block_size: bs,
        });
    }
    (n / bs)
        .checked_mul(ty.type_size() as u64)
        .filter(|&b| b <= limit)
        .ok_or(ShapeError::Overflow("byte size exceeds i64::MAX"))
}

fn tensor_n_bytes(dims: &[u64], ty: GgmlType) -> Option<u64> {
    check_shape(dims, ty).ok()
}

/// Rounds `x` up to a multiple of `align` (a power of two), or `None` on overflow.
pub(crate) fn align_up(x: u64, align: u64) -> Option<u64> {
    let mask = align.checked_sub(1)?;
    x.checked_add(mask).map(|v| v & !mask)
}

/// An owned copy of a file's bytes, 64-byte aligned so that tensor data inside it is as aligned as
/// in a memory map (callers may view F32 data as `&[f32]`).
struct AlignedBuf {
    chunks: Vec<Chunk>,
    len: usize,
}

#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(64))]
struct Chunk([u8; 64]);

impl AlignedBuf {
    fn new(src: &[u8]) -> AlignedBuf {
        let mut chunks = vec![Chunk([0; 64]); src.len().div_ceil(64)];
        let dst: &mut [u8] = bytemuck::cast_slice_mut(&mut chunks);
        if let Some(d) = dst.get_mut(..src.len()) {
            d.copy_from_slice(src);
        }
        AlignedBuf {
            chunks,
            len: src.len(),
        }
    }

    fn as_slice(&self) -> &[u8] {
        let all: &[u8] = bytemuck::cast_slice(&self.chunks);
        all.get(..self.len).unwrap_or(all)
    }
}

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(AlignedBuf),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(b) => b.as_slice(),
        }
    }
}

/// A parsed and validated GGUF file, backed by a memory map or an owned buffer.
///
/// Opening checks everything a later reader relies on: every tensor's data lies inside the file, is
/// aligned, matches its shape and type, and overlaps no other tensor. Tensor data is never copied.
pub struct GgufFile {
    storage: Storage,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("file_size", &self.file_size())
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| GgufError::io(Some(path), e))?;
        let len = file
            .metadata()
            .map_err(|e| GgufError::io(Some(path), e))?
            .len();
        if len == 0 {
            // Mapping an empty file fails on some systems; an empty buffer gives the proper error.
            return GgufFile::from_bytes(Vec::new());
        }
        // SAFETY: the map is read-only. Its contents may change only if another process writes or
        // truncates the file while it is mapped; like every mmap-based model loader (llama.cpp's
        // included) we require that model files are not modified while loaded.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| GgufError::io(Some(path), e))?;
        GgufFile::from_storage(Storage::Mmap(map))
    }

    /// Parses and validates a file held in memory (tests, fuzzing, small files). The bytes are copied
    /// into a 64-byte-aligned buffer.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        GgufFile::from_slice(&bytes)
    }

    /// Like [`GgufFile::from_bytes`] for borrowed bytes.
    pub fn from_slice(bytes: &[u8]) -> Result<GgufFile, GgufError> {
        // Parse before copying so that garbage is rejected without allocating a copy of it; the
        // parsed tables own their data, so they stay valid for the copy.
        let p = parse(bytes)?;
        Ok(GgufFile::build(Storage::Owned(AlignedBuf::new(bytes)), p))
    }

    fn from_storage(storage: Storage) -> Result<GgufFile, GgufError> {
        let p = parse(storage.bytes())?;
        Ok(GgufFile::build(storage, p))
    }

    fn build(storage: Storage, p: Parsed) -> GgufFile {
        let by_name = p
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        GgufFile {
            storage,
            version: p.version,
            metadata: p.metadata,
            tensors: p.tensors,
            by_name,
            alignment: p.alignment,
            data_offset: p.data_offset,
        }
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// The tensor table, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The exact bytes of a tensor of this file (validated at open). For a `TensorInfo` that does not
    /// come from this file the range is still bounds-checked: out-of-range yields an empty slice.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = self
            .data_offset
            .checked_add(t.offset)
            .and_then(|s| Some((s, s.checked_add(tensor_n_bytes(&t.dims, t.ty)?)?)))
            .and_then(|(s, e)| Some(usize::try_from(s).ok()?..usize::try_from(e).ok()?));
        range
            .and_then(|r| self.storage.bytes().get(r))
            .unwrap_or(&[])
    }

    /// The bytes of the tensor called `name`.
    pub fn tensor_data_by_name(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|t| self.tensor_data(t))
    }

    /// The data alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute byte offset of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// File size in bytes.
    pub fn file_size(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Whether the file is memory-mapped (as opposed to held in an owned buffer).
    pub fn is_mmapped(&self) -> bool {
        matches!(self.storage, Storage::Mmap(_))
    }
}

struct Parsed {
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

/// A bounds-checked cursor. Field names are passed as closures so they are only formatted on error
/// (a vocabulary has hundreds of thousands of strings).
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

type Field<'f> = &'f dyn Fn() -> String;

impl<'a> Cursor<'a> {
    fn file_size(&self) -> u64 {
        self.buf.len() as u64
    }

    fn pos(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, field: Field) -> Result<&'a [u8], GgufError> {
        let s = self
            .pos
            .checked_add(n)
            .and_then(|end| self.buf.get(self.pos..end))
            .ok_or_else(|| GgufError::Truncated {
                field: field(),
                offset: self.pos(),
                needed: n as u64,
                file_size: self.file_size(),
            })?;
        self.pos += n;
        Ok(s)
    }

    fn arr<const N: usize>(&mut self, field: Field) -> Result<[u8; N], GgufError> {
        let s = self.take(N, field)?;
        Ok(<[u8; N]>::try_from(s).unwrap_or([0; N]))
    }

    fn u32(&mut self, field: Field) -> Result<u32, GgufError> {
        self.arr(field).map(u32::from_le_bytes)
    }

    fn u64(&mut self, field: Field) -> Result<u64, GgufError> {
        self.arr(field).map(u64::from_le_bytes)
    }

    /// Rejects a count whose elements (each at least `min` bytes) cannot fit in what is left, and
    /// returns it as `usize` (which it then fits, being at most the file size).
    fn check_count(
        &self,
        count: u64,
        min: usize,
        unit: &'static str,
        at: u64,
        field: Field,
    ) -> Result<usize, GgufError> {
        let needed = count as u128 * min as u128;
        if needed > self.remaining() as u128 {
            return Err(GgufError::CountOverrun {
                field: field(),
                offset: at,
                count,
                unit,
                needed,
                available: self.remaining() as u64,
            });
        }
        usize::try_from(count).map_err(|_| GgufError::CountOverrun {
            field: field(),
            offset: at,
            count,
            unit,
            needed,
            available: self.remaining() as u64,
        })
    }

    fn string(&mut self, field: Field) -> Result<String, GgufError> {
        let at = self.pos();
        let len = self.u64(&|| format!("{} length", field()))?;
        let n = self.check_count(len, 1, "bytes", at, &|| format!("{} length", field()))?;
        let start = self.pos();
        let bytes = self.take(n, field)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(e) => Err(GgufError::InvalidUtf8 {
                field: field(),
                offset: start + e.valid_up_to() as u64,
            }),
        }
    }

    fn value_type(&mut self, field: Field) -> Result<ValueType, GgufError> {
        let at = self.pos();
        let id = self.u32(field)?;
        ValueType::from_id(id).ok_or_else(|| GgufError::UnknownValueType {
            field: field(),
            offset: at,
            type_id: id,
        })
    }

    fn value(&mut self, ty: ValueType, field: Field, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.arr(field)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.arr(field)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.arr(field)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.arr(field)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.arr(field)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.arr(field)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.arr(field)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.arr(field)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.arr(field)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.arr(field)?)),
            ValueType::Bool => {
                let at = self.pos();
                let [b] = self.arr(field)?;
                Value::Bool(bool_byte(b, at, field)?)
            }
            ValueType::String => Value::String(self.string(field)?),
            ValueType::Array => Value::Array(self.array(field, depth)?),
        })
    }

    fn array(&mut self, field: Field, depth: usize) -> Result<Array, GgufError> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(GgufError::NestingTooDeep {
                field: field(),
                offset: self.pos(),
                max_depth: MAX_ARRAY_DEPTH,
            });
        }
        let et = self.value_type(&|| format!("{} element type", field()))?;
        let at = self.pos();
        let count = self.u64(&|| format!("{} count", field()))?;
        let n = self.check_count(count, et.min_size(), "elements", at, &|| {
            format!("{} count", field())
        })?;

        macro_rules! numeric {
            ($variant:ident, $t:ty) => {{
                const SZ: usize = std::mem::size_of::<$t>();
                let bytes = self.take(n * SZ, field)?;
                Array::$variant(
                    bytes
                        .chunks_exact(SZ)
                        .map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or([0; SZ])))
                        .collect(),
                )
            }};
        }

        Ok(match et {
            ValueType::U8 => Array::U8(self.take(n, field)?.to_vec()),
            ValueType::I8 => numeric!(I8, i8),
            ValueType::U16 => numeric!(U16, u16),
            ValueType::I16 => numeric!(I16, i16),
            ValueType::U32 => numeric!(U32, u32),
            ValueType::I32 => numeric!(I32, i32),
            ValueType::U64 => numeric!(U64, u64),
            ValueType::I64 => numeric!(I64, i64),
            ValueType::F32 => numeric!(F32, f32),
            ValueType::F64 => numeric!(F64, f64),
            ValueType::Bool => {
                let start = self.pos();
                let bytes = self.take(n, field)?;
                let mut out = Vec::with_capacity(n);
                for (i, &b) in bytes.iter().enumerate() {
                    out.push(bool_byte(b, start + i as u64, &|| {
                        format!("{}[{i}]", field())
                    })?);
                }
                Array::Bool(out)
            }
            ValueType::String => {
                let mut out = Vec::with_capacity(n);
                for i in 0..n {
                    out.push(self.string(&|| format!("{}[{i}]", field()))?);
                }
                Array::String(out)
            }
            ValueType::Array => {
                let mut out = Vec::with_capacity(n);
                for i in 0..n {
                    out.push(self.array(&|| format!("{}[{i}]", field()), depth + 1)?);
                }
                Array::Array(out)
            }
        })
    }
}

fn bool_byte(b: u8, at: u64, field: Field) -> Result<bool, GgufError> {
    match b {
        0 => Ok(false),
        1 => Ok(true),
        byte => Err(GgufError::InvalidBool {
            field: field(),
            offset: at,
            byte,
        }),
    }
}

fn parse(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { buf, pos: 0 };

    let magic: [u8; 4] = c.arr(&|| "magic".into())?;
    if magic != MAGIC {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32(&|| "header.version".into())?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion { version, offset: 4 });
    }
    let n_tensors = c.u64(&|| "header.n_tensors".into())?;
    let n_kv = c.u64(&|| "header.n_kv".into())?;
    let n_kv = c.check_count(n_kv, MIN_KV_BYTES, "key/value pairs", 16, &|| {
        "header.n_kv".into()
    })?;
    // Every tensor info and kv pair must also fit: check both counts together before reading either.
    let needed =
        n_tensors as u128 * MIN_TENSOR_INFO_BYTES as u128 + n_kv as u128 * MIN_KV_BYTES as u128;
    if needed > c.remaining() as u128 {
        return Err(GgufError::CountOverrun {
            field: "header.n_tensors".into(),
            offset: 8,
            count: n_tensors,
            unit: "tensor infos",
            needed,
            available: c.remaining() as u64,
        });
    }

    let mut metadata = Metadata::new();
    let mut alignment = DEFAULT_ALIGNMENT;
    for i in 0..n_kv {
        let key_at = c.pos();
        let key = c.string(&|| format!("kv[{i}].key"))?;
        if key.is_empty() {
            return Err(GgufError::EmptyKey {
                index: i as u64,
                offset: key_at,
            });
        }
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey {
                key,
                offset: key_at,
            });
        }
        let ty = c.value_type(&|| format!("kv[{i}] '{key}' type"))?;
        let value_at = c.pos();
        let value = c.value(ty, &|| format!("kv[{i}] '{key}'"), 0)?;
        if key == ALIGNMENT_KEY {
            alignment = match value {
                Value::U32(a) if a.is_power_of_two() => u64::from(a),
                Value::U32(a) => {
                    return Err(GgufError::BadAlignment {
                        offset: value_at,
                        detail: format!("{a} is not a non-zero power of two"),
                    })
                }
                ref v => {
                    return Err(GgufError::BadAlignment {
                        offset: value_at,
                        detail: format!("stored as {}, must be u32", v.type_name()),
                    })
                }
            };
        }
        metadata.insert(key, value);
    }

    let n_tensors = c.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, "tensor infos", 8, &|| {
        "header.n_tensors".into()
    })?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(n_tensors);
    let mut names: HashMap<String, ()> = HashMap::with_capacity(n_tensors);
    // Where each tensor's offset field lies, for errors found after the table is read.
    let mut offset_fields: Vec<u64> = Vec::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let name_at = c.pos();
        let name = c.string(&|| format!("tensor_info[{i}].name"))?;
        if names.contains_key(&name) {
            return Err(GgufError::DuplicateTensor {
                name,
                offset: name_at,
            });
        }
        let nd_at = c.pos();
        let n_dims = c.u32(&|| format!("tensor_info[{i}] '{name}' n_dims"))?;
        if n_dims as usize > MAX_DIMS {
            return Err(GgufError::TooManyDims {
                tensor: name,
                offset: nd_at,
                n_dims,
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for j in 0..n_dims {
            dims.push(c.u64(&|| format!("tensor_info[{i}] '{name}' dims[{j}]"))?);
        }
        let ty_at = c.pos();
        let type_id = c.u32(&|| format!("tensor_info[{i}] '{name}' type"))?;
        let ty = GgmlType::from_id(type_id).ok_or_else(|| GgufError::UnknownTensorType {
            tensor: name.clone(),
            offset: ty_at,
            type_id,
        })?;
        let off_at = c.pos();
        let offset = c.u64(&|| format!("tensor_info[{i}] '{name}' offset"))?;
        match check_shape(&dims, ty) {
            Ok(_) => {}
            Err(ShapeError::TooManyDims) => {
                return Err(GgufError::TooManyDims {
                    tensor: name,
                    offset: nd_at,
                    n_dims,
                })
            }
            Err(ShapeError::Overflow(what)) => {
                return Err(GgufError::ElementCountOverflow {
                    tensor: name,
                    offset: nd_at,
                    dims,
                    what,
                })
            }
            Err(ShapeError::RowNotWholeBlocks { row, block_size }) => {
                return Err(GgufError::TensorShapeMismatch {
                    tensor: name,
                    offset: nd_at,
                    ty,
                    row,
                    block_size,
                })
            }
        }
        if offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                tensor: name,
                offset: off_at,
                tensor_offset: offset,
                alignment,
            });
        }
        names.insert(name.clone(), ());
        offset_fields.push(off_at);
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
        });
    }

    let file_size = c.file_size();
    // The padding after the tensor table may be missing in a file without tensors; with tensors,
    // the bounds check below catches a data section that starts past the end.
    let data_offset = align_up(c.pos(), alignment).unwrap_or(u64::MAX);

    let field_at = |i: usize| offset_fields.get(i).copied().unwrap_or(0);
    let mut ranges: Vec<(u64, u64, usize)> = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        let n_bytes = tensor_n_bytes(&t.dims, t.ty).unwrap_or(u64::MAX);
        // u128 cannot overflow here: each term is below 2^64.
        let start = u128::from(data_offset) + u128::from(t.offset);
        let end = start + u128::from(n_bytes);
        if end > u128::from(file_size) {
            return Err(GgufError::TensorOutOfBounds {
                tensor: t.name.clone(),
                offset: field_at(i),
                start,
                end,
                file_size,
            });
        }
        // Both fit in u64 now, being at most the file size.
        ranges.push((start as u64, end as u64, i));
    }
    ranges.sort_unstable();
    let mut furthest: Option<(u64, u64, usize)> = None;
    for &(s, e, i) in &ranges {
        if s == e {
            continue; // an empty tensor occupies no bytes
        }
        if let Some((ps, pe, pi)) = furthest {
            if s < pe {
                let name = |k: usize| tensors.get(k).map(|t| t.name.clone()).unwrap_or_default();
                return Err(GgufError::TensorOverlap {
                    tensor: name(i),
                    offset: field_at(i),
                    start: s,
                    end: e,
                    other: name(pi),
                    other_start: ps,
                    other_end: pe,
                });
            }
        }
        if furthest.is_none_or(|(_, pe, _)| e > pe) {
            furthest = Some((s, e, i));
        }
    }

    Ok(Parsed {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}
