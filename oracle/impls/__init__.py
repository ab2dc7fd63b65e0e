"""The implementations: adapters that run each kernel and peer on a case's inputs, and
their registration in the core registry."""
