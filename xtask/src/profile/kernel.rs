//! What the kernel says of a loaded program: where its functions' JIT images lie, and
//! the source line of each stretch of them (its BTF line info, as
//! `BPF_OBJ_GET_INFO_BY_FD` gives it with the JIT's address of each record).

use std::{
    mem::size_of,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
};

use anyhow::{Context, Result, bail};
use aya_obj::generated::{bpf_btf_info, bpf_cmd, bpf_line_info, bpf_prog_info};
use proxy_userspace::datapath::{kernel_btf::Btf, sys};

use super::attribute::{Function, Line, Program};

/// `bpf_attr` as `BPF_OBJ_GET_INFO_BY_FD` reads it.
#[repr(C)]
struct InfoAttr {
    bpf_fd: u32,
    info_len: u32,
    info: u64,
}

/// `bpf_attr` as `BPF_BTF_GET_FD_BY_ID` reads it.
#[repr(C)]
struct IdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

/// `BPF_OBJ_GET_INFO_BY_FD` into `info`, whose pointers the kernel fills.
fn info_by_fd<T>(fd: impl AsFd, info: &mut T) -> std::io::Result<()> {
    let mut attr = InfoAttr {
        bpf_fd: fd.as_fd().as_raw_fd() as u32,
        info_len: size_of::<T>() as u32,
        info: std::ptr::from_mut(info) as u64,
    };
    // SAFETY: the command's member of `bpf_attr`; `info` is a live info struct
    // of the size given, whose array pointers (if any) the caller sized.
    unsafe { sys::bpf(bpf_cmd::BPF_OBJ_GET_INFO_BY_FD as libc::c_long, &mut attr) }.map(|_| ())
}

/// Every loaded program named one of `names`, with its JIT images and line info.
pub fn programs(names: &[String]) -> Result<Vec<Program>> {
    let mut found = Vec::new();
    for info in aya::programs::loaded_programs() {
        let info = info.context("list the loaded BPF programs")?;
        let Some(name) = info.name_as_str() else {
            continue;
        };
        if !names.iter().any(|n| n == name) {
            continue;
        }
        let fd = info
            .fd()
            .with_context(|| format!("open program {} ({name})", info.id()))?;
        found.push(
            program(fd.as_fd(), info.id(), name)
                .with_context(|| format!("read program {} ({name})", info.id()))?,
        );
    }
    Ok(found)
}

fn program(fd: impl AsFd + Copy, id: u32, name: &str) -> Result<Program> {
    // SAFETY: a plain C struct, valid all zeros.
    let mut counts: bpf_prog_info = unsafe { std::mem::zeroed() };
    info_by_fd(fd, &mut counts).context("BPF_OBJ_GET_INFO_BY_FD")?;
    if counts.nr_jited_ksyms == 0 || counts.nr_jited_line_info == 0 {
        bail!("no JIT images or no line info (is the JIT on, and the object built with BTF?)");
    }
    if counts.line_info_rec_size as usize != size_of::<bpf_line_info>()
        || counts.jited_line_info_rec_size as usize != size_of::<u64>()
    {
        bail!(
            "line info records of {} and {} bytes, not {} and 8",
            counts.line_info_rec_size,
            counts.jited_line_info_rec_size,
            size_of::<bpf_line_info>()
        );
    }
    let mut ksyms = vec![0u64; counts.nr_jited_ksyms as usize];
    let mut lens = vec![0u32; counts.nr_jited_func_lens as usize];
    // SAFETY: as above.
    let mut lines =
        vec![unsafe { std::mem::zeroed::<bpf_line_info>() }; counts.nr_line_info as usize];
    let mut jited_lines = vec![0u64; counts.nr_jited_line_info as usize];
    // SAFETY: as above.
    let mut info: bpf_prog_info = unsafe { std::mem::zeroed() };
    info.nr_jited_ksyms = counts.nr_jited_ksyms;
    info.jited_ksyms = ksyms.as_mut_ptr() as u64;
    info.nr_jited_func_lens = counts.nr_jited_func_lens;
    info.jited_func_lens = lens.as_mut_ptr() as u64;
    info.nr_line_info = counts.nr_line_info;
    info.line_info_rec_size = counts.line_info_rec_size;
    info.line_info = lines.as_mut_ptr() as u64;
    info.nr_jited_line_info = counts.nr_jited_line_info;
    info.jited_line_info_rec_size = counts.jited_line_info_rec_size;
    info.jited_line_info = jited_lines.as_mut_ptr() as u64;
    info_by_fd(fd, &mut info).context("BPF_OBJ_GET_INFO_BY_FD, with its arrays")?;
    if ksyms.contains(&0) {
        bail!("the kernel hides the JIT's addresses (kernel.kptr_restrict, or not root)");
    }
    let btf = program_btf(counts.btf_id).context("read the program's BTF")?;
    let text = |off: u32| String::from_utf8_lossy(btf.string(off)).trim().to_string();
    let functions = ksyms
        .iter()
        .zip(&lens)
        .map(|(&start, &len)| Function { start, len })
        .collect();
    let lines = jited_lines
        .iter()
        .zip(&lines)
        .map(|(&addr, l)| Line {
            addr,
            file: text(l.file_name_off),
            // The line number is the high 22 bits, the column the low 10.
            number: l.line_col >> 10,
            text: text(l.line_off),
            ours: None,
        })
        .collect();
    Ok(Program::new(id, name.to_string(), functions, lines))
}

/// BTF object `id`, parsed.
fn program_btf(id: u32) -> Result<Btf> {
    let mut attr = IdAttr {
        id,
        next_id: 0,
        open_flags: 0,
    };
    // SAFETY: the command's member of `bpf_attr`, which holds no pointer.
    let raw = unsafe { sys::bpf(bpf_cmd::BPF_BTF_GET_FD_BY_ID as libc::c_long, &mut attr) }
        .context("BPF_BTF_GET_FD_BY_ID")?;
    // SAFETY: a descriptor the kernel just returned, owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
    // SAFETY: a plain C struct, valid all zeros.
    let mut info: bpf_btf_info = unsafe { std::mem::zeroed() };
    info_by_fd(&fd, &mut info).context("BPF_OBJ_GET_INFO_BY_FD of the BTF")?;
    let mut blob = vec![0u8; info.btf_size as usize];
    // SAFETY: as above.
    let mut info: bpf_btf_info = unsafe { std::mem::zeroed() };
    info.btf_size = blob.len() as u32;
    info.btf = blob.as_mut_ptr() as u64;
    info_by_fd(&fd, &mut info).context("BPF_OBJ_GET_INFO_BY_FD of the BTF, with its data")?;
    Ok(Btf::parse(blob)?)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use proxy_userspace::datapath::{Datapath, PinLayout, cleanup, pins::is_bpffs};

    use super::*;

    /// Removes a test's pins, pass or fail.
    struct Pins(PinLayout);

    impl Drop for Pins {
        fn drop(&mut self) {
            let _ = cleanup(&self.0);
        }
    }

    #[test]
    fn a_loaded_datapaths_jit_images_carry_its_source_lines() {
        assert!(
            is_bpffs(Path::new("/sys/fs/bpf")),
            "/sys/fs/bpf is not a bpffs mount: `cargo xtask setup` mounts it"
        );
        let pins = Pins(PinLayout::new(format!(
            "/sys/fs/bpf/ebpf-proxy-xtask-profile-{}",
            std::process::id()
        )));
        let _datapath = Datapath::load(pins.0.clone()).expect("load the datapath");
        let found = programs(&["tc_ingress".to_string()]).expect("read the loaded programs");
        assert!(!found.is_empty(), "no tc_ingress among the loaded programs");
        for program in &found {
            let (first, last) = program
                .bounds()
                .unwrap_or_else(|| panic!("program {} has no JIT image", program.id));
            let lines = program.lines();
            assert!(
                lines.iter().all(|l| l.addr >= first && l.addr < last),
                "program {}: a line record outside its JIT images [{first:#x}, {last:#x})",
                program.id
            );
            assert!(
                lines
                    .iter()
                    .any(|l| l.file.ends_with("proxy-ebpf/src/pipeline.rs")),
                "program {}: no line of pipeline.rs among its {} line records",
                program.id,
                lines.len()
            );
            assert!(
                lines.iter().all(|l| l.number > 0 && !l.file.is_empty()),
                "program {}: a line record without a file or line number",
                program.id
            );
        }
    }
}
