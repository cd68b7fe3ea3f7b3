#!/usr/bin/env python3
"""Planted defects: each case breaks one rule of the code on purpose and names the test that
must then fail. They turn the "breaking X makes test Y fail" claims of docs/TESTING.md and
docs/DESIGN.md into a command (docs/TESTING.md, "8. Planted defects").

A case is a TOML file in scripts/sabotage/ (NAME.toml):

    what = "the defect, in a sentence"
    doc = "where the docs claim the test catches it"
    run = "the command that must fail (run by bash in the scratch copy's root)"
    expect = "a regex the command's output must match (the failure it must show)"
    timeout = 1800                       # seconds, optional
    [[edit]]                             # one or more; each `from` must occur exactly once
    file = "crates/birch-core/src/..."
    from = '''exact text'''
    to = '''the defect'''

The run works on a scratch copy of the working tree (BIRCH_SABOTAGE_SRC, default
/var/tmp/birch-sabotage-src; refreshed at each run; its target/ is kept so rebuilds are
incremental; BIRCH_SABOTAGE_TARGET moves it, CARGO_TARGET_DIR is ignored), never on the tree
itself. A command that times out is killed with everything it started. For each case: the edits are applied, the command runs,
the files are put back. Verdicts:

    caught     the command failed and its output matched `expect`
    missed     the command passed: the test no longer catches the defect
    other      the command failed some other way (a build error, another test): read the log
    stale      an edit's `from` is not in the file exactly once: the code moved, update the case

    scripts/sabotage.py                  every case
    scripts/sabotage.py NAME...          these cases (file names without .toml)
    scripts/sabotage.py --list           the cases and what each breaks
    scripts/sabotage.py --check          only that every case's edits still apply (seconds)
    scripts/sabotage.py --baseline ...   also run each case's command unbroken first: it must pass

Logs go to BIRCH_SABOTAGE_OUT (default target/sabotage)/NAME.log. Exit status 0 when every case
is caught (and with --baseline, every baseline passed), 1 otherwise, 2 for bad arguments or
cases. Not run by CI (each case rebuilds what its command needs: minutes); `--check` is cheap.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "scripts" / "sabotage"


class CaseError(Exception):
    pass


def load(path):
    try:
        with open(path, "rb") as f:
            case = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CaseError(f"{path.name}: {e}") from e
    for key in ("what", "doc", "run", "expect", "edit"):
        if key not in case:
            raise CaseError(f"{path.name}: no `{key}`")
    if not case["edit"]:
        raise CaseError(f"{path.name}: no edits")
    for e in case["edit"]:
        for key in ("file", "from", "to"):
            if key not in e:
                raise CaseError(f"{path.name}: an edit without `{key}`")
        if e["from"] == e["to"]:
            raise CaseError(f"{path.name}: an edit whose `to` is its `from`")
    try:
        re.compile(case["expect"])
    except re.error as e:
        raise CaseError(f"{path.name}: bad expect regex: {e}") from e
    case["name"] = path.stem
    return case


def planted(case, tree):
    """The case's files as they read with its edits, or CaseError (stale) when an edit's
    text is not in its file exactly once. Several edits of one file apply in order."""
    texts = {}
    for e in case["edit"]:
        f = e["file"]
        if f not in texts:
            try:
                texts[f] = (tree / f).read_text()
            except OSError as err:
                raise CaseError(f"{f}: {err}") from err
        n = texts[f].count(e["from"])
        if n != 1:
            first = e["from"].strip().splitlines()[0] if e["from"].strip() else e["from"]
            raise CaseError(f"{f}: the text to replace occurs {n} times (want 1): {first!r}")
        texts[f] = texts[f].replace(e["from"], e["to"])
    return texts


def refresh(src):
    """The scratch copy: the working tree without build outputs and VCS data. Its files get
    the time of the copy (tar -m), not the tree's: cargo rebuilds by mtime, and a file put back
    with its old time would look older than a build made with the last run's defect in it."""
    src.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.name != "target":
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    subprocess.run(
        f"tar -C {ROOT} --exclude=./target --exclude=./.git --exclude='*.img' "
        f"--exclude=./bench/results -cf - . | tar -C {src} -xmf -",
        shell=True,
        check=True,
    )


def run(cmd, src, log, timeout):
    env = dict(os.environ)
    # Always the scratch copy's own target (or BIRCH_SABOTAGE_TARGET): a CARGO_TARGET_DIR
    # the caller exported may be the real tree's, which must never get a planted defect.
    env["CARGO_TARGET_DIR"] = os.environ.get("BIRCH_SABOTAGE_TARGET", str(src / "target"))
    start = time.monotonic()
    with open(log, "w") as out:
        out.write(f"$ {cmd}\n")
        out.flush()
        # In a session of its own, so a timeout ends the whole group (cargo, the tests, the
        # mount daemons they start), not only the shell.
        p = subprocess.Popen(
            ["nice", "-n", "10", "bash", "-c", cmd],
            cwd=src,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            out.write(f"\nsabotage.py: timed out after {timeout} s\n")
            rc = None
    return rc, time.monotonic() - start


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    flags = {a for a in argv if a.startswith("--")}
    unknown = flags - {"--list", "--check", "--baseline"}
    if unknown:
        print(f"sabotage.py: unknown option {' '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    paths = sorted(CASES.glob("*.toml"))
    if args:
        want = set(args)
        missing = want - {p.stem for p in paths}
        if missing:
            print(f"sabotage.py: no case {' '.join(sorted(missing))}", file=sys.stderr)
            return 2
        paths = [p for p in paths if p.stem in want]
    try:
        cases = [load(p) for p in paths]
    except CaseError as e:
        print(f"sabotage.py: {e}", file=sys.stderr)
        return 2
    if "--list" in flags:
        for c in cases:
            print(f"{c['name']}: {c['what']}\n    doc: {c['doc']}\n    run: {c['run']}")
        return 0
    if "--check" in flags:
        bad = 0
        for c in cases:
            try:
                planted(c, ROOT)
                print(f"{c['name']}: applies")
            except CaseError as e:
                print(f"{c['name']}: stale: {e}")
                bad += 1
        return 1 if bad else 0

    src = Path(os.environ.get("BIRCH_SABOTAGE_SRC", "/var/tmp/birch-sabotage-src"))
    out = Path(os.environ.get("BIRCH_SABOTAGE_OUT", ROOT / "target" / "sabotage"))
    out.mkdir(parents=True, exist_ok=True)
    refresh(src)
    failed = 0
    caught = 0
    if "--baseline" in flags:
        done = set()
        for c in cases:
            if c["run"] in done:
                continue
            done.add(c["run"])
            log = out / f"{c['name']}.baseline.log"
            rc, secs = run(c["run"], src, log, c.get("timeout", 1800))
            verdict = "passes" if rc == 0 else "FAILS unbroken"
            failed += rc != 0
            print(f"baseline {c['name']}: {verdict} ({secs:.0f} s, {log})", flush=True)
    for c in cases:
        log = out / f"{c['name']}.log"
        try:
            texts = planted(c, src)
        except CaseError as e:
            print(f"{c['name']}: stale: {e}", flush=True)
            failed += 1
            continue
        originals = {f: (src / f).read_text() for f in texts}
        try:
            for f, t in texts.items():
                (src / f).write_text(t)
            rc, secs = run(c["run"], src, log, c.get("timeout", 1800))
        finally:
            for f, t in originals.items():
                (src / f).write_text(t)
        text = log.read_text(errors="replace")
        if rc == 0:
            verdict = "MISSED (the command passed)"
        elif rc is None:
            verdict = "OTHER (timed out)"
        elif re.search(c["expect"], text, re.MULTILINE):
            verdict = "caught"
        else:
            verdict = f"OTHER (exit {rc}, no match for {c['expect']!r})"
        failed += verdict != "caught"
        caught += verdict == "caught"
        print(f"{c['name']}: {verdict} ({secs:.0f} s, {log})", flush=True)
    print(f"sabotage.py: {len(cases)} cases, {caught} caught", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
