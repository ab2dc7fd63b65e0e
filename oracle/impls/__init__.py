"""The implementations: adapters that run each kernel and peer on a case's inputs, and
their registration in the core registry. ``catalog.load_all()`` registers them all (the
project's modules named in ``catalog.MODULES``, then ``$ORACLE_PLUGINS``); importing a
module of this package registers nothing by itself."""
