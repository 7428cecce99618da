"""`python -m torch_dsv4_ops`: self-check every dsv4 op on the best device present.

On a GPU the Triton kernels run compiled; on the CPU they run under Triton's interpreter (the
process re-executes itself with TRITON_INTERPRET=1, which must be set before triton is imported).
Either way each op's results are compared byte for byte with the pure-torch reference on the CPU.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def _device(choice: str | None) -> torch.device:
    """The device to check on, or SystemExit with a one-line reason."""
    if choice is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(choice)
    except (RuntimeError, ValueError):
        raise SystemExit(f"python -m torch_dsv4_ops: --device {choice!r} is not a device; use cpu or cuda[:N]")
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"python -m torch_dsv4_ops: --device {choice}: dsv4 ops run on cpu or cuda (ROCm included), "
                         f"not {device.type}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(f"python -m torch_dsv4_ops: --device {choice}: no CUDA/ROCm GPU is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SystemExit(f"python -m torch_dsv4_ops: --device {choice}: only {torch.cuda.device_count()} GPU(s)")
    return device


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_dsv4_ops", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda[:N] or cpu (default: the GPU if present)")
    args = parser.parse_args(argv)
    device = _device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        # `python -m` imported the package (and triton) already: start again with the interpreter on
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "torch_dsv4_ops", *(argv if argv is not None else sys.argv[1:])],
                  dict(os.environ, TRITON_INTERPRET="1"))

    import torch_dsv4_ops
    from torch_dsv4_ops import selfcheck

    print(f"torch_dsv4_ops {torch_dsv4_ops.__version__}: torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; "
          f"{len(torch_dsv4_ops.OPS)} ops registered")
    rows = selfcheck.run(device)
    print(selfcheck.format_table(rows))
    failed = [r for r in rows if not r.ok]
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
