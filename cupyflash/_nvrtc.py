"""Compiling the CUDA sources with NVRTC, with an on-disk cubin cache.

This module needs NVRTC (the ``nvidia-cuda-nvrtc`` wheel or a CUDA toolkit) but no GPU:
the build check compiles every kernel for sm_80 and sm_90a on a CPU-only machine, and
the GPU backend loads the same cubins through ``cupy.RawModule``. One compile path
serves both, so what CI builds is what a GPU runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
# Installed: the sources are package data (cupyflash/kernels_cu). From a checkout:
# the repository's top-level kernels_cu/.
KERNEL_DIR = next(p for p in (_HERE / "kernels_cu", _HERE.parent / "kernels_cu") if p.is_dir())

BASE_OPTIONS = ("--std=c++17", "-default-device", "-DNDEBUG", "-Xptxas=-v")


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A compiled kernel instantiation and what ptxas said about it."""

    name_expression: str
    lowered_name: str
    arch: str
    binary_path: Path     # .cubin (or .ptx where NVRTC cannot target the device's arch)
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    static_smem: int
    log: str


class KernelBuildError(RuntimeError):
    """NVRTC rejected a kernel; the message carries its log."""


def nvrtc_version() -> tuple[int, int]:
    from cupy_backends.cuda.libs import nvrtc

    return tuple(nvrtc.getVersion())


def supported_archs() -> list[int]:
    from cupy_backends.cuda.libs import nvrtc

    return sorted(int(a) for a in nvrtc.getSupportedArchs())


def cache_dir() -> Path:
    """Where cubins are kept: $CUPYFLASH_CACHE_DIR, else cupyflash/ in CuPy's cache dir."""
    explicit = os.environ.get("CUPYFLASH_CACHE_DIR")
    if explicit:
        return Path(explicit)
    cupy_cache = os.environ.get("CUPY_CACHE_DIR", str(Path.home() / ".cupy" / "kernel_cache"))
    return Path(cupy_cache) / "cupyflash"


def _headers() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(KERNEL_DIR.glob("*.cuh"))}


def _parse_ptxas(log: str) -> dict[str, int]:
    def grab(pattern: str) -> int:
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack_frame": grab(r"(\d+) bytes stack frame"),
        "static_smem": grab(r"(\d+) bytes smem"),
    }


def compile_kernel(source_file: str, name_expression: str, arch: str) -> Compiled:
    """Compile one template instantiation of ``kernels_cu/<source_file>`` for ``arch``.

    ``arch`` is an NVRTC target such as ``"sm_80"``, ``"sm_90a"`` (cubin) or
    ``"compute_90"`` (PTX, for a GPU newer than this NVRTC knows). Results are cached
    on disk keyed by the sources, the instantiation, the options and NVRTC's version.
    """
    source = (KERNEL_DIR / source_file).read_text()
    headers = _headers()
    options = BASE_OPTIONS + (f"-arch={arch}",)
    key_text = json.dumps([source, headers, name_expression, options, nvrtc_version()], sort_keys=True)
    key = hashlib.sha256(key_text.encode()).hexdigest()[:32]
    directory = cache_dir()
    suffix = ".ptx" if arch.startswith("compute_") else ".cubin"
    binary_path = directory / (key + suffix)
    meta_path = directory / (key + ".json")
    if binary_path.exists() and meta_path.exists():
        meta = json.loads(meta_path.read_text())
        return Compiled(name_expression, meta["lowered_name"], arch, binary_path, log=meta["log"],
                        **_parse_ptxas(meta["log"]))

    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, source_file, [h.encode() for h in headers.values()],
                                    [n.encode() for n in headers])
    try:
        nvrtc.addNameExpression(program, name_expression)
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as error:
            raise KernelBuildError(
                f"NVRTC failed on {name_expression} for {arch}:\n{nvrtc.getProgramLog(program)}"
            ) from error
        log = nvrtc.getProgramLog(program)
        lowered = nvrtc.getLoweredName(program, name_expression)
        binary = nvrtc.getPTX(program) if suffix == ".ptx" else nvrtc.getCUBIN(program)
    finally:
        nvrtc.destroyProgram(program)

    directory.mkdir(parents=True, exist_ok=True)
    # Write to a temporary name and rename, so concurrent processes never see half a file.
    for path, data in ((binary_path, binary if isinstance(binary, bytes) else binary.encode()),
                       (meta_path, json.dumps({"lowered_name": lowered, "log": log}).encode())):
        tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return Compiled(name_expression, lowered, arch, binary_path, log=log, **_parse_ptxas(log))


def check_source(source: str, name: str, arch: str) -> None:
    """Compile ``source`` (which may include the kernels' headers) for ``arch`` and keep
    nothing: for compile-time checks such as the contract's static_asserts. Raises
    KernelBuildError with NVRTC's log where it fails."""
    from cupy_backends.cuda.libs import nvrtc

    headers = _headers()
    program = nvrtc.createProgram(source, name, [h.encode() for h in headers.values()],
                                  [n.encode() for n in headers])
    try:
        nvrtc.compileProgram(program, list(BASE_OPTIONS + (f"-arch={arch}",)))
    except nvrtc.NVRTCError as error:
        raise KernelBuildError(f"NVRTC failed on {name} for {arch}:\n{nvrtc.getProgramLog(program)}") from error
    finally:
        nvrtc.destroyProgram(program)


def _compile_one(job):
    return compile_kernel(*job)


def compile_many(jobs, workers: int | None = None, *, progress=None) -> list[Compiled]:
    """``compile_kernel(source_file, name_expression, arch)`` for each job, in parallel
    processes (NVRTC holds the interpreter lock, so threads would run one at a time).
    Spawned, not forked: the caller may hold a CUDA context, which a fork must not copy.

    ``progress``, if given, is called with a line of text as every tenth of the jobs
    finishes: a cold build of every kernel takes minutes, cached ones load at once."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = list(jobs)
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    start, step = time.perf_counter(), max(1, len(jobs) // 10)

    def report(results):
        for done, result in enumerate(results, 1):
            if progress is not None and (done % step == 0 or done == len(jobs)):
                progress(f"NVRTC: {done}/{len(jobs)} kernel instantiations built or loaded from "
                         f"{cache_dir()} ({time.perf_counter() - start:.0f} s, {workers} processes)")
            yield result

    if workers <= 1:
        return list(report(compile_kernel(*job) for job in jobs))
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(report(pool.map(_compile_one, jobs)))


def target_for(compute_capability: str) -> str:
    """The NVRTC target for a device: its own cubin where NVRTC knows the arch
    (``sm_90a`` on Hopper, for wgmma), else PTX for the newest arch NVRTC knows."""
    cc = int(compute_capability)
    known = supported_archs()
    if cc in known:
        return f"sm_{cc}a" if cc == 90 else f"sm_{cc}"
    older = [a for a in known if a <= cc]
    if not older:
        raise RuntimeError(f"NVRTC {nvrtc_version()} cannot target compute capability {cc}")
    return f"compute_{older[-1]}"
