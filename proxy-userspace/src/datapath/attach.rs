//! tc attachment through pinned bpf links (TCX, kernel >= 6.6): a pinned link
//! keeps the program attached after the agent exits, and the next agent swaps
//! its own program into the same link atomically.

use std::{io, path::Path};

use aya::programs::{
    LinkOrder, SchedClassifier, TcAttachType,
    links::{FdLink, LinkError, PinnedLink},
    tc::{SchedClassifierLink, TcAttachOptions},
};

#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error("attaching to tc ingress of {ifname}: {source}")]
    Attach {
        ifname: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("pinning the link of {ifname} at {path}: {source}")]
    Pin {
        ifname: String,
        path: String,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("the link of {ifname} cannot be pinned: {source}")]
    Link {
        ifname: String,
        #[source]
        source: LinkError,
    },
}

pub struct Attachment {
    pub ifindex: u32,
}

pub fn attach_tc_ingress(
    program: &mut SchedClassifier,
    ifname: &str,
    ifindex: u32,
    pin: &Path,
) -> Result<Attachment, AttachError> {
    let err = |source| AttachError::Attach {
        ifname: ifname.to_string(),
        source,
    };
    let link_id = match take_over(program, pin) {
        Some(id) => id,
        None => program
            .attach_with_options(
                ifname,
                TcAttachType::Ingress,
                TcAttachOptions::TcxOrder(LinkOrder::default()),
            )
            .map_err(err)?,
    };
    let link = program.take_link(link_id).map_err(err)?;
    let fd_link: FdLink = link.try_into().map_err(|source| AttachError::Link {
        ifname: ifname.to_string(),
        source,
    })?;
    // The link is pinned anew each time: the earlier pin is replaced by a
    // pin of the same link, or by the fresh one when taking over failed.
    let _ = std::fs::remove_file(pin);
    let pinned = fd_link.pin(pin).map_err(|source| AttachError::Pin {
        ifname: ifname.to_string(),
        path: pin.display().to_string(),
        source,
    })?;
    // Dropping our fd leaves the pin as the link's holder; it stays attached.
    drop(pinned);
    Ok(Attachment { ifindex })
}

/// Replaces the program in a pinned link of an earlier run. None when there
/// is no such link, or it is dead (its interface went away).
fn take_over(
    program: &mut SchedClassifier,
    pin: &Path,
) -> Option<aya::programs::tc::SchedClassifierLinkId> {
    let old = match PinnedLink::from_pin(pin) {
        Ok(old) => old,
        Err(LinkError::SyscallError(e)) if e.io_error.kind() == io::ErrorKind::NotFound => {
            return None;
        }
        Err(e) => {
            tracing::warn!(pin = %pin.display(), error = %e, "unusable link pin; attaching anew");
            let _ = std::fs::remove_file(pin);
            return None;
        }
    };
    let link: SchedClassifierLink = match FdLink::from(old).try_into() {
        Ok(link) => link,
        Err(e) => {
            tracing::warn!(pin = %pin.display(), error = %e, "pinned link is not a tc link; attaching anew");
            let _ = std::fs::remove_file(pin);
            return None;
        }
    };
    match program.attach_to_link(link) {
        Ok(id) => {
            tracing::info!(pin = %pin.display(), "took over pinned tc link");
            Some(id)
        }
        Err(e) => {
            tracing::warn!(pin = %pin.display(), error = %e, "pinned link is dead; attaching anew");
            let _ = std::fs::remove_file(pin);
            None
        }
    }
}
