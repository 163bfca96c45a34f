"""Compile every kernel instantiation for sm_80 and sm_90a and report ptxas' resources.

Needs NVRTC, not a GPU: ``python -m cupyflash.build_check`` prints one row per
instantiation and architecture (registers, spill bytes, stack frame, dynamic shared
memory) and exits non-zero if a kernel fails to compile or a tensor-core kernel spills.
"""

from __future__ import annotations

import argparse
import sys

from . import _kernels, _nvrtc


def build_all(archs=_kernels.BUILD_ARCHS, jobs: int = 2, *, progress=None):
    """Compile all instantiations for ``archs``; returns [(variant, Compiled)].
    ``progress`` gets a line of text as the build advances (see `_nvrtc.compile_many`)."""
    work = [(v, arch) for arch in archs for v in _kernels.all_variants() if v.builds_for(arch)]
    compiled = _nvrtc.compile_many([(v.source, v.name_expression, arch) for v, arch in work], jobs,
                                   progress=progress)
    return [(v, c) for (v, _), c in zip(work, compiled)]


def must_not_spill(variant: _kernels.Variant) -> bool:
    """The fp16/bf16 kernels and the families tuned to live in registers (the fp32/fp64
    forward) must not spill; a spill there is a bug. The fp32/fp64 tensor-core backward
    keeps dK and dV (or one of them) of 16 keys per warp in registers and spills a few
    bytes from d = 128 (the tile tables in _kernels say which); it is reported, not refused."""
    expr = variant.name_expression
    return "half_t" in expr or "bfloat16_t" in expr or variant.family.spill_free


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", action="append", help="NVRTC target (repeatable); default sm_80 and sm_90a")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    archs = tuple(args.arch or _kernels.BUILD_ARCHS)
    print(f"NVRTC {'.'.join(map(str, _nvrtc.nvrtc_version()))}, kernels from {_nvrtc.KERNEL_DIR}")
    try:
        built = build_all(archs, args.jobs, progress=lambda line: print(line, file=sys.stderr, flush=True))
    except _nvrtc.KernelBuildError as error:
        print(error, file=sys.stderr)
        return 1
    failures = 0
    print(f"{'arch':7} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'dyn smem':>8} {'static':>6}  instantiation")
    for v, c in built:
        problems = problems_of(v, c)
        failures += bool(problems)
        print(f"{c.arch:7} {c.registers:4d} {c.spill_stores:5d}/{c.spill_loads:<5d} {c.stack_frame:5d} "
              f"{v.smem_bytes:8d} {c.static_smem:6d}  {v.name_expression}"
              + "".join(f"  <-- {p}" for p in problems))
    print(f"{len(built)} instantiations built, {failures} with spills where none are allowed, "
          "serialised warpgroup MMAs or more static shared memory than the host reserves")
    return 1 if failures else 0


# ptxas's note (C7514) that it serialises a kernel's warpgroup MMAs, because code reads an
# accumulator while its product may still run: the kernel is still correct but its
# products no longer overlap anything, a silent loss of speed.
WGMMA_SERIALIZED = "C7514"


def problems_of(variant: _kernels.Variant, compiled) -> list[str]:
    """What is wrong with a compiled instantiation: spills where none are allowed,
    serialised warpgroup MMAs, and static shared memory beyond what the host adds to the
    launch's figure (it would launch with more shared memory than the host checked fits)."""
    problems = []
    if must_not_spill(variant) and (compiled.spill_stores or compiled.spill_loads):
        problems.append("SPILLS")
    if WGMMA_SERIALIZED in compiled.log:
        problems.append("WGMMA SERIALIZED")
    if compiled.static_smem > variant.static_smem:
        problems.append(f"STATIC SMEM > {variant.static_smem}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
