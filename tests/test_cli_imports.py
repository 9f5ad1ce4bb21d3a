"""The CLI imports only the subcommand it runs: `quasar --help` and a `quasar generate` command line must not
pull in plotting, the eval tasks, the bench or the HTTP server (each checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("matplotlib", "quasar.tools.evals", "quasar.tools.bench", "fastapi", "uvicorn", "starlette", "quasar.serve")

PROBE = """
import json, sys
argv, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
if argv[0] == "generate":
    import quasar.commands.generate as generate
    generate.run = lambda args: 0  # parse the command line, generate nothing
from quasar.cli import main
try:
    main(argv)
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))))
"""


def imported_after(argv: list[str]) -> tuple[list[str], str]:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(argv), json.dumps(HEAVY)],
                         capture_output=True, text=True, timeout=120, check=True)
    lines = out.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1])


def test_help_lists_every_subcommand_without_importing_them():
    from quasar.cli import COMMANDS

    heavy, help_text = imported_after(["--help"])
    assert heavy == []
    for name, summary in COMMANDS.items():
        assert name in help_text and summary.split()[0] in help_text


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--max-new-tokens", "8", "--seed", "3", "--json"],
    ["generate", "-", "--model", "default", "--verifier", "w8a8", "--drafter", "ngram", "--k", "auto"],
])
def test_generate_command_line_parses_without_heavy_imports(argv):
    assert imported_after(argv)[0] == []


def test_each_subcommand_registers_the_one_line_help_the_table_lists():
    """The table in cli.py is what `quasar --help` shows; the module's own help must not drift from it."""
    from quasar.cli import COMMANDS, build_parser

    for name, summary in COMMANDS.items():
        parser = build_parser(name)
        sub = next(a for a in parser._actions if a.dest == "command")
        helps = {choice.dest: choice.help for choice in sub._choices_actions}
        assert helps[name] == summary
