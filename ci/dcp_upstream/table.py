"""The pass table of PyTorch's DCP tests, as is and on ckptlib's storage (see run.sh).

python table.py OUT_DIR FILE...   (reads OUT_DIR/<file>-plain.xml and -ckptlib.xml)
"""

import json
import os
import sys
import xml.etree.ElementTree as ET


def outcomes(path: str) -> dict[str, str]:
    """{test id: passed | failed | skipped} from a junit XML."""
    found: dict[str, str] = {}
    if not os.path.exists(path):  # the run did not get as far as writing it: see its .log
        return found
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            found[name] = "failed"
        elif case.find("skipped") is not None:
            found[name] = "skipped"
        else:
            found[name] = "passed"
    return found


def main(out: str, files: list[str]) -> None:
    print("| file | plain DCP: pass / fail / skip | ckptlib storage: pass / fail / skip | lost |")
    print("| --- | --- | --- | --- |")
    differ = []
    for file in files:
        stem = file[: -len(".py")]
        plain, ours = outcomes(f"{out}/{stem}-plain.xml"), outcomes(f"{out}/{stem}-ckptlib.xml")

        def counts(results: dict[str, str]) -> str:
            return " / ".join(str(sum(v == k for v in results.values())) for k in ("passed", "failed", "skipped"))

        lost = sorted(t for t, v in plain.items() if v == "passed" and ours.get(t) != "passed")
        differ += [f"{file}::{t}" for t in lost]
        print(f"| {file} | {counts(plain)} | {counts(ours)} | {len(lost)} |")
    for test in differ:
        print(f"- passes on plain DCP, not on ckptlib: `{test}`")
    for file in files:
        path = f"{out}/{file[: -len('.py')]}-ckptlib.swaps"
        lines = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
        pids = {entry["pid"] for entry in lines}
        print(f"- {file}: ckptlib's writer/reader constructed {len(lines)} times in {len(pids)} processes")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
