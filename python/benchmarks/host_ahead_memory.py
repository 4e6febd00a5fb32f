"""What hprt references of torch's memory while the device trails the host, per front end, with
and without the hand-over of memory to torch (``record_stream``) and with and without an in-flight
window, on the CUDA emulator (torch's tensors and caching allocator stood in for: see
python/tests/test_host_ahead.py). Figures are layers of saved bytes, not times.

    cargo build -p hprt-cuda-emulator
    emu=$PWD/target/debug/libhprt_cuda_emulator.so
    HP_CUDA_LIB=$emu HP_NCCL_LIB=$emu HP_NVRTC_LIB=$emu HP_EMU_DEVICES=8 \\
        python python/benchmarks/host_ahead_memory.py
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))

import hprt.torch as ht  # noqa: E402
import test_host_ahead as T  # noqa: E402


class _Patch:
    def setattr(self, obj, name, value, raising=True):
        setattr(obj, name, value)


def main():
    real = ht._stream_recorder
    for recorder in (False, True):
        for front in (T.layer_groups, T.keyed, T.pipeline):
            for window in (None, 2 * T.LAYER_BYTES):
                ht._stream_recorder = real if recorder else (lambda backend: None)
                w = T.World("cuda", _Patch(), window)
                front(w)
                w.finish()
                print(f"record_stream={recorder!s:5} {front.__name__:12} "
                      f"window={'none' if window is None else '2 layers':8}: forward "
                      f"{w.most['forward'] / T.LAYER_BYTES:.1f} layers, backward "
                      f"{w.most['backward'] / T.LAYER_BYTES:.1f} layers")
    ht._stream_recorder = real


if __name__ == "__main__":
    main()
