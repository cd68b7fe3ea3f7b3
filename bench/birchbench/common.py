"""Shared pieces of the harness: paths, target names, size and number formats, the log.

Owns: where the harness lives (HERE = bench/, REPO, ENTRY = bench/birchbench.py, the script
every child process of the harness is started as), the list of targets, parsing and printing
sizes and figures, safe file names, the timestamped log (`LOG`, `log`; cli.py replaces LOG
with the run's own once the output directory is known) and the error text of a failed command.

Must not touch: mounts, processes, the machine or the report layout; nothing here runs a
command or writes a file other than the log.
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import sys
import threading

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bench/
REPO = os.path.dirname(HERE)
ENTRY = os.path.join(HERE, "birchbench.py")  # the harness's script: children run it with --_w5 etc.
# memfs_ll-uring: libfuse's memfs_ll served over FUSE over io_uring (`-o io_uring`), the
# transport-only floor for birchfs's default transport (birchfs serves over io_uring where the
# kernel has it, DESIGN §12.5); memfs_ll is the same server over /dev/fuse.
ALL_TARGETS = ["ext4", "xfs", "btrfs", "fuse2fs", "bindfs-mt", "memfs_ll", "memfs_ll-uring", "raw",
               "birchfs"]
# Valid in --targets but not run by default: birchfs on a Ceph RBD image (issue 21), which needs
# a birch built with `--features rbd` (--rbd-birch) and a cluster (--rbd-conf, or the throw-away
# single-node cluster of tests/rbd/single-node.sh, brought up and stopped by the run).
OPTIONAL_TARGETS = ["birchfs-rbd"]
KERNEL_KINDS = {"ext4", "xfs", "btrfs", "raw"}


# --------------------------------------------------------------------------- sizes

def parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", str(s))
    if not m:
        raise argparse.ArgumentTypeError(f"bad size: {s!r}")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def human(n: int) -> str:
    for unit, sh in (("G", 30), ("M", 20), ("K", 10)):
        if n >= (1 << sh) and n % (1 << sh) == 0:
            return f"{n >> sh}{unit}"
    return str(n)


def int_list(s: str) -> list[int]:
    return [int(x) for x in str(s).split(",") if x.strip()]


def str_list(s: str) -> list[str]:
    return [x.strip() for x in str(s).split(",") if x.strip()]


def fmt_num(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, str):
        return v
    if float(v).is_integer():
        return f"{int(v):,}"
    a = abs(v)
    if a >= 100:
        return f"{v:,.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    if a == 0:
        return "0"
    return f"{v:.3g}"


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_")


# --------------------------------------------------------------------------- logging

class Log:
    """Timestamped lines to the log file (and the terminal); a live status line on a tty."""

    def __init__(self, path: str | None, detached: bool):
        self.detached = detached
        self.file = None
        if path and not detached:
            self.file = open(path, "a", buffering=1)
        self.tty = (not detached) and sys.stdout.isatty()
        self.lock = threading.Lock()
        self.status_text = ""

    def line(self, msg: str) -> None:
        ts = datetime.datetime.now().strftime("%H:%M:%S")
        text = f"[{ts}] {msg}"
        with self.lock:
            if self.file:
                self.file.write(text + "\n")
            if self.tty:
                sys.stdout.write("\r\033[K" + text + "\n")
                if self.status_text:
                    sys.stdout.write(self._fit(self.status_text))
                sys.stdout.flush()
            else:
                print(text, flush=True)

    def _fit(self, s: str) -> str:
        width = shutil.get_terminal_size((120, 20)).columns
        return s[: max(10, width - 1)]

    def status(self, msg: str) -> None:
        with self.lock:
            self.status_text = msg
            if self.tty:
                sys.stdout.write("\r\033[K" + self._fit(msg))
                sys.stdout.flush()

    def clear_status(self) -> None:
        with self.lock:
            self.status_text = ""
            if self.tty:
                sys.stdout.write("\r\033[K")
                sys.stdout.flush()


LOG: Log = Log(None, False)


def log(msg: str) -> None:
    LOG.line(msg)


def fail_text(what, rc, out, err) -> str:
    tail = (err.strip() or out.strip())[-600:]
    return f"{what} rc={rc}: {tail}"
