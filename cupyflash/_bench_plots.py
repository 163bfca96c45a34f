"""Plots of `cupyflash.bench` results: TFLOP/s and peak memory against N, per case.

One figure per quantity, one panel per (dtype, d, causal, pass), one line per
implementation present in the results; failed measurements (null in the JSON) are left
out of the lines. Rows with a ``variant`` (``--mods``) get their own figure of bars. Needs matplotlib (the ``bench`` extra); `cupyflash.bench` imports this
module only to plot, so that measuring does not need it.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")  # files only: benchmarks run on machines without a display
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, NullFormatter  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

DTYPE_ORDER = ("float16", "bfloat16", "float32", "float64")
PASS_ORDER = ("fwd", "bwd")
# Fixed colours, so that an implementation looks the same in every plot and every run.
COLOURS = {"cupyflash": "tab:red", "torch-flash": "tab:blue", "torch-cudnn": "tab:green",
           "torch-efficient": "tab:orange", "torch-math": "tab:purple", "naive-cupy": "tab:gray"}
QUANTITIES = {
    "tflops": ("tflops", "TFLOP/s", 1.0, "linear"),
    "memory": ("peak_mem_bytes", "peak extra memory (MiB)", 2.0**-20, "log"),
}
PANEL_COLUMNS = 4
PANEL_INCHES = (4.2, 3.2)
HEADER_INCHES = 0.6  # title and legend above the panels


def _size_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def _cuda_version(code):
    """CUDA's integer version (12040) as text ("12.4")."""
    return f"{code // 1000}.{code % 1000 // 10}" if isinstance(code, int) else str(code)


def _title(result, what):
    v = result.get("versions", {})
    parts = [f"cupy {v.get('cupy')}", f"torch {v.get('torch')}" if v.get("torch") else "no torch",
             f"CUDA runtime {_cuda_version(v.get('cuda_runtime'))}, driver {_cuda_version(v.get('driver'))}"]
    if "cupyflash" in v:
        parts.insert(0, f"cupyflash {v['cupyflash']}")
    return (f"{what}, {result.get('gpu', 'unknown GPU')} - {result.get('date', '')[:10]}, "
            f"commit {str(result.get('commit', 'unknown'))[:12]}\n{'; '.join(parts)}")


def _whole_decades(ax, low, high):
    """Log axis from one power of ten to another, labelled in plain numbers: flat lines
    (O(N) memory on a constant-token grid) otherwise get a sliver of a decade and
    mantissa-exponent labels."""
    ax.set_ylim(10 ** math.floor(math.log10(low)), 10 ** math.ceil(math.log10(high * 1.0001)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _panel_key(row):
    return (row["dtype"], row["d"], row["causal"], row["pass"])


def _panel_order(key):
    dtype, d, causal, pass_ = key
    rank = DTYPE_ORDER.index(dtype) if dtype in DTYPE_ORDER else len(DTYPE_ORDER)
    return (rank, dtype, d, causal, PASS_ORDER.index(pass_) if pass_ in PASS_ORDER else 2)


def _impl_order(impl):
    return (impl != "cupyflash", list(COLOURS).index(impl) if impl in COLOURS else len(COLOURS), impl)


def plot_quantity(result, quantity, path):
    """One figure of `quantity` ("tflops" or "memory") against N; saved to `path`."""
    field, label, factor, yscale = QUANTITIES[quantity]
    panels = {}
    for row in result["rows"]:
        panels.setdefault(_panel_key(row), []).append(row)
    keys = sorted(panels, key=_panel_order)
    ncols = min(PANEL_COLUMNS, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    height = PANEL_INCHES[1] * nrows + HEADER_INCHES
    fig, axes = plt.subplots(nrows, ncols, figsize=(PANEL_INCHES[0] * ncols, height), squeeze=False)
    drawn = {}
    for ax, key in zip(axes.flat, keys):
        dtype, d, causal, pass_ = key
        impls = sorted({r["impl"] for r in panels[key]}, key=_impl_order)
        failed, values = [], []
        for impl in impls:
            points = sorted((r["N"], r[field] * factor) for r in panels[key]
                            if r["impl"] == impl and r[field] is not None)
            if points:
                n, y = zip(*points)
                values += y
                ours = impl == "cupyflash"  # drawn on top where a peer has the same values
                drawn[impl], = ax.plot(n, y, marker="o", ms=3, lw=1.5 if ours else 1, zorder=3 if ours else 2,
                                       color=COLOURS.get(impl), label=impl)
            else:  # said in the panel: a missing line should not read as "not measured"
                failed.append(impl)
            missing = [r["N"] for r in panels[key] if r["impl"] == impl and r[field] is None]
            if missing:  # an x on the N axis where a measurement failed (e.g. out of memory)
                ax.plot(missing, [0.0] * len(missing), "x", ms=4, color=COLOURS.get(impl), clip_on=False,
                        transform=blended_transform_factory(ax.transData, ax.transAxes))
        if failed:
            ax.text(0.02, 0.97, "failed: " + ", ".join(failed), transform=ax.transAxes,
                    fontsize=7, va="top", color="0.3")
        sizes = sorted({r["N"] for r in panels[key]})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [_size_label(n) for n in sizes])
        ax.minorticks_off()
        if not values:  # nothing but failures: no scale to show
            ax.set_yticks([])
        elif yscale == "linear":
            # Rates compared by eye need a zero; the headroom keeps the top line clear of
            # the "failed" note.
            ax.set_ylim(0, max(values) * 1.15)
        else:
            ax.set_yscale(yscale)
            _whole_decades(ax, min(values), max(values))
        ax.set_title(f"{dtype}, d={d}, {'causal' if causal else 'full'}, {pass_}", fontsize=9)
        ax.grid(True, which="major", alpha=0.3)
        ax.tick_params(labelsize=8)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("N (B = 16384 / N)", fontsize=8)
    for ax in axes[:, 0]:
        ax.set_ylabel(label, fontsize=8)
    handles = [drawn[impl] for impl in sorted(drawn, key=_impl_order)]
    fig.legend(handles, [h.get_label() for h in handles], loc="upper right", fontsize=8, ncol=len(handles))
    fig.suptitle(_title(result, label), fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - HEADER_INCHES / height))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _variant_label(row):
    return f"{row['impl']} {row['variant']}{' (causal)' if row['causal'] else ''}"


def plot_mods(result, path):
    """The modifier rows (``--mods``): one panel per (dtype, d, N, pass), a bar of
    milliseconds per implementation and variant, annotated with the speedup against the
    dense baseline where there is one; saved to `path`."""
    panels = {}
    for row in result["rows"]:
        if row.get("variant"):
            panels.setdefault((row["dtype"], row["d"], row["N"], row["pass"]), []).append(row)
    keys = sorted(panels, key=lambda k: (DTYPE_ORDER.index(k[0]) if k[0] in DTYPE_ORDER else 9, k[1],
                                         k[2], PASS_ORDER.index(k[3]) if k[3] in PASS_ORDER else 2))
    ncols = min(2, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    bars = max(len(rows) for rows in panels.values())
    panel_h = 1.2 + 0.22 * bars
    height = panel_h * nrows + HEADER_INCHES
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.5 * ncols, height), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        rows = panels[key]
        labels = [_variant_label(r) for r in rows]
        ms = [r["ms"] or 0.0 for r in rows]
        colours = [COLOURS.get(r["impl"], "0.5") for r in rows]
        ax.barh(range(len(rows)), ms, color=colours)
        for y, r in enumerate(rows):
            note = "failed" if r["ms"] is None else (
                f"{r['speedup_vs_dense']:.2f}x" if r.get("speedup_vs_dense") else "")
            ax.text(ms[y], y, f" {note}", va="center", fontsize=6)
        ax.set_yticks(range(len(rows)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlim(0, max(ms + [1e-3]) * 1.2)
        ax.set_xlabel("ms", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        dtype, d, n, pass_ = key
        ax.set_title(f"{dtype}, d={d}, N={_size_label(n)}, {pass_}", fontsize=9)
        ax.grid(True, axis="x", alpha=0.3)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    fig.suptitle(_title(result, "attention modifiers (ms; speedup against the dense baseline)"),
                 fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 1 - HEADER_INCHES / height))
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def plot_results(result, prefix):
    """The figures of `result`: ``<prefix>-tflops.png`` and ``<prefix>-memory.png`` for the
    grid's rows, ``<prefix>-mods.png`` for the modifier rows (those with a variant)."""
    grid = [r for r in result["rows"] if not r.get("variant")]
    paths = []
    if grid:
        paths += [plot_quantity(dict(result, rows=grid), quantity, f"{prefix}-{quantity}.png")
                  for quantity in QUANTITIES]
    if len(grid) < len(result["rows"]):
        paths.append(plot_mods(result, f"{prefix}-mods.png"))
    return paths
