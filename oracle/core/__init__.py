"""The oracle core: seeded cases, the implementation registry, the tolerance models, the
checks and the reports. It runs the reference and never imports a kernel."""
