"""What every rank of ``shardwise topology`` runs: ``python -m shardwise.topology.worker``.

All ranks discover the topology together; rank 0 prints it and writes the JSON and the PNG.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from shardwise.comm import current_world
from shardwise.topology.discover import discover
from shardwise.topology.measure import DEFAULT_SIZES
from shardwise.topology.report import draw_heatmap, format_topology


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardwise.topology.worker")
    parser.add_argument("--json", default=None, help="write the topology here (rank 0)")
    parser.add_argument("--png", default=None, help="draw the heat map here (rank 0)")
    parser.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)))
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    world = current_world.init()  # the command's own world: every rank of the launch
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
        topo = discover(world.group, sizes=sizes, reps=args.reps)
        if world.rank == 0:
            print(format_topology(topo), flush=True)
            if args.json:
                topo.write_json(args.json)
                print(f"wrote {args.json}", flush=True)
            if args.png:
                print(f"wrote {draw_heatmap(topo, args.png)}", flush=True)
    finally:
        current_world.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
