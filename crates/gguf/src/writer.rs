//! GGUF writers (version 3, little-endian): an in-memory [`GgufWriter`] for small files and tests, and
//! a [`StreamingWriter`] that writes the header up front and then takes each tensor's bytes in order,
//! so multi-gigabyte files never have to be held in memory.
//!
//! Every tensor's data is padded to the alignment, the last one included, as gguf-py and llama.cpp do.

use crate::error::GgufError;
use crate::reader::{
    align_up, check_shape, ShapeError, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGML_MAX_NAME,
    MAX_ARRAY_DEPTH,
};
use crate::types::GgmlType;
use crate::value::{Array, Metadata, Value};
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The version this crate writes.
pub const WRITE_VERSION: u32 = 3;

/// A tensor to be written: its name, shape (ggml order, `dims[0]` = row length) and type.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDecl {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorDecl {
    /// A declaration.
    pub fn new(name: impl Into<String>, dims: &[u64], ty: GgmlType) -> TensorDecl {
        TensorDecl {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
        }
    }

    /// The byte size its data must have, or an error if the shape cannot be stored in the type.
    pub fn n_bytes(&self) -> Result<u64, GgufError> {
        check_shape(&self.dims, self.ty).map_err(|e| {
            let why = match e {
                ShapeError::TooManyDims => format!("{} dimensions (at most 4)", self.dims.len()),
                ShapeError::Overflow(what) => what.to_owned(),
                ShapeError::RowNotWholeBlocks { row, block_size } => format!(
                    "row length {row} is not a multiple of the {} block size {block_size}",
                    self.ty
                ),
            };
            GgufError::InvalidWrite {
                reason: format!("tensor '{}' with shape {:?}: {why}", self.name, self.dims),
            }
        })
    }
}

impl From<&TensorInfo> for TensorDecl {
    fn from(t: &TensorInfo) -> TensorDecl {
        TensorDecl {
            name: t.name.clone(),
            dims: t.dims.clone(),
            ty: t.ty,
        }
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value, key: &str) -> Result<(), GgufError> {
    match v {
        Value::U8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(b) => out.push(u8::from(*b)),
        Value::String(s) => put_str(out, s),
        Value::Array(a) => put_array(out, a, key, 0)?,
    }
    Ok(())
}

fn put_array(out: &mut Vec<u8>, a: &Array, key: &str, depth: usize) -> Result<(), GgufError> {
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::InvalidWrite {
            reason: format!("key '{key}': arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
        });
    }
    out.extend_from_slice(&a.elem_type().id().to_le_bytes());
    out.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! nums {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => nums!(v),
        Array::U16(v) => nums!(v),
        Array::I16(v) => nums!(v),
        Array::U32(v) => nums!(v),
        Array::I32(v) => nums!(v),
        Array::U64(v) => nums!(v),
        Array::I64(v) => nums!(v),
        Array::F32(v) => nums!(v),
        Array::F64(v) => nums!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => {
            for s in v {
                put_str(out, s);
            }
        }
        Array::Array(v) => {
            for inner in v {
                put_array(out, inner, key, depth + 1)?;
            }
        }
    }
    Ok(())
}

/// The alignment a metadata map asks for, validated the way the reader will check it.
fn alignment_of(metadata: &Metadata) -> Result<u64, GgufError> {
    match metadata.get(ALIGNMENT_KEY) {
        None => Ok(DEFAULT_ALIGNMENT),
        Some(Value::U32(a)) if a.is_power_of_two() => Ok(u64::from(*a)),
        Some(v) => Err(GgufError::InvalidWrite {
            reason: format!("{ALIGNMENT_KEY} must be a u32 power of two, got {v:?}"),
        }),
    }
}

/// Serialises header, metadata, tensor table and the padding before the data section. Returns the
/// bytes, each tensor's data size, and the alignment.
fn layout(
    metadata: &Metadata,
    tensors: &[TensorDecl],
) -> Result<(Vec<u8>, Vec<u64>, u64), GgufError> {
    let alignment = alignment_of(metadata)?;
    let mut sizes = Vec::with_capacity(tensors.len());
    let mut seen = HashSet::with_capacity(tensors.len());
    for t in tensors {
        if t.name.len() >= GGML_MAX_NAME {
            return Err(GgufError::InvalidWrite {
                reason: format!(
                    "tensor name '{}' is {} bytes; llama.cpp needs names shorter than {GGML_MAX_NAME}",
                    t.name,
                    t.name.len()
                ),
            });
        }
        if !seen.insert(t.name.as_str()) {
            return Err(GgufError::InvalidWrite {
                reason: format!("duplicate tensor name '{}'", t.name),
            });
        }
        sizes.push(t.n_bytes()?);
    }

    let mut out = Vec::new();
    out.extend_from_slice(b"GGUF");
    out.extend_from_slice(&WRITE_VERSION.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(metadata.len() as u64).to_le_bytes());
    for (k, v) in metadata.iter() {
        if k.is_empty() {
            return Err(GgufError::InvalidWrite {
                reason: "empty metadata key".into(),
            });
        }
        put_str(&mut out, k);
        out.extend_from_slice(&v.value_type().id().to_le_bytes());
        put_value(&mut out, v, k)?;
    }
    let mut offset = 0u64;
    for (t, &size) in tensors.iter().zip(&sizes) {
        put_str(&mut out, &t.name);
        out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&t.ty.id().to_le_bytes());
        out.extend_from_slice(&offset.to_le_bytes());
        offset = offset
            .checked_add(size)
            .and_then(|o| align_up(o, alignment))
            .ok_or_else(|| GgufError::InvalidWrite {
                reason: "total tensor data size overflows u64".into(),
            })?;
    }
    let padded = align_up(out.len() as u64, alignment).unwrap_or(out.len() as u64);
    out.resize(padded as usize, 0);
    Ok((out, sizes, alignment))
}

/// Builds a GGUF file in memory: metadata in insertion order, tensors in the order added.
#[derive(Clone, Debug, Default)]
pub struct GgufWriter {
    metadata: Metadata,
    tensors: Vec<(TensorDecl, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file (alignment 32, no metadata, no tensors).
    pub fn new() -> GgufWriter {
        GgufWriter::default()
    }

    /// Starts from existing metadata (e.g. copied from another file).
    pub fn with_metadata(metadata: Metadata) -> GgufWriter {
        GgufWriter {
            metadata,
            tensors: Vec::new(),
        }
    }

    /// The metadata so far.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// Mutable access to the metadata.
    pub fn metadata_mut(&mut self) -> &mut Metadata {
        &mut self.metadata
    }

    /// Sets a key. Setting a key again replaces its value in place (as gguf-py does).
    pub fn add_kv(&mut self, key: impl Into<String>, value: impl Into<Value>) -> &mut GgufWriter {
        self.metadata.insert(key, value);
        self
    }

    /// Sets `general.alignment` (a power of two; checked when writing).
    pub fn set_alignment(&mut self, alignment: u32) -> &mut GgufWriter {
        self.metadata.insert(ALIGNMENT_KEY, Value::U32(alignment));
        self
    }

    /// Adds a tensor. Fails if the name is taken or `data` is not exactly the size the shape and type
    /// need.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: impl Into<Vec<u8>>,
    ) -> Result<&mut GgufWriter, GgufError> {
        let decl = TensorDecl::new(name, dims, ty);
        let data = data.into();
        if self.tensors.iter().any(|(t, _)| t.name == decl.name) {
            return Err(GgufError::InvalidWrite {
                reason: format!("duplicate tensor name '{}'", decl.name),
            });
        }
        let expected = decl.n_bytes()?;
        if expected != data.len() as u64 {
            return Err(GgufError::TensorDataSize {
                tensor: decl.name,
                expected,
                got: data.len() as u64,
            });
        }
        self.tensors.push((decl, data));
        Ok(self)
    }

    /// Adds an F32 tensor from values (stored little-endian).
    pub fn add_tensor_f32(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        values: &[f32],
    ) -> Result<&mut GgufWriter, GgufError> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.add_tensor(name, dims, GgmlType::F32, bytes)
    }

    /// The declared tensors, in order.
    pub fn tensor_decls(&self) -> impl Iterator<Item = &TensorDecl> {
        self.tensors.iter().map(|(t, _)| t)
    }

    /// Writes the file to `out`.
    pub fn write_to<W: Write>(&self, out: W) -> Result<W, GgufError> {
        let decls: Vec<TensorDecl> = self.tensors.iter().map(|(t, _)| t.clone()).collect();
        let mut w = StreamingWriter::new(out, &self.metadata, decls)?;
        for (t, data) in &self.tensors {
            w.write_tensor(&t.name, data)?;
        }
        w.finish()
    }

    /// Writes the file to `path` (created or truncated).
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        let decls: Vec<TensorDecl> = self.tensors.iter().map(|(t, _)| t.clone()).collect();
        let mut w = StreamingWriter::create(path, &self.metadata, decls)?;
        for (t, data) in &self.tensors {
            w.write_tensor(&t.name, data)?;
        }
        w.finish().map(drop)
    }

    /// The file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        self.write_to(Vec::new())
    }
}

/// Writes a GGUF file whose tensor table is known up front, taking each tensor's bytes in declared
/// order. Memory use is the header plus whatever the caller holds.
///
/// ```
/// # use gguf::{GgmlType, Metadata, StreamingWriter, TensorDecl};
/// let mut md = Metadata::new();
/// md.insert("general.architecture", "llama");
/// let decls = vec![TensorDecl::new("a", &[4], GgmlType::F32), TensorDecl::new("b", &[2], GgmlType::F16)];
/// let mut w = StreamingWriter::new(Vec::new(), &md, decls)?;
/// w.write_tensor("a", &[0u8; 16])?;
/// let mut sink = w.begin_tensor("b")?;
/// std::io::Write::write_all(&mut sink, &[0u8; 4]).unwrap();
/// sink.finish()?;
/// let bytes = w.finish()?;
/// assert_eq!(gguf::GgufFile::from_bytes(bytes)?.tensors().len(), 2);
/// # Ok::<(), gguf::GgufError>(())
/// ```
pub struct StreamingWriter<W: Write> {
    out: W,
    path: Option<PathBuf>,
    tensors: Vec<TensorDecl>,
    sizes: Vec<u64>,
    alignment: u64,
    /// Index of the next tensor to be written.
    next: usize,
    /// Bytes of the current tensor written so far, while a [`TensorSink`] is (or was left) open.
    partial: Option<u64>,
    /// Bytes written to `out` in total.
    pos: u64,
}

impl StreamingWriter<std::io::BufWriter<std::fs::File>> {
    /// Creates (or truncates) `path` and writes the header and tensor table.
    pub fn create(
        path: impl AsRef<Path>,
        metadata: &Metadata,
        tensors: Vec<TensorDecl>,
    ) -> Result<Self, GgufError> {
        let path = path.as_ref();
        // Validate before touching the file system, so a bad declaration leaves no stray file.
        layout(metadata, &tensors)?;
        let file = std::fs::File::create(path).map_err(|e| GgufError::io(Some(path), e))?;
        let mut w = StreamingWriter::new(
            std::io::BufWriter::with_capacity(1 << 20, file),
            metadata,
            tensors,
        )?;
        w.path = Some(path.to_path_buf());
        Ok(w)
    }
}

impl<W: Write> StreamingWriter<W> {
    /// Writes the header and tensor table to `out`.
    pub fn new(
        mut out: W,
        metadata: &Metadata,
        tensors: Vec<TensorDecl>,
    ) -> Result<Self, GgufError> {
        let (header, sizes, alignment) = layout(metadata, &tensors)?;
        out.write_all(&header).map_err(|e| GgufError::io(None, e))?;
        Ok(StreamingWriter {
            out,
            path: None,
            tensors,
            sizes,
            alignment,
            next: 0,
            partial: None,
            pos: header.len() as u64,
        })
    }

    fn io(&self, e: std::io::Error) -> GgufError {
        GgufError::io(self.path.as_deref(), e)
    }

    /// The declared tensors.
    pub fn tensors(&self) -> &[TensorDecl] {
        &self.tensors
    }

    /// The tensor whose bytes are expected next, or `None` when all are written.
    pub fn next_tensor(&self) -> Option<&TensorDecl> {
        self.tensors.get(self.next)
    }

    /// Total bytes written so far.
    pub fn bytes_written(&self) -> u64 {
        self.pos
    }

    fn expect(&self, name: &str) -> Result<u64, GgufError> {
        if let Some(done) = self.partial {
            return Err(GgufError::TensorOrder {
                expected: format!(
                    "the rest of tensor '{}' ({done} of {} bytes written)",
                    self.tensors.get(self.next).map_or("?", |t| t.name.as_str()),
                    self.sizes.get(self.next).copied().unwrap_or(0)
                ),
                got: format!("tensor '{name}'"),
            });
        }
        match self.tensors.get(self.next) {
            Some(t) if t.name == name => Ok(self.sizes.get(self.next).copied().unwrap_or(0)),
            Some(t) => Err(GgufError::TensorOrder {
                expected: format!("tensor '{}'", t.name),
                got: format!("tensor '{name}'"),
            }),
            None => Err(GgufError::TensorOrder {
                expected: "no more tensors".into(),
                got: format!("tensor '{name}'"),
            }),
        }
    }

    fn pad(&mut self) -> Result<(), GgufError> {
        let target = align_up(self.pos, self.alignment).unwrap_or(self.pos);
        let zeros = [0u8; 64];
        while self.pos < target {
            let n = ((target - self.pos) as usize).min(zeros.len());
            self.out
                .write_all(zeros.get(..n).unwrap_or(&[]))
                .map_err(|e| self.io(e))?;
            self.pos += n as u64;
        }
        Ok(())
    }

    /// Writes the whole data of the next tensor, which must be called `name` and be exactly its size.
    pub fn write_tensor(&mut self, name: &str, data: &[u8]) -> Result<(), GgufError> {
        let expected = self.expect(name)?;
        if expected != data.len() as u64 {
            return Err(GgufError::TensorDataSize {
                tensor: name.to_owned(),
                expected,
                got: data.len() as u64,
            });
        }
        self.out.write_all(data).map_err(|e| self.io(e))?;
        self.pos += data.len() as u64;
        self.pad()?;
        self.next += 1;
        Ok(())
    }

    /// Starts the next tensor, which must be called `name`; its bytes are then written through the
    /// returned sink in as many pieces as convenient, and [`TensorSink::finish`] checks the total.
    pub fn begin_tensor(&mut self, name: &str) -> Result<TensorSink<'_, W>, GgufError> {
        let expected = self.expect(name)?;
        self.partial = Some(0);
        Ok(TensorSink {
            w: self,
            expected,
            written: 0,
        })
    }

    /// Checks every declared tensor was written, flushes, and returns the underlying writer.
    pub fn finish(mut self) -> Result<W, GgufError> {
        if let Some(t) = self.tensors.get(self.next) {
            return Err(GgufError::TensorOrder {
                expected: format!(
                    "tensor '{}' ({} of {} tensors written)",
                    t.name,
                    self.next,
                    self.tensors.len()
                ),
                got: "finish".into(),
            });
        }
        self.out.flush().map_err(|e| self.io(e))?;
        Ok(self.out)
    }
}

/// The data of one tensor being streamed; see [`StreamingWriter::begin_tensor`]. Writing more bytes
/// than the tensor has is an error; dropping the sink without [`TensorSink::finish`] leaves the
/// writer refusing further tensors.
pub struct TensorSink<'a, W: Write> {
    w: &'a mut StreamingWriter<W>,
    expected: u64,
    written: u64,
}

impl<W: Write> TensorSink<'_, W> {
    /// Bytes still expected.
    pub fn remaining(&self) -> u64 {
        self.expected - self.written
    }

    /// Checks the size, pads to the alignment and moves on to the next tensor.
    pub fn finish(self) -> Result<(), GgufError> {
        if self.written != self.expected {
            return Err(GgufError::TensorDataSize {
                tensor: self
                    .w
                    .tensors
                    .get(self.w.next)
                    .map(|t| t.name.clone())
                    .unwrap_or_default(),
                expected: self.expected,
                got: self.written,
            });
        }
        self.w.pad()?;
        self.w.partial = None;
        self.w.next += 1;
        Ok(())
    }
}

impl<W: Write> Write for TensorSink<'_, W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if buf.len() as u64 > self.remaining() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!(
                    "{} bytes written to a tensor with {} bytes left",
                    buf.len(),
                    self.remaining()
                ),
            ));
        }
        let n = self.w.out.write(buf)?;
        self.written += n as u64;
        self.w.pos += n as u64;
        self.w.partial = Some(self.written);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.w.out.flush()
    }
}
