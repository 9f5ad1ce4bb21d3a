"""Task accuracy of each verifier precision (GSM8K, HumanEval, MMLU): the paper's accuracy table in miniature.

`runner.evaluate(EvalConfig(...))` runs every task on every verifier and returns an EvalReport."""
