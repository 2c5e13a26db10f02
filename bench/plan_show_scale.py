"""How long ``polykv plan show`` takes on a plan of many layers in one allocation group.

Writes plans of N layers (every layer SnapKV-prefill at 64 tokens, all in one ``cake`` or
``pyramidkv`` group) to a temporary folder and times ``plan show`` on each: in-process (after the
registry is built) and as a whole command (interpreter, torch and the registry included), beside the
start-up alone, measured in the same run. The time in-process should grow linearly with N.

    python bench/plan_show_scale.py --layers 2000 10000
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def write_plan(path: Path, layers: int, allocator: str) -> None:
    plan = {"schema_version": 1,
            "model": {"num_layers": layers, "num_kv_heads": 2, "head_dim": 32, "name": "big", "fingerprint": None},
            "provenance": {"context_tokens": 1024},
            "layers": [{"layer": i, "prefill": {"rule": "snapkv", "capacity": 64}, "decode": {"rule": "full"},
                        "k_bits": 16, "v_bits": 16} for i in range(layers)],
            "allocation": [{"allocator": allocator, "layers": list(range(layers))}]}
    path.write_text(json.dumps(plan))


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2000, 10000])
    ap.add_argument("--allocators", nargs="+", default=["cake", "pyramidkv"])
    args = ap.parse_args()

    import polykv.cli
    from polykv.registry import get_registry

    get_registry()
    startup = wall([sys.executable, "-c", "import polykv.cli; from polykv.registry import get_registry; "
                    "get_registry()"])
    print(f"start-up alone (interpreter, torch, registry): {startup:.2f} s")
    print("allocator  layers  in-process s  command s")
    with tempfile.TemporaryDirectory() as tmp:
        for allocator in args.allocators:
            for n in args.layers:
                path = Path(tmp) / f"{allocator}-{n}.plan.json"
                write_plan(path, n, allocator)
                start = time.perf_counter()
                with contextlib.redirect_stdout(io.StringIO()):
                    polykv.cli.main(["plan", "show", str(path)])
                inner = time.perf_counter() - start
                whole = wall([sys.executable, "-m", "polykv", "plan", "show", str(path)])
                print(f"{allocator:<10} {n:>6}  {inner:>12.2f}  {whole:>9.2f}")


if __name__ == "__main__":
    main()
