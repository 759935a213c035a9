//! One module per subcommand.
pub mod audit;
pub mod bench;
pub mod calibrate;
pub mod inspect;
pub mod run;
pub mod serve;
pub mod synth;
pub mod tokenize;
