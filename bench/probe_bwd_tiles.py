"""The Hopper backward's key-block tiles against each other, in one process: for each
tile of _kernels.BWD_SM90_KV_TILES[d] (alone at the front of the table, so every call
takes it), the --mods rows of the backward (N = 16k) and the dense grid's backward cells,
beside torch's cuDNN in the same run. Kernel work:

    python bench/probe_bwd_tiles.py [--head-dim 64] [--seqlens 2048 4096 16384] [--out DIR]

Prints one table a tile and writes each run's rows as JSON under --out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cupyflash  # noqa: E402
from cupyflash import _cuda, _kernels, bench  # noqa: E402


def main(argv):
    p = argparse.ArgumentParser()
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 16384])
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--commit", default=None)
    a = p.parse_args(argv)
    d = a.head_dim
    tiles = _kernels.BWD_SM90_KV_TILES[d]
    cupyflash.precompile(dtypes=["bfloat16"], head_dims=[d], options=True)
    commit = ["--commit", a.commit] if a.commit else []
    for tile in tiles:
        _kernels.BWD_SM90_KV_TILES[d] = (tile,)
        _cuda._BACKWARD_PLANS.clear()   # the plans chosen from the table before
        name = f"{tile[0]}x{tile[1]}"
        print(f"== tile (BLOCK_M, CONSUMERS) = {tile}", flush=True)
        bench.main(["--mods", "--passes", "bwd", "--mods-seqlens", "16384", "--head-dims", str(d),
                    "--out", str(a.out / f"mods-bwd-{name}.json"), *commit])
        bench.main(["--passes", "bwd", "--seqlens", *map(str, a.seqlens), "--head-dims", str(d),
                    "--dtypes", "bfloat16", "--peers", "torch-cudnn", "--wide-dtypes-seqlens",
                    "--out", str(a.out / f"grid-bwd-{name}.json"), *commit])
    _kernels.BWD_SM90_KV_TILES[d] = tiles
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
