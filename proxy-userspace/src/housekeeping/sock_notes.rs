//! The socket hooks' notes (`SOCK_NOTES`, and `SOCK_NOTES6` for IPv6
//! backends), read back by the agent, `status` and the tests. They live in
//! each socket's own storage, which the kernel's
//! socket diagnostics report for TCP sockets only (`inet_sk_diag_fill` is
//! done before it for a socket without connection state, as UDP's are), so
//! they are read through an iterator over the UDP table instead
//! (`program_names::SOCK_NOTES_DUMP`, `SOCK_NOTES6_DUMP`), which visits
//! every UDP socket of the reader's network namespace and writes the notes
//! of those holding some. Its link is pinned (`PinLayout::sock_notes`,
//! `sock_notes6`): reading that file runs the iterator, for whoever reads
//! it, over the sockets of the namespace they read it in. The load pins it
//! (`datapath::iter_link`); this module reads it.

use std::{
    collections::HashMap,
    io,
    path::{Path, PathBuf},
};

use bytemuck::Pod;
use proxy_common::{SockNotes, SockNotes6, SockNotes6Record, SockNotesRecord};

#[derive(Debug, thiserror::Error)]
pub enum SockNotesError {
    #[error("reading the socket hooks' notes through {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the socket notes iterator wrote {len} bytes, not whole {record}-byte records")]
    Torn { len: usize, record: usize },
}

/// The notes of every socket holding some, by socket cookie.
#[derive(Debug, Default)]
pub struct Notes(HashMap<u64, SockNotes>);

impl Notes {
    /// The notes of the socket with `cookie`.
    pub fn of(&self, cookie: u64) -> Option<&SockNotes> {
        self.0.get(&cookie)
    }

    /// How many sockets hold notes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// `Notes` of IPv6 backends (`SOCK_NOTES6`), by socket cookie.
#[derive(Debug, Default)]
pub struct Notes6(HashMap<u64, SockNotes6>);

impl Notes6 {
    /// The IPv6 notes of the socket with `cookie`.
    pub fn of(&self, cookie: u64) -> Option<&SockNotes6> {
        self.0.get(&cookie)
    }

    /// How many sockets hold IPv6 notes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The cookies of the sockets holding IPv6 notes.
    pub fn cookies(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.keys().copied()
    }
}

impl Notes {
    /// The cookies of the sockets holding notes.
    pub fn cookies(&self) -> impl Iterator<Item = u64> + '_ {
        self.0.keys().copied()
    }
}

/// Every socket's notes as the iterator pinned at `path` reads them now.
pub fn read(path: &Path) -> Result<Notes, SockNotesError> {
    let records: Vec<SockNotesRecord> = records(path)?;
    Ok(Notes(
        records.into_iter().map(|r| (r.cookie, r.notes)).collect(),
    ))
}

/// Every socket's notes of IPv6 backends as the iterator pinned at `path`
/// (`PinLayout::sock_notes6`) reads them now.
pub fn read6(path: &Path) -> Result<Notes6, SockNotesError> {
    let records: Vec<SockNotes6Record> = records(path)?;
    Ok(Notes6(
        records.into_iter().map(|r| (r.cookie, r.notes)).collect(),
    ))
}

/// The whole records the iterator pinned at `path` writes.
fn records<R: Pod>(path: &Path) -> Result<Vec<R>, SockNotesError> {
    let bytes = std::fs::read(path).map_err(|source| SockNotesError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let record = size_of::<R>();
    if bytes.len() % record != 0 {
        return Err(SockNotesError::Torn {
            len: bytes.len(),
            record,
        });
    }
    Ok(bytes
        .chunks_exact(record)
        .map(bytemuck::pod_read_unaligned)
        .collect())
}

#[cfg(test)]
mod tests {
    use proxy_common::{SockAddr, SockNote, SockNote6, sock_note, sock_note_slot};

    use super::*;

    #[test]
    fn reads_whole_records_and_refuses_torn_ones() {
        let note = SockNote {
            backend_be: u32::from_ne_bytes([10, 200, 0, 12]),
            frontend_be: u32::from_ne_bytes([10, 96, 0, 10]),
            backend_port_be: 5353u16.to_be(),
            frontend_port_be: 53u16.to_be(),
            how: sock_note::SENT,
        };
        let mut notes = SockNotes::default();
        notes.notes[sock_note_slot(note.backend_be, note.backend_port_be)] = note;
        let records = [
            SockNotesRecord { cookie: 7, notes },
            SockNotesRecord {
                cookie: 9,
                notes: SockNotes::default(),
            },
        ];
        let dir = std::env::temp_dir().join(format!("sock-notes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("records");
        std::fs::write(&path, bytemuck::cast_slice(&records)).expect("write records");
        let read_back = read(&path).expect("two whole records");
        assert_eq!(read_back.len(), 2);
        assert_eq!(read_back.of(7), Some(&notes));
        assert_eq!(
            read_back
                .of(7)
                .and_then(|n| n.find(&note.backend_be, note.backend_port_be)),
            Some(&note)
        );
        assert_eq!(read_back.of(8), None, "a cookie never written");

        let mut torn = bytemuck::cast_slice::<_, u8>(&records).to_vec();
        torn.pop();
        std::fs::write(&path, &torn).expect("write a torn record");
        let err = read(&path).expect_err("a torn record");
        assert!(
            matches!(err, SockNotesError::Torn { len, .. } if len == torn.len()),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).ok();
        assert!(
            matches!(read(&path), Err(SockNotesError::Read { .. })),
            "a missing pin"
        );
    }

    #[test]
    fn reads_ipv6_records_and_tells_the_families_apart() {
        let backend_be = [u32::from_ne_bytes([0xfd, 0, 2, 0]), 0, 0, 0x12u32.to_be()];
        let note = SockNote6 {
            backend_be,
            frontend_be: [
                u32::from_ne_bytes([0xfd, 0, 0, 0x96]),
                0,
                0,
                0x10u32.to_be(),
            ],
            backend_port_be: 5353u16.to_be(),
            frontend_port_be: 53u16.to_be(),
            how: sock_note::CONNECTED,
        };
        let mut notes = SockNotes6::default();
        notes.notes[note.backend_be.note_slot(note.backend_port_be)] = note;
        let records = [SockNotes6Record { cookie: 11, notes }];
        let dir = std::env::temp_dir().join(format!("sock-notes6-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("records");
        std::fs::write(&path, bytemuck::cast_slice(&records)).expect("write records");
        let read_back = read6(&path).expect("one whole record");
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(read_back.len(), 1);
        assert_eq!(
            read_back
                .of(11)
                .and_then(|n| n.find(&note.backend_be, note.backend_port_be)),
            Some(&note)
        );
        // An IPv4 record's bytes are no whole number of IPv6 records.
        let v4 = [SockNotesRecord {
            cookie: 7,
            notes: SockNotes::default(),
        }];
        std::fs::create_dir_all(&dir).expect("temp dir");
        std::fs::write(&path, bytemuck::cast_slice(&v4)).expect("write records");
        assert!(
            matches!(read6(&path), Err(SockNotesError::Torn { .. })),
            "IPv4 records read as IPv6 ones"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
