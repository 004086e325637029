"""JUnit XML: one testcase per task, so CI systems show the gate like test results.

Task names come from the user's metric or JSON files: shown as ``qdebug.safe_text.escaped``
writes them, since XML 1.0 cannot carry most control characters at all and a CI log shows
the rest raw."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pandas as pd

from qdebug.io.atomic import atomic_open
from qdebug.safe_text import escaped


def junit_xml(frame: pd.DataFrame, *, suite: str = "qdebug.baseline") -> str:
    failures = int((frame["verdict"] == "fail").sum())
    skipped = int((frame["verdict"] == "inconclusive").sum())
    root = ET.Element("testsuite", name=suite, tests=str(len(frame)), failures=str(failures),
                      errors="0", skipped=str(skipped))
    for row in frame.to_dict("records"):
        task = escaped(row["task"])
        case = ET.SubElement(root, "testcase", classname=suite, name=task)
        text = (f"quantized {row['quantized']:.6g} vs float {row['float']:.6g}: score {row['score']:.4f}, "
                f"required ratio {row['ratio']:g} ({row['direction']} is better), margin {row['margin']:+.6g}")
        if not math.isnan(row.get("ci_low", math.nan)):
            text += f"; interval [{row['ci_low']:.4f}, {row['ci_high']:.4f}]"
        if row["verdict"] == "fail":
            ET.SubElement(case, "failure", message=f"{task} below baseline").text = text
        elif row["verdict"] == "inconclusive":
            ET.SubElement(case, "skipped", message="inconclusive: eval set too small to decide").text = text
        else:
            ET.SubElement(case, "system-out").text = text
    return ET.tostring(root, encoding="unicode", xml_declaration=True)


def write_junit(path: str | Path, frame: pd.DataFrame) -> Path:
    with atomic_open(path, "w") as fh:
        fh.write(junit_xml(frame) + "\n")
    return Path(path)
