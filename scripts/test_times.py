"""    .venv/bin/python scripts/test_times.py --budget-min 12 fast.xml slow.xml

Reads pytest's JUnit XML reports and prints each report's test time and the bf16 path its run
took (fast bf16 matmul or the scalar loop of an AVX2-only CPU: the budget is read against the
machine), their sum against a budget, and the slowest tests of all reports together (.ci/run
calls it at the end)."""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET


def read_bf16_path(path: str) -> str:
    """What ``tests/conftest.py`` recorded of the run's bf16 matmul ("" for an older report)."""
    for prop in ET.parse(path).getroot().iter("property"):
        if prop.get("name") == "bf16_path":
            return prop.get("value", "")
    return ""


def read_cases(path: str) -> list:
    """(seconds, "file::test[id]") for every test case in one report."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        cases.append((float(case.get("time", 0.0)), f"{module}.py::{case.get('name')}"))
    return cases


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("reports", nargs="+", help="the budgeted runs (the README's command, the slow tests)")
    parser.add_argument("--also", nargs="*", default=[],
                        help="runs listed beside them but outside the budget (.ci/run: the isa tests again "
                             "under AVX2 kernels, a check of another kind of machine)")
    parser.add_argument("--budget-min", type=float, default=12.0)
    parser.add_argument("--slowest", type=int, default=15)
    args = parser.parse_args(argv)
    every, budgeted = [], 0.0
    for path in args.reports + args.also:
        cases = read_cases(path)
        every += cases
        minutes = sum(t for t, _ in cases) / 60
        budgeted += minutes if path in args.reports else 0.0
        where = read_bf16_path(path)
        print(f"{path}: {len(cases)} tests, {minutes:.1f} min" + (f" ({where})" if where else "")
              + ("" if path in args.reports else ", outside the budget"))
    verdict = "within" if budgeted <= args.budget_min else "OVER"
    print(f"tests: {budgeted:.1f} min in all, {verdict} the {args.budget_min:g}-minute budget"
          + (f"; {sum(t for t, _ in every) / 60:.1f} min with the runs outside it" if args.also else ""))
    print(f"slowest {args.slowest}:")
    for seconds, name in sorted(every, reverse=True)[:args.slowest]:
        print(f"  {seconds:7.2f} s  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
