#![no_std]
// Exists so that the exporter can name this crate as a build dependency.
