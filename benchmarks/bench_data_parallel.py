"""Step time of gk.DataParallel vs the plain module (and nn.DataParallel on GPUs).

python benchmarks/bench_data_parallel.py [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json

from gpukit.bench.data_parallel import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model, a few seconds")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    args = parser.parse_args()
    results = run(quick=args.quick)
    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
        return
    print(f"{'figure':<52} {'value':>9} {'baseline':>9} {'ratio':>6}  target")
    for r in results:
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else "n/a"
        base = f"{r.baseline_value:.2f}" if r.baseline_value is not None else "n/a"
        print(
            f"{r.name:<52} {r.value:>7.2f}{r.unit} {base:>7}{r.unit} {ratio:>6}  {r.target or ''}"
        )
    if results:
        print(f"\n{results[0].note}; {results[0].extra.get('machine', {}).get('processor', '')}")


if __name__ == "__main__":
    main()
