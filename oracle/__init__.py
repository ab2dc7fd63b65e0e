"""The oracle: cases, implementations, tolerance models, reports and the CLI."""
