//! Which build this is: a leaf that the build information metric and the landing
//! page read, so that neither reaches up to the crate root for it.

/// The git commit this binary was built from (`unknown` outside a git checkout).
pub const REVISION: &str = env!("POOLSCOPE_REVISION");
