"""`paratrain doctor`: check this machine's (or torchrun's group's) parallel set-up in one command."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..core.outputs import check_writable


def add(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("doctor", help="check that multi-device training works here, and how fast the links are")
    p.add_argument("--devices", default="auto", help="the workers to check with (default: what --devices auto "
                                                      "picks; under torchrun or srun, its group)")
    p.add_argument("--json", action="store_true", help="print the whole report as JSON")
    p.add_argument("--out", help="folder for doctor.json and link.json (the fitted link, for `paratrain plan "
                                 "--link FILE`)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a collective that hangs fails "
                                                                "(default: 60)")
    p.add_argument("--skip-training", action="store_true", help="leave out the 1-vs-N training check (collectives "
                                                                 "only)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..core.errors import UserError
    from ..measure import doctor
    from ..runtime.env import detect

    if args.timeout <= 0:
        raise UserError(f"--timeout must be a number of seconds above 0, not {args.timeout}")
    if args.devices != "auto" and not (args.devices.isdigit() and int(args.devices) >= 1):
        raise UserError(f"--devices must be auto or a number of devices of at least 1, not '{args.devices}'")
    if args.out:
        check_writable(args.out)
    group = detect().in_group
    if group:
        report = doctor.examine_group(args.timeout)
    else:
        report = doctor.examine(args.devices, args.timeout, train=not args.skip_training)
    if group and report.get("rank", 0) != 0:  # rank 0 speaks for the group
        return 0 if report["passed"] else 1
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "doctor.json").write_text(json.dumps(report, indent=2) + "\n")
        doctor.write_link(report, out)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report, args.out)
    return 0 if report["passed"] else 1


def _print(report: dict, out: str | None) -> None:
    from ..measure.doctor import Check, _size
    from ..measure.doctor.inventory import described

    for node in report["nodes"]:
        print("\n".join(described(node)))
    sweep = report.get("collectives") or {}
    if sweep.get("rows"):
        print(f"{'size':>10}{'time us':>12}{'algbw GB/s':>12}{'busbw GB/s':>12}{'#wrong':>8}")
        for r in sweep["rows"]:
            print(f"{_size(r['bytes']):>10}{r['time_s'] * 1e6:>12.1f}{r['algbw'] / 1e9:>12.3f}{r['busbw'] / 1e9:>12.3f}"
                  f"{r['wrong']:>8}")
    for c in report["checks"]:
        print(Check(**c).line())
    if out and sweep.get("fit"):
        print(f"link: {Path(out) / 'link.json'} (for `paratrain plan --link {Path(out) / 'link.json'}`)")
    failed = sum(c["status"] == "failed" for c in report["checks"])
    slow = sum(c["status"] == "slow" for c in report["checks"])
    warned = f", {slow} with a warning" if slow else ""
    print(f"doctor: every check passed{warned}" if not failed else
          f"doctor: {failed} of {len(report['checks'])} checks failed{warned}")
