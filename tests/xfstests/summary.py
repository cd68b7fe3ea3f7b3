#!/usr/bin/env python3
"""Summary of an xfstests run: pass / fail / not-run counts and each failure's first line.

    summary.py RESULTS XFSTESTS_DIR EXCLUDE_FILE TARGET SECONDS

Reads the suite's output (RESULTS/../check.log, one block per test: `generic/001 3s ...`,
`[not run] REASON`, `[expunged]`, `- output mismatch (see FILE)`, `[failed, exit status N]`, or
a message of the per-test check) and the RESULTS tree (NNN.out.bad beside the golden output).
A failure's first line is the first line its output added to the golden output (else the first
it lost), or the suite's own message when the output matched (a failed fsck, dmesg, exit status).
Also prints the excluded tests with their reasons, and writes passed.txt, failed.txt and
notrun.txt beside the log. Exit 1 when a test failed, else 0.
"""
import difflib
import os
import re
import sys

results, xfstests_dir, exclude_file, target, seconds = sys.argv[1:6]
log_path = os.path.join(os.path.dirname(results), "check.log")
log = open(log_path, errors="replace").read().splitlines() if os.path.exists(log_path) else []

test_re = re.compile(r"^(\w+/\d+)\b\s*(.*)$")
blocks = {}  # test -> lines of its block, in run order
order = []
current = None
for line in log:
    m = test_re.match(line)
    if m and os.path.exists(os.path.join(xfstests_dir, "tests", m.group(1))):
        current = m.group(1)
        if current not in blocks:
            order.append(current)
            blocks[current] = []
        blocks[current].append(m.group(2))
    elif line.startswith(("Ran:", "Not run:", "Failures:", "Failed ", "Passed all", "SECTION")):
        current = None
    elif current is not None:
        blocks[current].append(line)


def first_line(test, lines):
    bad = os.path.join(results, test + ".out.bad")
    golden = os.path.join(xfstests_dir, "tests", test + ".out")
    if os.path.exists(bad) and os.path.exists(golden):
        want = open(golden, errors="replace").read().splitlines()
        got = open(bad, errors="replace").read().splitlines()
        diff = [d for d in difflib.unified_diff(want, got, lineterm="", n=0)
                if d[:1] in "+-" and not d.startswith(("+++", "---"))]
        added = [d for d in diff if d.startswith("+")]
        if added or diff:
            return (added or diff)[0]
    text = " ".join(x.strip() for x in lines if x.strip())
    return text[:200] or "failed (no message)"


passed, failed, notrun, excluded = [], [], [], []
for test in order:
    lines = blocks[test]
    text = "\n".join(lines)
    if "[expunged]" in text:
        excluded.append(test)
    elif "[not run]" in text:
        notrun.append((test, text.split("[not run]", 1)[1].strip().splitlines()[0]))
    elif re.search(r"output mismatch|\[failed|_check_|inconsistent|\bfailed\b", text):
        failed.append((test, first_line(test, lines)))
    elif re.search(r"\d+s", text):
        passed.append(test)
    else:  # the run stopped inside this test (time limit)
        failed.append((test, "did not finish (the run was stopped)"))

# The lists beside the log (passed.txt, failed.txt, notrun.txt).
out_dir = os.path.dirname(results)
for name, tests in (("passed", passed), ("failed", [t for t, _ in failed]), ("notrun", [t for t, _ in notrun])):
    with open(os.path.join(out_dir, name + ".txt"), "w") as f:
        f.writelines(t + "\n" for t in tests)

def reasons_of(path):
    out = {}
    if path and os.path.exists(path):
        for line in open(path):
            name, _, why = line.partition("#")
            if name.strip():
                out[name.strip()] = why.strip()
    return out


reasons = reasons_of(exclude_file)
# XFSTESTS_KNOWN (run.sh --ci): failures listed there are reported, not judged.
known = reasons_of(os.environ.get("XFSTESTS_KNOWN"))
known_failed = [(t, why) for t, why in failed if t in known]
failed = [(t, why) for t, why in failed if t not in known]

known_note = f" (+{len(known_failed)} known)" if known else ""
print(f"=== xfstests on {target}: {len(passed)} passed, {len(failed)} failed{known_note}, "
      f"{len(notrun)} not run, {len(excluded)} excluded ({int(seconds) // 60} min {int(seconds) % 60} s)")
for test, why in failed:
    print(f"FAIL {test}: {why}")
for test, why in known_failed:
    print(f"known failure {test}: {why}\n    reason: {known[test]}")
for test in passed:
    if test in known:
        print(f"known failure {test} passed this time (if it keeps passing, take it off known-failures.txt)")
for test in excluded:
    print(f"excluded {test}: {reasons.get(test, '(see exclude.txt)')}")
if os.environ.get("XFSTESTS_SHOW_NOTRUN") == "1":
    for test, why in notrun:
        print(f"not run {test}: {why}")
else:
    counts = {}
    for _, why in notrun:
        counts[why] = counts.get(why, 0) + 1
    for why, n in sorted(counts.items(), key=lambda kv: -kv[1])[:12]:
        print(f"not run ({n}): {why}")
if not order:
    print("no test ran: see " + log_path)
    sys.exit(1)
sys.exit(1 if failed else 0)
