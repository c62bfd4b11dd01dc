"""The benchmark harness: candidate JSON -> quality vs dense, execution proof, paired speed, verdicts, report."""
