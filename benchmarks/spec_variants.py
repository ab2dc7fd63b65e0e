"""How many Triton compiles a random-shape run needs: the specialisation keys of the
launches a set of drawn cases makes, counted on the CPU without running the kernels.

A Triton kernel compiles once per key: its constexprs, its tensors' dtypes and 16-byte
alignment, and each integer argument not in ``do_not_specialize`` classed as 1, a multiple
of 16 or other (Triton 3.6's specialisation). This tool runs the Triton implementation of
an op on ``--cases`` cases drawn as the false-alarm run draws them (``oracle.tools.falsealarm.
draw_cases``, ``--configs`` as there) with the interpreter's launch replaced by a recorder
(nothing executes, so a launcher that reads a kernel's output gets zeros: the count is
exact for single-launch paths and a lower bound elsewhere), and prints, per kernel, the
distinct keys after every fifth of the cases and the arguments whose class varied. On a GPU
a fuzz or false-alarm case that meets a new key pays a compile (seconds with many workers
compiling at once), so keys per case near 1 mean a compile-bound run.

Run: ``TRITON_INTERPRET=1 .venv/bin/python -m benchmarks.spec_variants attention_decode
--cases 150 [--shape-classes small]``.
"""

from __future__ import annotations

import argparse
import inspect
import os
from collections import defaultdict


def _arg_class(value):
    import torch

    if isinstance(value, torch.Tensor):
        return str(value.dtype), value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return "1" if value == 1 else "16k" if value % 16 == 0 else "int"
    if isinstance(value, float):
        return "fp32"
    return repr(value)


def launch_key(fn, do_not_specialize, args, kwargs) -> tuple:
    """The specialisation key of one launch of kernel ``fn`` (module docstring)."""
    import torch

    skip = set(do_not_specialize or ())
    key = []
    for param, value in zip(inspect.signature(fn).parameters.values(), args):
        if param.name in skip:
            if isinstance(value, torch.Tensor):
                key.append((param.name, str(value.dtype)))
            continue
        key.append((param.name, _arg_class(value)))
    return tuple(key) + tuple(sorted((k, repr(v)) for k, v in kwargs.items()))


def count_keys(op: str, cases: int, shape_classes=("small",), seed: int = 11,
               configs: int = 0, pin_formats: bool = False):
    """(curve, varied): distinct keys per kernel after each fifth of the cases, and per
    kernel the arguments whose class took more than one value. ``configs``: the cases'
    shapes from that many shape configs (``Case.config``; 0: each case its own);
    ``pin_formats``: their format fields too (``oracle.core.cases.config_formats``)."""
    from triton.runtime.interpreter import InterpretedFunction

    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("count_keys records the Triton interpreter's launches: run it with "
                           "TRITON_INTERPRET=1 (kernels compiled for a GPU never reach the "
                           "recorder)")
    from oracle.core.cases import make_inputs
    from oracle.core.registry import implementations
    from oracle.impls.catalog import load_all
    from oracle.tools.falsealarm import draw_cases

    load_all()

    keys: dict = defaultdict(set)

    def record(self, *args, grid, warmup, **kwargs):
        keys[self.fn.__name__].add(launch_key(self.fn, self.kwargs.get("do_not_specialize"),
                                              args, kwargs))

    original = InterpretedFunction.run
    InterpretedFunction.run = record
    try:
        (impl,) = implementations(op, ["triton"], "cpu")
        curve = []
        drawn = draw_cases(op, cases, seed=seed, shape_classes=tuple(shape_classes),
                           configs=configs, pin_formats=pin_formats)
        step = max(1, cases // 5)
        for i, case in enumerate(drawn, 1):
            ok, why = impl.supports(case)
            # The interpreter declines the larger shape classes for time; nothing runs here.
            if ok or why.startswith("shape class"):
                try:
                    impl.run(make_inputs(case))
                except Exception:  # noqa: BLE001 - a launcher reading unrun outputs
                    pass
            if i % step == 0 or i == cases:
                curve.append((i, {k: len(v) for k, v in sorted(keys.items())}))
    finally:
        InterpretedFunction.run = original
    varied = {}
    for name, ks in keys.items():
        classes = defaultdict(set)
        for k in ks:
            for arg, cls in k:
                classes[arg].add(cls)
        varied[name] = {arg: len(v) for arg, v in classes.items() if len(v) > 1}
    return curve, varied


def main(argv=None) -> int:
    from oracle.core.cases import OPS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ops", nargs="+", choices=list(OPS))
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--shape-classes", nargs="+", default=["small"])
    ap.add_argument("--configs", type=int, default=0, help="shape configs (0: none)")
    ap.add_argument("--pin-formats", action="store_true", help="configs fix the formats too")
    args = ap.parse_args(argv)
    if args.cases < 1:
        ap.error(f"--cases must be >= 1, got {args.cases}")
    print("| op | kernel | cases | distinct keys | keys per case |")
    print("|---|---|---:|---:|---:|")
    for op in args.ops:
        curve, varied = count_keys(op, args.cases, args.shape_classes, configs=args.configs,
                                   pin_formats=args.pin_formats)
        n, last = curve[-1]
        for name, k in last.items():
            print(f"| {op} | {name} | {n} | {k} | {k / n:.2f} |")
        for name, v in varied.items():
            print(f"  {name}: curve {[(i, c.get(name, 0)) for i, c in curve]}; varied "
                  f"{v}")
    return 0


if __name__ == "__main__":
    # Here, not at import: a test importing this module must not turn the interpreter on
    # for a GPU process (torch.compile's kernels would then be interpreted and fail).
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is decorated
    raise SystemExit(main())
