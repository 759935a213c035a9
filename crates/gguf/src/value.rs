//! Metadata values: the thirteen GGUF value types, typed arrays, and the insertion-ordered key/value map
//! with accessors that turn a missing key or a wrong type into a typed error.

use crate::error::GgufError;
use std::collections::HashMap;

/// A metadata value type as GGUF numbers it (`gguf_type` in gguf.h).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    /// The type for an on-disk id, or `None` for an id GGUF does not define.
    pub fn from_id(id: u32) -> Option<ValueType> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// The on-disk id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// Short name used in error messages (`u32`, `string`, `array`, ...).
    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "u8",
            I8 => "i8",
            U16 => "u16",
            I16 => "i16",
            U32 => "u32",
            I32 => "i32",
            F32 => "f32",
            Bool => "bool",
            String => "string",
            Array => "array",
            U64 => "u64",
            I64 => "i64",
            F64 => "f64",
        }
    }

    /// Bytes one value occupies on disk when that is fixed (numbers and bool).
    pub fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// The fewest bytes one value can occupy on disk: a string is at least its u64 length, an array at
    /// least its u32 element type and u64 count. Used to reject counts before allocating for them.
    pub fn min_size(self) -> usize {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            t => t.fixed_size().unwrap_or(1),
        }
    }
}

impl std::fmt::Display for ValueType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Array),
}

/// A metadata array. GGUF arrays are homogeneous, so each is stored as a vector of its element type:
/// a 150k-entry vocabulary costs one `String` per entry and a score table one `f32` per entry, and an
/// empty array keeps its element type through a read/write round trip. Nested arrays may each have
/// their own element type.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F32(Vec<f32>),
    F64(Vec<f64>),
    Bool(Vec<bool>),
    String(Vec<String>),
    Array(Vec<Array>),
}

impl Value {
    /// This value's GGUF type.
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F32(_) => ValueType::F32,
            Value::F64(_) => ValueType::F64,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
        }
    }

    /// A short description of the type for error messages: `u32`, `string`, `array<f32>`.
    pub fn type_name(&self) -> String {
        match self {
            Value::Array(a) => format!("array<{}>", a.elem_type()),
            v => v.value_type().name().to_owned(),
        }
    }

    /// The value as a signed 128-bit integer if it is any integer type (lets callers range-check once).
    pub fn as_int(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// The value as `f64` if it is `f32` or `f64`.
    pub fn as_float(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => None,
        }
    }

    /// The string, if this is a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The bool, if this is a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The array, if this is an array.
    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl Array {
    /// The element type.
    pub fn elem_type(&self) -> ValueType {
        match self {
            Array::U8(_) => ValueType::U8,
            Array::I8(_) => ValueType::I8,
            Array::U16(_) => ValueType::U16,
            Array::I16(_) => ValueType::I16,
            Array::U32(_) => ValueType::U32,
            Array::I32(_) => ValueType::I32,
            Array::U64(_) => ValueType::U64,
            Array::I64(_) => ValueType::I64,
            Array::F32(_) => ValueType::F32,
            Array::F64(_) => ValueType::F64,
            Array::Bool(_) => ValueType::Bool,
            Array::String(_) => ValueType::String,
            Array::Array(_) => ValueType::Array,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::String(v) => v.len(),
            Array::Array(v) => v.len(),
        }
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` as a [`Value`] (cloned), or `None` past the end.
    pub fn get(&self, i: usize) -> Option<Value> {
        Some(match self {
            Array::U8(v) => Value::U8(*v.get(i)?),
            Array::I8(v) => Value::I8(*v.get(i)?),
            Array::U16(v) => Value::U16(*v.get(i)?),
            Array::I16(v) => Value::I16(*v.get(i)?),
            Array::U32(v) => Value::U32(*v.get(i)?),
            Array::I32(v) => Value::I32(*v.get(i)?),
            Array::U64(v) => Value::U64(*v.get(i)?),
            Array::I64(v) => Value::I64(*v.get(i)?),
            Array::F32(v) => Value::F32(*v.get(i)?),
            Array::F64(v) => Value::F64(*v.get(i)?),
            Array::Bool(v) => Value::Bool(*v.get(i)?),
            Array::String(v) => Value::String(v.get(i)?.clone()),
            Array::Array(v) => Value::Array(v.get(i)?.clone()),
        })
    }

    /// The elements as [`Value`]s (each cloned). For bulk access prefer the typed variants directly.
    pub fn iter(&self) -> impl Iterator<Item = Value> + '_ {
        (0..self.len()).filter_map(move |i| self.get(i))
    }

    /// Element `i` as an integer if the array holds an integer type.
    fn int_at(&self, i: usize) -> Option<i128> {
        Some(match self {
            Array::U8(v) => (*v.get(i)?).into(),
            Array::I8(v) => (*v.get(i)?).into(),
            Array::U16(v) => (*v.get(i)?).into(),
            Array::I16(v) => (*v.get(i)?).into(),
            Array::U32(v) => (*v.get(i)?).into(),
            Array::I32(v) => (*v.get(i)?).into(),
            Array::U64(v) => (*v.get(i)?).into(),
            Array::I64(v) => (*v.get(i)?).into(),
            _ => return None,
        })
    }

    fn is_integer(&self) -> bool {
        matches!(
            self,
            Array::U8(_)
                | Array::I8(_)
                | Array::U16(_)
                | Array::I16(_)
                | Array::U32(_)
                | Array::I32(_)
                | Array::U64(_)
                | Array::I64(_)
        )
    }
}

macro_rules! value_from {
    ($($t:ty => $v:ident),* $(,)?) => {$(
        impl From<$t> for Value {
            fn from(x: $t) -> Value { Value::$v(x) }
        }
        impl From<Vec<$t>> for Array {
            fn from(x: Vec<$t>) -> Array { Array::$v(x) }
        }
        impl From<Vec<$t>> for Value {
            fn from(x: Vec<$t>) -> Value { Value::Array(Array::$v(x)) }
        }
    )*};
}
value_from!(u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, u64 => U64, i64 => I64,
    f32 => F32, f64 => F64, bool => Bool, String => String);

impl From<&str> for Value {
    fn from(s: &str) -> Value {
        Value::String(s.to_owned())
    }
}

impl From<Vec<&str>> for Value {
    fn from(v: Vec<&str>) -> Value {
        Value::Array(Array::String(v.into_iter().map(str::to_owned).collect()))
    }
}

impl From<Array> for Value {
    fn from(a: Array) -> Value {
        Value::Array(a)
    }
}

impl From<Vec<Array>> for Value {
    fn from(v: Vec<Array>) -> Value {
        Value::Array(Array::Array(v))
    }
}

/// Insertion-ordered metadata: the key/value pairs of a GGUF file in file order, with O(1) lookup.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
}

fn wrong_type(key: &str, expected: &'static str, found: &Value) -> GgufError {
    GgufError::WrongType {
        key: key.to_owned(),
        expected,
        found: found.type_name(),
    }
}

fn out_of_range(key: &str, target: &'static str, value: impl std::fmt::Display) -> GgufError {
    GgufError::OutOfRange {
        key: key.to_owned(),
        target,
        value: value.to_string(),
    }
}

impl Metadata {
    /// An empty map.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Sets `key`. A new key goes at the end; an existing key keeps its position and gets the new value,
    /// which is returned with the old one.
    pub fn insert(&mut self, key: impl Into<String>, value: impl Into<Value>) -> Option<Value> {
        let key = key.into();
        let value = value.into();
        if let Some(&i) = self.index.get(&key) {
            if let Some(slot) = self.entries.get_mut(i) {
                return Some(std::mem::replace(&mut slot.1, value));
            }
        }
        self.index.insert(key.clone(), self.entries.len());
        self.entries.push((key, value));
        None
    }

    /// Removes `key`, keeping the order of the rest.
    pub fn remove(&mut self, key: &str) -> Option<Value> {
        let i = self.index.remove(key)?;
        if i >= self.entries.len() {
            return None;
        }
        let (_, v) = self.entries.remove(i);
        for idx in self.index.values_mut() {
            if *idx > i {
                *idx -= 1;
            }
        }
        Some(v)
    }

    /// Whether `key` is present.
    pub fn contains_key(&self, key: &str) -> bool {
        self.index.contains_key(key)
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index
            .get(key)
            .and_then(|&i| self.entries.get(i))
            .map(|(_, v)| v)
    }

    /// All pairs in insertion (file) order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// All keys in insertion order.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_str())
    }

    /// The value of `key`, or [`GgufError::KeyMissing`].
    pub fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::KeyMissing {
            key: key.to_owned(),
        })
    }

    fn int<T: TryFrom<i128>>(&self, key: &str, target: &'static str) -> Result<T, GgufError> {
        let v = self.require(key)?;
        let i = v.as_int().ok_or_else(|| wrong_type(key, target, v))?;
        T::try_from(i).map_err(|_| out_of_range(key, target, i))
    }

    /// An integer key as `u32`: any integer type is accepted if the value fits.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.int(key, "u32")
    }

    /// An integer key as `u64`: any integer type is accepted if the value fits.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        self.int(key, "u64")
    }

    /// An integer key as `i32`: any integer type is accepted if the value fits.
    pub fn get_i32(&self, key: &str) -> Result<i32, GgufError> {
        self.int(key, "i32")
    }

    /// An integer key as `i64`: any integer type is accepted if the value fits.
    pub fn get_i64(&self, key: &str) -> Result<i64, GgufError> {
        self.int(key, "i64")
    }

    /// An integer key as `usize`: any integer type is accepted if the value fits.
    pub fn get_usize(&self, key: &str) -> Result<usize, GgufError> {
        self.int(key, "usize")
    }

    /// A float key as `f32`: `f32` or `f64` (narrowed) is accepted.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_float()
            .map(|f| f as f32)
            .ok_or_else(|| wrong_type(key, "f32", v))
    }

    /// A float key as `f64`: `f32` or `f64` is accepted.
    pub fn get_f64(&self, key: &str) -> Result<f64, GgufError> {
        let v = self.require(key)?;
        v.as_float().ok_or_else(|| wrong_type(key, "f64", v))
    }

    /// A bool key.
    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| wrong_type(key, "bool", v))
    }

    /// A string key.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| wrong_type(key, "string", v))
    }

    /// An array key of any element type.
    pub fn get_array(&self, key: &str) -> Result<&Array, GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| wrong_type(key, "array", v))
    }

    /// A string-array key (e.g. `tokenizer.ggml.tokens`), borrowed without copying.
    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        let v = self.require(key)?;
        match v {
            Value::Array(Array::String(s)) => Ok(s),
            _ => Err(wrong_type(key, "array<string>", v)),
        }
    }

    /// A float-array key as `f32`s: `f32` arrays are copied, `f64` arrays narrowed.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        let v = self.require(key)?;
        match v {
            Value::Array(Array::F32(a)) => Ok(a.clone()),
            Value::Array(Array::F64(a)) => Ok(a.iter().map(|&x| x as f32).collect()),
            _ => Err(wrong_type(key, "array<f32>", v)),
        }
    }

    fn int_array<T: TryFrom<i128>>(
        &self,
        key: &str,
        target: &'static str,
    ) -> Result<Vec<T>, GgufError> {
        let v = self.require(key)?;
        let a = match v {
            Value::Array(a) if a.is_integer() => a,
            _ => return Err(wrong_type(key, target, v)),
        };
        let mut out = Vec::with_capacity(a.len());
        for i in 0..a.len() {
            let x = a.int_at(i).ok_or_else(|| wrong_type(key, target, v))?;
            let y = T::try_from(x).map_err(|_| GgufError::OutOfRange {
                key: format!("{key}[{i}]"),
                target,
                value: x.to_string(),
            })?;
            out.push(y);
        }
        Ok(out)
    }

    /// An integer-array key as `i32`s (any integer element type whose values fit).
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        self.int_array(key, "array<i32>")
    }

    /// An integer-array key as `u32`s (any integer element type whose values fit).
    pub fn get_u32_array(&self, key: &str) -> Result<Vec<u32>, GgufError> {
        self.int_array(key, "array<u32>")
    }

    /// An integer-array key as `u64`s (any integer element type whose values fit).
    pub fn get_u64_array(&self, key: &str) -> Result<Vec<u64>, GgufError> {
        self.int_array(key, "array<u64>")
    }

    fn opt<'a, T>(
        &'a self,
        key: &str,
        f: impl FnOnce(&'a Metadata, &str) -> Result<T, GgufError>,
    ) -> Result<Option<T>, GgufError> {
        if self.contains_key(key) {
            f(self, key).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Like [`Metadata::get_u32`], but a missing key is `Ok(None)`; a wrong type is still an error.
    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.opt(key, Metadata::get_u32)
    }

    /// Like [`Metadata::get_u64`], but a missing key is `Ok(None)`.
    pub fn opt_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.opt(key, Metadata::get_u64)
    }

    /// Like [`Metadata::get_i32`], but a missing key is `Ok(None)`.
    pub fn opt_i32(&self, key: &str) -> Result<Option<i32>, GgufError> {
        self.opt(key, Metadata::get_i32)
    }

    /// Like [`Metadata::get_i64`], but a missing key is `Ok(None)`.
    pub fn opt_i64(&self, key: &str) -> Result<Option<i64>, GgufError> {
        self.opt(key, Metadata::get_i64)
    }

    /// Like [`Metadata::get_f32`], but a missing key is `Ok(None)`.
    pub fn opt_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.opt(key, Metadata::get_f32)
    }

    /// Like [`Metadata::get_bool`], but a missing key is `Ok(None)`.
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.opt(key, Metadata::get_bool)
    }

    /// Like [`Metadata::get_str`], but a missing key is `Ok(None)`.
    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.opt(key, Metadata::get_str)
    }

    /// Like [`Metadata::get_str_array`], but a missing key is `Ok(None)`.
    pub fn opt_str_array(&self, key: &str) -> Result<Option<&[String]>, GgufError> {
        self.opt(key, Metadata::get_str_array)
    }

    /// Like [`Metadata::get_f32_array`], but a missing key is `Ok(None)`.
    pub fn opt_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        self.opt(key, Metadata::get_f32_array)
    }

    /// Like [`Metadata::get_i32_array`], but a missing key is `Ok(None)`.
    pub fn opt_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>, GgufError> {
        self.opt(key, Metadata::get_i32_array)
    }

    /// `general.architecture` (e.g. `llama`).
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.get_str("general.architecture")
    }
}

impl<K: Into<String>, V: Into<Value>> FromIterator<(K, V)> for Metadata {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Metadata {
        let mut m = Metadata::new();
        for (k, v) in iter {
            m.insert(k, v);
        }
        m
    }
}
