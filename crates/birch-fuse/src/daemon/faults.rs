//! Fault injection under a real mount (test builds only, the `fault-injection` feature): the
//! test kit's [`FaultDevice`] placed between the image and the filesystem with the mount's
//! `fault=` rules, and the `fault` control command (`birch fault MNT TEXT`) that adds a rule,
//! clears them or releases hung requests while the mount serves.
//! Owns: that placement and that command. Must not touch: what a fault does (the test kit's
//! device) or how the filesystem meets it (birch-core); a build without the feature has none
//! of this, and its daemon refuses to serve with `fault=` rules.

use std::sync::Arc;

use birch_core::control::ControlCommand;
use birch_core::device::BlockDevice;
use birch_testkit::{FaultDevice, Rule};

use super::control_socket::ControlHandler;

/// `device` behind a fault device armed with `rules` (texts `Rule::parse` takes), and that
/// fault device; the chances are drawn from `seed`.
pub fn arm(
    device: Arc<dyn BlockDevice>,
    rules: &[String],
    seed: u64,
) -> Result<(Arc<dyn BlockDevice>, Arc<FaultDevice>), String> {
    let fault = Arc::new(FaultDevice::new(device, seed));
    for text in rules {
        fault.add(Rule::parse(text)?);
        log::warn!("fault injection: rule armed: {text} (seed {seed})");
    }
    Ok((fault.clone(), fault))
}

/// A control handler that runs `fault TEXT` on `fault` and passes every other command to
/// `inner`.
pub fn handler(fault: Arc<FaultDevice>, inner: Arc<ControlHandler>) -> Arc<ControlHandler> {
    Arc::new(move |command: &ControlCommand| match command {
        ControlCommand::Fault(text) => match fault.command(text) {
            Ok(done) => {
                log::warn!("fault injection: {done}; injected so far: {}", fault.stats);
                Ok(())
            }
            Err(e) => Err(birch_core::Error::Invalid(e)),
        },
        other => inner(other),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::expect_used)]

    use super::*;
    use birch_core::device::MemDevice;

    /// Rules armed at the mount fire; the control command adds, clears and refuses, and every
    /// other command reaches the filesystem's handler.
    #[test]
    fn mount_rules_and_the_control_command_reach_the_device() {
        let mem: Arc<dyn BlockDevice> = Arc::new(MemDevice::new(1 << 20));
        let (device, fault) = arm(mem, &["flush:eio,times=1".into()], 1).expect("arm");
        assert!(device.flush().is_err(), "the mount's rule fires");
        device.flush().expect("once");
        let passed = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let seen = passed.clone();
        let inner: Arc<ControlHandler> = Arc::new(move |_: &ControlCommand| {
            seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Ok(())
        });
        let control = handler(fault.clone(), inner);
        control(&ControlCommand::Fault("flush:eio".into())).expect("add");
        assert!(device.flush().is_err(), "the added rule fires");
        control(&ControlCommand::Fault("clear".into())).expect("clear");
        device.flush().expect("cleared");
        let e = control(&ControlCommand::Fault("flush:sideways".into())).expect_err("bad rule");
        assert!(e.to_string().contains("unknown effect"), "{e}");
        control(&ControlCommand::Sync).expect("passed on");
        assert_eq!(passed.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert_eq!(
            fault.stats.eio.load(std::sync::atomic::Ordering::Relaxed),
            2
        );
    }
}
