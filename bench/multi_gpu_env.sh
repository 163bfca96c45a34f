# Sourced by the multi-GPU device scripts (multi_gpu_session.sh, multi_gpu_tests.sh,
# ring_profile.sh): the checkout on PYTHONPATH, a kernel cache, NVLink multicast off, CuPy
# able to load NCCL, and `precompile`.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CUPYFLASH_CACHE_DIR=${CUPYFLASH_CACHE_DIR:-/tmp/cupyflash-cache}
# NVLink multicast stays off (the machine's rule; set again in case the environment lost it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# CuPy finds libnccl through the nvidia-nccl wheel's lib folder where the loader does not.
nccl_lib=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))" 2>/dev/null)
[ -n "$nccl_lib" ] && export LD_LIBRARY_PATH=$nccl_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
gpus=$(nvidia-smi -L | wc -l)
# precompile [cupyflash.precompile keyword arguments]: the kernels on every CPU (cached, so a
# second call only loads them), the log in $OUT/precompile.log.
precompile() {
    python3 -c "import os, cupyflash as cf; print(len(cf.precompile(workers=os.cpu_count(), ${1:-})), 'kernels')" \
        > "$OUT/precompile.log" 2>&1
    echo "precompile rc=$? ($(tail -1 "$OUT/precompile.log"))"
}
