"""Does the 16-bit warpgroup MMA round its fp32 accumulator to nearest or truncate it?

Through the public API: q = 0, so every score is 0 and every P is exactly 1; v holds
integers up to 2048, exact in fp16 after the halves' scale (2^3). With precision="tf32"
the Hopper forward accumulates P V over all keys on the tensor cores (fwd_sm90.cu: one
product into O's accumulator), so O's sum passes 2^24 and each k-step's addition rounds.
Truncation biases the sum by about half an ulp a k-step (relative error ~1e-4 at 64k
keys); rounding to nearest leaves a random walk (~1e-6). precision="highest" sums each key
tile from zero and adds the tiles in the FPU (exact here below 2^24 a tile): the control.

    python bench/wgmma_accumulation_probe.py
"""

import cupy as cp
import numpy as np

import cupyflash


def main():
    rng = np.random.default_rng(0)
    for nk in (4096, 65536):
        v = rng.integers(1024, 2049, size=(1, 1, nk, 64)).astype(np.float32)
        q = np.zeros((1, 1, 128, 64), np.float32)
        k = rng.standard_normal((1, 1, nk, 64)).astype(np.float32)
        exact = v.astype(np.float64).mean(axis=2)   # every row of o
        for precision in ("highest", "tf32"):
            o = cp.asnumpy(cupyflash.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), precision=precision))
            err = (o.astype(np.float64) - exact[:, :, None, :]) / exact[:, :, None, :]
            print(f"keys {nk:6d} {precision:8s} relative error of o: mean {err.mean():+.2e}, "
                  f"max |.| {np.abs(err).max():.2e}")


if __name__ == "__main__":
    main()
