//! What the socket hook needs to know of the node: the cgroup v2 directory
//! whose sockets it sees, and the cookie of the node's network namespace,
//! which tells the node's own sockets from pods' (see `proxy-ebpf`'s `sock`).

use std::{
    io,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

/// `SO_NETNS_COOKIE` (Linux 5.14), which the libc crate does not name.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// The cookie of the network namespace this process is in.
pub fn netns_cookie() -> io::Result<u64> {
    // Any socket of the namespace will do; the wildcard address binds even
    // where the loopback is down.
    let socket = std::net::UdpSocket::bind("0.0.0.0:0")?;
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: a valid socket and an out-buffer of the size passed.
    let ret = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    if ret != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cookie)
}

/// Whether `path` is the root of a cgroup v2 hierarchy or a directory in one.
pub fn is_cgroup2(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
}

/// The host's cgroup v2 mount: `/sys/fs/cgroup` on a unified host, its
/// `unified` directory on a hybrid one. None on a host without cgroup v2.
pub fn default_cgroup_root() -> Option<PathBuf> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| is_cgroup2(p))
}
