//! Declares the `bpf_target_arch` cfg that aya-build sets (the kernel's arch, whose
//! `struct pt_regs` layout the programs read).
fn main() {
    println!(
        "cargo::rustc-check-cfg=cfg(bpf_target_arch, values(\"x86_64\", \"aarch64\", \"arm\", \"loongarch64\", \"mips\", \"mips64\", \"powerpc64\", \"riscv64\", \"s390x\"))"
    );
}
