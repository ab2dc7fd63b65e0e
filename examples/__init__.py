"""Example plugins: kernels written in another project's conventions, registered with the
oracle through ``ORACLE_PLUGINS`` (see examples/README.md)."""
