#!/usr/bin/env python3
"""What a meson test run skipped, and why, from its meson-logs/testlog.json: each skipped test with
the reason it printed (tests/skip_test.sh prints "SKIP: why"), and the GoogleTest and pytest cases
skipped inside tests that passed (GTEST_SKIP's message, pytest's -rs summary), grouped by reason. scripts/test.sh prints this
before its closing line.

usage: skip_reasons.py TESTLOG_JSON            the report
       skip_reasons.py --cases TESTLOG_JSON    the number of GoogleTest and pytest cases skipped inside passing tests"""
import collections
import json
import re
import sys

skipped_tests = []
inside = collections.Counter()
cases_only = sys.argv[1] == "--cases"
with open(sys.argv[-1]) as log:
    for line in log:
        test = json.loads(line)
        out = test.get("stdout") or ""
        if test.get("result") == "SKIP":
            reasons = [l[len("SKIP:"):].strip() for l in out.splitlines() if l.startswith("SKIP:")]
            skipped_tests.append("%s: %s" % (test["name"], reasons[-1] if reasons else "(no reason printed)"))
            continue
        # GoogleTest prints the skip's message between the case's RUN and SKIPPED lines. Under
        # mpirun every rank prints it; the cases are counted once per test and reason.
        reason, message_next = None, False
        seen = set()
        for text in out.splitlines():
            text = re.sub(r"\x1b\[[0-9;]*m", "", text)
            text = re.sub(r"^\[rank \d+\] ", "", text)
            if text.startswith("[ RUN      ]"):
                reason, message_next = None, False
            elif text.endswith(": Skipped"):
                message_next = True
            elif message_next and text.strip():
                reason, message_next = text.strip(), False
            match = re.match(r"\[  SKIPPED \] (\S+\.\S+)", text)
            if match and match.group(1) not in seen:
                seen.add(match.group(1))
                inside[(test["name"], reason or "(no message)")] += 1
            # pytest's short summary (-rs): "SKIPPED [N] file:line: reason", once per run it prints.
            match = re.match(r"SKIPPED \[(\d+)\] [^:]+(?::\d+)?: (.*)$", text)
            if match:
                inside[(test["name"], match.group(2))] += int(match.group(1))

if cases_only:
    print(sum(inside.values()))
    sys.exit(0)
for entry in skipped_tests:
    print("  skipped test  " + entry)
for (name, reason), cases in sorted(inside.items()):
    print("  inside %s: %d case(s) skipped: %s" % (name, cases, reason))
