//! Validates GGUF files and prints a one-line verdict for each: `cargo run -p gguf --example validate
//! -- FILE...`. Exit status 1 if any file is rejected.

fn main() {
    let mut bad = false;
    for path in std::env::args().skip(1) {
        match gguf::GgufFile::open(&path) {
            Ok(f) => println!(
                "{path}: ok (v{}, {} keys, {} tensors, data at {})",
                f.version(),
                f.metadata().len(),
                f.tensors().len(),
                f.data_offset()
            ),
            Err(e) => {
                bad = true;
                println!("{path}: [{}] {e}", e.kind());
            }
        }
    }
    std::process::exit(i32::from(bad));
}
