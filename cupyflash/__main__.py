"""``python -m cupyflash info``: versions, GPU and kernel cache, in one place for bug reports."""

import argparse
import platform
import sys

import numpy as np

from . import __version__, _cpu_threads, _cuda, _nvrtc


def info() -> str:
    lines = [f"cupyflash {__version__}", f"python {platform.python_version()}", f"numpy {np.__version__}"]
    try:
        import cupy
        lines.append(f"cupy {cupy.__version__}")
    except Exception as exc:
        lines.append(f"cupy: not importable ({type(exc).__name__}: {exc})")
        cupy = None
    try:
        lines.append(f"NVRTC {'.'.join(map(str, _nvrtc.nvrtc_version()))}")
    except Exception as exc:
        lines.append(f"NVRTC: not loadable ({type(exc).__name__})")
    if cupy is not None and _cuda.gpu_available():
        rt = cupy.cuda.runtime
        lines.append(f"CUDA runtime {rt.runtimeGetVersion()}, driver {rt.driverGetVersion()}")
        for i in range(rt.getDeviceCount()):
            props = rt.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
            target, smem = _cuda._device_info(i)
            lines.append(f"GPU {i}: {name}, compute capability {props['major']}.{props['minor']}, "
                         f"kernels built for {target}, {smem // 1024} KiB shared memory per block")
    else:
        from ._gpu_status import why_not_usable
        lines.append(f"no GPU: the NumPy backend serves every call ({why_not_usable()})")
    lines.append(f"NumPy backend threads: {_cpu_threads.num_threads()} "
                 f"(${_cpu_threads.ENV_THREADS} to change)")
    lines.append(f"kernel sources: {_nvrtc.KERNEL_DIR}")
    lines.append(f"kernel cache: {_nvrtc.cache_dir()}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cupyflash",
        description="cupyflash's command line. Related: python -m cupyflash.bench (the "
                    "benchmark; --cpu for the NumPy backend), python -m cupyflash.build_check "
                    "(NVRTC build of every kernel, no GPU needed).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    commands.add_parser("info", help="versions, the GPU (or why there is none) and the kernel "
                                     "cache, for bug reports")
    parser.parse_args(sys.argv[1:] if argv is None else argv)
    print(info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
