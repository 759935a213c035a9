//! Prints the top next tokens after a list of token ids (a quick look at a model's output).
use cpu::{CpuBackend, CpuOptions};
use runtime::{Backend, SeqChunk, StepBatch, Want};

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args.next().expect("usage: probe MODEL.gguf ID...");
    let ids: Vec<u32> = args.map(|a| a.parse().expect("token id")).collect();
    let mut be = CpuBackend::load(&path, &CpuOptions::default()).expect("load");
    let t = std::time::Instant::now();
    let out = be
        .step(&StepBatch {
            chunks: vec![SeqChunk {
                prompt_len: None,
                seq: 0,
                tokens: ids,
                start_pos: 0,
                want: Want::Last,
            }],
        })
        .expect("step");
    let row = out.row(0).expect("row");
    let mut top: Vec<(usize, f32)> = row.iter().copied().enumerate().collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1));
    println!("{:?} in {:?}", &top[..5], t.elapsed());
}
