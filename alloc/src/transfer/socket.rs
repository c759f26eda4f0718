//! An engine's datagram socket in the abstract namespace: where its notifications, loads,
//! unloads and revocations arrive. Senders are checked by their kernel-attested credentials
//! (`SO_PASSCRED`): only this user's processes, or uids the engine allows, are heard.

use std::mem::MaybeUninit;
use std::os::fd::OwnedFd;

use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendFlags, SocketAddrUnix,
    SocketFlags, SocketType,
};

use super::wire::{Message, MAX_NOTIF_BYTES};
use crate::error::{Error, Result};

/// The largest datagram accepted (a notification plus its header and names).
const MAX_DATAGRAM: usize = MAX_NOTIF_BYTES + 4096;

/// A bound datagram socket.
#[derive(Debug)]
pub(crate) struct Endpoint {
    fd: OwnedFd,
    name: String,
    own_uid: u32,
    allowed_uids: Vec<u32>,
}

fn ipc(what: &str, name: &str, e: rustix::io::Errno) -> Error {
    Error::Ipc(format!("transfer socket `{name}`: {what}: {e}"))
}

fn unbound() -> Result<OwnedFd> {
    rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| Error::Ipc(format!("transfer socket: {e}")))
}

impl Endpoint {
    /// Bind `name` (abstract namespace) and ask for senders' credentials.
    pub(crate) fn bind(name: &str, allowed_uids: Vec<u32>) -> Result<Endpoint> {
        let fd = unbound()?;
        let addr = SocketAddrUnix::new_abstract_name(name.as_bytes())
            .map_err(|e| ipc("address", name, e))?;
        rustix::net::bind(&fd, &addr).map_err(|e| ipc("bind", name, e))?;
        rustix::net::sockopt::set_socket_passcred(&fd, true)
            .map_err(|e| ipc("SO_PASSCRED", name, e))?;
        Ok(Endpoint {
            fd,
            name: name.to_owned(),
            own_uid: rustix::process::geteuid().as_raw(),
            allowed_uids,
        })
    }

    /// The socket's name.
    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    /// Send `msg` to the endpoint named `to` (non-blocking: a full or absent receiver is an
    /// error, never a wait).
    pub(crate) fn send(&self, to: &str, msg: &Message) -> Result<()> {
        let addr =
            SocketAddrUnix::new_abstract_name(to.as_bytes()).map_err(|e| ipc("address", to, e))?;
        let bytes = msg.encode();
        rustix::net::sendto(&self.fd, &bytes, SendFlags::DONTWAIT, &addr)
            .map_err(|e| ipc("send", to, e))?;
        Ok(())
    }

    /// Wait for the next message from an allowed sender. Malformed datagrams and those of
    /// other users are dropped (logged); `Ok(None)` is a wake-up with nothing to read (an
    /// empty datagram: the engine's stop signal).
    pub(crate) fn recv(&self) -> Result<Option<Message>> {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        loop {
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmCredentials(1))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                &self.fd,
                &mut [std::io::IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::empty(),
            );
            let got = match got {
                Ok(g) => g,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(ipc("receive", &self.name, e)),
            };
            let uid = control.drain().find_map(|m| match m {
                RecvAncillaryMessage::ScmCredentials(c) => Some(c.uid.as_raw()),
                _ => None,
            });
            let allowed = uid.is_some_and(|u| u == self.own_uid || self.allowed_uids.contains(&u));
            if !allowed {
                tracing::warn!(socket = %self.name, ?uid, "transfer message from a user not allowed: dropped");
                continue;
            }
            if got.bytes == 0 {
                return Ok(None);
            }
            if got.flags.contains(rustix::net::ReturnFlags::TRUNC) {
                tracing::warn!(socket = %self.name, "transfer message too long: dropped");
                continue;
            }
            match Message::decode(&buf[..got.bytes]) {
                Ok(m) => return Ok(Some(m)),
                Err(e) => {
                    tracing::warn!(socket = %self.name, error = %e, "malformed transfer message: dropped")
                }
            }
        }
    }

    /// Wake the thread blocked in [`Endpoint::recv`] with an empty datagram.
    pub(crate) fn wake(&self) {
        let sent = unbound().and_then(|fd| {
            let addr = SocketAddrUnix::new_abstract_name(self.name.as_bytes())
                .map_err(|e| ipc("address", &self.name, e))?;
            rustix::net::sendto(&fd, &[], SendFlags::DONTWAIT, &addr)
                .map_err(|e| ipc("wake", &self.name, e))
        });
        if let Err(e) = sent {
            tracing::warn!(error = %e, "waking the transfer socket's thread failed");
        }
    }
}
