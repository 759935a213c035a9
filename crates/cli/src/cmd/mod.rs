//! One module per subcommand.
pub mod inspect;
pub mod run;
pub mod serve;
pub mod synth;
pub mod tokenize;
