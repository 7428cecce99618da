"""`python -m torch_dsv4_ops`: self-check every dsv4 op on the best device present."""
from __future__ import annotations

import argparse
import sys

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_dsv4_ops", description=__doc__)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: the GPU if present)")
    args = parser.parse_args(argv)

    import torch_dsv4_ops
    from torch_dsv4_ops import selfcheck

    device = torch.device(args.device) if args.device else selfcheck.best_device()
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
