"""``python -m cupyflash info``: versions, GPU and kernel cache, in one place for bug reports."""

import platform
import sys

import numpy as np

from . import __version__, _cuda, _nvrtc


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
        lines.append("no GPU: the NumPy backend serves every call")
    lines.append(f"kernel sources: {_nvrtc.KERNEL_DIR}")
    lines.append(f"kernel cache: {_nvrtc.cache_dir()}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["info"]:
        print("usage: python -m cupyflash info", file=sys.stderr)
        return 2
    print(info())
    return 0


if __name__ == "__main__":
    sys.exit(main())
