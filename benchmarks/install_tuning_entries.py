"""Put measured tuning entries of one op into a device's table: `tuning/<device>.json` gets `entries` as that op's
list (its other ops are kept; the file is made if missing). The device is CUDA device 0 unless named.

    python benchmarks/install_tuning_entries.py dense_linear out/dense_table.json [--device-key nvidia_h200]

With `--prepend` the entries go ahead of the op's entries already there instead of replacing them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nibble.kernels.tuning_tables import TUNING_DIR


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("op")
    ap.add_argument("entries", type=Path)
    ap.add_argument("--device-key", default=None, help="table name (default: that of CUDA device 0)")
    ap.add_argument("--prepend", action="store_true", help="keep the op's entries, after these")
    args = ap.parse_args()
    key = args.device_key
    if key is None:
        from nibble.kernels._triton import device_key

        key = device_key("cuda:0")
    entries = json.loads(args.entries.read_text())
    if not isinstance(entries, list) or not all(isinstance(e, dict) and {"when", "config"} <= set(e) for e in entries):
        sys.exit(f"{args.entries}: expected a list of {{'when': ..., 'config': ...}} entries")
    path = TUNING_DIR / f"{key}.json"
    table = json.loads(path.read_text()) if path.is_file() else {}
    table[args.op] = entries + (table.get(args.op, []) if args.prepend else [])
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{path}: {len(entries)} {args.op} entries{' put first' if args.prepend else ''}")


if __name__ == "__main__":
    main()
