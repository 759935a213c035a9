//! The JSON description format shared with scripts/check_gguf_with_gguf_py.py (see its docstring):
//! conversions between it and this crate's types.

use gguf::{Array, GgmlType, GgufFile, GgufWriter, Metadata, Value};
use serde_json::{json, Value as J};

fn type_name(v: &Value) -> &'static str {
    v.value_type().name()
}

fn array_desc(a: &Array) -> J {
    let values: Vec<J> = match a {
        Array::U8(v) => v.iter().map(|&x| json!(x)).collect(),
        Array::I8(v) => v.iter().map(|&x| json!(x)).collect(),
        Array::U16(v) => v.iter().map(|&x| json!(x)).collect(),
        Array::I16(v) => v.iter().map(|&x| json!(x)).collect(),
        Array::U32(v) => v.iter().map(|&x| json!(x)).collect(),
        Array::I32(v) => v.iter().map(|&x| json!(x)).collect(),
        Array::U64(v) => v.iter().map(|&x| json!(x)).collect(),
        Array::I64(v) => v.iter().map(|&x| json!(x)).collect(),
        Array::F32(v) => v.iter().map(|&x| json!(x.to_bits())).collect(),
        Array::F64(v) => v.iter().map(|&x| json!(x.to_bits())).collect(),
        Array::Bool(v) => v.iter().map(|&x| json!(x)).collect(),
        Array::String(v) => v.iter().map(|x| json!(x)).collect(),
        Array::Array(v) => v.iter().map(array_desc).collect(),
    };
    json!({"type": "array", "elem": a.elem_type().name(), "value": values})
}

/// A value in description form (without the key).
pub fn value_desc(v: &Value) -> J {
    let value = match v {
        Value::U8(x) => json!(x),
        Value::I8(x) => json!(x),
        Value::U16(x) => json!(x),
        Value::I16(x) => json!(x),
        Value::U32(x) => json!(x),
        Value::I32(x) => json!(x),
        Value::U64(x) => json!(x),
        Value::I64(x) => json!(x),
        Value::F32(x) => json!(x.to_bits()),
        Value::F64(x) => json!(x.to_bits()),
        Value::Bool(x) => json!(x),
        Value::String(x) => json!(x),
        Value::Array(a) => return array_desc(a),
    };
    json!({"type": type_name(v), "value": value})
}

fn bad(what: &str, j: &J) -> String {
    format!("bad description {what}: {j}")
}

fn int<T: TryFrom<i128>>(j: &J) -> Result<T, String> {
    let i: i128 = if let Some(u) = j.as_u64() {
        u.into()
    } else if let Some(i) = j.as_i64() {
        i.into()
    } else {
        return Err(bad("integer", j));
    };
    T::try_from(i).map_err(|_| bad("integer range", j))
}

fn items<T>(j: &J, f: impl Fn(&J) -> Result<T, String>) -> Result<Vec<T>, String> {
    j.as_array()
        .ok_or_else(|| bad("array", j))?
        .iter()
        .map(f)
        .collect()
}

fn array_from_desc(j: &J) -> Result<Array, String> {
    let elem = j["elem"].as_str().ok_or_else(|| bad("elem", j))?;
    let v = &j["value"];
    Ok(match elem {
        "u8" => Array::U8(items(v, int)?),
        "i8" => Array::I8(items(v, int)?),
        "u16" => Array::U16(items(v, int)?),
        "i16" => Array::I16(items(v, int)?),
        "u32" => Array::U32(items(v, int)?),
        "i32" => Array::I32(items(v, int)?),
        "u64" => Array::U64(items(v, int)?),
        "i64" => Array::I64(items(v, int)?),
        "f32" => Array::F32(items(v, |x| int(x).map(f32::from_bits))?),
        "f64" => Array::F64(items(v, |x| int(x).map(f64::from_bits))?),
        "bool" => Array::Bool(items(v, |x| x.as_bool().ok_or_else(|| bad("bool", x)))?),
        "string" => Array::String(items(v, |x| {
            x.as_str()
                .map(str::to_owned)
                .ok_or_else(|| bad("string", x))
        })?),
        "array" => Array::Array(items(v, array_from_desc)?),
        _ => return Err(bad("elem type", j)),
    })
}

/// A value from description form.
pub fn value_from_desc(j: &J) -> Result<Value, String> {
    let v = &j["value"];
    Ok(match j["type"].as_str().ok_or_else(|| bad("type", j))? {
        "u8" => Value::U8(int(v)?),
        "i8" => Value::I8(int(v)?),
        "u16" => Value::U16(int(v)?),
        "i16" => Value::I16(int(v)?),
        "u32" => Value::U32(int(v)?),
        "i32" => Value::I32(int(v)?),
        "u64" => Value::U64(int(v)?),
        "i64" => Value::I64(int(v)?),
        "f32" => Value::F32(f32::from_bits(int(v)?)),
        "f64" => Value::F64(f64::from_bits(int(v)?)),
        "bool" => Value::Bool(v.as_bool().ok_or_else(|| bad("bool", j))?),
        "string" => Value::String(v.as_str().ok_or_else(|| bad("string", j))?.to_owned()),
        "array" => Value::Array(array_from_desc(j)?),
        _ => return Err(bad("type", j)),
    })
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

pub fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if s.len() % 2 != 0 {
        return Err(format!("odd hex length {}", s.len()));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| {
            s.get(i..i + 2)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad hex at {i}"))
        })
        .collect()
}

/// Lists every difference between a parsed file and a description.
pub fn compare(f: &GgufFile, d: &J) -> Vec<String> {
    let mut errs = Vec::new();
    let mut eq = |what: String, got: J, want: &J| {
        if &got != want {
            errs.push(format!("{what}: read {got}, expected {want}"));
        }
    };
    eq("version".into(), json!(f.version()), &d["version"]);
    eq("alignment".into(), json!(f.alignment()), &d["alignment"]);
    eq(
        "data_offset".into(),
        json!(f.data_offset()),
        &d["data_offset"],
    );
    eq("file_size".into(), json!(f.file_size()), &d["file_size"]);
    let keys: Vec<&str> = f.metadata().keys().collect();
    let want_keys: Vec<J> = d["kv"]
        .as_array()
        .map(|a| a.iter().map(|kv| kv["key"].clone()).collect())
        .unwrap_or_default();
    eq("key order".into(), json!(keys), &J::Array(want_keys));
    for kv in d["kv"].as_array().into_iter().flatten() {
        let key = kv["key"].as_str().unwrap_or_default();
        let mut want = kv.clone();
        if let Some(o) = want.as_object_mut() {
            o.remove("key");
        }
        let got = f.metadata().get(key).map(value_desc).unwrap_or(J::Null);
        eq(format!("key {key}"), got, &want);
    }
    let want_t = d["tensors"].as_array().cloned().unwrap_or_default();
    eq(
        "tensor count".into(),
        json!(f.tensors().len()),
        &json!(want_t.len()),
    );
    for (t, w) in f.tensors().iter().zip(&want_t) {
        let n = &t.name;
        eq(format!("tensor {n} name"), json!(n), &w["name"]);
        eq(format!("tensor {n} dims"), json!(t.dims), &w["dims"]);
        eq(format!("tensor {n} type"), json!(t.ty.id()), &w["type"]);
        eq(format!("tensor {n} offset"), json!(t.offset), &w["offset"]);
        eq(
            format!("tensor {n} n_bytes"),
            json!(t.n_bytes()),
            &w["n_bytes"],
        );
        eq(
            format!("tensor {n} data"),
            json!(hex(f.tensor_data(t))),
            &w["data_hex"],
        );
        // The by-name lookup must agree with the table.
        eq(
            format!("tensor {n} lookup"),
            json!(f.tensor(n) == Some(t)),
            &json!(true),
        );
    }
    errs
}

/// A writer holding exactly what a description describes (metadata in order, tensors in order).
pub fn writer_from_desc(d: &J) -> Result<GgufWriter, String> {
    let mut md = Metadata::new();
    for kv in d["kv"].as_array().ok_or("no kv")? {
        let key = kv["key"].as_str().ok_or("no key")?;
        md.insert(key, value_from_desc(kv)?);
    }
    let mut w = GgufWriter::with_metadata(md);
    for t in d["tensors"].as_array().ok_or("no tensors")? {
        let name = t["name"].as_str().ok_or("no name")?;
        let dims: Vec<u64> = items(&t["dims"], int)?;
        let ty = GgmlType::from_id(int(&t["type"])?).ok_or("bad type")?;
        let data = unhex(t["data_hex"].as_str().ok_or("no data")?)?;
        w.add_tensor(name, &dims, ty, data)
            .map_err(|e| e.to_string())?;
    }
    Ok(w)
}

/// The description of what a writer will write, computed from the writer's inputs alone (offsets from
/// the format's packing rule, not from reading the file back).
pub fn desc_of_writer(w: &GgufWriter, tensors: &[(String, Vec<u64>, GgmlType, Vec<u8>)]) -> J {
    let align = w.metadata().get_u32("general.alignment").unwrap_or(32) as u64;
    let pad = |x: u64| x.div_ceil(align) * align;
    // header: magic, version, counts
    let mut pos = 4 + 4 + 8 + 8u64;
    for (k, v) in w.metadata().iter() {
        pos += 8 + k.len() as u64 + 4 + encoded_len(v);
    }
    for (name, dims, _, _) in tensors {
        pos += 8 + name.len() as u64 + 4 + 8 * dims.len() as u64 + 4 + 8;
    }
    let data_offset = pad(pos);
    let mut off = 0u64;
    let mut tdesc = Vec::new();
    for (name, dims, ty, data) in tensors {
        tdesc.push(
            json!({"name": name, "dims": dims, "type": ty.id(), "offset": off,
            "n_bytes": data.len(), "data_hex": hex(data)}),
        );
        off = pad(off + data.len() as u64);
    }
    json!({
        "version": 3, "alignment": align, "data_offset": data_offset,
        "file_size": data_offset + off,
        "kv": w.metadata().iter().map(|(k, v)| {
            let mut d = value_desc(v);
            if let Some(o) = d.as_object_mut() { o.insert("key".into(), json!(k)); }
            d
        }).collect::<Vec<_>>(),
        "tensors": tdesc,
    })
}

fn array_len(a: &Array) -> u64 {
    12 + match a {
        Array::U8(v) => v.len() as u64,
        Array::I8(v) => v.len() as u64,
        Array::U16(v) => 2 * v.len() as u64,
        Array::I16(v) => 2 * v.len() as u64,
        Array::U32(v) => 4 * v.len() as u64,
        Array::I32(v) => 4 * v.len() as u64,
        Array::F32(v) => 4 * v.len() as u64,
        Array::U64(v) => 8 * v.len() as u64,
        Array::I64(v) => 8 * v.len() as u64,
        Array::F64(v) => 8 * v.len() as u64,
        Array::Bool(v) => v.len() as u64,
        Array::String(v) => v.iter().map(|s| 8 + s.len() as u64).sum(),
        Array::Array(v) => v.iter().map(array_len).sum(),
    }
}

fn encoded_len(v: &Value) -> u64 {
    match v {
        Value::String(s) => 8 + s.len() as u64,
        Value::Array(a) => array_len(a),
        v => v.value_type().fixed_size().unwrap_or(0) as u64,
    }
}

/// CRC-32 (IEEE, as zlib.crc32 computes it), for describing large tensors compactly.
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// The description of a file as our reader sees it (tensor data as CRC-32), for checking our reading
/// of real files against gguf-py's.
pub fn desc_of_file(f: &GgufFile) -> J {
    json!({
        "version": f.version(), "alignment": f.alignment(), "data_offset": f.data_offset(),
        "file_size": f.file_size(),
        "kv": f.metadata().iter().map(|(k, v)| {
            let mut d = value_desc(v);
            if let Some(o) = d.as_object_mut() { o.insert("key".into(), json!(k)); }
            d
        }).collect::<Vec<_>>(),
        "tensors": f.tensors().iter().map(|t| json!({
            "name": t.name, "dims": t.dims, "type": t.ty.id(), "offset": t.offset,
            "n_bytes": t.n_bytes(), "data_crc32": crc32(f.tensor_data(t)),
        })).collect::<Vec<_>>(),
    })
}
