"""`python -m registry list` (a table of the entries), `python -m registry validate` (CI's check) and
`python -m registry pr-check --base <ref>` (what a pull request touches, validated and smoke-evaluated:
registry/pr_check.py)."""

from __future__ import annotations

import argparse
import difflib
import sys

from registry.schema import SpecAlgorithm, entry_names
from registry.validate import resolve_all, validate_all


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def cmd_list() -> int:
    rows = [["name", "family", "checkpoint", "dtype", "quant", "spec/draft", "replay", "world size",
             "baseline", "nightly"]]
    failed = 0
    for report in resolve_all():
        if report.resolved is None:
            rows.append([report.name, "(invalid: python -m registry validate)"] + [""] * 8)
            failed += 1
            continue
        e = report.resolved.entry
        spec = "none" if e.speculative.algorithm == SpecAlgorithm.none else \
            f"{e.speculative.algorithm.value}/{e.speculative.draft_len}"
        ckpt = f"registry/checkpoints/{e.checkpoint}" if e.embedded else e.checkpoint
        rows.append([e.name, e.family.value, ckpt, e.dtype.value, e.quant.value, spec,
                     str(e.ssm.replay).lower(), str(e.world_size), e.baseline or "-",
                     "yes" if e.nightly else "-"])
    print(_table(rows))
    return 1 if failed else 0


def cmd_validate(names: list[str]) -> int:
    unknown = [n for n in names if n not in entry_names()]
    if unknown:
        close = [m for n in unknown for m in difflib.get_close_matches(n, entry_names(), n=2, cutoff=0.4)]
        hint = f"did you mean {' or '.join(dict.fromkeys(close))}? " if close else ""
        print(f"error: unknown registry entries {unknown}", file=sys.stderr)
        print(f"  fix: {hint}choose from {', '.join(entry_names())}", file=sys.stderr)
        return 2
    reports = validate_all(names or None)
    for r in reports:
        print(f"{'ok  ' if not r.errors else 'FAIL'}  {r.name}")
        for msg in r.errors:
            print(f"      error: {msg}")
        for msg in r.notes:
            print(f"      note: {msg}")
    bad = [r.name for r in reports if r.errors]
    if bad:
        print(f"error: {len(bad)} of {len(reports)} registry entries are invalid: {', '.join(bad)}",
              file=sys.stderr)
        print("  fix: correct the entries as each error line above says", file=sys.stderr)
        return 1
    print(f"{len(reports)} registry entries valid")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m registry", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="print a table of the registry entries")
    p_val = sub.add_parser("validate", help="check every entry (schema, composition, sweeps, baselines)")
    p_val.add_argument("names", nargs="*", help="entries to check (default: all)")
    from registry import pr_check

    p_pr = sub.add_parser("pr-check", help="check the entries and baseline rows a change touches (CI)")
    pr_check.add_arguments(p_pr)
    args = parser.parse_args(argv)
    if args.command == "pr-check":
        return pr_check.run_from_args(args)
    return cmd_list() if args.command == "list" else cmd_validate(args.names)


if __name__ == "__main__":
    sys.exit(main())
