"""The tools on the oracle: the CLI, fuzzing, mutants, false-alarm runs, end-to-end
accuracy, the suite report and the tolerance models' soundness checks."""
