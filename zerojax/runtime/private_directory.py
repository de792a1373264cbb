"""Directories whose files zerojax loads as programs must be writable by this user alone.

JAX's persistent compilation cache holds compiled XLA executables, which are code by nature,
and the capture cache beside it holds captured programs, whose graphs decide what a training
step computes. A file another user can plant in either runs, or silently changes the training,
as the user who loads it. So, as ssh refuses a key whose permissions are too open, zerojax
refuses such a directory before using it: it must be owned by this user (or root) and
writable by no one else, i.e. not world-writable (a sticky bit does not help: others may still
add files) and not group-writable unless the group is this user's private group (named as the
user and with no other members, the group a umask of 002 is safe with).

A directory zerojax creates for a cache is created 0700.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat

__all__ = ["UnsafeDirectoryError", "check_private_directory"]


class UnsafeDirectoryError(PermissionError):
    """A cache directory that users other than this one can write to, or owned by another."""


def check_private_directory(path: str, what: str) -> None:
    """Raise UnsafeDirectoryError naming `path`, its owner and mode, unless `path` is owned by
    this user (or root) and writable by this user alone; `what` names the directory's use.
    A path that does not exist passes: it is created (0700) by whoever writes to it."""
    if not hasattr(os, "getuid"):  # pragma: no cover - no POSIX owners (Windows)
        return
    try:
        status = os.stat(path)
    except FileNotFoundError:
        return
    mode = stat.S_IMODE(status.st_mode)
    uid = os.getuid()
    problem = None
    if status.st_uid not in (uid, 0):
        problem = f"it is owned by {_user(status.st_uid)}, not by {_user(uid)}"
    elif mode & stat.S_IWOTH:
        problem = "every user can write to it"
    elif mode & stat.S_IWGRP and not _is_private_group(status.st_gid, uid):
        problem = f"the users of group {_group(status.st_gid)} can write to it"
    if problem is None:
        return
    raise UnsafeDirectoryError(
        f"{what} {path!r} (mode {mode:04o}, owner {_user(status.st_uid)}, group "
        f"{_group(status.st_gid)}) is refused: {problem}, and zerojax loads programs from it "
        f"that would run as you. Use a directory only you can write to (`chmod go-w {path}`, "
        f"or another runtime.compilation_cache_dir)"
    )


def _is_private_group(gid: int, uid: int) -> bool:
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:
        return False
    return group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"
