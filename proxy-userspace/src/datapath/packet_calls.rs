//! What the packet programs call, read from the object the agent loads.
//! A call on a packet's path costs its return, which on kernels with
//! return-stack mitigations goes through a thunk: the programs are one
//! function each, and copy memory inline (docs/architecture.md, "No calls
//! on a packet's path"). Tests only: the compiler decides both, and a
//! change of code or toolchain can undo either without a sign.

use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SymbolKind};
use proxy_common::program_names::PACKET as PACKET_PROGRAMS;

use super::EBPF_OBJECT;

/// The memory functions the compiler calls where it does not expand a copy
/// or a fill in place; on BPF, byte loops from `compiler_builtins`.
const MEMORY_FUNCTIONS: [&str; 5] = ["memset", "memmove", "memcpy", "memcmp", "bcmp"];

fn object() -> object::File<'static> {
    object::File::parse(EBPF_OBJECT).expect("the embedded eBPF object parses")
}

#[test]
fn each_packet_program_is_one_function() {
    let file = object();
    // A program macro's body left out of line is a function of its own,
    // named in the entry's path: `..10tc_ingress10tc_ingress` (v0 mangling).
    let nested: Vec<(String, String)> = PACKET_PROGRAMS
        .iter()
        .map(|p| (p.to_string(), format!("{}{p}{}{p}", p.len(), p.len())))
        .collect();
    let found: Vec<String> = file
        .symbols()
        .filter(|s| s.kind() == SymbolKind::Text)
        .filter_map(|s| s.name().ok().map(str::to_owned))
        .filter_map(|name| {
            nested
                .iter()
                .find(|(_, inner)| name.contains(inner.as_str()))
                .map(|(program, _)| format!("{program}: {name}"))
        })
        .collect();
    assert!(
        found.is_empty(),
        "packet programs whose body is a function the entry calls on every packet: {found:?}"
    );
    for program in PACKET_PROGRAMS {
        assert!(
            file.symbols()
                .any(|s| s.kind() == SymbolKind::Text && s.name() == Ok(program)),
            "no program {program} in the object"
        );
    }
}

#[test]
fn no_code_calls_a_memory_function() {
    let file = object();
    let mut calls = Vec::new();
    for section in file
        .sections()
        .filter(|s| s.kind() == object::SectionKind::Text)
    {
        for (offset, relocation) in section.relocations() {
            let RelocationTarget::Symbol(index) = relocation.target() else {
                continue;
            };
            let Ok(symbol) = file.symbol_by_index(index) else {
                continue;
            };
            if let Ok(name) = symbol.name()
                && MEMORY_FUNCTIONS.contains(&name)
            {
                let caller = file
                    .symbols()
                    .filter(|s| {
                        s.kind() == SymbolKind::Text
                            && s.section_index() == Some(section.index())
                            && (s.address()..s.address() + s.size()).contains(&offset)
                    })
                    .find_map(|s| s.name().ok().map(str::to_owned))
                    .unwrap_or_else(|| format!("{}+{offset:#x}", section.name().unwrap_or("?")));
                calls.push(format!("{caller} calls {name}"));
            }
        }
    }
    assert!(
        calls.is_empty(),
        "code calling a byte loop where a copy or fill could be inline: {calls:?}"
    );
}
