//! POSIX ACLs: the `system.posix_acl_access` / `system.posix_acl_default` xattrs.
//!
//! With FUSE_POSIX_ACL the kernel enforces ACLs itself and leaves two jobs to the filesystem:
//! on create, mkdir and mknod, a directory's default ACL is inherited (and then the umask is
//! not applied), otherwise the umask is; and chmod keeps the ACL's owner, mask (or group) and
//! other entries in step with the mode. The xattr format is Linux's `posix_acl_xattr`: a u32
//! version (2), then entries of u16 tag, u16 permissions, u32 id.

use crate::error::{Error, Result};

/// Name of the xattr holding an inode's access ACL; chmod rewrites it to follow the mode.
pub const ACL_ACCESS: &[u8] = b"system.posix_acl_access";
/// Name of the xattr holding a directory's default ACL, inherited by inodes created in it.
pub const ACL_DEFAULT: &[u8] = b"system.posix_acl_default";

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const GROUP_OBJ: u16 = 0x04;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    tag: u16,
    perm: u16,
    id: u32,
}

fn parse(bytes: &[u8]) -> Result<Vec<Entry>> {
    if bytes.len() < 4
        || (bytes.len() - 4) % 8 != 0
        || u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) != VERSION
    {
        return Err(Error::Invalid(format!(
            "POSIX ACL of {} bytes",
            bytes.len()
        )));
    }
    Ok(bytes[4..]
        .chunks_exact(8)
        .map(|c| Entry {
            tag: u16::from_le_bytes([c[0], c[1]]),
            perm: u16::from_le_bytes([c[2], c[3]]),
            id: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
        })
        .collect())
}

fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = VERSION.to_le_bytes().to_vec();
    for e in entries {
        out.extend_from_slice(&e.tag.to_le_bytes());
        out.extend_from_slice(&e.perm.to_le_bytes());
        out.extend_from_slice(&e.id.to_le_bytes());
    }
    out
}

/// Whether an ACL is only the three base entries (then the mode says it all).
fn is_minimal(entries: &[Entry]) -> bool {
    entries
        .iter()
        .all(|e| matches!(e.tag, USER_OBJ | GROUP_OBJ | OTHER))
}

/// What a new inode gets from its directory's default ACL: its mode, its access ACL, and (for
/// directories) its own default ACL. `mode` carries type and permission bits as requested.
pub struct Inherited {
    /// Type and permission bits of the new inode, after the default ACL (or umask) is applied.
    pub mode: u32,
    /// Access ACL to store on the new inode; `None` when the mode alone expresses it.
    pub access: Option<Vec<u8>>,
    /// Default ACL to store on a new directory (a copy of the parent's); `None` otherwise.
    pub default: Option<Vec<u8>>,
}

/// Applies a directory's default ACL (or, without one, the umask) to a new inode.
pub fn inherit(
    parent_default: Option<&[u8]>,
    mode: u32,
    umask: u32,
    is_dir: bool,
) -> Result<Inherited> {
    let Some(default) = parent_default else {
        return Ok(Inherited {
            mode: mode & !(umask & 0o777),
            access: None,
            default: None,
        });
    };
    let mut entries = parse(default)?;
    let has_mask = entries.iter().any(|e| e.tag == MASK);
    let (owner, group, other) = ((mode >> 6) & 7, (mode >> 3) & 7, mode & 7);
    let mut new_mode = mode & !0o777;
    for e in entries.iter_mut() {
        match e.tag {
            USER_OBJ => {
                e.perm &= owner as u16;
                new_mode |= u32::from(e.perm) << 6;
            }
            MASK => {
                e.perm &= group as u16;
                new_mode |= u32::from(e.perm) << 3;
            }
            GROUP_OBJ if !has_mask => {
                e.perm &= group as u16;
                new_mode |= u32::from(e.perm) << 3;
            }
            OTHER => {
                e.perm &= other as u16;
                new_mode |= u32::from(e.perm);
            }
            _ => {}
        }
    }
    let access = (!is_minimal(&entries)).then(|| encode(&entries));
    Ok(Inherited {
        mode: new_mode,
        access,
        default: is_dir.then(|| default.to_vec()),
    })
}

/// The access ACL after a chmod to `mode`: owner, mask (or group) and other follow the mode.
pub fn chmod(access: &[u8], mode: u32) -> Result<Vec<u8>> {
    let mut entries = parse(access)?;
    let has_mask = entries.iter().any(|e| e.tag == MASK);
    for e in entries.iter_mut() {
        match e.tag {
            USER_OBJ => e.perm = ((mode >> 6) & 7) as u16,
            MASK => e.perm = ((mode >> 3) & 7) as u16,
            GROUP_OBJ if !has_mask => e.perm = ((mode >> 3) & 7) as u16,
            OTHER => e.perm = (mode & 7) as u16,
            _ => {}
        }
    }
    Ok(encode(&entries))
}

/// What an access ACL says of the mode (Linux's `posix_acl_equiv_mode`): the permission bits
/// (owner, mask or else group, other) and whether the mode says all the ACL says (only the
/// three base entries; then no ACL needs to be stored).
pub fn equiv_mode(access: &[u8]) -> Result<(u32, bool)> {
    let entries = parse(access)?;
    let (mut owner, mut group, mut mask, mut other) = (None, None, None, None);
    for e in &entries {
        let perm = u32::from(e.perm & 7);
        match e.tag {
            USER_OBJ => owner = Some(perm),
            GROUP_OBJ => group = Some(perm),
            MASK => mask = Some(perm),
            OTHER => other = Some(perm),
            _ => {}
        }
    }
    match (owner, mask.or(group), other) {
        (Some(u), Some(g), Some(o)) => Ok((u << 6 | g << 3 | o, is_minimal(&entries))),
        _ => Err(Error::Invalid(
            "POSIX ACL without owner, group or other entry".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
        encode(
            &entries
                .iter()
                .map(|(tag, perm, id)| Entry {
                    tag: *tag,
                    perm: *perm,
                    id: *id,
                })
                .collect::<Vec<_>>(),
        )
    }

    #[test]
    fn default_acl_is_inherited_without_umask() {
        let default = acl(&[
            (USER_OBJ, 7, 0),
            (0x02, 5, 1000),
            (GROUP_OBJ, 5, 0),
            (MASK, 7, 0),
            (OTHER, 0, 0),
        ]);
        let got = inherit(Some(&default), libc::S_IFREG | 0o666, 0o022, false).expect("inherit");
        assert_eq!(
            got.mode,
            libc::S_IFREG | 0o660,
            "mode = requested & ACL (owner, mask, other); umask ignored"
        );
        let access = parse(&got.access.expect("named user keeps an access ACL")).expect("parse");
        assert!(access.contains(&Entry {
            tag: MASK,
            perm: 6,
            id: 0
        }));
        assert!(got.default.is_none(), "files get no default ACL");
        let dir = inherit(Some(&default), libc::S_IFDIR | 0o777, 0o022, true).expect("inherit");
        assert_eq!(dir.default.as_deref(), Some(&default[..]));
    }

    #[test]
    fn umask_applies_without_default_acl() {
        let got = inherit(None, libc::S_IFREG | 0o666, 0o022, false).expect("inherit");
        assert_eq!(got.mode, libc::S_IFREG | 0o644);
    }

    #[test]
    fn chmod_moves_the_mask() {
        let access = acl(&[
            (USER_OBJ, 7, 0),
            (0x02, 7, 1000),
            (GROUP_OBJ, 5, 0),
            (MASK, 7, 0),
            (OTHER, 4, 0),
        ]);
        let after = parse(&chmod(&access, 0o640).expect("chmod")).expect("parse");
        assert!(after.contains(&Entry {
            tag: MASK,
            perm: 4,
            id: 0
        }));
        assert!(
            after.contains(&Entry {
                tag: GROUP_OBJ,
                perm: 5,
                id: 0
            }),
            "group entry stays when a mask exists"
        );
        assert!(after.contains(&Entry {
            tag: OTHER,
            perm: 0,
            id: 0
        }));
    }

    #[test]
    fn equiv_mode_takes_the_mask_for_group() {
        let minimal = acl(&[(USER_OBJ, 4, 0), (GROUP_OBJ, 7, 0), (OTHER, 6, 0)]);
        assert_eq!(equiv_mode(&minimal).expect("parse"), (0o476, true));
        let named = acl(&[
            (USER_OBJ, 7, 0),
            (0x02, 5, 1000),
            (GROUP_OBJ, 7, 0),
            (MASK, 2, 0),
            (OTHER, 0, 0),
        ]);
        assert_eq!(equiv_mode(&named).expect("parse"), (0o720, false));
        assert!(equiv_mode(&acl(&[(USER_OBJ, 7, 0)])).is_err());
    }

    #[test]
    fn garbage_acl_is_an_error() {
        assert!(parse(&[1, 2, 3]).is_err());
        assert!(inherit(Some(&[9, 9, 9, 9, 9]), 0o644, 0, false).is_err());
    }
}
