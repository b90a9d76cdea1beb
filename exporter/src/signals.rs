//! The signals poolscope acts on (SIGHUP reloads, SIGINT and SIGTERM stop), taken
//! without a handler or a file descriptor: blocked in every thread (the mask is set
//! before the first thread starts, and each thread inherits it) and received by
//! `sigwait` in one thread. A self-pipe would need a Unix socket pair (signal-hook's),
//! which the systemd unit's `RestrictAddressFamilies` would then have to allow.
use std::io;

/// The signals [`block`] holds for [`wait`].
pub const HANDLED: [libc::c_int; 3] = [libc::SIGHUP, libc::SIGINT, libc::SIGTERM];

fn handled_set() -> io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data, initialized by sigemptyset before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid, writable sigset_t.
    if unsafe { libc::sigemptyset(&raw mut set) } != 0 {
        return Err(io::Error::last_os_error());
    }
    for signal in HANDLED {
        // SAFETY: as above; `signal` is a valid signal number.
        if unsafe { libc::sigaddset(&raw mut set, signal) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(set)
}

/// Blocks the handled signals in the calling thread, and so in every thread it
/// starts from now on. Call it before any other thread exists: a thread started
/// earlier would take SIGTERM with its default action (ending the process at once).
pub fn block() -> io::Result<()> {
    let set = handled_set()?;
    // SAFETY: a valid set; the old mask is not wanted.
    match unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &raw const set, std::ptr::null_mut()) } {
        0 => Ok(()),
        error => Err(io::Error::from_raw_os_error(error)),
    }
}

/// Waits for the next handled signal (pending ones first) and returns it.
pub fn wait() -> io::Result<libc::c_int> {
    let set = handled_set()?;
    let mut signal = 0;
    // SAFETY: a valid set and a writable int.
    match unsafe { libc::sigwait(&raw const set, &raw mut signal) } {
        0 => Ok(signal),
        error => Err(io::Error::from_raw_os_error(error)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SIGHUP sent to this process while it is blocked stays pending and is what
    /// `wait` returns, instead of ending the process (SIGHUP's default action).
    #[test]
    fn a_blocked_signal_is_taken_by_wait() -> io::Result<()> {
        let waiter = std::thread::spawn(|| -> io::Result<libc::c_int> {
            block()?;
            // SAFETY: sends SIGHUP to this very thread, which blocks it.
            match unsafe { libc::pthread_kill(libc::pthread_self(), libc::SIGHUP) } {
                0 => wait(),
                error => Err(io::Error::from_raw_os_error(error)),
            }
        });
        let signal = waiter
            .join()
            .map_err(|_| io::Error::other("the waiter panicked"))??;
        assert_eq!(signal, libc::SIGHUP);
        Ok(())
    }
}
