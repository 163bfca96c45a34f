"""Train a one-layer attention model with hand-written gradients: no autograd, no framework.

The task is multi-query associative recall. A sequence first lists ``pairs`` key-value
pairs (each position holds one pair: a key token and a value token, keys distinct), then
asks for ``queries`` of those keys again (the value slot blank); the model must answer each
query with the value stored under its key. One causal attention layer solves it: a query
position attends to the pair position whose key matches and copies its value.

Model (``D = d_model``, ``H`` heads of ``D / H`` dims)::

    x      = key_embed[key] + value_embed[value] + pos_embed[position]      (B, N, D)
    q,k,v  = x W_q, x W_k, x W_v, split into heads                          (B, N, H, D/H)
    a      = cupyflash.attention_vjp(q, k, v, causal=True, layout="bshd")   (B, N, H, D/H)
    h      = x + a W_o                                                       residual
    logits = h[query positions] W_unembed                                    (B, queries, vocab)
    loss   = mean softmax cross-entropy against the stored values

Every gradient is written out in `forward`'s backward closure; cupyflash gives the
attention's (dq, dk, dv); Adam is `adam_step`. tests/test_examples.py checks the gradients
against finite differences in float64.

Runs on a GPU with CuPy (arrays are CuPy arrays, attention runs in the GPU kernels) and
otherwise on NumPy with cupyflash's NumPy backend, with smaller defaults so that it
reaches a low loss in about 12 s on two CPU cores (the GPU defaults take about 16 s on
an H200).

    python examples/train_tiny_transformer.py [--steps S] [--seq-len N] [--d-model D]
        [--heads H] [--dtype bfloat16] [--seed 0] [--plot loss.png]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers "bfloat16" as a NumPy dtype name)
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout too

import cupyflash  # noqa: E402
from cupyflash import _cuda  # noqa: E402

# Defaults per machine. The CPU ones train in about 12 s on two cores (loss ~1e-3 by step
# 300); the GPU ones give the kernels longer rows and train in about 16 s on an H200 (on
# the NumPy backend, bf16 inputs at ~1 s a step, they reach loss 2e-3 by step 200).
CPU_DEFAULTS = dict(seq_len=64, vocab=64, d_model=64, heads=2, batch=32, steps=600, dtype="float32")
GPU_DEFAULTS = dict(seq_len=256, vocab=128, d_model=128, heads=4, batch=64, steps=1000, dtype="bfloat16")


@dataclass(frozen=True)
class Config:
    """Task and model sizes. The first ``pairs`` positions store pairs, the rest ask."""

    seq_len: int
    vocab: int  # key tokens and value tokens each take values in range(vocab)
    d_model: int
    heads: int
    dtype: str = "float32"  # attention inputs; parameters are float32 (float64 for float64)

    @property
    def pairs(self):
        return self.seq_len // 2

    @property
    def queries(self):
        return self.seq_len - self.pairs

    @property
    def blank(self):
        """The value token of a query position: one past the real values."""
        return self.vocab

    @property
    def param_dtype(self):
        return np.float64 if self.dtype == "float64" else np.float32

    def check(self):
        if self.seq_len < 2:
            raise ValueError(f"seq_len must be at least 2, got {self.seq_len}")
        if self.vocab < self.pairs:
            raise ValueError(f"vocab ({self.vocab}) must be at least the number of pairs "
                             f"({self.pairs}): the keys of one sequence are distinct")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")


def array_module(x):
    """numpy for NumPy arrays, cupy for CuPy arrays (cupy is imported only when in use)."""
    if isinstance(x, np.ndarray):
        return np
    import cupy
    return cupy


def make_batch(rng, cfg, batch, xp=np):
    """One batch of recall problems: (key ids, value ids, target values), int arrays on xp.

    ``key_ids`` and ``value_ids`` are (batch, seq_len); ``targets`` is (batch, queries),
    the value stored under each queried key.
    """
    keys = np.argsort(rng.random((batch, cfg.vocab)), axis=1)[:, :cfg.pairs]  # distinct per row
    values = rng.integers(cfg.vocab, size=(batch, cfg.pairs))
    asked = rng.permuted(np.tile(np.arange(cfg.pairs), (batch, 1)), axis=1)
    asked = np.concatenate([asked, rng.integers(cfg.pairs, size=(batch, cfg.queries - cfg.pairs))], axis=1)
    key_ids = np.concatenate([keys, np.take_along_axis(keys, asked, axis=1)], axis=1)
    value_ids = np.concatenate([values, np.full((batch, cfg.queries), cfg.blank)], axis=1)
    targets = np.take_along_axis(values, asked, axis=1)
    return tuple(xp.asarray(a) for a in (key_ids, value_ids, targets))


def init_params(rng, cfg, xp=np):
    """Embeddings with unit-variance entries; matrices scaled by 1/sqrt(fan-in), so that the
    attention scores start near unit variance (neither uniform nor saturated)."""
    D, V = cfg.d_model, cfg.vocab
    shapes = {"key_embed": (V, D), "value_embed": (V + 1, D), "pos_embed": (cfg.seq_len, D),
              "w_q": (D, D), "w_k": (D, D), "w_v": (D, D), "w_o": (D, D), "w_unembed": (D, V)}
    return {name: xp.asarray(rng.standard_normal(shape) / (math.sqrt(shape[0]) if name.startswith("w_") else 1.0),
                             dtype=cfg.param_dtype)
            for name, shape in shapes.items()}


def one_hot(ids, rows, dtype, xp):
    return xp.eye(rows, dtype=dtype)[ids]


def cross_entropy(logits, targets, xp):
    """Mean softmax cross-entropy, its gradient w.r.t. the logits, and the accuracy."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
    picked = xp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    count = targets.size
    dlogits = (xp.exp(log_probs) - one_hot(targets, logits.shape[-1], logits.dtype, xp)) / count
    accuracy = (logits.argmax(axis=-1) == targets).mean()
    return -picked.sum() / count, dlogits, accuracy


def forward(params, batch, cfg, *, backend="auto"):
    """The loss on one batch, its accuracy, and a closure that returns the gradients.

    Returns ``(loss, accuracy, gradients)`` where ``gradients()`` gives a dict shaped like
    ``params``; loss and accuracy are 0-d arrays on the parameters' array module.
    """
    key_ids, value_ids, targets = batch
    xp = array_module(params["w_q"])
    B, N = key_ids.shape
    D, H = cfg.d_model, cfg.heads
    P = cfg.pairs

    x = params["key_embed"][key_ids] + params["value_embed"][value_ids] + params["pos_embed"][:N]
    heads = [(x @ params[w]).reshape(B, N, H, D // H).astype(cfg.dtype, copy=False) for w in ("w_q", "w_k", "w_v")]
    attn, attention_grads = cupyflash.attention_vjp(*heads, causal=True, layout="bshd", backend=backend)
    a = attn.reshape(B, N, D).astype(x.dtype, copy=False)
    h = x + a @ params["w_o"]
    h_asked = h[:, P:]
    loss, dlogits, accuracy = cross_entropy(h_asked @ params["w_unembed"], targets, xp)

    def gradients():
        grads = {"w_unembed": h_asked.reshape(-1, D).T @ dlogits.reshape(-1, cfg.vocab)}
        dh = xp.zeros_like(h)
        dh[:, P:] = dlogits @ params["w_unembed"].T
        grads["w_o"] = a.reshape(-1, D).T @ dh.reshape(-1, D)
        da = (dh @ params["w_o"].T).reshape(B, N, H, D // H).astype(cfg.dtype, copy=False)
        dx = dh.copy()  # the residual path
        for w, dproj in zip(("w_q", "w_k", "w_v"), attention_grads(da)):
            dproj = dproj.reshape(B, N, D).astype(x.dtype, copy=False)
            grads[w] = x.reshape(-1, D).T @ dproj.reshape(-1, D)
            dx += dproj @ params[w].T
        flat_dx = dx.reshape(-1, D)
        for name, ids in (("key_embed", key_ids), ("value_embed", value_ids)):
            rows = params[name].shape[0]
            grads[name] = one_hot(ids.ravel(), rows, x.dtype, xp).T @ flat_dx
        grads["pos_embed"] = xp.zeros_like(params["pos_embed"])
        grads["pos_embed"][:N] = dx.sum(axis=0)
        return grads

    return loss, accuracy, gradients


def adam_init(params):
    xp = array_module(params["w_q"])
    return {"step": 0, "m": {n: xp.zeros_like(p) for n, p in params.items()},
            "v": {n: xp.zeros_like(p) for n, p in params.items()}}


def adam_step(params, grads, state, lr, beta1=0.9, beta2=0.999, eps=1e-8):
    """One Adam update of ``params`` in place (Kingma & Ba, with bias correction)."""
    state["step"] += 1
    t = state["step"]
    for name, g in grads.items():
        m, v = state["m"][name], state["v"][name]
        m *= beta1
        m += (1 - beta1) * g
        v *= beta2
        v += (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**t), v / (1 - beta2**t)
        params[name] -= lr * m_hat / (v_hat ** 0.5 + eps)


def train(cfg, *, steps, batch, lr, seed, xp, log_every=50, log=print, backend="auto"):
    """Train from scratch; returns (params, per-step losses as floats)."""
    rng = np.random.default_rng(seed)
    params = init_params(rng, cfg, xp)
    state = adam_init(params)
    losses = []
    for step in range(1, steps + 1):
        loss, accuracy, gradients = forward(params, make_batch(rng, cfg, batch, xp), cfg, backend=backend)
        adam_step(params, gradients(), state, lr)
        losses.append(float(loss))
        if step % log_every == 0 or step == 1 or step == steps:
            log(f"step {step:5d}  loss {losses[-1]:.4f}  batch accuracy {float(accuracy):.3f}")
    return params, losses


def evaluate(params, cfg, *, batches, batch, seed, xp, backend="auto"):
    """Mean loss and accuracy on fresh batches (no gradients are computed)."""
    rng = np.random.default_rng(seed)
    results = [forward(params, make_batch(rng, cfg, batch, xp), cfg, backend=backend)[:2]
               for _ in range(batches)]
    return tuple(sum(float(r[i]) for r in results) / batches for i in (0, 1))


def plot_losses(losses, path, title):
    try:
        import matplotlib
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install 'cupyflash[bench]' or "
              "matplotlib); no plot written")
        return
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(np.arange(1, len(losses) + 1), losses, lw=1)
    ax.set(xlabel="step", ylabel="training loss (cross-entropy, nats)", yscale="log", title=title)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"loss curve written to {path}")


def parse_args(argv, on_gpu):
    defaults = GPU_DEFAULTS if on_gpu else CPU_DEFAULTS
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Defaults are this machine's (GPU or NumPy backend).")
    p.add_argument("--steps", type=int, default=defaults["steps"],
                   help="training steps (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=defaults["seq_len"],
                   help="N: half stores key-value pairs, half asks for them (default: %(default)s)")
    p.add_argument("--vocab", type=int, default=defaults["vocab"], help="key and value tokens, >= N/2 (default: %(default)s)")
    p.add_argument("--d-model", type=int, default=defaults["d_model"],
                   help="model width (default: %(default)s)")
    p.add_argument("--heads", type=int, default=defaults["heads"],
                   help="attention heads (default: %(default)s)")
    p.add_argument("--batch", type=int, default=defaults["batch"],
                   help="sequences per step (default: %(default)s)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate (default: %(default)s)")
    p.add_argument("--dtype", default=defaults["dtype"],
                   choices=["float16", "bfloat16", "float32", "float64"],
                   help="dtype of the attention inputs; parameters stay float32, or float64 "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--log-every", type=int, default=50,
                   help="steps between printed losses (default: %(default)s)")
    p.add_argument("--plot", type=Path, metavar="PATH", help="save the loss curve as a PNG")
    return p.parse_args(argv)


def main(argv=None):
    on_gpu = _cuda.gpu_available()
    args = parse_args(argv, on_gpu)
    if on_gpu:
        import cupy as xp
        where = "GPU (CuPy arrays, cupyflash's CUDA kernels)"
    else:
        xp = np
        where = "no GPU found: NumPy backend, smaller defaults"
    cfg = Config(seq_len=args.seq_len, vocab=args.vocab, d_model=args.d_model,
                 heads=args.heads, dtype=args.dtype)
    cfg.check()
    print(f"cupyflash {cupyflash.__version__} on {where}")
    print(f"associative recall: {cfg.pairs} pairs + {cfg.queries} queries, vocab {cfg.vocab}; "
          f"d_model {cfg.d_model}, {cfg.heads} heads, attention in {cfg.dtype}, batch {args.batch}, "
          f"{args.steps} steps; chance loss {math.log(cfg.vocab):.2f}")
    start = time.perf_counter()
    params, losses = train(cfg, steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed,
                           xp=xp, log_every=args.log_every)
    seconds = time.perf_counter() - start
    loss, accuracy = evaluate(params, cfg, batches=8, batch=args.batch, seed=args.seed + 1, xp=xp)
    print(f"trained in {seconds:.1f} s; on {8 * args.batch} fresh sequences: loss {loss:.4f}, "
          f"recall accuracy {accuracy:.3f} (chance {1 / cfg.vocab:.3f})")
    if args.plot:
        plot_losses(losses, args.plot, f"associative recall, N={cfg.seq_len}, {cfg.heads} heads, "
                    f"{cfg.dtype} attention ({'GPU' if on_gpu else 'NumPy backend'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
